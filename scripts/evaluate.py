"""Evaluate the base model, or a trained adapter, on one prepared split: predictions JSONL and metrics JSON.
With --processes N (the evaluation's GPUs) the split is shared out among N processes, one GPU each."""

import argparse
import json

from vlft.jobs import distributed
from vlft.jobs.cli import add_cpu_fallback_argument, add_predicted_argument, run, set_cpu_threads, say_took_at_exit
from vlft.generation.evaluate import evaluate_split
from vlft.modeling import require_gpus


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--adapter", help="trained adapter; the untrained base model without it")
    parser.add_argument("--prepared", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--settings", required=True, help="evaluation settings, as JSON")
    parser.add_argument("--predictions", required=True)
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--threads", type=int, default=8, help="CPU threads for torch, shared by the processes")
    parser.add_argument(
        "--processes", type=int, default=1, help="GPUs the job asked for, one process each sharing the split"
    )
    add_cpu_fallback_argument(parser)
    add_predicted_argument(parser)
    args = parser.parse_args()
    require_gpus(args.processes, args.cpu_fallback)
    threads_each = max(1, args.threads // max(1, args.processes))
    distributed.relaunch(args.processes, threads_each)
    set_cpu_threads(threads_each)
    if args.processes > 1 and distributed.launched_rank() == 0:
        print(
            f"the split shared out among {args.processes} processes, batch i to process i mod {args.processes}",
            flush=True,
        )
    try:
        metrics = evaluate_split(
            model_dir=args.model,
            adapter=args.adapter,
            prepared=args.prepared,
            cache=args.cache,
            settings=json.loads(args.settings),
            predictions_out=args.predictions,
            metrics_out=args.metrics,
            trust_remote_code=args.trust_remote_code,
        )
    finally:
        distributed.leave()
    if distributed.launched_rank() == 0:
        print(json.dumps(metrics))
        say_took_at_exit(args.predicted_seconds)


if __name__ == "__main__":
    run(main)

"""Train one experiment stage's LoRA adapter from the pixel caches; resumes from its newest checkpoint.
With --processes N (a stage's GPUs) it trains data-parallel in N processes, one GPU each."""

import argparse
import json
import sys
import time

from vlft import parallelism
from vlft.jobs import distributed
from vlft.jobs.cli import add_cpu_fallback_argument, add_predicted_argument, run, set_cpu_threads, say_took_at_exit
from vlft.modeling import require_gpus
from vlft.jobs.stopping import StopRequest, slurm_end_time
from vlft.training.train import Preempted, StageInputs, train_stage

# Distinct from a crash: the job stopped on request, with its progress saved.
EXIT_PREEMPTED = 75


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--prepared", nargs="+", required=True, help="prepared JSONL of each training split")
    parser.add_argument("--caches", nargs="+", required=True, help="pixel cache of each training split, same order")
    parser.add_argument("--init-adapter", help="adapter of the stage this one starts from")
    parser.add_argument("--settings", required=True, help="the stage's resolved settings, as JSON")
    parser.add_argument("--eval-prepared", help="prepared JSONL of the split it evaluates on as it trains")
    parser.add_argument("--eval-cache", help="that split's cache, of the kind it trains from")
    parser.add_argument("--eval-settings", help="how the evaluations during training generate, as JSON")
    parser.add_argument("--checkpoints", required=True, help="where checkpoints of this stage are kept")
    parser.add_argument("--checkpoint-every", type=int, default=200, help="optimizer steps between checkpoints")
    parser.add_argument(
        "--attempt", type=int, default=1, help="Snakemake's attempt; a retry restores the outputs of a finished attempt"
    )
    parser.add_argument("--tensorboard", help="where the stage's TensorBoard run goes, written as it trains")
    parser.add_argument(
        "--report-to", default="tensorboard", help="the config's report_to, comma-separated: tensorboard, wandb, mlflow"
    )
    parser.add_argument(
        "--activation-checkpointing",
        type=int,
        choices=[0, 1],
        default=0,
        help="1: recompute activations in the backward",
    )
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--summary", required=True)
    parser.add_argument("--threads", type=int, default=8, help="CPU threads for torch, shared by the processes")
    parser.add_argument(
        "--processes", type=int, default=1, help="GPUs the job asked for, one data-parallel process each"
    )
    parser.add_argument(
        "--nodes", type=int, default=1, help="nodes of the SLURM job, --processes on each (vlft.jobs.distributed)"
    )
    parser.add_argument(
        "--parallelism",
        choices=parallelism.CHOICES,
        default="replicate",
        help="the processes shard the frozen base, or each holds it whole (vlft.parallelism)",
    )
    add_cpu_fallback_argument(parser)
    add_predicted_argument(parser)
    return parser.parse_args()


def main():
    args = parse_arguments()
    require_gpus(args.processes, args.cpu_fallback)
    threads_each = max(1, args.threads // max(1, args.processes))
    distributed.relaunch(args.processes, threads_each, args.nodes)
    stop = StopRequest()  # before anything slow: a signal during loading must not kill us unsaved
    stop.end_time = slurm_end_time()
    main_process = distributed.launched_rank() == 0
    if main_process:
        limit = (
            f", SLURM time limit at {time.strftime('%H:%M:%S', time.localtime(stop.end_time))}" if stop.end_time else ""
        )
        processes = (
            f", {args.processes * args.nodes} data-parallel processes" if args.processes * args.nodes > 1 else ""
        )
        processes += f" on {args.nodes} nodes" if args.nodes > 1 else ""
        print(f"attempt {args.attempt}{processes}{limit}", flush=True)
    set_cpu_threads(threads_each)
    inputs = StageInputs(
        model_dir=args.model,
        prepared=args.prepared,
        caches=args.caches,
        init_adapter=args.init_adapter,
        trust_remote_code=args.trust_remote_code,
        eval_prepared=args.eval_prepared,
        eval_cache=args.eval_cache,
    )
    evaluation = json.loads(args.eval_settings) if args.eval_settings else None
    try:
        summary = train_stage(
            inputs=inputs,
            params=json.loads(args.settings),
            adapter_out=args.adapter,
            log_out=args.log,
            summary_out=args.summary,
            checkpoint_root=args.checkpoints,
            checkpoint_every=args.checkpoint_every,
            stop=stop,
            reuse_finished=args.attempt > 1,
            curves_dir=args.tensorboard,
            report_to=tuple(filter(None, args.report_to.split(","))),
            activation_checkpointing=bool(args.activation_checkpointing),
            evaluation=evaluation,
            parallelism=args.parallelism,
        )
    except Preempted as stopped:
        if main_process:
            print(f"stopped: {stopped}", file=sys.stderr, flush=True)
        sys.exit(EXIT_PREEMPTED)
    finally:
        distributed.leave()
    if main_process:
        print(json.dumps(summary))
        say_took_at_exit(args.predicted_seconds)


if __name__ == "__main__":
    run(main)

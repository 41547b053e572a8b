"""Write the comparative report: results/report/index.html and its CSV tables."""

import argparse
import json
from pathlib import Path

from vlft.jobs.cli import run
from vlft.errors import InputError
from vlft.report import Evaluation, TrainedStage, write_report


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--metrics", nargs="+", required=True, help="metrics.json of each evaluation")
    parser.add_argument("--predictions", nargs="+", required=True, help="predictions.jsonl of each evaluation")
    parser.add_argument("--prepared", nargs="+", required=True, help="the prepared split of each evaluation")
    parser.add_argument(
        "--image-roots", nargs="+", required=True, help="the image root of each evaluation's split, in order"
    )
    parser.add_argument("--evaluations", nargs="+", required=True, help="experiment/stage/split of each, in order")
    parser.add_argument("--summaries", nargs="+", required=True, help="summary.json of each trained stage")
    parser.add_argument("--logs", nargs="+", required=True, help="log.jsonl of each trained stage, in order")
    parser.add_argument("--stages", nargs="+", required=True, help="experiment/stage of each, in order")
    parser.add_argument(
        "--init-from", nargs="+", required=True, help="experiment/stage each started from ('-' for none), in order"
    )
    parser.add_argument("--output-dir", required=True)
    parser.add_argument(
        "--sweeps", default="7b7d", help="each sweep's experiments: JSON (vlft.plan.Plan.sweeps), in hex"
    )
    parser.add_argument(
        "--selections", nargs="*", default=[], help="each keep_best's outcome: its kept.json (vlft.sweeps.keep_best)"
    )
    args = parser.parse_args()
    per_evaluation = (args.metrics, args.predictions, args.prepared, args.image_roots, args.evaluations)
    if not (
        len(set(map(len, per_evaluation))) == 1
        and len(args.summaries) == len(args.logs) == len(args.stages) == len(args.init_from)
    ):
        raise InputError(
            "--metrics/--predictions/--prepared/--image-roots/--evaluations, --summaries/--logs/--stages/--init-from",
            "each list needs one entry per job",
        )
    evaluations = [
        Evaluation(*label.split("/"), metrics, predictions, prepared, image_root)
        for label, metrics, predictions, prepared, image_root in zip(
            args.evaluations, args.metrics, args.predictions, args.prepared, args.image_roots
        )
    ]
    stages = [
        TrainedStage(*label.split("/"), summary, log, "" if start == "-" else start)
        for label, summary, log, start in zip(args.stages, args.summaries, args.logs, args.init_from)
    ]
    write_report(
        evaluations=evaluations,
        stages=stages,
        output_dir=args.output_dir,
        sweeps=json.loads(bytes.fromhex(args.sweeps)),
        selections=[json.loads(Path(path).read_text()) for path in args.selections],
    )
    print(f"wrote {args.output_dir}/index.html")


if __name__ == "__main__":
    run(main)

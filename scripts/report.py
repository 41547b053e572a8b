"""Write the comparative report: results/report/index.html and its CSV tables."""

import argparse

from vlft.cli import run
from vlft.errors import InputError
from vlft.report import Evaluation, TrainedStage, write_report


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--metrics", nargs="+", required=True, help="metrics.json of each evaluation")
    parser.add_argument("--evaluations", nargs="+", required=True, help="experiment/stage/split of each, in order")
    parser.add_argument("--summaries", nargs="+", required=True, help="summary.json of each trained stage")
    parser.add_argument("--logs", nargs="+", required=True, help="log.jsonl of each trained stage, in order")
    parser.add_argument("--stages", nargs="+", required=True, help="experiment/stage of each, in order")
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()
    if not (len(args.metrics) == len(args.evaluations) and len(args.summaries) == len(args.logs) == len(args.stages)):
        raise InputError("--metrics/--evaluations, --summaries/--logs/--stages", "each list needs one entry per job")
    evaluations = [Evaluation(*label.split("/"), metrics) for label, metrics in zip(args.evaluations, args.metrics)]
    stages = [
        TrainedStage(*label.split("/"), summary, log)
        for label, summary, log in zip(args.stages, args.summaries, args.logs)
    ]
    write_report(evaluations=evaluations, stages=stages, output_dir=args.output_dir)
    print(f"wrote {args.output_dir}/index.html")


if __name__ == "__main__":
    run(main)

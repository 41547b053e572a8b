"""Write the comparative report: results/report/index.html and its CSV tables."""

import argparse
import json
from pathlib import Path

from vlft.jobs.cli import run
from vlft.errors import InputError
from vlft.report.page import write_report
from vlft.report.study import Evaluation, StageResult
from vlft.trained_stage import TrainedStage

# The lists of the inputs file (the workflow's report_inputs rule), each in the order of its labels.
PER_EVALUATION = ("metrics", "predictions", "prepared", "image_roots", "evaluations")
PER_STAGE = ("summaries", "logs", "stages", "init_from")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--inputs",
        required=True,
        help="JSON: each evaluation's metrics, predictions, prepared split, image root and experiment/stage/split; "
        "each trained stage's summary, log, experiment/stage and the stage it started from ('-' for none); each "
        "keep_best's kept.json (selections); each sweep's experiments (sweeps, vlft.plan.Plan.sweeps)",
    )
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()
    try:
        inputs = json.loads(Path(args.inputs).read_text())
        lengths = {name: len(inputs[name]) for name in PER_EVALUATION + PER_STAGE}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(args.inputs, f"not the report's inputs file ({type(err).__name__}: {err})") from None
    if len({lengths[n] for n in PER_EVALUATION}) != 1 or len({lengths[n] for n in PER_STAGE}) != 1:
        raise InputError(args.inputs, f"each list needs one entry per job: {lengths}")
    evaluations = [
        Evaluation(*label.split("/"), metrics, predictions, prepared, image_root)
        for metrics, predictions, prepared, image_root, label in zip(*(inputs[n] for n in PER_EVALUATION))
    ]
    stages = [
        StageResult.read(
            label,
            TrainedStage(Path(summary).with_name("adapter"), Path(log), Path(summary)),
            "" if start == "-" else start,
        )
        for summary, log, label, start in zip(*(inputs[n] for n in PER_STAGE))
    ]
    write_report(
        evaluations=evaluations,
        stages=stages,
        output_dir=args.output_dir,
        sweeps=inputs.get("sweeps", {}),
        selections=[json.loads(Path(path).read_text()) for path in inputs.get("selections", [])],
    )
    print(f"wrote {args.output_dir}/index.html")


if __name__ == "__main__":
    run(main)

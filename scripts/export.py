"""Export a trained stage as a model of its own: the adapter merged into the base weights, the
processor with the stage's pixels, the chat template and a README card (vlft.export)."""

import argparse
import json
from pathlib import Path

from vlft.jobs.cli import run


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="the base model's directory")
    parser.add_argument("--stage", required=True, help="the trained stage: results/train/<experiment>/<stage>")
    parser.add_argument("--settings", required=True, help="the stage's resolved settings, as JSON")
    parser.add_argument("--metrics", nargs="*", default=[], help="metrics.json of the stage's evaluations")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    from vlft.export import export_stage  # torch and transformers: after the arguments are checked

    metrics = {Path(path).parent.name: json.loads(Path(path).read_text()) for path in args.metrics}
    export_stage(args.model, args.stage, json.loads(args.settings), metrics, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    run(main)

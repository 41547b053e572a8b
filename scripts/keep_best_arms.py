"""Compare a sweep's arms at the end of a stage and keep the best (an experiment's `keep_best`): only
they train their later stages (vlft.sweeps.keep_best)."""

import argparse
import json
from pathlib import Path

from vlft.files import write_json
from vlft.jobs.cli import run
from vlft.sweeps import keep_best


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--selection", required=True, help="the sweep's keep_best, resolved (vlft.plan.Plan.selections)"
    )
    parser.add_argument("--metrics", nargs="+", required=True, help="metrics.json of each arm's stage, the arms' order")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    selection = json.loads(args.selection)
    arms = selection["candidates"]
    where = dict(zip(arms, args.metrics))
    chosen = keep_best(
        {arm: json.loads(Path(path).read_text()) for arm, path in where.items()},
        selection["arms"],
        selection["metric"],
        where,
    )
    write_json(args.out, {**selection, **chosen})
    print(f"kept after {selection['after']}: {', '.join(chosen['kept'])}")
    for arm, why in chosen["stopped"].items():
        print(f"stopped: {arm} ({why})")


if __name__ == "__main__":
    run(main)

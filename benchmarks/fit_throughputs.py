"""Fit a device's rows of vlft/throughputs.csv from a finished study's own jobs.

Each training job's measured time (its summary's wall_time_s) is taken as fixed + c x samples +
tokens / R + v x image tokens through the tower, and each evaluation's (its metrics' wall_time_s) as
fixed + prefill tokens / P + decode tokens x (step / rows + row) + v x image tokens: the very terms
vlft.costs predicts with, each counted from the job's data as the dry run counts it. Least squares,
coefficients held at 0 or above. Prints the rows; with --check, each job's measured time against
the fitted prediction.

    python benchmarks/fit_throughputs.py --config config/config.yaml --device cpu --model tiny-demo
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np
import yaml

from vlft.config import resolve_config, results_directory
from vlft.costs import eval_seconds, train_seconds
from vlft.devices import Throughputs
from vlft.digests import DigestMemo
from vlft.plan import build_plan
from vlft.study_costs import StudyCosts

TRAIN = ("train_fixed_s", "train_s_per_sample", "train_s_per_token", "vision_s_per_image_token")
EVAL = ("eval_fixed_s", "prefill_s_per_token", "decode_step_s", "decode_row_s")


def unit_rate(quantity: str) -> Throughputs:
    """Coefficients all 0 but one, at 1: a prediction with them is that coefficient's term."""
    names = TRAIN + EVAL
    values = {q: 0.0 for q in names}
    values[quantity] = 1.0
    # vlft.costs reads rates (tokens a second); a term in seconds a token is their inverse
    per_s = {"train_tokens_per_s": 1 / values["train_s_per_token"] if values["train_s_per_token"] else np.inf}
    per_s["prefill_tokens_per_s"] = 1 / values["prefill_s_per_token"] if values["prefill_s_per_token"] else np.inf
    return Throughputs("fit", "fit", {**values, **per_s}, 1.0)


def fit(rows: list[tuple[list[float], float]]) -> np.ndarray:
    """Non-negative least squares by dropping negative coefficients one at a time (few columns)."""
    features = np.array([r[0] for r in rows])
    measured = np.array([r[1] for r in rows])
    active = list(range(features.shape[1]))
    while True:
        solution = np.zeros(features.shape[1])
        solution[active] = np.linalg.lstsq(features[:, active], measured, rcond=None)[0]
        negative = [i for i in active if solution[i] < 0]
        if not negative:
            return solution
        active.remove(min(negative, key=lambda i: solution[i]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--model", required=True, help="the measured model's name in the table")
    parser.add_argument("--source", default="", help="what ran: command, machine, date, commit")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    config = yaml.safe_load(Path(args.config).read_text())
    config = resolve_config(config)
    config["results"] = results_directory(config, [args.config] if args.config != "config/config.yaml" else [])
    config["planning"]["device"] = args.device
    plan = build_plan(config)
    costs = StudyCosts(plan, config, DigestMemo(".snakemake/vlft/digests.json"), config["results"])
    compute = costs.shape.compute_params
    train_rows, eval_rows = [], []
    for stage_id, stage in plan.stages.items():
        summary = Path(config["results"], "train", stage_id, "summary.json")
        counts = costs.counts(
            stage.settings["dataset"], stage.settings["train_splits"], stage.settings, stage.settings["filter"] or {}
        )
        # A grpo stage's time is mostly its rollouts, fitted with the evaluations' coefficients.
        if summary.is_file() and counts and stage.settings["method"] != "grpo":
            measured = json.loads(summary.read_text())["wall_time_s"]
            terms = [train_seconds(stage.settings, counts, unit_rate(q)) for q in TRAIN]
            train_rows.append(([t.seconds for t in terms], measured))
    for experiment, stage, split in plan.evaluations():
        metrics = Path(config["results"], "eval", experiment, stage, split, "metrics.json")
        settings = plan.eval_settings(experiment, stage, config["evaluation"])
        counts = costs.counts(settings["dataset"], [split], settings, {})
        if metrics.is_file() and counts:
            measured = json.loads(metrics.read_text())["wall_time_s"]
            terms = [eval_seconds(config["evaluation"], counts, unit_rate(q)) for q in EVAL]
            eval_rows.append(([t.seconds for t in terms], measured))
    if not train_rows or not eval_rows:
        sys.exit("fit_throughputs: the study has no finished training and evaluation jobs with data to count")
    fitted = dict(zip(TRAIN, fit(train_rows))) | dict(zip(EVAL, fit(eval_rows)))
    source = f"benchmarks/fit_throughputs.py over {len(train_rows)} training and {len(eval_rows)} evaluation jobs; {args.source}"
    out = csv.writer(sys.stdout, lineterminator="\n")
    for quantity, value in fitted.items():
        if quantity.endswith("_s_per_token"):  # the table keeps rates
            quantity = quantity.replace("_s_per_token", "_tokens_per_s")
            value = 1 / value if value else 1e12
        out.writerow([args.device, args.model, f"{compute:.3g}", quantity, f"{value:.4g}", source])
    if args.check:
        for name, rows, quantities in (("train", train_rows, TRAIN), ("evaluate", eval_rows, EVAL)):
            for features, measured in rows:
                predicted = sum(f * fitted[q] for f, q in zip(features, quantities))
                print(f"{name}: measured {measured:.1f} s, fitted {predicted:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()

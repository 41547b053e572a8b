"""A study as the report reads it: each evaluation's metrics and each trained stage's summary and
log, read once, and what they say together (results beside the base model and the stage each
started from, the winners and whether their margins are more than noise, repeats, sweeps)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from vlft.files import read_jsonl
from vlft.plan import BASE_EXPERIMENT
from vlft.significance import paired_p_value, wilson_interval
from vlft.trained_stage import TrainedStage


@dataclass(frozen=True)
class Evaluation:
    experiment: str
    stage: str
    split: str
    metrics: str  # its metrics.json
    predictions: str = ""  # its predictions.jsonl, for the examples
    prepared: str = ""  # the prepared split it answered, for the examples' images
    image_root: str = ""  # where that split's images lie (prepared records name them relative to it)


@dataclass(frozen=True)
class StageResult:
    """A trained stage as the report reads it (its outputs, vlft.trained_stage.TrainedStage): its
    summary and its per-step log, each read once, and the stage it started from."""

    experiment: str
    stage: str
    summary: dict
    log: list[dict]
    init_from: str = ""  # experiment/stage of the adapter it started from, if any

    @classmethod
    def read(cls, label: str, outputs: TrainedStage, init_from: str = "") -> "StageResult":
        experiment, stage = label.split("/")
        return cls(experiment, stage, outputs.read_summary(), read_jsonl(outputs.log), init_from)

    @property
    def label(self) -> str:
        return f"{self.experiment}/{self.stage}"


def collect(
    evaluations: list[Evaluation], stages: list[StageResult]
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    rows, category_rows = [], []
    for evaluation in evaluations:
        experiment, stage, split = evaluation.experiment, evaluation.stage, evaluation.split
        metrics = json.loads(Path(evaluation.metrics).read_text())
        rows.append(
            {
                "experiment": experiment,
                "stage": stage,
                "split": split,
                "accuracy": metrics["accuracy"],
                # The 95% interval its samples leave it (vlft.significance; clicks: those with a box).
                **dict(zip(("ci95_low", "ci95_high"), accuracy_interval(metrics))),
                "loss": metrics["loss"],
                "n": metrics["n"],
                "answer_format": metrics["answer_format"],
                # Older metrics lack it: one dataset, then.
                "dataset": metrics.get("dataset") or "",
                "eval_wall_time_s": metrics["wall_time_s"],
                # Clicks only: answers without a point, and the mean distance over the diagonal.
                **{k: metrics[k] for k in ("unparseable", "mean_distance") if k in metrics},
                # Free text: the metrics of the field's public challenges, beside accuracy.
                **{k: metrics[k] for k in ("bleu", "rouge_l", "meteor") if k in metrics},
            }
        )
        # A click split's platforms (ScreenSpot's) beside its element types, named apart.
        platforms = {f"platform: {p}": a for p, a in metrics.get("accuracy_by_platform", {}).items()}
        for category, accuracy in (metrics["accuracy_by_category"] | platforms).items():
            category_rows.append(
                {
                    "experiment": experiment,
                    "stage": stage,
                    "split": split,
                    "dataset": rows[-1]["dataset"],
                    "category": category,
                    "accuracy": accuracy,
                }
            )
    results = pd.DataFrame(rows)
    # Each job beside the base model on the same split of the same dataset.
    base = results[results.experiment == BASE_EXPERIMENT].set_index(["dataset", "split"])["accuracy"]
    results["base_accuracy"] = [base.get((d, s)) for d, s in zip(results["dataset"], results["split"])]
    results["gain_over_base"] = results["accuracy"] - results["base_accuracy"]
    # And beside the stage it started from (a curriculum's step), on the same split.
    labels = results.experiment + "/" + results.stage
    accuracy = dict(zip(zip(labels, results.dataset, results.split), results.accuracy))
    starts = {trained.label: trained.init_from for trained in stages if trained.init_from}
    results["started_from"] = [starts.get(label, "") for label in labels]
    start_accuracy = [
        accuracy.get((start, d, s), float("nan"))
        for start, d, s in zip(results.started_from, results.dataset, results.split)
    ]
    results["gain_over_start"] = results.accuracy - start_accuracy
    results = results.sort_values(["experiment", "stage", "split"]).reset_index(drop=True)
    categories = (
        pd.DataFrame(category_rows)
        .pivot_table(index=["experiment", "stage", "split", "dataset"], columns="category", values="accuracy")
        .reset_index()
        .rename_axis(columns=None)  # else the page shows the pivot's "category" as an empty column
    )

    job_rows = []
    for trained in stages:
        summary = dict(trained.summary)  # a copy: what is for using the adapter is left out of it
        # For using the adapter, not for reading (the evaluations during training have a chart of their own).
        # What trained has a section of its own (vlft.report.page.trained_parts_html).
        for key in ("adapter_crc32", "model", "answering", "evaluations_during_training", "settings", "trained_parts"):
            summary.pop(key, None)
        summary.pop("trained_parts_problems", None)
        if "kept" in summary:  # keep: best: the step whose adapter the stage kept
            summary["kept_step"] = summary.pop("kept")["step"]
        job_rows.append({"experiment": trained.experiment, "stage": trained.stage, **summary})
    jobs = pd.DataFrame(job_rows).sort_values(["experiment", "stage"]).reset_index(drop=True)
    repeats = repeated_stages(jobs)
    jobs["repeats"] = [repeats.get(f"{e}/{s}", "") for e, s in zip(jobs.experiment, jobs.stage)]
    results["repeats"] = [repeats.get(label, "") for label in results.experiment + "/" + results.stage]
    return results, categories, jobs


def accuracy_interval(metrics: dict) -> tuple[float, float]:
    judged = metrics.get("n_with_box", metrics["n"])
    return wilson_interval(round(metrics["accuracy"] * judged), judged)


def answers_right(evaluation: Evaluation) -> dict:
    """{sample id: right} of an evaluation's predictions (None: a click without a box to judge)."""
    return {p["id"]: p["correct"] for p in read_jsonl(evaluation.predictions)} if evaluation.predictions else {}


def repeated_stages(jobs: pd.DataFrame) -> dict[str, str]:
    """Each stage that trained on the very data, in the very order, with the very settings of an
    earlier one (its filter may read otherwise): its label -> the earlier one's. Its results repeat
    that stage's; they are no second finding."""
    first: dict[str, str] = {}
    repeats = {}
    for experiment, stage, fingerprint in zip(jobs.experiment, jobs.stage, jobs.get("data_and_settings", [])):
        if not isinstance(fingerprint, str):  # a summary of an earlier version: unknown
            continue
        label = f"{experiment}/{stage}"
        if fingerprint in first:
            repeats[label] = first[fingerprint]
        else:
            first[fingerprint] = label
    return repeats


def winners(results: pd.DataFrame, right: dict | None = None) -> pd.DataFrame:
    """Per evaluated split of each dataset, the trained stage(s) of the best accuracy (all of them
    where they tie), with their gain over the base model; with `right` (each evaluation's
    {sample id: right}, by (experiment, stage, split)), whether its margin over the runner-up and
    over the stage it started from (or the base model) is more than chance on the same samples."""
    trained = results[results.experiment != BASE_EXPERIMENT]
    rows = []
    for (dataset, split), jobs in trained.groupby(["dataset", "split"], sort=True):
        best = jobs[jobs.accuracy == jobs.accuracy.max()]
        row = {
            "dataset": dataset,
            "split": split,
            "best": ", ".join(best.experiment + "/" + best.stage),
            "accuracy": best.accuracy.iloc[0],
            "gain_over_base": best.gain_over_base.iloc[0],
            "runner_up": _runner_up(jobs, best.accuracy.iloc[0]),
            "n": best.n.iloc[0],
        }
        if right is not None:
            row |= _margins(results, jobs, best.iloc[0], right)
        if len(best) > 1:  # a tie is a finding of its own, said in the row rather than left to blanks
            row["runner_up"] = row["runner_up"] or f"none: all {len(best)} trained stages tie"
            ahead = f"a tie of {len(best)}: none is ahead of the others"
            row["margin"] = "; ".join(filter(None, [ahead, row.get("margin")])) if right is not None else ahead
        rows.append(row)
    return pd.DataFrame(rows)


def _margins(results: pd.DataFrame, jobs: pd.DataFrame, best, right: dict) -> dict:
    """The exact McNemar p of the winner against the runner-up and against its start, and what
    they say (p < 0.05: more than noise)."""
    answers = lambda experiment, stage: right.get((experiment, stage, best.split))  # noqa: E731
    won = answers(best.experiment, best.stage)
    rest = jobs[jobs.accuracy < best.accuracy]
    second = rest[rest.accuracy == rest.accuracy.max()].iloc[0] if not rest.empty else None
    start = best.started_from.split("/") if best.started_from else None
    if start is None:  # a first stage starts from the base model
        base = results[(results.experiment == BASE_EXPERIMENT) & (results.dataset == best.dataset)]
        start = [BASE_EXPERIMENT, base.stage.iloc[0]] if not base.empty else None
    p_second = paired_p_value(won, answers(second.experiment, second.stage)) if second is not None else None
    p_start = paired_p_value(won, answers(*start)) if start is not None and won else None
    return {
        "p_vs_runner_up": p_second,
        "p_vs_start": p_start,
        "margin": "; ".join(
            f"over {name}: {'more than noise' if p < 0.05 else 'within noise'}"
            for name, p in (("the runner-up", p_second), ("its start", p_start))
            if p is not None
        ),
    }


def _runner_up(jobs: pd.DataFrame, best: float) -> str:
    rest = jobs[jobs.accuracy < best]
    if rest.empty:
        return ""
    second = rest[rest.accuracy == rest.accuracy.max()]
    return f"{', '.join(second.experiment + '/' + second.stage)} ({second.accuracy.iloc[0]:.3f})"


def step_offsets(stages: list[StageResult]) -> dict[str, int]:
    """Per stage, the steps of the stages it starts from: a curriculum's stages one after the other."""
    by_label = {trained.label: trained for trained in stages}

    def offset(trained: StageResult) -> int:
        start = by_label.get(trained.init_from)
        return offset(start) + len(start.log) if start else 0

    return {trained.label: offset(trained) for trained in stages}


def evaluations_during_training(stages: list[StageResult]) -> dict[str, tuple[list[dict], dict | None]]:
    """The evaluations during training (`eval_every`) of each stage that has them, and the one whose
    adapter it kept (`keep: best`; None for the last), by its label."""
    found = {}
    for trained in stages:
        summary = trained.summary
        if summary.get("evaluations_during_training"):
            found[trained.label] = summary["evaluations_during_training"], summary.get("kept")
    return found


def sweep_results(results: pd.DataFrame, sweeps: dict[str, dict]) -> pd.DataFrame:
    """Each sweep's experiments (vlft.sweeps), their final stage on each split: the swept values
    beside its accuracy and the accuracy's 95% interval."""
    rows = []
    for experiment, sweep in sweeps.items():
        final = results[(results.experiment == experiment) & (results.stage == sweep["final"])]
        for row in final.itertuples():
            rows.append(
                {"sweep": sweep["experiment"], **sweep["values"], "experiment": experiment, "stage": row.stage}
                | {"split": row.split, "accuracy": row.accuracy, "ci95_low": row.ci95_low, "ci95_high": row.ci95_high}
            )
    return pd.DataFrame(rows)


def outcome_lines(report_dir: str | Path) -> list[str]:
    """What a finished run says last: each split's winner and the report's path (nothing where no
    report has been made)."""
    report_dir = Path(report_dir)
    if not (report_dir / "results.csv").is_file() or not (report_dir / "index.html").is_file():
        return []
    results = pd.read_csv(report_dir / "results.csv", keep_default_na=False)
    lines = []
    for row in winners(results).itertuples():
        name = f"{row.dataset}/{row.split}" if row.dataset else row.split
        runner_up = f"; runner-up {row.runner_up}" if row.runner_up else ""
        lines.append(
            f"{name}: {row.best} won, accuracy {row.accuracy:.3f} of {row.n} ({row.gain_over_base:+.3f} over the base){runner_up}"
        )
    return lines + [f"The report: {report_dir / 'index.html'}"]

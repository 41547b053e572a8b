"""The comparative report: one self-contained HTML page (tables, loss curves, per-category accuracy,
example answers with their images) and CSV tables."""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes
# Every label drawn as the text it is: a category named "$5 or more" is no math to typeset (an
# unknown macro in one failed the whole report, after all training), nor is a stage's name.
matplotlib.rcParams["text.parse_math"] = False
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from vlft.files import atomic_path, read_jsonl  # noqa: E402
from vlft.plan import BASE_EXPERIMENT, BASE_STAGE  # noqa: E402
from vlft.significance import paired_p_value, wilson_interval  # noqa: E402


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
class TrainedStage:
    experiment: str
    stage: str
    summary: str  # its summary.json
    log: str  # its per-step log.jsonl
    init_from: str = ""  # experiment/stage of the adapter it started from, if any

    @property
    def label(self) -> str:
        return f"{self.experiment}/{self.stage}"


def collect(
    evaluations: list[Evaluation], stages: list[TrainedStage]
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
        summary = json.loads(Path(trained.summary).read_text())
        # For using the adapter, not for reading (the evaluations during training have a chart of their own).
        for key in ("adapter_crc32", "model", "answering", "evaluations_during_training", "settings"):
            summary.pop(key, None)
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


def _save_png(fig, path: Path | None) -> str:
    """Write the figure as a PNG file (for Snakemake's report; None: the page alone has it) and return
    it base64-encoded (for the self-contained page)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    if path is not None:
        with atomic_path(path) as tmp:
            tmp.write_bytes(buffer.getvalue())
    return base64.b64encode(buffer.getvalue()).decode()


def step_offsets(stages: list[TrainedStage], logs: dict[str, list[dict]]) -> dict[str, int]:
    """Per stage, the steps of the stages it starts from: a curriculum's stages one after the other."""
    by_label = {trained.label: trained for trained in stages}

    def offset(trained: TrainedStage) -> int:
        start = by_label.get(trained.init_from)
        return offset(start) + len(logs[start.label]) if start else 0

    return {trained.label: offset(trained) for trained in stages}


def _panels(experiments: list[str]):
    """One panel per experiment, two a row."""
    columns = min(2, len(experiments))
    rows = -(-len(experiments) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.2 * rows), squeeze=False, sharey=True)
    for ax in list(axes.flat)[len(experiments) :]:
        ax.set_visible(False)
    return fig, axes


def _label_panels(fig, axes, experiments: list[str], ylabel: str) -> None:
    """Each panel titled by its experiment, over optimizer steps; the y axis named on the left."""
    for ax, experiment in zip(axes.flat, experiments):
        ax.set_title(experiment, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel, fontsize=8)
    fig.tight_layout()


def loss_curves(stages: list[TrainedStage], path: Path) -> str:
    """One panel per experiment; a curriculum's stages one after the other, each from the step
    where the stage it started from ended."""
    logs = {trained.label: read_jsonl(trained.log) for trained in stages}
    offsets = step_offsets(stages, logs)
    experiments = sorted({trained.experiment for trained in stages})
    fig, axes = _panels(experiments)
    for ax, experiment in zip(axes.flat, experiments):
        for trained in (t for t in stages if t.experiment == experiment):
            start, log = offsets[trained.label], logs[trained.label]
            ax.plot([start + r["step"] for r in log], [r["loss"] for r in log], label=trained.stage, linewidth=1.2)
        ax.set_yscale("log")
    _label_panels(fig, axes, experiments, "training loss (per answer token)")
    return _save_png(fig, path)


def evaluations_during_training(stages: list[TrainedStage]) -> dict[str, tuple[list[dict], dict | None]]:
    """The evaluations during training (`eval_every`) of each stage that has them, and the one whose
    adapter it kept (`keep: best`; None for the last), by its label."""
    found = {}
    for trained in stages:
        summary = json.loads(Path(trained.summary).read_text())
        if summary.get("evaluations_during_training"):
            found[trained.label] = summary["evaluations_during_training"], summary.get("kept")
    return found


def accuracy_curves(stages: list[TrainedStage], evals: dict[str, tuple[list[dict], dict | None]]) -> str:
    """Accuracy over the steps, from the evaluations during training: one panel per experiment that
    has them, its stages one after the other as in the loss curves; a kept best marked."""
    logs = {trained.label: read_jsonl(trained.log) for trained in stages}
    offsets = step_offsets(stages, logs)
    experiments = sorted({t.experiment for t in stages if t.label in evals})
    fig, axes = _panels(experiments)
    for ax, experiment in zip(axes.flat, experiments):
        for trained in (t for t in stages if t.experiment == experiment and t.label in evals):
            start, (records, kept) = offsets[trained.label], evals[trained.label]
            steps = [start + r["step"] for r in records]
            (line,) = ax.plot(steps, [r["accuracy"] for r in records], marker=".", label=trained.stage, linewidth=1.2)
            if kept:
                ax.plot([start + kept["step"]], [kept["accuracy"]], marker="*", markersize=12, color=line.get_color())
        ax.set_ylim(0, 1.05)
    _label_panels(fig, axes, experiments, "accuracy during training")
    # In the page only: a study without evaluations during training has no such chart, and the
    # report rule's outputs are the same files for every study.
    return _save_png(fig, None)


def category_chart(categories: pd.DataFrame, path: Path) -> str:
    """Accuracy by category of every job, one panel per evaluated split of each dataset (whose
    categories are its own)."""
    panels = sorted(categories.groupby(["dataset", "split"]).groups)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 4.5 * len(panels)), squeeze=False)
    for (dataset, split), ax in zip(panels, axes[:, 0]):
        table = categories[(categories.dataset == dataset) & (categories.split == split)].copy()
        table.index = table.experiment + "/" + table.stage
        table = table.drop(columns=["experiment", "stage", "split", "dataset"]).dropna(axis=1, how="all")
        table.plot.bar(ax=ax, width=0.8)
        ax.set_ylabel(f"accuracy on {dataset} {split}".replace("  ", " "))
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8, title="category")
        ax.grid(axis="y", alpha=0.3)
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    return _save_png(fig, path)


# Per evaluation: the first this many right and wrong answers, so that a page of nine evaluations
# of thousands of samples still opens at once.
EXAMPLES_EACH = 3
THUMBNAIL_PX = 160


def escaped(text: str) -> str:
    """Text for the page: HTML escaped, and control characters (a model may generate any) shown as
    \\xNN rather than put into the page raw."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 32 and c not in "\n\t" else c for c in html.escape(text))


def thumbnail_jpeg(
    path: str, box: list[float] | None = None, point: list[float] | None = None, size: int | None = THUMBNAIL_PX
) -> bytes:
    """The image shrunk to a thumbnail (`size` pixels on its long side; None: as it is), as a JPEG;
    for a click, the target box (green) and the predicted point (red) drawn on it, both given in
    pixels of the original image."""
    from PIL import Image, ImageDraw, ImageOps

    with Image.open(path) as image:
        small = ImageOps.exif_transpose(image).convert("RGB")
        size = size or max(small.size)
        scale = size / max(small.size)
        small.thumbnail((size, size))
    scale = min(scale, 1.0)  # thumbnail() never enlarges
    pen = ImageDraw.Draw(small)
    if box is not None:
        pen.rectangle([round(v * scale) for v in box], outline=(0, 200, 60), width=2)
    if point is not None:
        x, y = point[0] * scale, point[1] * scale
        pen.ellipse((x - 4, y - 4, x + 4, y + 4), outline=(230, 20, 20), width=2)
        pen.line((x - 7, y, x + 7, y), fill=(230, 20, 20))
        pen.line((x, y - 7, x, y + 7), fill=(230, 20, 20))
    buffer = io.BytesIO()
    small.save(buffer, format="JPEG", quality=80)
    return buffer.getvalue()


def examples_html(evaluations: list[Evaluation]) -> str:
    """For each evaluation, a few right and wrong answers: the image as a thumbnail (a click's target
    box and predicted point drawn on it), the question, the reference and the model's answer, all
    text escaped."""
    thumbnails: dict[str, str] = {}

    def thumbnail(path: str, prediction: dict) -> str:
        if "box" in prediction:  # a click: drawn for this answer
            return base64.b64encode(thumbnail_jpeg(path, prediction["box"], prediction["point"])).decode()
        if path not in thumbnails:
            thumbnails[path] = base64.b64encode(thumbnail_jpeg(path)).decode()
        return thumbnails[path]

    sections = []
    for evaluation in evaluations:
        if not evaluation.predictions:
            continue
        right, wrong = [], []
        for prediction in read_jsonl(evaluation.predictions):
            if prediction["correct"] is None:  # a click without a box: neither
                continue
            shown = right if prediction["correct"] else wrong
            if len(shown) < EXAMPLES_EACH:
                shown.append(prediction)
        images = {r["id"]: str(Path(evaluation.image_root) / r["image"]) for r in read_jsonl(evaluation.prepared)}
        rows = "".join(
            f'<tr class="{"right" if p["correct"] else "wrong"}">'
            f'<td><img alt="image of {escaped(p["id"])}" '
            f'src="data:image/jpeg;base64,{thumbnail(images[p["id"]], p)}"></td>'
            f"<td>{escaped(p['question'])}</td><td>{escaped(p['reference'] or '')}</td>"
            f"<td>{escaped(p['prediction'])}</td><td>{'right' if p['correct'] else 'wrong'}</td></tr>"
            for p in right + wrong
        )
        label = escaped(f"{evaluation.experiment}/{evaluation.stage} on {evaluation.split}")
        clicks = any("box" in p for p in right + wrong)
        legend = "<p>Green: the target box; red: the point answered.</p>" if clicks else ""
        sections.append(
            f"<details><summary>{label}: {len(right)} right, {len(wrong)} wrong</summary>{legend}"
            '<div class="scroll"><table class="t examples"><tr><th>image</th><th>question</th><th>reference</th>'
            f"<th>answer</th><th></th></tr>{rows}</table></div></details>"
        )
    return "".join(sections)


# The page's look: tables that scroll in their own box rather than being cut off, example answers
# wrapped, wrong ones marked.
STYLE = """<style>
body { font-family: system-ui, sans-serif; margin: 2rem auto; padding: 0 1rem; max-width: 72rem; color: #222; }
div.scroll { overflow-x: auto; max-width: 100%; margin-bottom: 1.5rem; }
div.scroll table.t { margin-bottom: 0; }
table.t { border-collapse: collapse; font-size: 0.9rem; margin-bottom: 1.5rem; }
table.t th, table.t td { padding: 0.25rem 0.6rem; border-bottom: 1px solid #ddd; text-align: right; }
table.t th { background: #f3f3f3; }
table.examples td, table.examples th { text-align: left; vertical-align: top; max-width: 28rem; white-space: pre-wrap; overflow-wrap: anywhere; }
tr.wrong td:last-child { color: #b00; }
img { max-width: 100%; }
</style>"""
# The jobs table's columns, where the stages have them.
JOB_COLUMNS = (
    "experiment",
    "stage",
    "steps",
    "samples",
    "wall_time_s",
    "samples_per_s",
    "tokens_per_s",
    "peak_memory_gb",
    "final_loss",
    "resumed_from_step",
    "eval_share",
    "kept_step",
    "device",
    "repeats",
)


def table_html(frame: pd.DataFrame) -> str:
    """A table that scrolls inside its own box where it is wider than the page, never cut off."""
    table = frame.to_html(index=False, float_format=lambda v: f"{v:.3f}", classes="t", border=0, na_rep="")
    return f'<div class="scroll">{table}</div>'


# What a spreadsheet reads as the start of a formula (OWASP's list for CSV injection).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def inert_for_spreadsheets(table: pd.DataFrame) -> pd.DataFrame:
    """The table with every text cell that a spreadsheet would run as a formula (a category named
    `=HYPERLINK(...)`) written as text: a leading apostrophe, which spreadsheets show as nothing."""

    def inert(value):
        return "'" + value if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value

    text = [c for c in table.columns if not pd.api.types.is_numeric_dtype(table[c])]
    return table.assign(**{c: table[c].map(inert) for c in text}).rename(columns=inert)


PREFERENCE_COLUMNS = ["preference_accuracy_start", "preference_accuracy_end", "reward_margin_end"]
HELD_OUT_COLUMNS = ["held_out_pairs", "held_out_preference_accuracy", "held_out_reward_margin"]


def preference_stages(jobs: pd.DataFrame, results: pd.DataFrame) -> str:
    """The section on preference (dpo) stages, where the study has any: how often each step's pairs
    preferred the chosen answer, early and late, and its accuracy beside the stage it started from."""
    if "preference_accuracy_end" not in jobs:
        return ""
    columns = PREFERENCE_COLUMNS + [c for c in HELD_OUT_COLUMNS if c in jobs]
    tuned = jobs[jobs.preference_accuracy_end.notna()][["experiment", "stage", *columns]]
    shown = tuned.merge(
        results[["experiment", "stage", "split", "accuracy", "started_from", "gain_over_start"]],
        on=["experiment", "stage"],
    )
    return (
        "<h2>Preference stages</h2><p><code>preference_accuracy</code>: the share of a step's pairs whose chosen "
        "answer gained more on the starting weights than its rejected one, over the first and the last tenth of "
        "the steps; <code>reward_margin_end</code>: the mean margin (β times the log-ratio difference) at the end; "
        "<code>held_out_…</code>: the same for the pairs of the stage's eval split, after its last step. "
        "Accuracy: answers, as every stage is judged, beside the stage it started from.</p>" + table_html(shown)
    )


def reward_stages(stages: list[TrainedStage], jobs: pd.DataFrame, results: pd.DataFrame, path: Path) -> str:
    """The section on reward (grpo) stages, where the study has any: each step's mean reward, its
    rewards early and late, and its accuracy beside the stage it started from."""
    if "reward_end" not in jobs:
        return ""
    tuned = jobs[jobs.reward_end.notna()][["experiment", "stage", "reward_start", "reward_end"]]
    shown = tuned.merge(
        results[["experiment", "stage", "split", "accuracy", "started_from", "gain_over_start"]],
        on=["experiment", "stage"],
    )
    rewarded = [t for t in stages if f"{t.experiment}/{t.stage}" in set(tuned.experiment + "/" + tuned.stage)]
    fig, axes = _panels([t.label for t in rewarded])
    for ax, trained in zip(axes.flat, rewarded):
        log = read_jsonl(trained.log)
        steps = [r["step"] for r in log]
        mean = [r["reward"] for r in log]
        spread = [r["reward_std"] for r in log]
        ax.plot(steps, mean, linewidth=1.2, label="reward")
        ax.fill_between(steps, [m - d for m, d in zip(mean, spread)], [m + d for m, d in zip(mean, spread)], alpha=0.2)
    _label_panels(fig, axes, [t.label for t in rewarded], "mean reward of the step's answers (± their groups' spread)")
    png = _save_png(fig, path)
    return (
        "<h2>Reward stages</h2><p>The mean reward of each step's sampled answers (the weighted sum of the "
        "stage's <code>rewards</code>), over the first (<code>reward_start</code>) and the last tenth "
        "(<code>reward_end</code>) of the steps, and per step below; accuracy: answers, as every stage is "
        "judged, beside the stage it started from.</p>"
        + table_html(shown)
        + f'<img alt="mean reward per step, one panel per reward stage" src="data:image/png;base64,{png}">'
    )


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


def stopped_arms_html(selections: list[dict]) -> str:
    """Each keep_best: which of its sweep's arms went on past its stage, which stopped there, and why."""
    rows = [
        {
            "arm": arm,
            "after": selection["after"],
            "compared by": f"{selection['metric']} on {selection['split']}",
            "value": selection["values"][arm],
            "went on": "yes" if arm in selection["kept"] else "no",
            "why": "among the best" if arm in selection["kept"] else "stopped: " + selection["stopped"][arm],
        }
        for selection in selections
        for arm in selection["candidates"]
    ]
    if not rows:
        return ""
    return (
        "<h3>Arms stopped early</h3><p>A sweep with <code>keep_best</code> compared its arms at the end of a stage; "
        "only the best trained their later stages.</p>" + table_html(pd.DataFrame(rows))
    )


def sweep_section(results: pd.DataFrame, sweeps: dict[str, dict], path: Path, selections: list[dict]) -> str:
    """The section on sweeps, where the study has any: each sweep's final stages by their values,
    and each split's accuracy (with its 95% interval) against the swept value, a panel per sweep
    (where several settings are swept, against their combinations in order); the arms keep_best
    stopped, and why."""
    if not sweeps:
        return ""
    table = sweep_results(results, sweeps)
    if table.empty:  # no final stage evaluated: the chart the workflow expects says so
        fig, ax = plt.subplots(figsize=(5.5, 1.5))
        ax.axis("off")
        ax.text(0.5, 0.5, "no sweep's final stage is evaluated (eval_splits)", ha="center", va="center")
        _save_png(fig, path)
        return (
            "<h2>Sweeps</h2><p>No sweep's final stage is evaluated (its <code>eval_splits</code> are empty).</p>"
            + stopped_arms_html(selections)
        )
    names = list(dict.fromkeys(table.sweep))
    fig, axes = _panels(names)
    for ax, name in zip(axes.flat, names):
        rows = table[table.sweep == name]
        keys = list(next(s["values"] for s in sweeps.values() if s["experiment"] == name))
        numeric = len(keys) == 1 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in rows[keys[0]])
        for split, points in rows.groupby("split", sort=True):
            points = points.sort_values(keys)
            if numeric:
                x = points[keys[0]].tolist()
            else:
                x = list(range(len(points)))
                ax.set_xticks(x, [", ".join(str(r[k]) for k in keys) for _, r in points.iterrows()], fontsize=7)
            ax.errorbar(
                x,
                points.accuracy,
                yerr=[points.accuracy - points.ci95_low, points.ci95_high - points.accuracy],
                marker="o",
                capsize=3,
                label=split,
            )
        if numeric:
            values = sorted(set(rows[keys[0]]))
            if values[0] > 0 and values[-1] >= 10 * values[0]:
                ax.set_xscale("log")
                ax.minorticks_off()
            # The swept values themselves, written plainly (the page's labels are not parsed as math).
            ax.set_xticks(values, [f"{v:g}" for v in values], fontsize=7)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(" x ".join(keys))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("accuracy of the final stage (95% interval)", fontsize=8)
    fig.tight_layout()
    png = _save_png(fig, path)
    return (
        "<h2>Sweeps</h2><p>Each sweep's experiments (a stage's <code>sweep</code>), their final stage on each "
        "split, by the values swept; the stages they share were trained once (<code>repeats</code> in the "
        "results).</p>"
        + table_html(table)
        + f'<img alt="accuracy against the swept values, one panel per sweep" src="data:image/png;base64,{png}">'
        + stopped_arms_html(selections)
    )


def rests_on_html(stages: list[TrainedStage]) -> str:
    """What the report rests on: when and with what it was made, the base model, and each stage's
    settings (those that differ between stages; the rest said once)."""
    from vlft.provenance import provenance

    facts = provenance()
    summaries = {t.label: json.loads(Path(t.summary).read_text()) for t in stages}
    settings = {label: summary.get("settings") for label, summary in summaries.items()}
    models = sorted({summary.get("model", {}).get("path", "") for summary in summaries.values()})
    known = {label: s for label, s in settings.items() if s}
    keys = sorted({k for s in known.values() for k in s})
    differing = [k for k in keys if len({json.dumps(s.get(k), sort_keys=True) for s in known.values()}) > 1]
    shared = {k: next(iter(known.values())).get(k) for k in keys if k not in differing}
    table = pd.DataFrame(
        [{"stage": label, **{k: json.dumps(s.get(k)) for k in differing}} for label, s in known.items()]
    )
    rows = "".join(
        f"<li>{html.escape(name)}: <code>{html.escape(str(value))}</code></li>" for name, value in facts.items()
    )
    return (
        "<h2>What this rests on</h2><ul>"
        + rows
        + f"<li>base model: <code>{html.escape(', '.join(models))}</code></li></ul>"
        + "<p>Each stage's settings where stages differ (the rest, the same for all: "
        + html.escape(json.dumps(shared, sort_keys=True))
        + ").</p>"
        + (table_html(table) if known else "<p>The stages' summaries predate their settings.</p>")
    )


def write_report(
    evaluations: list[Evaluation],
    stages: list[TrainedStage],
    output_dir: str | Path,
    sweeps: dict | None = None,
    selections: list[dict] | None = None,
) -> None:
    output_dir = Path(output_dir)
    results, categories, jobs = collect(evaluations, stages)
    for name, table in (("results.csv", results), ("accuracy_by_category.csv", categories), ("jobs.csv", jobs)):
        with atomic_path(output_dir / name) as tmp:
            inert_for_spreadsheets(table).to_csv(tmp, index=False, float_format="%.4f")

    # The columns a reader compares first, then the rest.
    first = ["experiment", "stage", "split", "accuracy", "gain_over_base", "gain_over_start", "started_from", "repeats"]
    results_shown = results[first + [c for c in results.columns if c not in first]]

    charts = category_chart(categories, output_dir / "accuracy_by_category.png")
    losses = loss_curves(stages, output_dir / "loss_curves.png")
    during = evaluations_during_training(stages)
    accuracy_over_steps = ""
    if during:
        png = accuracy_curves(stages, during)
        accuracy_over_steps = (
            "<h2>Accuracy during training</h2><p>The evaluations as each stage trained (<code>eval_every</code>), on a "
            "fixed subset of one split (<code>eval_samples</code>); a star marks the adapter a stage kept "
            "(<code>keep: best</code>). <code>eval_share</code> in the jobs table: their share of the stage's time.</p>"
            f'<img alt="accuracy during training, one panel per experiment" src="data:image/png;base64,{png}">'
        )
    job_columns = [c for c in JOB_COLUMNS if c in jobs]
    right = {(e.experiment, e.stage, e.split): answers_right(e) for e in evaluations}
    preferences = preference_stages(jobs, results)
    rewards = reward_stages(stages, jobs, results, output_dir / "reward_curves.png")
    swept = sweep_section(results, sweeps or {}, output_dir / "sweeps.png", selections or [])
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Experiment report</title>
{STYLE}</head><body>
<h1>Experiment report</h1>
<p>Every trained stage on every evaluated split, beside the untrained base model (experiment <code>{BASE_EXPERIMENT}</code>) on the same split of the same dataset (its stage is <code>{BASE_STAGE}</code> on the defaults' dataset, else the dataset's name).
Accuracy compares the final answer parsed out of each generated answer with the reference's; for a click stage, it is whether the point answered lands in the target's box.</p>
<h2>Who won</h2>
<p>Per evaluated split, the trained stage of the best accuracy (every one, where they tie), its gain over the base model, and the next best.</p>
{table_html(winners(results, right))}
<p><code>p_vs_runner_up</code>, <code>p_vs_start</code>: the exact McNemar test of the winner against the runner-up, and against the stage it started from (the base model for a first stage), on the samples both answered: how likely a split of the samples they answer differently at least this lopsided is by chance. Below 0.05 the margin is more than noise; above it, another draw of as many samples could reverse it. <code>ci95_low</code> and <code>ci95_high</code> in the results: the 95% Wilson interval of each accuracy.</p>
<h2>Results</h2>
<p><code>gain_over_start</code>: over the stage it started from (<code>started_from</code>, by <code>init_from</code>), on the same split. <code>repeats</code>: an earlier stage that trained on the very records, in the very order, with the very settings (its filter may read otherwise), whose results these repeat: no second finding.</p>
{table_html(results_shown)}
<h2>Accuracy by category</h2>{table_html(categories)}
<img alt="accuracy by category, one panel per split" src="data:image/png;base64,{charts}">
<h2>Training loss</h2><p>One panel per experiment; a curriculum's stages one after the other.</p>
<img alt="training loss curves, one panel per experiment" src="data:image/png;base64,{losses}">
{accuracy_over_steps}
{preferences}
{rewards}
{swept}
<h2>Jobs: wall time and throughput</h2>{table_html(jobs[job_columns])}
{rests_on_html(stages)}
<h2>Example answers</h2>
<p>The first {EXAMPLES_EACH} right and {EXAMPLES_EACH} wrong answers of each evaluation, in the split's order.</p>
{examples_html(evaluations)}
</body></html>
"""
    with atomic_path(output_dir / "index.html") as tmp:
        tmp.write_text(page)


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

"""The report's charts, each a PNG file (for Snakemake's report) and the same figure as SVG inside the
self-contained page, its text kept as text (sharp at any zoom, found by the browser's search): loss
and accuracy over the steps, accuracy by category, and the panels every chart is laid out in. The
only part of the report that loads matplotlib."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes
# Every label drawn as the text it is: a category named "$5 or more" is no math to typeset (an
# unknown macro in one failed the whole report, after all training), nor is a stage's name.
matplotlib.rcParams["text.parse_math"] = False
# In the page's SVG: text as text, drawn in the page's fonts; ids the same each time the report is made.
matplotlib.rcParams["svg.fonttype"] = "none"
matplotlib.rcParams["svg.hashsalt"] = "vlft-report"
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402
import pandas as pd  # noqa: E402

from vlft.files import atomic_path  # noqa: E402
from vlft.report.study import StageResult, step_offsets  # noqa: E402


def save_chart(fig, path: Path | None) -> str:
    """Write the figure as a PNG file (for Snakemake's report; None: the page alone has it) and return
    it as SVG markup for the page."""
    if path is not None:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    svg = buffer.getvalue()
    return svg[svg.index("<svg") :]


class PlainLogFormatter(ticker.LogFormatter):
    """A log axis's labels as plain numbers (0.3, 6, 20), on the ticks matplotlib's LogFormatter would
    label: its default writes them as math (6x10^0), which the page's labels are not parsed as."""

    def _num_to_string(self, x, vmin, vmax):
        return f"{x:g}"


def panels(experiments: list[str]):
    """One panel per experiment, two a row."""
    columns = min(2, len(experiments))
    rows = -(-len(experiments) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.2 * rows), squeeze=False, sharey=True)
    for ax in list(axes.flat)[len(experiments) :]:
        ax.set_visible(False)
    return fig, axes


def label_panels(fig, axes, experiments: list[str], ylabel: str) -> None:
    """Each panel titled by its experiment, over optimizer steps; the y axis named on the left."""
    for ax, experiment in zip(axes.flat, experiments):
        ax.set_title(experiment, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel, fontsize=8)
    fig.tight_layout()


def loss_curves(stages: list[StageResult], path: Path) -> str:
    """One panel per experiment; a curriculum's stages one after the other, each from the step
    where the stage it started from ended."""
    offsets = step_offsets(stages)
    experiments = sorted({trained.experiment for trained in stages})
    fig, axes = panels(experiments)
    for ax, experiment in zip(axes.flat, experiments):
        for trained in (t for t in stages if t.experiment == experiment):
            start, log = offsets[trained.label], trained.log
            ax.plot([start + r["step"] for r in log], [r["loss"] for r in log], label=trained.stage, linewidth=1.2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(PlainLogFormatter())
        ax.yaxis.set_minor_formatter(PlainLogFormatter())
    label_panels(fig, axes, experiments, "training loss (per answer token)")
    return save_chart(fig, path)


def accuracy_curves(stages: list[StageResult], evals: dict[str, tuple[list[dict], dict | None]]) -> str:
    """Accuracy over the steps, from the evaluations during training: one panel per experiment that
    has them, its stages one after the other as in the loss curves; a kept best marked."""
    offsets = step_offsets(stages)
    experiments = sorted({t.experiment for t in stages if t.label in evals})
    fig, axes = panels(experiments)
    for ax, experiment in zip(axes.flat, experiments):
        for trained in (t for t in stages if t.experiment == experiment and t.label in evals):
            start, (records, kept) = offsets[trained.label], evals[trained.label]
            steps = [start + r["step"] for r in records]
            (line,) = ax.plot(steps, [r["accuracy"] for r in records], marker=".", label=trained.stage, linewidth=1.2)
            if kept:
                ax.plot([start + kept["step"]], [kept["accuracy"]], marker="*", markersize=12, color=line.get_color())
        ax.set_ylim(0, 1.05)
    label_panels(fig, axes, experiments, "accuracy during training")
    # In the page only: a study without evaluations during training has no such chart, and the
    # report rule's outputs are the same files for every study.
    return save_chart(fig, None)


def category_chart(categories: pd.DataFrame, path: Path) -> str:
    """Accuracy by category of every job, one panel per evaluated split of each dataset (whose
    categories are its own)."""
    splits = sorted(categories.groupby(["dataset", "split"]).groups)
    fig, axes = plt.subplots(len(splits), 1, figsize=(9, 4.5 * len(splits)), squeeze=False)
    for (dataset, split), ax in zip(splits, axes[:, 0]):
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
    return save_chart(fig, path)

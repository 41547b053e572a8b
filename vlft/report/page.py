"""The report's page: one self-contained HTML file of the study's tables and charts, its example
answers with their images, and what it rests on; and the CSV tables beside it."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import pandas as pd

from vlft.files import atomic_path, read_jsonl
from vlft.plan import BASE_EXPERIMENT, BASE_STAGE
from vlft.report.charts import accuracy_curves, category_chart, label_panels, loss_curves, panels, plt, save_chart
from vlft.report.study import (
    Evaluation,
    StageResult,
    answers_right,
    collect,
    evaluations_during_training,
    sweep_results,
    winners,
)
from vlft.report.tables import JOB_COLUMNS, inert_for_spreadsheets, preference_stages, stopped_arms_html, table_html
from vlft.thumbnails import thumbnail_jpeg

# The results' columns the page's table shows, where a study has them: the stage, its scores (accuracy,
# the field's text metrics, a click's distance) and what it gained. Each evaluation's other columns
# (its interval, loss, count, time) follow in a table of their own.
COMPARED = [
    "experiment",
    "stage",
    "split",
    "accuracy",
    "bleu",
    "rouge_l",
    "meteor",
    "mean_distance",
    "gain_over_base",
    "gain_over_start",
    "started_from",
    "repeats",
]

# Per evaluation: the first this many right and wrong answers, so that a page of nine evaluations
# of thousands of samples still opens at once.
EXAMPLES_EACH = 3


def escaped(text: str) -> str:
    """Text for the page: HTML escaped, and control characters (a model may generate any) shown as
    \\xNN rather than put into the page raw."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 32 and c not in "\n\t" else c for c in html.escape(text))


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
p.problem { color: #b00; font-weight: bold; }
img { max-width: 100%; }
figure.chart { margin: 0 0 1.5rem; }
figure.chart svg { max-width: 100%; height: auto; }
</style>"""


def figure(svg: str, label: str) -> str:
    """A chart in the page: its SVG, named for screen readers as an image's alt text would."""
    return f'<figure class="chart" role="img" aria-label="{html.escape(label)}">{svg}</figure>'


def reward_stages(stages: list[StageResult], jobs: pd.DataFrame, results: pd.DataFrame, path: Path) -> str:
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
    fig, axes = panels([t.label for t in rewarded])
    for ax, trained in zip(axes.flat, rewarded):
        log = trained.log
        steps = [r["step"] for r in log]
        mean = [r["reward"] for r in log]
        spread = [r["reward_std"] for r in log]
        ax.plot(steps, mean, linewidth=1.2, label="reward")
        ax.fill_between(steps, [m - d for m, d in zip(mean, spread)], [m + d for m, d in zip(mean, spread)], alpha=0.2)
    label_panels(fig, axes, [t.label for t in rewarded], "mean reward of the step's answers (± their groups' spread)")
    svg = save_chart(fig, path)
    return (
        "<h2>Reward stages</h2><p>The mean reward of each step's sampled answers (the weighted sum of the "
        "stage's <code>rewards</code>), over the first (<code>reward_start</code>) and the last tenth "
        "(<code>reward_end</code>) of the steps, and per step below; accuracy: answers, as every stage is "
        "judged, beside the stage it started from.</p>"
        + table_html(shown)
        + figure(svg, "mean reward per step, one panel per reward stage")
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
        save_chart(fig, path)
        return (
            "<h2>Sweeps</h2><p>No sweep's final stage is evaluated (its <code>eval_splits</code> are empty).</p>"
            + stopped_arms_html(selections)
        )
    names = list(dict.fromkeys(table.sweep))
    fig, axes = panels(names)
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
    svg = save_chart(fig, path)
    return (
        "<h2>Sweeps</h2><p>Each sweep's experiments (a stage's <code>sweep</code>), their final stage on each "
        "split, by the values swept; the stages they share were trained once (<code>repeats</code> in the "
        "results).</p>"
        + table_html(table)
        + figure(svg, "accuracy against the swept values, one panel per sweep")
        + stopped_arms_html(selections)
    )


def rests_on_html(stages: list[StageResult]) -> str:
    """What the report rests on: when and with what it was made, the base model, and each stage's
    settings (those that differ between stages; the rest said once)."""
    from vlft.provenance import provenance

    facts = provenance()
    summaries = {t.label: t.summary for t in stages}
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


def trained_parts_html(stages: list[StageResult]) -> str:
    """What each stage trained, by part (vlft.training.census): its tensors changed of all, a part
    it trains marked; a frozen part that moved or a trained part that did not, one line in red."""
    from vlft.training.census import PARTS

    counted = [t for t in stages if t.summary.get("trained_parts")]
    if not counted:
        return ""

    def cell(part: dict | None) -> str:
        if part is None:
            return ""
        changed, tensors = part["changed"], part["changed"] + part["unchanged"]
        return f"{changed} of {tensors} changed" + (" (trained)" if part["trained"] else "")

    table = pd.DataFrame(
        [{"stage": t.label, **{name: cell(t.summary["trained_parts"].get(name)) for name in PARTS}} for t in counted]
    )
    table = table.loc[:, (table != "").any()]  # a part no stage has (the tower's LoRA, mostly) is no column
    problems = "".join(
        f'<p class="problem">{html.escape(t.label)}: {html.escape(problem)}.</p>'
        for t in counted
        for problem in t.summary.get("trained_parts_problems", [])
    )
    return (
        "<h2>What trained</h2><p>Each stage's tensors, by part of the model, whose values its training changed "
        "(checksums at its start and end); (trained): the part it trains.</p>" + table_html(table) + problems
    )


def write_report(
    evaluations: list[Evaluation],
    stages: list[StageResult],
    output_dir: str | Path,
    sweeps: dict | None = None,
    selections: list[dict] | None = None,
) -> None:
    output_dir = Path(output_dir)
    results, categories, jobs = collect(evaluations, stages)
    for name, table in (("results.csv", results), ("accuracy_by_category.csv", categories), ("jobs.csv", jobs)):
        with atomic_path(output_dir / name) as tmp:
            inert_for_spreadsheets(table).to_csv(tmp, index=False, float_format="%.4f")

    # The columns a reader compares, the field's text metrics among them, fit the page; the rest below.
    compared = [c for c in COMPARED if c in results and results[c].notna().any()]
    details = ["experiment", "stage", "split"] + [c for c in results.columns if c not in compared]

    charts = category_chart(categories, output_dir / "accuracy_by_category.png")
    losses = loss_curves(stages, output_dir / "loss_curves.png")
    during = evaluations_during_training(stages)
    accuracy_over_steps = ""
    if during:
        svg = accuracy_curves(stages, during)
        accuracy_over_steps = (
            "<h2>Accuracy during training</h2><p>The evaluations as each stage trained (<code>eval_every</code>), on a "
            "fixed subset of one split (<code>eval_samples</code>); a star marks the adapter a stage kept "
            "(<code>keep: best</code>). <code>eval_share</code> in the jobs table: their share of the stage's time.</p>"
            + figure(svg, "accuracy during training, one panel per experiment")
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
<p><code>p_vs_runner_up</code>, <code>p_vs_start</code>: the exact McNemar test of the winner against the runner-up, and against the stage it started from (the base model for a first stage), on the samples both answered: how likely a split of the samples they answer differently at least this lopsided is by chance. Below 0.05 the margin is more than noise; above it, another draw of as many samples could reverse it. <code>ci95_low</code> and <code>ci95_high</code> under the results (more of each evaluation): the 95% Wilson interval of each accuracy.</p>
<h2>Results</h2>
<p><code>gain_over_start</code>: over the stage it started from (<code>started_from</code>, by <code>init_from</code>), on the same split. <code>repeats</code>: an earlier stage that trained on the very records, in the very order, with the very settings (its filter may read otherwise), whose results these repeat: no second finding.</p>
{table_html(results[compared])}
<details><summary>More of each evaluation: {", ".join(details[3:])} (every column is in results.csv)</summary>
{table_html(results[details])}</details>
<h2>Accuracy by category</h2>{table_html(categories)}
{figure(charts, "accuracy by category, one panel per split")}
<h2>Training loss</h2><p>One panel per experiment; a curriculum's stages one after the other.</p>
{figure(losses, "training loss curves, one panel per experiment")}
{accuracy_over_steps}
{preferences}
{rewards}
{swept}
{trained_parts_html(stages)}
<h2>Jobs: wall time and throughput</h2>{table_html(jobs[job_columns])}
{rests_on_html(stages)}
<h2>Example answers</h2>
<p>The first {EXAMPLES_EACH} right and {EXAMPLES_EACH} wrong answers of each evaluation, in the split's order.</p>
{examples_html(evaluations)}
</body></html>
"""
    with atomic_path(output_dir / "index.html") as tmp:
        tmp.write_text(page)

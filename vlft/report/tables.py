"""The report's tables: as HTML for the page and as CSV files that a spreadsheet opens inert, and
the sections that are a table alone (preference stages, the arms a sweep stopped)."""

from __future__ import annotations

import re


import pandas as pd

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
    """A table that scrolls inside its own box where it is wider than the page, never cut off; its
    column names may wrap after each underscore (gain_over_base), as they would at spaces."""
    table = frame.to_html(index=False, float_format=lambda v: f"{v:.3f}", classes="t", border=0, na_rep="")
    table = re.sub(r"<th>([^<]*)</th>", lambda th: f"<th>{th.group(1).replace('_', '_<wbr>')}</th>", table)
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

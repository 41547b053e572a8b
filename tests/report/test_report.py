"""The report's tables and charts: hostile names drawn as text, CSV cells inert, ties said as ties."""

import html
import io

import pandas as pd

from vlft.report.charts import category_chart
from vlft.report.tables import inert_for_spreadsheets


def categories_of(names: list[str]) -> pd.DataFrame:
    rows = [
        {"experiment": "exp1", "stage": "main", "split": "val", "dataset": "kvasir"} | {n: 0.5 for n in names},
        {"experiment": "base", "stage": "base", "split": "val", "dataset": "kvasir"} | {n: 0.25 for n in names},
    ]
    return pd.DataFrame(rows)


def test_category_names_are_drawn_as_text_whatever_they_hold(tmp_path):
    """A `$` pair with an unknown macro between failed matplotlib's math parser, and so the whole
    report after all training; one pair without was typeset as math."""
    names = ["$\\undefinedmacro$ polyps", "$5 or $10", "yes/no"]
    svg = category_chart(categories_of(names), tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 0
    assert all(html.escape(name, quote=False) in svg for name in names)  # the page's chart holds them as text


def test_csv_cells_a_spreadsheet_would_run_are_written_inert():
    table = categories_of(['=HYPERLINK("http://x","y")', "+1", "-2 polyps", "@sum", "color"])
    table.loc[0, "stage"] = "=cmd|'/c calc'!A1"
    text = inert_for_spreadsheets(table).to_csv(index=False)
    frame = pd.read_csv(io.StringIO(text))
    assert list(frame.columns[4:]) == ['\'=HYPERLINK("http://x","y")', "'+1", "'-2 polyps", "'@sum", "color"]
    assert frame.stage.tolist() == ["'=cmd|'/c calc'!A1", "base"]
    assert frame["color"].tolist() == [0.5, 0.25]  # numbers stay numbers


def test_a_tie_for_best_is_said_in_its_row():
    """Three stages at the best accuracy: all three named, and the row says it is a tie rather than
    leaving the runner-up and the margin blank as if something were missing."""
    from vlft.report.study import winners

    def row(experiment, accuracy):
        return {
            "experiment": experiment,
            "stage": "main",
            "split": "val",
            "dataset": "kvasir",
            "accuracy": accuracy,
            "gain_over_base": accuracy - 0.25,
            "n": 4,
            "started_from": "",
        }

    results = pd.DataFrame([row("base", 0.25)] + [row(f"exp{i}", 0.75) for i in (1, 2, 3)])
    results.loc[0, "stage"] = "base"
    right = {("base", "base", "val"): {"a": True, "b": False, "c": False, "d": False}}
    right |= {(f"exp{i}", "main", "val"): {"a": True, "b": True, "c": True, "d": False} for i in (1, 2, 3)}
    [won] = winners(results, right).to_dict("records")
    assert won["best"] == "exp1/main, exp2/main, exp3/main"
    assert won["runner_up"] == "none: all 3 trained stages tie"
    assert won["margin"].startswith("a tie of 3: none is ahead of the others; over its start: ")

    results = pd.concat([results, pd.DataFrame([row("exp4", 0.5)])], ignore_index=True)
    right[("exp4", "main", "val")] = {"a": True, "b": True, "c": False, "d": False}
    [won] = winners(results, right).to_dict("records")
    assert won["runner_up"] == "exp4/main (0.500)" and won["margin"].startswith("a tie of 3: none is ahead")

"""The report's tables and charts on hostile names: labels drawn as text, CSV cells inert."""

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
    png = category_chart(categories_of(names), tmp_path / "chart.png")
    assert png and (tmp_path / "chart.png").stat().st_size > 0


def test_csv_cells_a_spreadsheet_would_run_are_written_inert():
    table = categories_of(['=HYPERLINK("http://x","y")', "+1", "-2 polyps", "@sum", "color"])
    table.loc[0, "stage"] = "=cmd|'/c calc'!A1"
    text = inert_for_spreadsheets(table).to_csv(index=False)
    frame = pd.read_csv(io.StringIO(text))
    assert list(frame.columns[4:]) == ['\'=HYPERLINK("http://x","y")', "'+1", "'-2 polyps", "'@sum", "color"]
    assert frame.stage.tolist() == ["'=cmd|'/c calc'!A1", "base"]
    assert frame["color"].tolist() == [0.5, 0.25]  # numbers stay numbers

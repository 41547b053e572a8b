"""The demo's report as a person opens it: in a real browser (headless Chromium, Debian's package,
driven through its chromedriver), with no console error, every image decoded, and no empty table."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import need

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser():
    need("chromium")
    need("chromedriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    yield driver
    driver.quit()


def problems(driver, page) -> list[str]:
    """What a reader of `page` would meet: console errors, images that do not decode, empty tables."""
    driver.get(page.as_uri())
    found = [f"console: {entry['message']}" for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    # decode() settles once the browser has decoded the whole image, or failed to.
    images = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "Promise.all([...document.images].map(i => i.decode().then(() => [i.alt, true], () => [i.alt, false])))"
        ".then(done);"
    )
    found += [f"image does not decode: {alt}" for alt, decoded in images if not decoded]
    rows = driver.execute_script(
        "return [...document.querySelectorAll('table')].map(t => t.querySelectorAll('tbody tr').length)"
    )
    found += [f"table {n + 1} is empty" for n, count in enumerate(rows) if count == 0]
    if not images or not rows:
        found.append(f"{len(images)} images and {len(rows)} tables: the page did not render its content")
    return found


def test_the_demo_report_renders_in_a_browser(browser, demo_workdir):
    page = demo_workdir / "results/report/index.html"
    assert problems(browser, page) == []
    assert browser.title == "Experiment report"
    # Four charts (loss, accuracy by category, exp4's accuracy during training, click_grpo's rewards)
    # and nine tables (who won, results and its further columns, categories, preference stages,
    # reward stages, what trained, jobs, the stages' settings), then the
    # examples: per evaluation (the base model and 10 stages on the shapes' val and test, the base
    # model and the 4 click stages on the screens' test: 27) a table of its first 3 right and 3 wrong
    # answers, each with its image.
    evaluations = 2 * (10 + 1) + 5
    sections = browser.find_elements("css selector", "details")
    assert len(sections) == 1 + evaluations  # the results' further columns, then the examples
    example_rows = browser.find_elements("css selector", "table.examples tr.right, table.examples tr.wrong")
    assert evaluations * 3 <= len(example_rows) <= evaluations * 6
    assert len(browser.find_elements("css selector", "img")) == len(example_rows)
    assert len(browser.find_elements("css selector", "figure.chart svg")) == 4
    assert len(browser.find_elements("css selector", "table")) == 9 + evaluations
    # Every stage trained its adapter and nothing else: no line in red.
    assert "What trained" in [h.text for h in browser.find_elements("css selector", "h2")]
    assert not browser.find_elements("css selector", "p.problem")
    # The click stage's examples say which colour is which on their drawings.
    click = next(s for s in sections if "click/main on test" in s.get_attribute("textContent"))
    assert "Green: the target box; red: the point answered." in click.get_attribute("textContent")


def test_a_broken_image_or_an_empty_table_is_found(browser, demo_workdir, tmp_path):
    """The check above can fail: the same page with one image's bytes replaced by bytes that are no
    PNG (a truncated PNG still decodes, partly) and one table emptied."""
    import base64

    text = (demo_workdir / "results/report/index.html").read_text()
    start = text.index("data:image/jpeg;base64,") + len("data:image/jpeg;base64,")
    text = text[:start] + base64.b64encode(b"not a JPEG").decode() + text[text.index('"', start) :]
    body_start, body_end = text.index("<tbody>"), text.index("</tbody>")
    broken = tmp_path / "index.html"
    broken.write_text(text[: body_start + len("<tbody>")] + text[body_end:])
    found = problems(browser, broken)
    assert any(p.startswith("image does not decode") for p in found), found
    assert "table 1 is empty" in found, found


def test_example_answers_are_escaped_and_show_their_image(browser, tmp_path):
    """A model's answer is shown as text, whatever it holds: markup, control characters."""
    import json

    from PIL import Image

    from vlft.report.page import write_report
    from vlft.report.study import Evaluation, StageResult
    from vlft.trained_stage import TrainedStage

    Image.new("RGB", (300, 200), (200, 30, 30)).save(tmp_path / "red.png")
    answer = '<script>document.title = "owned"</script>\x00 <b>red</b>'
    garbled = "polyp" * 120  # one "word" of 600 letters, as a garbled answer can be
    rows = [("r1", answer), ("r2", garbled)]
    (tmp_path / "predictions.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "id": i,
                    "question": "What <i>colour</i>?",
                    "reference": "red",
                    "prediction": said,
                    "correct": False,
                    "category": None,
                }
            )
            + "\n"
            for i, said in rows
        )
    )
    (tmp_path / "prepared.jsonl").write_text("".join(json.dumps({"id": i, "image": "red.png"}) + "\n" for i, _ in rows))
    metrics = {
        "n": 1,
        "accuracy": 0.0,
        "accuracy_by_category": {"all": 0.0},
        "loss": 1.0,
        "wall_time_s": 1.0,
        "answer_format": "final",
    }
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 1}))
    (tmp_path / "log.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    evaluations = [
        Evaluation(
            experiment,
            stage,
            "val",
            str(tmp_path / "metrics.json"),
            str(tmp_path / "predictions.jsonl"),
            str(tmp_path / "prepared.jsonl"),
            str(tmp_path),
        )
        for experiment, stage in (("base", "base"), ("exp1", "main"))
    ]
    write_report(
        evaluations,
        [StageResult.read("exp1/main", TrainedStage.at(tmp_path))],
        tmp_path / "report",
    )

    assert problems(browser, tmp_path / "report/index.html") == []
    assert browser.title == "Experiment report"
    browser.find_element("css selector", "details:has(table.examples) summary").click()
    cell = browser.find_element("css selector", "table.examples tr.wrong td:nth-child(4)")
    assert cell.text == '<script>document.title = "owned"</script>\\x00 <b>red</b>'
    assert browser.find_element("css selector", "table.examples tr.wrong td:nth-child(2)").text == "What <i>colour</i>?"
    # At a laptop's 1,280 pixels no answer spills out of its cell, however long its words.
    browser.set_window_size(1280, 900)
    spilled = browser.execute_script(
        "return [...document.querySelectorAll('table.examples td')].filter(td => td.scrollWidth > td.clientWidth + 1).length"
    )
    assert spilled == 0
    image = browser.find_element("css selector", "table.examples img")
    assert max(image.get_property("naturalWidth"), image.get_property("naturalHeight")) == 160


def table_rows(driver, heading: str, nth: int = 0) -> list[dict]:
    """The nth table after an h2 of the page, as the reader sees it: header -> cell text, per row."""
    return driver.execute_script(
        """
        const h2 = [...document.querySelectorAll('h2')].find(h => h.textContent === arguments[0]);
        let node = h2.nextElementSibling, skip = arguments[1];
        while (!node.querySelector('table') || skip-- > 0) node = node.nextElementSibling;
        const table = node.querySelector('table');
        const names = [...table.querySelectorAll('thead th')].map(th => th.textContent);
        return [...table.querySelectorAll('tbody tr')].map(
            tr => Object.fromEntries([...tr.children].map((td, i) => [names[i], td.textContent])));
        """,
        heading,
        nth,
    )


def test_the_report_names_the_winner_and_fits_a_laptop_screen(browser, demo_workdir):
    """At 1,280 pixels: no table cut off (each scrolls in its own box), who won each split, each
    stage's gain over the base model and over the stage it started from, repeats flagged."""
    import pandas as pd

    browser.set_window_size(1280, 900)
    assert problems(browser, demo_workdir / "results/report/index.html") == []
    layout = browser.execute_script("""
        const page = document.documentElement.clientWidth;
        return {
            page_overflows: document.documentElement.scrollWidth > page,
            tables: [...document.querySelectorAll('table')].map(t => {
                const box = t.parentElement;
                return {boxed: box.matches('div.scroll'), right: box.getBoundingClientRect().right, page,
                        scrolls: getComputedStyle(box).overflowX, reachable: box.scrollWidth >= t.offsetWidth};
            }),
        };
        """)
    assert not layout["page_overflows"]
    for table in layout["tables"]:
        assert table["boxed"] and table["right"] <= table["page"] and table["reachable"], table
        assert table["scrolls"] == "auto", table

    results = pd.read_csv(demo_workdir / "results/report/results.csv")
    trained = results[results.experiment != "base"]
    won = table_rows(browser, "Who won")
    assert [(row["dataset"], row["split"]) for row in won] == sorted(set(zip(trained.dataset, trained.split)))
    for row in won:
        jobs = trained[(trained.dataset == row["dataset"]) & (trained.split == row["split"])]
        best = jobs[jobs.accuracy == jobs.accuracy.max()]
        assert row["best"] == ", ".join(best.experiment + "/" + best.stage)
        assert float(row["accuracy"]) == pytest.approx(best.accuracy.iloc[0], abs=5e-4)

    # Each winner's margin tested on the same samples (exact McNemar), and each accuracy's interval.
    for row in won:
        for name in ("p_vs_runner_up", "p_vs_start"):
            assert row[name] == "" or 0 <= float(row[name]) <= 1, row
        assert float(row["p_vs_start"]) < 0.05 and "over its start: more than noise" in row["margin"], row
    shown = {(r["experiment"], r["stage"], r["split"]): r for r in table_rows(browser, "Results")}
    more = {(r["experiment"], r["stage"], r["split"]): r for r in table_rows(browser, "Results", nth=1)}
    for key, row in shown.items():
        assert float(more[key]["ci95_low"]) <= float(row["accuracy"]) <= float(more[key]["ci95_high"]), row
    # What it rests on: the packages, the commit, the base model, each stage's settings.
    rests_on = browser.find_element("xpath", "//h2[text()='What this rests on']/following-sibling::ul[1]").text
    assert "torch: " in rests_on and "workflow commit: " in rests_on and "base model: " in rests_on
    settings = {r["stage"]: r for r in table_rows(browser, "What this rests on")}
    assert settings["click_grpo/grpo"]["method"] == '"grpo"' and settings["exp1/main"]["method"] == "null"
    accuracy = {k: float(r["accuracy"]) for k, r in shown.items()}
    for split in ("val", "test"):
        # A curriculum's stage beside the one it started from.
        stage2 = shown[("exp3", "stage2", split)]
        assert stage2["started_from"] == "exp3/stage1"
        assert float(stage2["gain_over_start"]) == pytest.approx(
            accuracy[("exp3", "stage2", split)] - accuracy[("exp3", "stage1", split)], abs=2e-3
        )
        assert shown[("exp3", "stage1", split)]["gain_over_start"] == ""
        # The demo's exp4 stage 1 trains on the records of exp3 stage 1 (difficulty 1-2 are the
        # colour and yes/no questions), in the same order, with the same settings.
        assert shown[("exp4", "stage1", split)]["repeats"] == "exp3/stage1"
        assert [k for k, r in shown.items() if r["repeats"] and k[2] == split] == [("exp4", "stage1", split)]
    # One panel per experiment, two a row: a picture taller than wide for the demo's seven.
    losses = browser.find_element("css selector", "figure[aria-label^='training loss curves'] svg")
    assert losses.size["height"] > losses.size["width"]


def test_the_reports_metrics_and_chart_labels_read_as_they_should_on_a_laptop(browser, demo_workdir, tmp_path):
    """At 1,280 pixels the results table shows the field's metrics (BLEU, ROUGE-L, METEOR) with no
    sideways scrolling, and the loss chart's axis labels are the numbers drawn, not math markup
    ($\\mathdefault{6\\times10^{0}}$, what a log axis writes where math is not typeset)."""
    browser.set_window_size(1280, 900)
    assert problems(browser, demo_workdir / "results/report/index.html") == []
    results = browser.execute_script("""
        const h2 = [...document.querySelectorAll('h2')].find(h => h.textContent === 'Results');
        let box = h2.nextElementSibling;
        while (!box.matches('div.scroll')) box = box.nextElementSibling;
        const names = [...box.querySelectorAll('thead th')].map(th => th.textContent);
        return {names, scroll: box.scrollWidth, shown: box.clientWidth};
        """)
    assert {"accuracy", "bleu", "rouge_l", "meteor"} <= set(results["names"]), results
    assert results["scroll"] <= results["shown"], results
    labels = browser.execute_script(
        "return [...document.querySelectorAll(\"figure[aria-label^='training loss'] g[id^='ytick'] text\")]"
        ".map(t => t.textContent)"
    )
    assert labels and all(float(label) > 0 for label in labels), labels
    browser.find_element("css selector", "figure[aria-label^='training loss']").screenshot(str(tmp_path / "loss.png"))
    assert (tmp_path / "loss.png").stat().st_size > 10_000  # the chart was drawn, not an empty box

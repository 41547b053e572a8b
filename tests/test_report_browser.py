"""The demo's report as a person opens it: in a real browser (headless Chromium, Debian's package,
driven through its chromedriver), with no console error, every image decoded, and no empty table."""

from __future__ import annotations

import shutil

import pytest

from conftest import need

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
    assert len(browser.find_elements("css selector", "img")) == 2
    assert len(browser.find_elements("css selector", "table")) == 3


def test_a_broken_image_or_an_empty_table_is_found(browser, demo_workdir, tmp_path):
    """The check above can fail: the same page with one image's bytes replaced by bytes that are no
    PNG (a truncated PNG still decodes, partly) and one table emptied."""
    import base64

    text = (demo_workdir / "results/report/index.html").read_text()
    start = text.index("data:image/png;base64,") + len("data:image/png;base64,")
    text = text[:start] + base64.b64encode(b"not a PNG").decode() + text[text.index('"', start) :]
    body_start, body_end = text.index("<tbody>"), text.index("</tbody>")
    broken = tmp_path / "index.html"
    broken.write_text(text[: body_start + len("<tbody>")] + text[body_end:])
    found = problems(browser, broken)
    assert any(p.startswith("image does not decode") for p in found), found
    assert "table 1 is empty" in found, found

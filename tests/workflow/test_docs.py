"""The documentation holds together: the README is a short door with a table of contents, its links
land on pages and headings that exist, the user guide (docs/) builds as a site with mkdocs --strict,
where a broken link fails, and the config reference is the schema's own words."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from vlft.config_reference import SCHEMA, reference

REPO = Path(__file__).resolve().parents[2]
README_MOST_LINES = 300


def test_the_readme_is_a_short_door_with_a_table_of_contents():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MOST_LINES
    headings = re.findall(r"^## (.+)$", text, re.M)
    contents = re.findall(r"^- \[([^\]]+)\]\(#([^)]+)\)", text, re.M)
    assert [anchor for _, anchor in contents] == [slug(h) for h in headings], (contents, headings)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs write it: lower case, punctuation dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_of_the_readme_lands_on_a_page_and_heading_that_exist():
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]*)(?:#([^)]+))?\)", text)
    assert links
    for target, anchor in links:
        page = REPO / target if target else REPO / "README.md"
        assert page.is_file(), f"README links to {target}, which does not exist"
        if anchor:
            anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), re.M)}
            assert anchor in anchors, f"README links to {target}#{anchor}; its headings: {sorted(anchors)}"


def build(site: Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=cwd,
        capture_output=True,
        text=True,
    )


def test_the_user_guide_builds_and_a_broken_link_fails_the_build(tmp_path):
    built = build(tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site/reference/config/index.html").is_file()
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy)
    page = copy / "docs/daily.md"
    page.write_text(page.read_text() + "\nSee [a page that is not there](nowhere.md).\n")
    broken = build(tmp_path / "broken-site", copy)
    assert broken.returncode != 0 and "nowhere.md" in broken.stderr


def test_the_config_reference_is_the_schemas_own_words():
    """docs/reference/config.md is written from the schema (`python -m vlft.config_reference`): a
    key the schema gains or a description it changes shows here until the page is written again."""
    schema = yaml.safe_load(SCHEMA.read_text())
    assert (REPO / "docs/reference/config.md").read_text() == reference(schema)
    page = reference(schema)
    for key in ("learning_rate", "method", "rewards", "image_groups", "planning.device", "experiments.<name>.stages"):
        assert f"| `{key}` |" in page, key


def test_the_readmes_study_in_one_page_is_a_valid_plan(tiny_model_dir, tmp_path, monkeypatch):
    """The README's one page of YAML, its model path pointed at a tiny Qwen3-VL and its reward of
    one's own importable: the schema takes it and the plan resolves every stage (each init_from
    found, each reward known for its stage's answer format)."""
    from vlft.config import resolve_config
    from vlft.plan import build_plan

    (tmp_path / "my_rewards.py").write_text("def brevity(records, answers):\n    return [1.0 for _ in answers]\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    (study,) = re.findall(r"```yaml\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL)
    config = yaml.safe_load(study.replace("/models/Qwen3-VL-8B-Instruct", str(tiny_model_dir)))
    plan = build_plan(resolve_config(config))
    assert {"exp1/main", "exp4/stage1", "exp4/stage2", "exp7/dpo", "exp8/grpo"} <= set(plan.stages)


def test_the_speed_page_is_one_table_whose_every_figure_is_in_the_log_entry_it_links():
    """docs/performance.md: one table of what is true today, each row with its command, device, date
    and commit, and a link to its dated entry of the benchmarks log, which holds the row's figure
    (a figure changed on one side only fails here). mkdocs --strict checks that each anchor exists."""
    from markdown.extensions.toc import slugify

    page = (REPO / "docs/performance.md").read_text()
    log = (REPO / "benchmarks/README.md").read_text()
    tables = re.findall(r"((?:^\|.*\|\n)+)", page, re.M)
    assert len(tables) == 1
    header, _, *rows = tables[0].splitlines()
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "workload",
        "figure",
        "against",
        "command",
        "device",
        "date",
        "commit",
        "entry",
    ]
    assert len(rows) >= 10
    sections = {}  # anchor -> the entry's text, to its next heading of the same or a higher level
    headings = list(re.finditer(r"^(#+) (.+)$", log, re.M))
    for i, heading in enumerate(headings):
        level = len(heading.group(1))
        end = next((h.start() for h in headings[i + 1 :] if len(h.group(1)) <= level), len(log))
        sections.setdefault(slugify(heading.group(2), "-"), log[heading.start() : end])
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        workload, figure, _, command, device, date, commit, entry = cells
        assert command.startswith("`") and device and re.fullmatch(r"\d{4}-\d\d-\d\d", date), row
        assert re.fullmatch(r"[0-9a-f]{7}(, [0-9a-f]{7})*", commit), row
        [anchor] = re.findall(r"\]\(log\.md#([^)]+)\)", entry)
        number = re.search(r"[\d,]+(\.\d+)?", figure).group(0)
        assert number in sections[anchor] and date in sections[anchor] + log, (workload, number, anchor)

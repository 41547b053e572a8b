"""The tree keeps its conventions: Snakemake's linter finds nothing but the one lint the README
explains (no conda environment or container per rule), snakefmt and black leave every file as it is."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import REPO

# README, "The software environment": the package install is every rule's environment.
EXPLAINED_LINT = "Specify a conda environment or container for each rule."


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True)


def test_snakemake_lint_finds_only_the_explained_lint():
    result = run(sys.executable, "-m", "snakemake", "--lint")
    lints = re.findall(r"^\s+\* (.+?):?$", result.stdout + result.stderr, re.MULTILINE)
    assert lints and set(lints) == {EXPLAINED_LINT}, result.stdout + result.stderr


def test_snakefmt_leaves_the_workflow_as_it_is():
    result = run(sys.executable, "-m", "snakefmt", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_black_leaves_the_python_as_it_is():
    result = run(sys.executable, "-m", "black", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def flags_crowded(text: str) -> list[str]:
    """The string lines of a workflow file's shell commands that hold more than one flag."""
    crowded, in_shell = [], False
    for line in text.splitlines():
        if line.strip() == "shell:":
            in_shell = True
        elif in_shell and line.strip().startswith('"'):
            if len(re.findall(r"(?:^|\s)--[\w-]+", line.strip().strip('"'))) > 1:
                crowded.append(line.strip())
        elif in_shell and not line.strip().startswith("#"):
            in_shell = False
    return crowded


def test_every_rules_shell_command_has_one_flag_a_line():
    crowded = [line for smk in (REPO / "workflow").rglob("*.smk") for line in flags_crowded(smk.read_text())]
    assert not crowded, crowded
    # The check itself: a command of two flags on a line is found.
    assert flags_crowded('    shell:\n        "python x.py --a {a} --b {b} "\n') == ['"python x.py --a {a} --b {b} "']


# A measured figure: a time, a size or a rate with its unit, or a share with decimals.
MEASURED = re.compile(r"\b\d[\d,]*(?:\.\d+)? ?(?:ms|µs|GiB|GB/s|TB/s|tok/s)\b|\b\d+\.\d+ ?(?:s|x|%)(?!\w)")


def measured_figures(source: str) -> list[str]:
    """The comments and docstrings of a Python source that state a measured figure."""
    import ast
    import io
    import tokenize

    texts = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            texts.append(ast.get_docstring(node) or "")
    return [line.strip() for text in texts for line in text.splitlines() if MEASURED.search(line)]


def test_measured_figures_live_in_the_benchmarks_log_not_in_code_comments():
    """A figure in a comment decays unseen; the comment says why and points to benchmarks/README.md."""
    found = {
        str(path.relative_to(REPO)): figures
        for folder in ("vlft", "scripts")
        for path in (REPO / folder).rglob("*.py")
        if (figures := measured_figures(path.read_text()))
    }
    smk = [line for path in (REPO / "workflow").rglob("*.smk") for line in path.read_text().splitlines()]
    if figures := [line for line in smk if line.strip().startswith("#") and MEASURED.search(line)]:
        found["workflow"] = figures
    assert not found, found
    # The check itself: figures of the kinds that were there are found, plain counts are not.
    assert sorted(measured_figures('"""1.1 ms of the 8B\'s 11.7 ms step."""\n# 12.9 GiB for the 8B\n')) == [
        "# 12.9 GiB for the 8B",
        "1.1 ms of the 8B's 11.7 ms step.",
    ]
    assert measured_figures("# 9 questions an image, 8 answers each\n") == []


# A benchmark's main reads as its steps: the work is in functions named for it.
LONGEST_MAIN = 60


def test_benchmarks_import_the_installed_package_and_their_mains_are_short():
    import ast

    edits, long_mains = [], []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        source = path.read_text()
        if "sys.path" in source:
            edits.append(path.name)
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name == "main":
                if node.end_lineno - node.lineno + 1 > LONGEST_MAIN:
                    long_mains.append(f"{path.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not edits, f"benchmarks that edit sys.path: {edits}"
    assert not long_mains, long_mains

"""The tree keeps its conventions: Snakemake's linter finds nothing but the one lint the README
explains (no conda environment or container per rule), snakefmt and black leave every file as it is."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO

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

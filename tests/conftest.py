"""Shared fixtures: a fresh copy of the workflow, as a new user's clone, and helpers to run Snakemake in it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_PARTS = ("Snakefile", "workflow", "config", "scripts", "profiles", "vlft", "pyproject.toml")


def copy_workflow(target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    for part in WORKFLOW_PARTS:
        source = REPO / part
        if source.is_dir():
            shutil.copytree(source, target / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target / part)
    return target


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", *args], cwd=workdir, capture_output=True, text=True
    )
    if check and result.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def planned_outputs(workdir: Path, *args: str) -> set[str]:
    """The first output of every job a dry run plans, e.g. 'results/train/exp4/stage2/adapter'."""
    result = snakemake(workdir, "--dry-run", *args)
    text = result.stdout + result.stderr
    if "Nothing to be done" in text:
        return set()
    return {m.group(1).split(",")[0].strip() for m in re.finditer(r"^\s+output: (.+)$", text, re.MULTILINE)} | {
        f"rule:{m.group(1)}" for m in re.finditer(r"^(?:local)?rule (\w+):$", text, re.MULTILINE) if m.group(1) == "all"
    }


@pytest.fixture(scope="session")
def demo_workdir(tmp_path_factory) -> Path:
    """The whole demo pipeline, run once, exactly as the README's quick start runs it."""
    workdir = copy_workflow(tmp_path_factory.mktemp("demo"))
    snakemake(workdir, "--cores", "2")
    return workdir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from vlft.demo.tiny_model import make_tiny_model

    path = tmp_path_factory.mktemp("model") / "tiny"
    make_tiny_model(path)
    return path

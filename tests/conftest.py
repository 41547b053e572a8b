"""Shared fixtures: a fresh copy of the workflow, as a new user's clone, and helpers to run Snakemake in it."""

from __future__ import annotations

import os
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


def snakemake(workdir: Path, *args: str, check: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", *args], cwd=workdir, capture_output=True, text=True, timeout=timeout
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


# The README's quick start, after its install: the whole demo pipeline.
DEMO_COMMAND = "snakemake --cores all"


@pytest.fixture(scope="session")
def demo_workdir(tmp_path_factory) -> Path:
    """The whole demo pipeline, run once, exactly as the README's quick start runs it."""
    workdir = copy_workflow(tmp_path_factory.mktemp("demo"))
    snakemake(workdir, *DEMO_COMMAND.split()[1:])
    return workdir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from vlft.demo.tiny_model import make_tiny_model

    path = tmp_path_factory.mktemp("model") / "tiny"
    make_tiny_model(path)
    return path


def slurm_problem() -> str | None:
    """Why no SLURM cluster can be used here, or None when one answers."""
    if shutil.which("sbatch") is None:
        return "no SLURM client (sbatch) on this machine; start one with scripts/slurm_cluster.sh start"
    ping = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    if ping.returncode != 0 or "idle" not in ping.stdout and "mix" not in ping.stdout:
        return f"no idle SLURM node answers (sinfo: {ping.stdout.strip() or ping.stderr.strip()})"
    return None


@pytest.fixture(scope="session")
def slurm_cluster():
    """A SLURM cluster to submit to: skipped where there is none, a failure where CI asks for one
    (VLFT_REQUIRE_SLURM=1, set by .ci/run after scripts/slurm_cluster.sh start)."""
    problem = slurm_problem()
    if problem and os.environ.get("VLFT_REQUIRE_SLURM") == "1":
        pytest.fail(f"SLURM required (VLFT_REQUIRE_SLURM=1) but {problem}")
    if problem:
        pytest.skip(problem)


def site_profile(directory: Path, **extra) -> Path:
    """A site's own small profile, given after profiles/slurm: the account and partition of the
    cluster from scripts/slurm_cluster.sh, threads capped to its CPUs, quick first status check."""
    import yaml

    settings = {
        "default-resources": {"slurm_account": "demo", "slurm_partition": "debug"},
        "max-threads": 2,
        "slurm-init-seconds-before-status-checks": 2,
        **extra,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(settings))
    return directory

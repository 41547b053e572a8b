"""When and with what a result was made: the date, the workflow's version and commit, and the
versions of the packages that computed it."""

from __future__ import annotations

import os
import subprocess
import time
from importlib import metadata

from vlft.jobs.launch import WORKFLOW_DIR

PACKAGES = ("vlft", "torch", "transformers", "peft", "snakemake")


def provenance() -> dict[str, str]:
    facts = {"made": time.strftime("%Y-%m-%d %H:%M %Z")}
    facts["workflow commit"] = _commit(os.environ.get(WORKFLOW_DIR) or os.getcwd())
    for package in PACKAGES:
        try:
            facts[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            facts[package] = "not installed"
    return facts


def _commit(directory: str) -> str:
    """The workflow's git commit, marked where its files differ from it; 'unknown' outside git."""

    def git(*args):
        return subprocess.run(["git", "-C", directory, *args], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return "unknown (not a git checkout)"
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + (" with local changes" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (git not found)"

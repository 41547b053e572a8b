"""Outputs a stat shows unusable, found when a plan is made: an empty file where content must be
(a copy cut short, a disk full at the wrong moment), or one missing from an output directory. They
are removed before Snakemake plans, and kept in a list until they are made again: the workflow's
`all` asks for them, because Snakemake makes a missing output again only where a job that needs it
runs, and the jobs after it are all there. So the plan (a dry run's too) lists the jobs that make
them again and what follows. What only reading shows (other bytes of the same size) is
vlft.integrity's, when a job reads them."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from vlft.files import atomic_path, remove_inside
from vlft.jobs.launch import WORKFLOW_DIR  # set for its jobs by the workflow's Snakefile

# Each kind of output, by glob under the results directory, and the files it must hold, not empty
# ("." for the output itself).
MUST_NOT_BE_EMPTY = {
    "prepared/*/*.jsonl": ".",
    "cache/images/*/*/*": "index.json",
    "cache/vision/*/*/*": "index.json",
    "train/*/*/adapter": ("adapter_config.json", "adapter_model.safetensors"),
    "train/*/*/summary.json": ".",
    "eval/*/*/*/metrics.json": ".",
    "eval/*/*/*/predictions.jsonl": ".",
}


# The list of removed outputs, under the working directory (where Snakemake keeps its records).
TO_REMAKE = ".snakemake/vlft/to-remake.json"


def remake_later(output: str | Path, to_remake: str | Path = TO_REMAKE) -> None:
    """Add an output a job of the workflow found damaged and removed to the list, so that the next
    plan makes it again though every job after it is there. A job runs in the workflow's working
    directory, where the list is; outside a workflow's job (a script by hand, a test) there is no list."""
    if WORKFLOW_DIR not in os.environ:
        return
    Path(to_remake).parent.mkdir(parents=True, exist_ok=True)
    with open(Path(to_remake).with_suffix(".lock"), "a") as lock:  # jobs side by side add to one list
        fcntl.flock(lock, fcntl.LOCK_EX)
        _write(to_remake, sorted(set(_read(to_remake)) | {str(output)}))


def remove_empty_outputs(results: str | Path, to_remake: str | Path) -> list[str]:
    """Remove every output that is plainly unusable (an empty file where content must be, or one
    missing from an output directory) and add it to the list `to_remake` holds; one sentence each.
    Stats alone: it runs at every plan."""
    results = Path(results)
    said, removed = [], []
    for pattern, needed in MUST_NOT_BE_EMPTY.items():
        for output in sorted(results.glob(pattern)):
            if any(part.startswith(".") for part in output.relative_to(results).parts):
                # A writer's temporary path (vlft.files.atomic_path), being written now or left by
                # one that was killed (its target's next writer removes it): no output, and a plan
                # made while a job writes it (a SLURM job's own) must not take it from under it.
                continue
            for name in (needed,) if isinstance(needed, str) else needed:
                file = output / name if name != "." else output
                if not file.is_file() or file.stat().st_size == 0:
                    state = "missing" if not file.exists() else "empty"
                    remove_inside(output, output.parent)
                    removed.append(str(output))
                    said.append(f"{file}: damaged: {state}; removed {output}, so that this run makes it again")
                    break
    if removed:
        _write(to_remake, sorted(set(_read(to_remake) + removed)))
    return said


def still_to_remake(to_remake: str | Path) -> list[str]:
    """The outputs removed as damaged that have not been made again since (those that have leave
    the list)."""
    listed = _read(to_remake)
    missing = [path for path in listed if not Path(path).exists()]
    if missing != listed:
        _write(to_remake, missing)
    return missing


def _read(path: str | Path) -> list[str]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []


def _write(path: str | Path, outputs: list[str]) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(outputs))

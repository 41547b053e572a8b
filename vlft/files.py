"""Atomic outputs: write beside the target, rename into place on success, so a crash leaves no half-written file."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(target: str | Path):
    """Yield a temporary path next to `target`; rename it onto `target` only if the block succeeds.

    Works for files and directories alike. The temporary path is on the same file system, so the
    rename is atomic.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
        _remove(target)
        os.replace(tmp, target)
    finally:
        _remove(tmp)


def write_json(path: str | Path, data) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: str | Path, rows) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()

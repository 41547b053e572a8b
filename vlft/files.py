"""Atomic outputs: write beside the target, rename into place on success, so a crash leaves no
half-written file; and the one way the project deletes anything, `remove_inside`, which refuses a
path outside the directory that owns it."""

from __future__ import annotations

import glob
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
    # Left by writers of this target that were killed: whoever writes the target now owns them.
    for stale in target.parent.glob(f".{glob.escape(target.name)}.tmp-*"):
        remove_inside(stale, target.parent)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        remove_inside(target, target.parent)
        os.replace(tmp, target)
    finally:
        remove_inside(tmp, target.parent)


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


def remove_inside(path: str | Path, owner: str | Path) -> None:
    """Remove `path` (a file, a link, a whole directory; nothing if absent), which must lie inside
    `owner`. Resolved first (a link is removed, never followed), so that no name, link or `..` makes
    the project delete what it does not own."""
    path, owner = Path(path), Path(owner).resolve()
    where = path.parent.resolve() / path.name
    if path.name in ("", ".", "..") or where == owner or not where.is_relative_to(owner):
        raise RuntimeError(f"refusing to delete {path}: it is not inside {owner}, the directory this step owns")
    if where.is_dir() and not where.is_symlink():
        shutil.rmtree(where)
    elif where.exists() or where.is_symlink():
        where.unlink()

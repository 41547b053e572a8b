"""Atomic outputs: write beside the target, rename into place on success, so a crash leaves no
half-written file; the one way the project deletes anything, `remove_inside`, which refuses a
path outside the directory that owns it; and the one way it reads text a user gives it, `read_text`."""

from __future__ import annotations

import codecs
import errno
import glob
import itertools
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from vlft.errors import ConfigError, InputError, StorageError

# Write errors that mean "no room": a full file system, or the user's quota on it (common on clusters).
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
# A file system with less than this left is taken as full when a write to it failed: a writer that
# runs out of room fills it to its last blocks first. Some writers lose the errno on the way up
# (torch.save says "basic_ios::clear: iostream error", safetensors a string), so free space decides.
NEARLY_FULL_BYTES = 1 << 20


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
        follow_umask(tmp)
        remove_inside(target, target.parent)
        os.replace(tmp, target)
    except Exception as err:
        # Judged before the partial write below is removed: that frees the room it took.
        if full := storage_error(err, target):
            raise full from err
        raise
    finally:
        remove_inside(tmp, target.parent)


def umask() -> int:
    """This process's umask, read without changing it (os.umask sets it while it reads it, which a
    thread creating a file meanwhile would see)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    return 0o022


def follow_umask(path: Path) -> None:
    """Give a written output (a file, or a directory and all in it) the modes a plain `open` would
    have: libraries that write through temporary files (safetensors, tempfile) leave them 0600 or
    0700 whatever the umask, which hides a group-shared results directory's weights from colleagues."""
    mask = umask()
    paths = [path, *path.rglob("*")] if path.is_dir() else [path] if path.exists() else []
    for entry in paths:
        if entry.is_symlink():
            continue
        executable = entry.is_dir() or entry.stat().st_mode & 0o111
        entry.chmod((0o777 if executable else 0o666) & ~mask)


def storage_error(err: BaseException, path: str | Path) -> StorageError | None:
    """The one-sentence error for a write of `path` that failed for want of room, or None where `err`
    had another cause."""
    if isinstance(err, StorageError):
        return err
    if isinstance(err, (InputError, ConfigError)):  # bad input, whatever room is left
        return None
    reason = None
    for cause in (err, err.__cause__, err.__context__):
        if isinstance(cause, OSError) and cause.errno in NO_ROOM:
            reason = os.strerror(cause.errno)
        elif cause is not None:
            reason = reason or next((os.strerror(e) for e in NO_ROOM if os.strerror(e) in str(cause)), None)
    mount = _mount_point(Path(path).parent)
    try:
        usage = shutil.disk_usage(mount)
    except OSError:
        usage = None
    if reason is None and usage is not None and usage.free < NEARLY_FULL_BYTES:
        reason = os.strerror(errno.ENOSPC)
    if reason is None:
        return None
    free = f" ({_size(usage.free)} free of {_size(usage.total)})" if usage else ""
    return StorageError(
        f"{path}: could not be written: {reason} on {mount}{free}; nothing half-written is left "
        "behind: free some space (or raise the quota) and run again"
    )


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _mount_point(path: Path) -> Path:
    """The mount point of the file system `path` is on (or would be on: it may not exist yet)."""
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def write_json(path: str | Path, data) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: str | Path, rows) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def read_text(path: str | Path, errors: str = "strict") -> str:
    """A data file a user gives (a split, an importer's JSON), as JSON text is: UTF-8 whatever the
    locale, a byte-order mark at its start read as none (Windows tools write one; JSON refuses it),
    and bytes that are not UTF-8 one InputError naming the line, not a decoding traceback (or
    `errors="replace"`, for readers that leave the verdict to the strict one)."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8-sig", errors)
    except UnicodeDecodeError as err:
        start = data.rfind(b"\n", 0, err.start) + 1
        raise InputError(
            path,
            f"not UTF-8 text (byte 0x{data[err.start]:02x} at column {err.start - start + 1})",
            data.count(b"\n", 0, err.start) + 1,
        ) from None


# The longest line a records file may hold. A record with a long chain of reasoning is tens of KB;
# a line of this size is no record (a file of another kind, a line break lost over gigabytes), and is
# refused before it is held in memory.
MAX_LINE_BYTES = 16 << 20


def text_lines(path: str | Path, errors: str = "strict"):
    """(line number, text) of each line of a data file a user gives, one line in memory at a time,
    decoded as `read_text` decodes; a line longer than MAX_LINE_BYTES is one InputError naming it."""
    with open(path, "rb") as handle:
        for line_no in itertools.count(1):
            raw = handle.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):  # cut short by the limit
                raise InputError(path, f"longer than {MAX_LINE_BYTES >> 20} MiB: no record is this long", line_no)
            if line_no == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                yield line_no, raw.decode("utf-8", errors).rstrip("\n")
            except UnicodeDecodeError as err:
                raise InputError(
                    path, f"not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1})", line_no
                ) from None


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

"""Content checksums: written when a cache or an adapter is made, checked when it is read, so that a
file damaged in place (same size, other bytes) or truncated is one sentence naming it, never wrong
metrics. A damaged output is removed where it is found, so that the next run (and a dry run before
it) rebuilds it.

Caches are checked per image, on exactly the bytes a job reads, the first time it reads them: a
full check at no extra I/O. CRC-32 (zlib's, as gzip and PNG use it), not a cryptographic hash: the
faults to catch are accidents (a shard overwritten, a copy cut short), and it runs at over twice
sha256's speed a core, which keeps the check a small share of an evaluation job's time
(benchmarks/README.md, "Checksums"). Adapters, a few hundred MB at most, are checked whole when loaded.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from vlft.empty_outputs import remake_later
from vlft.errors import InputError
from vlft.files import remove_inside
from vlft.trained_stage import TrainedStage


def tensor_checksum(tensor: torch.Tensor) -> str:
    """CRC-32 of a tensor's bytes, whatever its dtype (bf16 included)."""
    return f"{zlib.crc32(tensor.contiguous().view(torch.uint8).numpy()):08x}"


def file_checksum(path: Path, chunk_bytes: int = 1 << 24) -> str:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def adapter_checksums(adapter_dir: Path) -> dict[str, str]:
    """CRC-32 of each file of an adapter directory, by name: for the stage's summary."""
    return {path.name: file_checksum(path) for path in sorted(Path(adapter_dir).iterdir()) if path.is_file()}


def damaged(output: Path, file: Path, what: str, rebuilt_by: str) -> InputError:
    """Remove a damaged output whole and say so: `file` in it is damaged, `rebuilt_by` redoes it."""
    output = Path(output)
    remove_inside(output, output.parent)
    remake_later(output)
    return InputError(
        file, f"damaged: {what}; removed {output}, so that the next run {rebuilt_by} (a dry run lists the job)"
    )


def verify_adapter(adapter_dir: str | Path) -> None:
    """Check an adapter's files against the checksums its stage's summary recorded when it was made;
    an adapter of an earlier version, whose summary records none, is taken as it is."""
    adapter_dir = Path(adapter_dir)
    stage = TrainedStage.of_adapter(adapter_dir)  # the stage's outputs, or their finished copy
    summary = stage.summary
    expected = stage.read_summary().get("adapter_crc32") if summary.exists() else None
    for name, checksum in (expected or {}).items():
        path = adapter_dir / name
        if not path.exists() or file_checksum(path) != checksum:
            state = "missing" if not path.exists() else "its content differs from the checksum in " + str(summary)
            raise damaged(adapter_dir, path, state, "trains the stage again")

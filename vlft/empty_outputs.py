"""Outputs a stat shows unusable, found when a plan is made: an empty file where content must be
(a copy cut short, a disk full at the wrong moment), or one missing from an output directory. They
are removed before Snakemake plans, so that the plan (a dry run's too) lists the jobs that make
them again. What only reading shows (other bytes of the same size) is vlft.caches.integrity's,
when a job reads them."""

from __future__ import annotations

from pathlib import Path

from vlft.files import remove_inside

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


def remove_empty_outputs(results: str | Path) -> list[str]:
    """Remove every output that is plainly unusable (an empty file where content must be, or one
    missing from an output directory), so that the plan, a dry run's included, lists the jobs that
    make them again; one sentence each. Stats alone: it runs at every plan."""
    results = Path(results)
    said = []
    for pattern, needed in MUST_NOT_BE_EMPTY.items():
        for output in sorted(results.glob(pattern)):
            for name in (needed,) if isinstance(needed, str) else needed:
                file = output / name if name != "." else output
                if not file.is_file() or file.stat().st_size == 0:
                    state = "missing" if not file.exists() else "empty"
                    remove_inside(output, output.parent)
                    said.append(f"{file}: damaged: {state}; removed {output}, so that this run makes it again")
                    break
    return said

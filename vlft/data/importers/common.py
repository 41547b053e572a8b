"""What every importer shares: rows read with their place in the file, text fields read strictly,
and outputs written whole or not at all."""

from __future__ import annotations

import json
import math
from pathlib import Path

from vlft.errors import InputError
from vlft.files import atomic_path, read_text, write_jsonl


def json_rows(path: str | Path) -> list[tuple[tuple, dict]]:
    """A JSON array (row = 1-based index) or JSONL (row = line number), each row with its place."""
    text = read_text(path)
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise InputError(path, f"not valid JSON ({err.msg})", err.lineno) from None
        return [((path, i), row) for i, row in enumerate(rows, start=1)]
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines: JSON text may hold U+2028
        if line.strip():
            try:
                rows.append(((path, number), json.loads(line)))
            except json.JSONDecodeError as err:
                raise InputError(path, f"not valid JSON ({err.msg} at column {err.colno})", number) from None
    return rows


def text(value) -> str | None:
    """A field's text, or None where it is missing, empty or 'nan' (as pandas reads a blank)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    value = str(value).strip()
    return None if not value or value.lower() == "nan" else value


def required_text(row: dict, field: str, where) -> str:
    value = text(row.get(field))
    if value is None:
        raise InputError(where[0], "missing or empty", where[1], field)
    return value


def plain(value):
    """A parquet cell as JSON can hold it: arrays as lists, numpy scalars as numbers."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


class UniqueIds:
    """Record ids, refused where one repeats, with both places named."""

    def __init__(self):
        self.seen: dict[str, str] = {}

    def add(self, record_id: str, where) -> str:
        if record_id in self.seen:
            raise InputError(
                where[0], f"duplicate id {record_id!r} (first seen at {self.seen[record_id]})", where[1], "id"
            )
        self.seen[record_id] = f"{where[0]}:{where[1]}"
        return record_id


def write_splits(out_dir: str | Path, splits: dict[str, list[dict]], new: bool = True) -> None:
    """One JSONL per split in a new directory, whole or not at all (`new` False: into a directory
    the caller is making whole, as atomic_path's temporary one)."""
    if not new:
        Path(out_dir).mkdir(exist_ok=True)
        for split, records in splits.items():
            write_jsonl(Path(out_dir) / f"{split}.jsonl", records)
        return
    with atomic_path(out_dir) as tmp:
        write_splits(tmp, splits, new=False)

"""What every importer shares: rows read with their place in the file, text fields read strictly,
and outputs written whole or not at all."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

from vlft.errors import InputError
from vlft.files import atomic_path, read_text, write_jsonl

# Where LLaVA-style text shows a row's image: taken out of the text by the importers that read it.
IMAGE_MARKER = "<image>"


def json_rows(path: str | Path, refusals: "Refusals | None" = None) -> list[tuple[tuple, dict]]:
    """A JSON array (row = 1-based index) or JSONL (row = line number), each row with its place; a
    JSONL line that is not JSON is refused as its row (with `refusals`), else it stops the file."""
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
            with refusals.row((path, number)) if refusals is not None else nullcontext():
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


# R1-style answers (R1-V's, VLM-R1's and EasyR1's `solution`): reasoning in think tags, the answer in answer tags.
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
THINK_TAG = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def tagged_answer(value: str) -> str | None:
    """An R1-style answer as our record writes one: the answer tags' text, after the think tags'
    reasoning and 'Final answer:' where it has some (what answer_match and the evaluation read);
    None where the text has no answer tag."""
    answers = ANSWER_TAG.findall(value)
    if not answers:
        return None
    thinking = "\n".join(t.strip() for t in THINK_TAG.findall(value) if t.strip())
    return f"{thinking}\nFinal answer: {answers[-1].strip()}" if thinking else answers[-1].strip()


def structure(value) -> str | None:
    """What a structured cell is, in words for a refusal ("an object (its fields: x, y)", "a list of
    4 values"), or None where the cell is no object and no list of several values."""
    value = plain(value)
    if isinstance(value, dict):
        return f"an object (its fields: {', '.join(map(str, value)) or 'none'})"
    if isinstance(value, list) and len(value) > 1:
        return f"a list of {len(value)} values"
    return None


def shown(value, limit: int = 120) -> str:
    """A cell as a message shows it: bytes as their count, never themselves; long text cut."""

    def without_bytes(v):
        if isinstance(v, (bytes, bytearray)):
            return f"<{len(v):,} bytes>"
        if isinstance(v, dict):
            return {k: without_bytes(x) for k, x in v.items()}
        if isinstance(v, list):
            return [without_bytes(x) for x in v]
        return v

    said = repr(without_bytes(plain(value)))
    return said if len(said) <= limit else said[: limit - 3] + "..."


def holds_bytes(value) -> bool:
    """Whether a cell carries an image's bytes (raw, or as the Hub's {bytes, path}), at any depth."""
    value = plain(value)
    if isinstance(value, (bytes, bytearray)):
        return True
    if isinstance(value, dict):  # JSON holds the Hub's {bytes, path} with its bytes as text
        return bool(value.get("bytes")) or any(holds_bytes(v) for v in value.values())
    return isinstance(value, list) and any(holds_bytes(v) for v in value)


class UniqueIds:
    """Record ids, each unique: a repeated one gets an id of its own (`<id>-2`, `-3`, ...), and the
    renames are kept for the summary."""

    def __init__(self):
        self.seen: dict[str, str] = {}
        self.renamed: list[str] = []  # "file:row: 'id' -> 'id-2' (first at file:row)"

    def add(self, record_id: str, where) -> str:
        given, n = record_id, 1
        while record_id in self.seen:
            n += 1
            record_id = f"{given}-{n}"
        if n > 1:
            self.renamed.append(f"{where[0]}:{where[1]}: {given!r} -> {record_id!r} (first at {self.seen[given]})")
        self.seen[record_id] = f"{where[0]}:{where[1]}"
        return record_id

    def summary(self) -> dict:
        if not self.renamed:
            return {}
        return {"ids_renamed": len(self.renamed), "ids_renamed_first": self.renamed[:5]}


class Refusals:
    """The rows an importer refuses, each with its place and reason, collected rather than raised
    one at a time. With rows refused, the import stops listing them all (the first few in its
    message, every one in `<out>.refused.jsonl` beside the output); with `skip_bad_rows` the rows
    that fit are imported and the list written all the same. A fault of the file itself (not JSON,
    a missing column) stops it at once."""

    SHOWN = 3

    def __init__(self, out_dir: str | Path, skip_bad_rows: bool = False):
        self.listing = Path(f"{Path(out_dir)}.refused.jsonl")
        self.skip_bad_rows = skip_bad_rows
        self.refused: list[dict] = []

    @contextmanager
    def row(self, where):
        """A row's import: an error that names a row is its refusal."""
        try:
            yield
        except InputError as error:
            if error.line is None:
                raise
            self.refused.append(
                {"file": str(error.path), "row": error.line, "field": error.field, "reason": error.reason}
            )

    def finish(self) -> dict:
        """After every row, before writing: stop where rows were refused (unless skipping them);
        the summary's counts of refused rows by field."""
        self.listing.unlink(missing_ok=True)
        if not self.refused:
            return {}
        files = {name: n for n, name in enumerate(dict.fromkeys(r["file"] for r in self.refused))}
        self.refused.sort(key=lambda r: (files[r["file"]], r["row"]))  # in the files' order, by row
        write_jsonl(self.listing, self.refused)
        if not self.skip_bad_rows:
            shown = "; ".join(
                f"{r['file']}:{r['row']}" + (f": field '{r['field']}'" if r["field"] else "") + f": {r['reason']}"
                for r in self.refused[: self.SHOWN]
            )
            more = f" (and {len(self.refused) - self.SHOWN} more)" if len(self.refused) > self.SHOWN else ""
            raise InputError(
                self.listing,
                f"{len(self.refused)} rows refused, every one listed in this file: {shown}{more}; nothing was "
                "written; --skip-bad-rows imports the others",
            )
        by_field = Counter(r["field"] or "row" for r in self.refused)
        return {"refused": len(self.refused), "refused_by_field": dict(by_field), "refused_list": str(self.listing)}


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

"""Flat visual question answering: one row an image, a question and an answer, as most medical VQA
sets publish it (SLAKE, VQA-RAD, PathVQA, LLaVA-Med's evaluation files), in JSON, JSONL, CSV or
parquet, the image as a file's path or as its bytes (the Hub's parquet exports: {bytes, path}).

The fields are named by options where a set names them its own way (SLAKE's `img_name`, LLaVA-Med's
`text`); by default the usual names are looked for. A row's split comes from a field (`split_field`)
or from its file's name as the publishers name their split files (`train.json`, `validate.json`,
`test-00000-of-00001.parquet`), else `split`. Embedded images are written once each, named by
their content, to `<out>/images/`; paths stay relative to `image_root`. Every other field is kept
on the record under its own name (SLAKE's `modality` and `answer_type`, say), so a curriculum's
`filter` can select on it, except one named as a field of our records (`history`, `system`, ...):
kept as `published_<name>`. `keep` selects rows (SLAKE's English questions: `q_lang=en`), the rest
counted.

RL datasets' rows read the same way: `problem` and `solution` (R1-V, VLM-R1), its R1-style tags
read; EasyR1's and verl's `images` list of one embedded image. A solution that is a place on the
image (VLM-R1's REC boxes, GUI-R1's `gt_bbox` with its `gt_action`, AndroidControl's click actions)
makes a click record, and steps of other actions are skipped and counted
(vlft.data.importers.targets)."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path

from vlft.errors import InputError
from vlft.files import atomic_path, read_text
from vlft.data.importers.common import (
    IMAGE_MARKER,
    Refusals,
    UniqueIds,
    json_rows,
    plain,
    shown,
    structure,
    tagged_answer,
    text,
    write_splits,
)
from vlft.data.importers.kvasir import ImageWriter, parquet_rows
from vlft.data.importers.targets import CLICK_ACTIONS, action_of, click_fields, image_size, target_values, units_of

# The names each field goes by in the published sets, looked for in this order where none is given.
FIELD_NAMES = {
    "image": ("image", "img_name", "image_name", "img", "file_name", "image_path", "img_path", "images"),
    "question": ("question", "text", "query", "problem", "instruction"),
    "answer": ("answer", "answers", "gpt4_answer", "label", "solution", "gt_bbox"),
    "id": ("id", "qid", "question_id"),
}
# Our records' own fields (vlft.data.records): a published field of one of these names is kept as
# `published_<name>`, never read as ours (GUI-R1's `history` is text, ours a list of rounds).
RECORD_FIELDS = ("history", "system", "rejected", "box", "point", "width", "height", "image_sha256")
# The names of split files, as the publishers write them, and our split each is.
SPLIT_NAMES = {
    "train": "train",
    "training": "train",
    "val": "val",
    "valid": "val",
    "validate": "val",
    "validation": "val",
    "dev": "val",
    "test": "test",
    "testing": "test",
}


def import_flat_vqa(
    files: list[str | Path],
    out_dir: str | Path,
    image_root: str | Path | None = None,
    fields: dict[str, str] | None = None,
    category: str | None = None,
    split_field: str | None = None,
    split: str | None = None,
    keep: dict[str, str] | None = None,
    split_map: dict[str, str] | None = None,
    skip_bad_rows: bool = False,
) -> dict:
    """One record a row. `fields` names the image, question, answer and id fields where they differ
    from the usual names; `category` the field the report's breakdown is by; `keep` the rows
    imported ({field: value}, the rest counted); `split_map` the split each value of `split_field`
    is, where it is not one of the usual names (VQA-RAD's `phrase_type`: test_freeform=test, ...).
    An answer that is a place on the image (a box solution, a click action) makes a click record
    (vlft.data.importers.targets)."""
    refusals = Refusals(out_dir, skip_bad_rows)
    with atomic_path(out_dir) as tmp:
        rows_in = _FlatImport(tmp, image_root, category, split_field, SPLIT_NAMES | _lower(split_map), keep)
        for path in files:
            rows = list(_rows(path, refusals))
            names = rows_in.fields[str(path)] = _field_names([row for _, row in rows], fields or {}, path)
            file_split = None if split_field else _split_of_file(path) or split
            if file_split is None and not split_field:
                raise InputError(
                    path,
                    "its name says no split (train, val or test): give --split for its rows, "
                    "or --split-field where a field names each row's",
                )
            units = units_of([t for _, row in rows if (t := _quiet_target(row, names["answer"])) is not None])
            for where, row in rows:
                with refusals.row(where):
                    rows_in.add(row, where, names, file_split, units)
        refused = refusals.finish()
        if not rows_in.splits:
            raise InputError(files[0], f"no row to import: {rows_in.why_none()}")
        write_splits(tmp, rows_in.splits, new=False)
    return rows_in.summary(out_dir) | refused


class _FlatImport:
    """The rows of every file as they become records: their splits, the images written from their
    bytes, and what became of the rows that made none."""

    def __init__(self, tmp: Path, image_root, category, split_field, split_names, keep):
        self.tmp, self.image_root, self.category = tmp, image_root, category
        self.split_field, self.split_names, self.keep = split_field, split_names, keep or {}
        self.splits: dict[str, list[dict]] = {}
        self.fields: dict[str, dict] = {}
        self.ids, self.counts, self.skipped_actions = UniqueIds(), Counter(), Counter()
        self.images: ImageWriter | None = None
        self.dropped: list[tuple[tuple, str]] = []  # (where, answer field) of rows without an answer

    def add(self, row, where, names: dict, file_split: str | None, units: str) -> None:
        if not isinstance(row, dict):
            raise InputError(where[0], "each row must be an object of fields", where[1])
        if any(str(plain(row.get(k))) != v for k, v in self.keep.items()):
            self.counts["skipped_by_keep"] += 1
            return
        cell = plain(row.get(names["answer"]))
        action = action_of(row, cell)
        if action is not None and action not in CLICK_ACTIONS:
            self.skipped_actions[action] += 1  # a step a click record cannot hold: typing, scrolling, ...
            return
        target = target_values(cell, where, names["answer"])
        if action is not None and target is None:
            raise InputError(where[0], f"a {action} action that names no place on the image", where[1], names["answer"])
        answer = None if target is not None else _answer(cell, where, names["answer"])
        if target is None and answer is None:
            self.counts["dropped_without_answer"] += 1
            self.dropped.append((where, names["answer"]))
            return
        if answer is not None and (tagged := tagged_answer(answer)) is not None:
            answer = tagged
            self.counts["answer_tags_read"] += 1
        image, image_file = self._image(_one_image(row.get(names["image"]), where, names["image"]), where, names)
        record = {
            "id": self.ids.add(self._id(row, where, names["id"]), where),
            "image": image,
            "question": _question(row.get(names["question"]), where, names["question"], self.counts),
            "answer": answer,
            "category": text(row.get(self.category)) if self.category else None,
        }
        if target is not None:
            record |= click_fields(target, units, image_size(image_file, where), where, names["answer"])
            self.counts["click_records"] += 1
            if history := text(row.get("history")):  # GUI-R1's earlier steps, which its prompt shows
                record["question"] += f"\nPrevious actions: {history}"
                self.counts["action_history_in_question"] += 1
        used = {names["image"], names["question"], names["answer"], names["id"], self.split_field}
        if target is not None:
            used.add("history")
        for name, value in row.items():
            if name not in used and name not in record:
                kept = f"published_{name}" if name in RECORD_FIELDS else name  # never read as ours
                self.counts["fields_renamed"] += kept != name
                record[kept] = plain(value)
        row_split = file_split or _split_value(row.get(self.split_field), where, self.split_field, self.split_names)
        self.splits.setdefault(row_split, []).append(record)

    @staticmethod
    def _id(row: dict, where, field: str | None) -> str:
        return (text(row.get(field)) if field else None) or f"{Path(where[0]).stem}-{where[1]}"

    def _image(self, cell, where, names: dict) -> tuple[str, Path]:
        """The record's image name and its file: written from the row's bytes, or under image_root."""
        if _is_bytes(cell):
            self.images = self.images or ImageWriter(self.tmp / "images")
            data = cell.get("bytes") if isinstance(cell, dict) else cell
            name = self.images.add(hashlib.sha256(data).hexdigest()[:16], cell, where)
            return name, self.images.directory / name
        name = _image_path(cell, self.image_root, where, names["image"])
        return name, Path(self.image_root) / name

    def why_none(self) -> str:
        why = ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in self.counts.items()) or "no rows"
        if self.skipped_actions:
            why += f", steps of actions other than a click skipped: {dict(self.skipped_actions)}"
        if self.dropped:
            (path, row), field = self.dropped[0]
            why += f" (the first without answer: {path}:{row}, field {field!r})"
        return why

    def summary(self, out_dir) -> dict:
        records = [r for split in self.splits.values() for r in split]
        return {
            "records": len(records),
            **dict(self.counts),
            **({"skipped_actions": dict(self.skipped_actions)} if self.skipped_actions else {}),
            **self.ids.summary(),
            "images": len(self.images.id_of) if self.images else len({r["image"] for r in records}),
            "image_root": f"{out_dir}/images" if self.images else str(self.image_root),
            "fields": self.fields,
            "splits": {name: len(split) for name, split in self.splits.items()},
        }


def _lower(split_map: dict[str, str] | None) -> dict[str, str]:
    return {k.lower(): v for k, v in (split_map or {}).items()}


def _quiet_target(row, field: str) -> list[float] | None:
    """A row's target where it has one that reads, for telling a file's units; None otherwise
    (the row's own import names what is wrong with it)."""
    if not isinstance(row, dict) or action_of(row, plain(row.get(field))) not in (None, *CLICK_ACTIONS):
        return None  # a step of another action: its place, where it has one, is no target (GUI-R1's [-1, -1])
    try:
        return target_values(row.get(field), ("", 0), field)
    except InputError:
        return None


def _rows(path, refusals: Refusals):
    """A file's rows with their places: JSON (an array, or an object holding one list of rows),
    JSONL, CSV or parquet, by its extension."""
    suffix = Path(path).suffix.lower()
    if suffix == ".parquet":
        yield from parquet_rows([path], [])
    elif suffix in (".csv", ".tsv"):
        import pandas as pd

        try:
            frame = pd.read_csv(path, sep="\t" if suffix == ".tsv" else ",", dtype=str, keep_default_na=False)
        except (OSError, ValueError) as err:
            raise InputError(path, f"cannot be read as {suffix[1:].upper()} ({err})") from None
        for number, row in enumerate(frame.to_dict("records"), start=2):  # line 1 is the header
            yield (path, number), row
    elif suffix == ".json" and read_text(path).lstrip().startswith("{"):
        data = json.loads(read_text(path))
        lists = [v for v in data.values() if isinstance(v, list)] if isinstance(data, dict) else []
        if len(lists) != 1:
            raise InputError(path, "a JSON object that holds no single list of rows")
        yield from (((path, n), row) for n, row in enumerate(lists[0], start=1))
    else:
        yield from json_rows(path, refusals)


def _field_names(rows: list[dict], given: dict[str, str], path) -> dict[str, str | None]:
    """Each field's name in this file: as given, else the first usual name its rows have."""
    present = set().union(*(row.keys() for row in rows if isinstance(row, dict))) if rows else set()
    names = {}
    for field, candidates in FIELD_NAMES.items():
        if field in given:
            if given[field] not in present and rows:
                raise InputError(path, f"has no field {given[field]!r} (--{field}); its fields: {sorted(present)}")
            names[field] = given[field]
            continue
        names[field] = next((c for c in candidates if c in present), None)
        if names[field] is None and field != "id":
            raise InputError(
                path,
                f"has none of the usual {field} fields ({', '.join(candidates)}): name it with --{field}; "
                f"its fields: {sorted(present)}",
            )
    return names


def _split_of_file(path) -> str | None:
    """The split a published file holds, from the words of its name: `train.json`, `validate.json`,
    `test-00000-of-00001.parquet`, MEVF's `testset.json`, `slake_train.jsonl`; None where its name
    says none, or several."""
    words = re.split(r"[-_. ]+", Path(path).name.split(".")[0].lower())
    said = {SPLIT_NAMES.get(word) or SPLIT_NAMES.get(word.removesuffix("set")) for word in words}
    said.discard(None)
    return said.pop() if len(said) == 1 else None


def _question(value, where, field: str, counts: Counter) -> str:
    """A row's question without the `<image>` marker that LLaVA-style files leave in it (the image
    is the row's own: LLaVA-Med's evaluation takes the marker out too), counted."""
    question = text(value)
    if question is None:
        raise InputError(where[0], "missing or empty", where[1], field)
    markers = question.count(IMAGE_MARKER)
    if markers > 1:
        raise InputError(where[0], f"{markers} {IMAGE_MARKER} markers: a record shows one image", where[1], field)
    if markers:
        counts["image_markers_removed"] += 1
        question = question.replace(IMAGE_MARKER, "").strip()
        if not question:
            raise InputError(where[0], f"holds only {IMAGE_MARKER}", where[1], field)
    return question


def _split_value(value, where, field: str, names: dict[str, str]) -> str:
    """The split a row's `field` names: one of the usual names, or mapped (`split_map`)."""
    name = text(value)
    if name is None:
        raise InputError(where[0], "missing or empty (the row's split)", where[1], field)
    if name.lower() not in names:
        raise InputError(
            where[0],
            f"split {name!r} is none of {', '.join(sorted(set(SPLIT_NAMES)))}: map it with --split-map",
            where[1],
            field,
        )
    return names[name.lower()]


def _answer(value, where, field: str) -> str | None:
    """A row's answer as text: numbers (VQA-RAD's counts) as written, a list of one as its item;
    None where missing or empty. A structured answer (an object that is no action, a list of several
    values that is no place) is refused as what it is, never imported as Python's text of it."""
    value = plain(value)
    if isinstance(value, list) and len(value) <= 1:
        value = value[0] if value else None
    if (kind := structure(value)) is not None:
        raise InputError(where[0], f"the answer is {kind}, not text", where[1], field)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return text(value)


def _one_image(cell, where, field: str):
    """A row's image cell; a list of one (EasyR1's and verl's `images` column) is its item. A list of
    several is refused: a record shows one image."""
    cell = plain(cell)
    if isinstance(cell, list):
        if len(cell) != 1:
            raise InputError(where[0], f"{len(cell)} images: a record shows one image", where[1], field)
        cell = cell[0]
    return cell


def _is_bytes(cell) -> bool:
    data = cell.get("bytes") if isinstance(cell, dict) else cell
    return isinstance(data, (bytes, bytearray)) and len(data) > 0


def _image_path(cell, image_root, where, field: str) -> str:
    """An image named by its path, relative to `image_root` (which must hold it)."""
    name = cell.get("path") if isinstance(cell, dict) else cell
    if not isinstance(name, (str, type(None))):
        raise InputError(where[0], f"names no image file: {shown(cell)}", where[1], field)
    name = text(name)
    if name is None:
        raise InputError(where[0], "names no image (no path, no bytes)", where[1], field)
    if "://" in name:
        raise InputError(where[0], f"image {name} is a URL: download it and name the file", where[1], field)
    if image_root is None:
        raise InputError(
            where[0], f"image {name!r} is a path: give --image-root, where the images are", where[1], field
        )
    if not (Path(image_root) / name).is_file():
        raise InputError(where[0], f"image {name!r} is not under {image_root}", where[1], field)
    return name

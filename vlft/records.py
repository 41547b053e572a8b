"""Dataset records: the one input format, its validation, and the selection and order of a stage.

A record is one JSON object a line: id, image (relative to the dataset's image root), question,
answer (may hold reasoning that ends in a final answer), and optionally category, difficulty,
box or point, and any other fields a filter or an order may use.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import ExifTags, Image

from vlft.errors import InputError
from vlft.files import write_jsonl

REQUIRED_TEXT_FIELDS = ("question", "answer")


def read_raw_records(jsonl: str | Path) -> list[tuple[int, dict]]:
    """Parse every line, checking the fields; returns (line number, record) pairs."""
    records, seen_ids = [], {}
    with open(jsonl) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(jsonl, f"not valid JSON ({err.msg} at column {err.colno})", line_no) from None
            if not isinstance(record, dict):
                raise InputError(jsonl, "each line must be a JSON object", line_no)
            _check_fields(record, jsonl, line_no)
            record["id"] = str(record["id"])
            if record["id"] in seen_ids:
                raise InputError(jsonl, f"duplicate id (first seen on line {seen_ids[record['id']]})", line_no, "id")
            seen_ids[record["id"]] = line_no
            records.append((line_no, record))
    if not records:
        raise InputError(jsonl, "no records")
    return records


def _check_fields(record: dict, jsonl, line_no: int) -> None:
    if "id" not in record or not isinstance(record["id"], (str, int)) or record["id"] == "":
        raise InputError(jsonl, "missing or empty", line_no, "id")
    if not isinstance(record.get("image"), str) or not record["image"]:
        raise InputError(jsonl, "missing or not a path", line_no, "image")
    for name in REQUIRED_TEXT_FIELDS:
        value = record.get(name)
        if not isinstance(value, str) or not value.strip():
            raise InputError(jsonl, "missing or empty", line_no, name)
    for name, size in (("box", 4), ("point", 2)):
        value = record.get(name)
        if value is not None and not (
            isinstance(value, list) and len(value) == size and all(isinstance(v, (int, float)) for v in value)
        ):
            raise InputError(jsonl, f"must be a list of {size} numbers", line_no, name)
    box = record.get("box")
    if box is not None and not (box[0] <= box[2] and box[1] <= box[3]):
        raise InputError(jsonl, f"must be [x1, y1, x2, y2] with x1 <= x2 and y1 <= y2, not {box}", line_no, "box")


def image_paths(jsonl: str | Path, image_root: str | Path) -> list[str]:
    """The images a raw split refers to, read leniently: lines that do not parse are skipped here
    and reported, with their line number, when the split is prepared."""
    paths = []
    with open(jsonl) as f:
        for line in f:
            try:
                image = json.loads(line).get("image")
            except (json.JSONDecodeError, AttributeError):
                continue
            if isinstance(image, str) and image:
                paths.append(str(Path(image_root) / image))
    return paths


# The largest long side / short side the Qwen-VL image processors take (their smart_resize).
MAX_ASPECT_RATIO = 200

# EXIF orientations that turn the stored image by 90 or 270 degrees (with or without a mirror).
TRANSPOSED_ORIENTATIONS = {5, 6, 7, 8}


def aspect_ratio_problem(width: int, height: int) -> str | None:
    """The Qwen-VL image processors' one refusal of an image size (smart_resize's aspect-ratio
    limit), which would otherwise stop the pixel cache later, or None. Its own words, not its call:
    smart_resize's module brings transformers and torch, some 12 s of every prepare_split job on a
    GPU node. tests/test_bad_input.py checks that both refuse the same sizes."""
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        return (
            f"{width}x{height} pixels cannot be taken by the model's image processor "
            f"(absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got {ratio})"
        )
    return None


def _check_image(path: Path) -> tuple[int, int] | str:
    """(width, height) of a readable image as a person sees it (EXIF orientation applied), or the
    reason it cannot be used."""
    if not path.is_file():
        return "file not found"
    try:
        with Image.open(path) as image:
            image.load()  # decode fully: a truncated file only fails here
            width, height = image.size
            if image.getexif().get(ExifTags.Base.Orientation) in TRANSPOSED_ORIENTATIONS:
                width, height = height, width
    except Exception as err:  # PIL raises many types for corrupt files
        return f"cannot be read as an image ({type(err).__name__}: {err})"
    return aspect_ratio_problem(width, height) or (width, height)


def prepare_split(raw_jsonl: str | Path, image_root: str | Path, output: str | Path, threads: int = 8) -> int:
    """Validate every record and every image once; write the normalized records atomically."""
    records = read_raw_records(raw_jsonl)
    paths = [Path(image_root) / record["image"] for _, record in records]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        checks = list(pool.map(_check_image, paths))
    normalized = []
    for (line_no, record), path, check in zip(records, paths, checks):
        if isinstance(check, str):
            raise InputError(raw_jsonl, f"{check}: {path}", line_no, "image")
        record = dict(record, image_path=str(path), width=check[0], height=check[1])
        normalized.append(record)
    write_jsonl(output, normalized)
    return len(normalized)


def selected_by(record: dict, filters: dict) -> bool:
    """Whether a record's fields match every filter (a value or a list of accepted values)."""
    return all(record.get(name) in (v if isinstance(v, list) else [v]) for name, v in filters.items())


def select_records(records: list[dict], filters: dict) -> list[dict]:
    return [r for r in records if selected_by(r, filters)]


def filter_problem(jsonl_paths: list[str | Path], filters: dict) -> str | None:
    """Why a stage's filter cannot train (it selects no record of its splits, taken as a whole), or
    None; read from the raw splits before any job runs, leniently: lines that do not parse are the
    prepare step's to report, with their line numbers."""
    for path in jsonl_paths:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and selected_by(record, filters):
                    return None
    return f"{filters} selects no record of {', '.join(str(p) for p in jsonl_paths)}"


def order_records(
    records: list[dict], order: str, field: str | None, descending: bool, seed: int, epoch: int
) -> list[dict]:
    """One epoch's order: shuffled with the seed, as given, or sorted by a field (a curriculum)."""
    if order == "given":
        return list(records)
    if order == "random":
        shuffled = list(records)
        random.Random(seed * 100_003 + epoch).shuffle(shuffled)
        return shuffled
    missing = [r["id"] for r in records if r.get(field) is None]
    if missing:
        raise InputError("records", f"cannot sort by '{field}': {len(missing)} records lack it (first: {missing[0]})")
    # A stable sort keeps the given order among equals.
    return sorted(records, key=lambda r: r[field], reverse=descending)

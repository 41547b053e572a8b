"""Dataset records: the one input format, its validation, and the selection and order of a stage.

A record is one JSON object a line: id, image (relative to the dataset's image root), question,
answer (may hold reasoning that ends in a final answer), and optionally category, difficulty,
box or point, a conversation's `system` prompt and its earlier rounds as `history` (a list of
{"question", "answer"}: the image is shown with the first of them), and any other fields a filter
or an order may use.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image

from vlft.errors import InputError
from vlft.files import text_lines, write_jsonl

REQUIRED_TEXT_FIELDS = ("question", "answer")


def raw_records(jsonl: str | Path):
    """(line number, record) of each record of a raw split, its fields checked, one line in memory
    at a time. Ids are checked for repeats by `check_unique_ids`, which needs them all."""
    for line_no, line in text_lines(jsonl):
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
        yield line_no, record


def id_hash(record_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(record_id.encode(), digest_size=8).digest(), "little", signed=True)


def check_unique_ids(jsonl: str | Path, hashes: array) -> None:
    """No id twice in a split, from 8 bytes a record (a million records: 8 MB) rather than a set of
    the ids themselves; where two hashes meet, the file is read again for those ids alone, to name
    the line that repeats one (or to find that two ids only share a hash)."""
    ordered = np.sort(np.frombuffer(hashes, dtype=np.int64))
    repeated = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
    if not repeated:
        return
    first_seen = {}
    for line_no, record in raw_records(jsonl):
        if id_hash(record["id"]) in repeated:
            if record["id"] in first_seen:
                raise InputError(jsonl, f"duplicate id (first seen on line {first_seen[record['id']]})", line_no, "id")
            first_seen[record["id"]] = line_no


def _check_fields(record: dict, jsonl, line_no: int) -> None:
    if "id" not in record or not isinstance(record["id"], (str, int)) or record["id"] == "":
        raise InputError(jsonl, "missing or empty", line_no, "id")
    if not isinstance(record.get("image"), str) or not record["image"]:
        raise InputError(jsonl, "missing or not a path", line_no, "image")
    for name in REQUIRED_TEXT_FIELDS:
        value = record.get(name)
        if not isinstance(value, str) or not value.strip():
            raise InputError(jsonl, "missing or empty", line_no, name)
    if "rejected" in record:  # a preference pair: `answer` the chosen one
        rejected = record["rejected"]
        if not isinstance(rejected, str) or not rejected.strip():
            raise InputError(jsonl, "must be non-empty text: the answer not preferred", line_no, "rejected")
        if rejected.strip() == record["answer"].strip():
            raise InputError(
                jsonl, "the same as the answer: a preference pair needs two different answers", line_no, "rejected"
            )
    if "system" in record and (not isinstance(record["system"], str) or not record["system"].strip()):
        raise InputError(jsonl, "must be non-empty text", line_no, "system")
    history = record.get("history")
    if history is not None and not (
        isinstance(history, list)
        and all(
            isinstance(turn, dict)
            and set(turn) == {"question", "answer"}
            and all(isinstance(v, str) and v.strip() for v in turn.values())
            for turn in history
        )
    ):
        raise InputError(
            jsonl, 'must be a list of {"question": ..., "answer": ...} with text in both', line_no, "history"
        )
    for name, size in (("box", 4), ("point", 2)):
        value = record.get(name)
        if value is not None and not (
            isinstance(value, list) and len(value) == size and all(isinstance(v, (int, float)) for v in value)
        ):
            raise InputError(jsonl, f"must be a list of {size} numbers", line_no, name)
    box = record.get("box")
    if box is not None and not (box[0] <= box[2] and box[1] <= box[3]):
        raise InputError(jsonl, f"must be [x1, y1, x2, y2] with x1 <= x2 and y1 <= y2, not {box}", line_no, "box")


# The largest long side / short side the Qwen-VL image processors take (their smart_resize).
MAX_ASPECT_RATIO = 200

# EXIF orientations that turn the stored image by 90 or 270 degrees (with or without a mirror).
TRANSPOSED_ORIENTATIONS = {5, 6, 7, 8}


def aspect_ratio_problem(width: int, height: int) -> str | None:
    """The Qwen-VL image processors' one refusal of an image size (smart_resize's aspect-ratio
    limit), which would otherwise stop the pixel cache later, or None. Its own words, not its call:
    smart_resize's module brings transformers and torch, seconds of every prepare_split job. tests/data/test_prepare_split.py checks that both refuse the same sizes.
    """
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        return (
            f"{width}x{height} pixels cannot be taken by the model's image processor "
            f"(absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got {ratio})"
        )
    return None


def check_image(path: Path, digest: bool = False) -> tuple[int, int] | tuple[int, int, str] | str:
    """(width, height) of a readable image as a person sees it (EXIF orientation applied), with
    `digest` the sha256 of its file's bytes too, or the reason it cannot be used."""
    if not path.is_file():
        return "file not found"
    data = path.read_bytes()
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # decode fully: a truncated file only fails here
            width, height = image.size
            if image.getexif().get(ExifTags.Base.Orientation) in TRANSPOSED_ORIENTATIONS:
                width, height = height, width
    except Exception as err:  # PIL raises many types for corrupt files
        return f"cannot be read as an image ({type(err).__name__}: {err})"
    if problem := aspect_ratio_problem(width, height):
        return problem
    return (width, height, hashlib.sha256(data).hexdigest()) if digest else (width, height)


def prepare_split(raw_jsonl: str | Path, image_root: str | Path, output: str | Path, threads: int = 8) -> int:
    """Validate every record and every image once; write the normalized records atomically.

    Two passes over the raw file, one record in memory at a time: memory grows with the split's
    distinct images and by 8 bytes a record (for repeated ids), never with the records themselves.
    A normalized record names its image as the raw one does, relative to the image root, with the
    sha256 of its bytes (`image_sha256`, its identity in the caches) and its size: nothing in it says
    where the dataset lies, so the same bytes elsewhere prepare to the same file."""
    first_line_of, hashes = {}, array("q")
    for line_no, record in raw_records(raw_jsonl):
        hashes.append(id_hash(record["id"]))
        if record["image"] not in first_line_of:
            if problem := outside_root(Path(image_root) / record["image"], image_root):
                raise InputError(raw_jsonl, problem, line_no, "image")
            first_line_of[record["image"]] = line_no
    if not hashes:
        raise InputError(raw_jsonl, "no records")
    check_unique_ids(raw_jsonl, hashes)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        checks = dict(
            zip(
                first_line_of, pool.map(lambda image: check_image(Path(image_root) / image, digest=True), first_line_of)
            )
        )
    # In order of first mention, so that the first bad line is the one named.
    for image, check in checks.items():
        if isinstance(check, str):
            raise InputError(raw_jsonl, f"{check}: {Path(image_root) / image}", first_line_of[image], "image")

    def normalized():
        for line_no, record in raw_records(raw_jsonl):
            width, height, sha256 = checks[record["image"]]
            if problem := place_problem(record, width, height):
                field, reason = problem
                raise InputError(raw_jsonl, f"{reason} of {Path(image_root) / record['image']}", line_no, field)
            yield dict(record, image_sha256=sha256, width=width, height=height)

    write_jsonl(output, normalized())
    return len(hashes)


def outside_root(path: Path, image_root: str | Path) -> str | None:
    """Why an image path lies outside its dataset's image root (an absolute path, or one that climbs
    out with `..`), or None. Judged on the path as written, not where symlinks lead: a root of links
    to a shared store is a root like any other. An image from elsewhere would be read, cached and
    shown in the shareable report's examples without the dataset's owner having put it there."""
    root = os.path.normpath(os.path.abspath(image_root))
    if os.path.commonpath([root, os.path.normpath(os.path.abspath(path))]) != root:
        return f"{path} lies outside the dataset's image_root {image_root}: records name images relative to it"
    return None


def place_problem(record: dict, width: int, height: int) -> tuple[str, str] | None:
    """(field, why) where a record's box or point does not lie in its image of `width` x `height`
    pixels (a box's corners within it and its area positive), or None."""
    box, point = record.get("box"), record.get("point")
    if box is not None and not (0 <= box[0] < box[2] <= width and 0 <= box[1] < box[3] <= height):
        return "box", f"box {box} is not a box of positive area inside the {width}x{height} image"
    if point is not None and not (0 <= point[0] <= width and 0 <= point[1] <= height):
        return "point", f"point {point} is not inside the {width}x{height} image"
    return None


def matches(value, accepted) -> bool:
    """Whether a record's field matches a filter's value (or list of accepted values); a field that
    is a list (a record in several classes) matches where any one of its values does."""
    accepted = accepted if isinstance(accepted, list) else [accepted]
    if isinstance(value, list):
        return any(v in accepted for v in value)
    return value in accepted


def selected_by(record: dict, filters: dict) -> bool:
    """Whether a record's fields match every filter."""
    return all(matches(record.get(name), v) for name, v in filters.items())


def select_records(records: list[dict], filters: dict) -> list[dict]:
    return [r for r in records if selected_by(r, filters)]


def selection_problem(
    jsonl_paths: list[str | Path], filters: dict, order_field: str | None = None, pair_field: str | None = None
) -> str | None:
    """Why a stage cannot train on its splits, taken as a whole: its filter or its order names a
    field that no record has, its method learns from a field (`pair_field`: a dpo stage's
    `rejected`) that no record has, or the filter selects no record; or None. Read from the raw
    splits before any job runs, leniently: lines that do not parse are the prepare step's to report,
    with their line numbers. The sentence starts with the stage's key it is about."""
    named = ", ".join(str(p) for p in jsonl_paths)
    needed = set(filters) | ({order_field} if order_field else set()) | ({pair_field} if pair_field else set())
    fields_seen, selected = set(), False
    for record in raw_objects(jsonl_paths):
        fields_seen.update(k for k, v in record.items() if v is not None)
        selected = selected or selected_by(record, filters)
        if selected and needed <= fields_seen:  # all it can know: stop reading (this runs at every start)
            return None
    for name in filters:
        if name not in fields_seen:
            return f"filter: no record of {named} has the field '{name}'"
    if order_field and order_field not in fields_seen:
        return f"order_field: no record of {named} has the field '{order_field}'"
    if pair_field and pair_field not in fields_seen:
        return f"method: a dpo stage learns from preference pairs, and no record of {named} has a '{pair_field}' answer"
    if not selected:
        return f"filter: {filters} selects no record of {named}"
    return None


def raw_objects(jsonl_paths: list[str | Path]):
    """The JSON objects of raw splits, lines that do not parse left out (prepare_split names them)."""
    for path in jsonl_paths:
        for _, line in text_lines(path, errors="replace"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield record


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

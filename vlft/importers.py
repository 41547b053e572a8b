"""Published dataset formats brought to our records: one JSONL per split and the images they name,
so that nothing downstream knows the formats' shapes.

- Kvasir-VQA as released (parquet: the image's bytes in a column, `question`, `answer`, `source`,
  `img_id`), and Kvasir-VQA-x1 (`img_id`, `complexity`, `question`, `answer`, `question_class`,
  `original`; its images are Kvasir-VQA's, by `img_id`).
- Chat-format JSON or JSONL as LLaMA-Factory (sharegpt `conversations`), ms-swift (`messages` and
  `images`) and LLaVA (`image` and `conversations`) write it.
- ScreenSpot-style click data (`img_filename`, `instruction`, `bbox`).

Each importer writes its outputs whole or not at all, and stops at the first bad row with one line
naming the file and the row.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections import Counter
from pathlib import Path

from PIL import Image

from vlft.errors import InputError
from vlft.files import atomic_path, write_jsonl

SPLITS = {"train": 0.70, "val": 0.15, "test": 0.15}

# ---------------------------------------------------------------- Kvasir-VQA and Kvasir-VQA-x1


def question_type(question: str) -> str:
    """The kind of a Kvasir-VQA question, from its text (the dataset's question templates)."""
    q = " ".join(question.lower().split())
    if q.startswith("how many") or "number of" in q:
        return "count"
    if "color" in q or "colour" in q:
        return "color"
    if q.startswith("where") or "location" in q:
        return "location"
    if "all that are present" in q or "all that apply" in q:
        return "multiple choice"
    if q.split(" ", 1)[0] in ("is", "are", "does", "do", "has", "have", "was", "were", "can", "could", "did", "will"):
        return "yes/no"
    return "single choice"


def split_of(image_id: str, fractions: dict[str, float] = SPLITS) -> str:
    """The split an image belongs to, from its id alone: stable across runs and row orders, and every
    record of one image lands in the same split."""
    position = int(hashlib.sha256(image_id.encode()).hexdigest()[:12], 16) / 16**12
    for split, fraction in fractions.items():
        position -= fraction
        if position < 0:
            return split
    return split


def import_kvasir_vqa(parquet_files: list[str | Path], out_dir: str | Path) -> dict:
    """Kvasir-VQA as published: images written once per img_id from their original bytes, one record
    a row with a stable id (the image's id and the row's rank among that image's rows), the question
    type as `category`, rows without an answer dropped and counted, splits made by image."""
    rows, images = _read_kvasir(parquet_files, image_column=True)
    records, dropped = [], 0
    per_image = Counter()
    for where, row in rows:
        answer = _text(row.get("answer"))
        if answer is None:
            dropped += 1
            continue
        image_id = _required_text(row, "img_id", where)
        per_image[image_id] += 1
        records.append(
            {
                "id": f"{image_id}-{per_image[image_id]}",
                "image": images[image_id][1],
                "question": _required_text(row, "question", where),
                "answer": answer,
                "category": question_type(row["question"]),
                "source": _text(row.get("source")),
            }
        )
    return _write_dataset(records, images, out_dir, dropped)


def import_kvasir_vqa_x1(x1_files: list[str | Path], kvasir_parquet: list[str | Path], out_dir: str | Path) -> dict:
    """Kvasir-VQA-x1: `complexity` becomes `difficulty` (1 to 3, what a curriculum by difficulty
    filters on), `question_class` becomes `category`; the images are Kvasir-VQA's, by img_id."""
    _, images = _read_kvasir(kvasir_parquet, image_column=True)
    rows, _ = _read_kvasir(x1_files, image_column=False)
    records, dropped = [], 0
    per_image = Counter()
    for where, row in rows:
        answer = _text(row.get("answer"))
        if answer is None:
            dropped += 1
            continue
        image_id = _required_text(row, "img_id", where)
        if image_id not in images:
            raise InputError(where[0], f"img_id {image_id!r} is not among Kvasir-VQA's images", where[1], "img_id")
        complexity = row.get("complexity")
        if not isinstance(complexity, (int, float)) or complexity not in (1, 2, 3):
            raise InputError(where[0], f"must be 1, 2 or 3, not {complexity!r}", where[1], "complexity")
        classes = row.get("question_class")
        classes = classes.tolist() if hasattr(classes, "tolist") else classes  # parquet lists come as arrays
        category = "+".join(map(str, classes)) if isinstance(classes, (list, tuple)) else _text(classes)
        per_image[image_id] += 1
        records.append(
            {
                "id": f"{image_id}-x1-{per_image[image_id]}",
                "image": images[image_id][1],
                "question": _required_text(row, "question", where),
                "answer": answer,
                "difficulty": int(complexity),
                "category": category,
            }
        )
    used = {r["image"] for r in records}
    return _write_dataset(records, {k: v for k, v in images.items() if v[1] in used}, out_dir, dropped)


def _read_kvasir(files: list[str | Path], image_column: bool) -> tuple[list, dict]:
    """Every row as ((file, row number from 1), dict), and with `image_column` each image's original
    bytes, checked to open, and the file name to write them to: {img_id: (bytes, name)}."""
    import pandas as pd

    required = ["img_id", "question", "answer"] + (["image"] if image_column else [])
    rows, images, first_seen = [], {}, {}
    for path in files:
        frame = pd.read_parquet(path)
        missing = [c for c in required if c not in frame.columns]
        if missing:
            raise InputError(path, f"missing column(s) {', '.join(missing)}; it has {', '.join(frame.columns)}")
        for number, row in enumerate(frame.to_dict("records"), start=1):
            where = (path, number)
            rows.append((where, row))
            if not image_column:
                continue
            image_id = _required_text(row, "img_id", where)
            data = _image_bytes(row["image"], where)
            digest = hashlib.sha256(data).hexdigest()
            if image_id in first_seen:
                if first_seen[image_id][0] != digest:
                    first = first_seen[image_id][1]
                    raise InputError(
                        path, f"img_id {image_id!r} has other image bytes than on row {first}", number, "image"
                    )
                continue
            first_seen[image_id] = (digest, number)
            images[image_id] = (data, f"{image_id}{_extension(data)}")
    return rows, images


def _image_bytes(value, where) -> bytes:
    """The image's original bytes, as Hugging Face datasets stores an Image column ({bytes, path}) or
    as plain bytes; opened once to be sure they are an image."""
    data = value.get("bytes") if isinstance(value, dict) else value
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise InputError(where[0], "no image bytes", where[1], "image")
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except Exception as err:  # PIL raises many kinds for bad bytes
        raise InputError(where[0], f"unreadable image bytes ({err})", where[1], "image") from None
    return bytes(data)


def _extension(data: bytes) -> str:
    with Image.open(io.BytesIO(data)) as image:
        kind = image.format
    return {"JPEG": ".jpg", "PNG": ".png", "WEBP": ".webp", "BMP": ".bmp", "TIFF": ".tif"}.get(kind, f".{kind.lower()}")


# ---------------------------------------------------------------- chat-format JSON(L)


def import_chat(files: list[str | Path], image_root: str | Path, out_dir: str | Path, split: str = "train") -> dict:
    """LLaMA-Factory (sharegpt), ms-swift and LLaVA chat records: one image, one user turn and one
    assistant turn each; the image paths stay relative to `image_root` (images are not copied)."""
    records, seen = [], {}
    for path in files:
        for where, row in _json_rows(path):
            record = _chat_record(row, where, Path(image_root))
            record_id = str(row.get("id", f"{Path(path).stem}-{where[1]}"))
            if record_id in seen:
                raise InputError(path, f"duplicate id {record_id!r} (first seen at {seen[record_id]})", where[1], "id")
            seen[record_id] = f"{path}:{where[1]}"
            records.append({"id": record_id, **record})
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        write_jsonl(tmp / f"{split}.jsonl", records)
    return {"records": len(records), "splits": {split: len(records)}}


def _json_rows(path: str | Path) -> list[tuple[tuple, dict]]:
    """A JSON array (row = 1-based index) or JSONL (row = line number)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise InputError(path, f"not valid JSON ({err.msg})", err.lineno) from None
        return [((path, i), row) for i, row in enumerate(rows, start=1)]
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(((path, number), json.loads(line)))
            except json.JSONDecodeError as err:
                raise InputError(path, f"not valid JSON ({err.msg} at column {err.colno})", number) from None
    return rows


def _chat_record(row, where, image_root: Path) -> dict:
    path, number = where
    if not isinstance(row, dict):
        raise InputError(path, "each record must be a JSON object", number)
    if "messages" in row:  # ms-swift, and LLaMA-Factory's OpenAI style: role / content
        turns = [(m.get("role"), m.get("content")) for m in row["messages"]]
    elif "conversations" in row:  # sharegpt and LLaVA: from / value
        turns = [(m.get("from"), m.get("value")) for m in row["conversations"]]
    else:
        raise InputError(path, "neither 'messages' nor 'conversations'", number)
    roles = [_ROLES.get(role, role) for role, _ in turns]
    if roles != ["user", "assistant"]:
        raise InputError(path, f"needs exactly one user turn then one assistant turn, has {roles}", number)
    images = row.get("images", [row["image"]] if "image" in row else [])
    images = [images] if isinstance(images, str) else images
    if len(images) != 1 or not isinstance(images[0], str):
        raise InputError(path, f"needs exactly one image, has {len(images)}", number, "images")
    question, answer = (content for _, content in turns)
    if not isinstance(question, str) or question.count("<image>") > 1:
        raise InputError(path, "the user turn must be text with at most one <image>", number)
    question = question.replace("<image>", "").strip()
    if not question or not isinstance(answer, str) or not answer.strip():
        raise InputError(path, "an empty question or answer", number)
    image = Path(images[0])
    if image.is_absolute():
        try:
            image = image.relative_to(image_root.resolve())
        except ValueError:
            raise InputError(path, f"image {images[0]} is not under {image_root}", number, "images") from None
    return {"image": str(image), "question": question, "answer": answer.strip()}


_ROLES = {"human": "user", "gpt": "assistant"}


# ---------------------------------------------------------------- ScreenSpot-style click data


def import_screenspot(files: list[str | Path], out_dir: str | Path, bbox: str = "xywh", split: str = "test") -> dict:
    """Click records: the instruction as the question, the target box in original pixels as `box`
    [x1, y1, x2, y2] (from `bbox` as x, y, width, height, or with bbox='xyxy' as corners), its
    centre as the answer, `data_type` (text, icon) as `category`. Images stay where they are."""
    records, seen = [], {}
    for path in files:
        for where, row in _json_rows(path):
            number = where[1]
            for field in ("img_filename", "instruction", "bbox"):
                if field not in row:
                    raise InputError(path, "missing", number, field)
            box = row["bbox"]
            if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box)):
                raise InputError(path, f"must be 4 numbers, not {box!r}", number, "bbox")
            x1, y1, a, b = box
            x2, y2 = (x1 + a, y1 + b) if bbox == "xywh" else (a, b)
            if not (x2 > x1 and y2 > y1):
                raise InputError(path, f"an empty box {box!r} as {bbox}", number, "bbox")
            record_id = str(row.get("id", f"{Path(path).stem}-{number}"))
            if record_id in seen:
                raise InputError(path, f"duplicate id {record_id!r} (first seen at {seen[record_id]})", number, "id")
            seen[record_id] = f"{path}:{number}"
            records.append(
                {
                    "id": record_id,
                    "image": row["img_filename"],
                    "question": row["instruction"],
                    "answer": f"({(x1 + x2) / 2:g}, {(y1 + y2) / 2:g})",
                    "box": [x1, y1, x2, y2],
                    "category": row.get("data_type"),
                }
            )
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        write_jsonl(tmp / f"{split}.jsonl", records)
    return {"records": len(records), "splits": {split: len(records)}}


# ---------------------------------------------------------------- shared


def _text(value) -> str | None:
    """A field's text, or None where it is missing, empty or 'nan' (as pandas reads a blank)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    text = str(value).strip()
    return None if not text or text.lower() == "nan" else text


def _required_text(row: dict, field: str, where) -> str:
    text = _text(row.get(field))
    if text is None:
        raise InputError(where[0], "missing or empty", where[1], field)
    return text


def _write_dataset(records: list[dict], images: dict, out_dir: str | Path, dropped: int) -> dict:
    """images/ (each image written once, its original bytes) and one JSONL per split; every record
    goes to its image's split."""
    image_ids = {name: image_id for image_id, (_, name) in images.items()}
    by_split = {split: [] for split in SPLITS}
    for record in records:
        by_split[split_of(image_ids[record["image"]])].append(record)
    with atomic_path(out_dir) as tmp:
        (tmp / "images").mkdir(parents=True)
        for data, name in images.values():
            (tmp / "images" / name).write_bytes(data)
        for split, rows in by_split.items():
            write_jsonl(tmp / f"{split}.jsonl", rows)
    return {
        "records": len(records),
        "dropped_without_answer": dropped,
        "images": len(images),
        "splits": {split: len(rows) for split, rows in by_split.items()},
    }

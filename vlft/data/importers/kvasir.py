"""Kvasir-VQA and Kvasir-VQA-x1 as their authors publish them on the Hugging Face Hub.

- Kvasir-VQA: parquet, each row with its image's bytes (`image`), `question`, `answer`, `source`,
  `img_id`; 58,849 rows on 6,500 images, one published split, so ours are made by image (70/15/15).
- Kvasir-VQA-x1: parquet `train-*.parquet` and `test-*.parquet` (`img_id`, `complexity`,
  `question`, `answer`, `question_class` (a list), `original` (the Kvasir-VQA pairs a question was
  composed from)); its images are Kvasir-VQA's, by `img_id`. The published split is kept; our
  validation split is carved from its train split by image.

The parquet is read one row group at a time and each image written as it is first met, so memory
holds the records' text, not the images (benchmarks/README.md, "Importers", measures it).
"""

from __future__ import annotations

import hashlib
import io
from collections import Counter
from pathlib import Path

from PIL import Image

from vlft.errors import InputError
from vlft.files import atomic_path, write_jsonl
from vlft.data.importers.common import Refusals, plain, required_text, text

SPLITS = {"train": 0.70, "val": 0.15, "test": 0.15}
# Kvasir-VQA-x1's train split, by image: what becomes our validation split (its test split is kept whole).
X1_VAL_FRACTION = 0.10


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


def import_kvasir_vqa(parquet_files: list[str | Path], out_dir: str | Path, skip_bad_rows: bool = False) -> dict:
    """Kvasir-VQA as published: images written once per img_id from their original bytes, one record
    a row with a stable id (the image's id and the row's rank among that image's rows), the question
    type as `category`, rows without an answer dropped and counted, splits made by image."""
    records, dropped, refusals = [], 0, Refusals(out_dir, skip_bad_rows)
    per_image = Counter()
    with atomic_path(out_dir) as tmp:
        images = ImageWriter(tmp / "images")
        for where, row in parquet_rows(parquet_files, ["img_id", "question", "answer", "image"]):
            with refusals.row(where):
                image_id = required_text(row, "img_id", where)
                name = images.add(image_id, row["image"], where)
                answer = text(row.get("answer"))
                if answer is None:
                    dropped += 1
                    continue
                question = required_text(row, "question", where)
                per_image[image_id] += 1
                records.append(
                    {
                        "id": f"{image_id}-{per_image[image_id]}",
                        "image": name,
                        "question": question,
                        "answer": answer,
                        "category": question_type(question),
                        "source": text(row.get("source")),
                    }
                )
        refused = refusals.finish()
        splits = {split: [] for split in SPLITS}
        for record in records:
            splits[split_of(images.id_of[record["image"]])].append(record)
        _write(tmp, splits)
    return refused | {
        "records": len(records),
        "dropped_without_answer": dropped,
        "images": len(images.id_of),
        "splits": {split: len(rows) for split, rows in splits.items()},
        "split_by": "image, 70/15/15 (Kvasir-VQA publishes one split)",
    }


def import_kvasir_vqa_x1(
    x1_files: list[str | Path], kvasir_parquet: list[str | Path], out_dir: str | Path, skip_bad_rows: bool = False
) -> dict:
    """Kvasir-VQA-x1: its train and test splits as published (val carved from train by image),
    `complexity` as `difficulty` (1 to 3, what a curriculum by difficulty filters on),
    `question_class` kept as the list it is (a filter on one class selects every record that has it)
    and joined as `category` (the report's breakdown), `original` kept; the images are
    Kvasir-VQA's, by img_id, written once each."""
    rows, dropped, refusals = [], 0, Refusals(out_dir, skip_bad_rows)
    per_image = Counter()
    for path in x1_files:
        published = published_split(path)
        for where, row in parquet_rows([path], ["img_id", "question", "answer", "complexity"]):
            with refusals.row(where):
                dropped += _x1_row(row, where, published, per_image, rows)
    wanted = {record["image"] for _, _, record in rows}
    with atomic_path(out_dir) as tmp:
        images = ImageWriter(tmp / "images")
        for where, row in parquet_rows(kvasir_parquet, ["img_id", "image"]):
            image_id = required_text(row, "img_id", where)
            if image_id in wanted:
                images.add(image_id, row["image"], where)
        names = {image_id: name for name, image_id in images.id_of.items()}
        splits = {"train": [], "val": [], "test": []}
        for where, split, record in rows:
            with refusals.row(where):
                if record["image"] not in names:
                    raise InputError(
                        where[0], f"img_id {record['image']!r} is not among Kvasir-VQA's images", where[1], "img_id"
                    )
                splits[split].append(dict(record, image=names[record["image"]]))
        refused = refusals.finish()
        _write(tmp, splits)
    by_split = {split: {r["image"] for r in records} for split, records in splits.items()}
    return refused | {
        "records": sum(map(len, splits.values())),
        "dropped_without_answer": dropped,
        "images": len(names),
        "splits": {split: len(records) for split, records in splits.items()},
        "split_by": f"as published (train, test); val is {X1_VAL_FRACTION:.0%} of the published train split's images",
        "images_in_train_and_test": len((by_split["train"] | by_split["val"]) & by_split["test"]),
    }


def _x1_row(row: dict, where, published: str, per_image: Counter, rows: list) -> int:
    """One Kvasir-VQA-x1 row's record, with its split, appended to `rows`; 1 where it is dropped
    for want of an answer, else 0."""
    answer = text(row.get("answer"))
    if answer is None:
        return 1
    image_id = required_text(row, "img_id", where)
    complexity = row.get("complexity")
    if not isinstance(complexity, (int, float)) or complexity not in (1, 2, 3):
        raise InputError(where[0], f"must be 1, 2 or 3, not {complexity!r}", where[1], "complexity")
    classes = plain(row.get("question_class"))
    classes = [str(c) for c in classes] if isinstance(classes, list) else [c for c in [text(classes)] if c]
    question = required_text(row, "question", where)
    per_image[image_id] += 1
    record = {
        "id": f"{image_id}-x1-{per_image[image_id]}",
        "image": image_id,  # its file name once the image is written
        "question": question,
        "answer": answer,
        "difficulty": int(complexity),
        "category": "+".join(classes) or None,
        "question_class": classes,
        "original": plain(row.get("original")),
    }
    split = published
    if published == "train":
        split = split_of(image_id, {"train": 1 - X1_VAL_FRACTION, "val": X1_VAL_FRACTION})
    rows.append((where, split, record))
    return 0


def published_split(path: str | Path) -> str:
    """The split a Kvasir-VQA-x1 file holds, from its name as the Hub publishes it (train-*.parquet)."""
    name = Path(path).name
    for split in ("train", "test"):
        if name.startswith(split):
            return split
    raise InputError(path, "cannot tell its split: Kvasir-VQA-x1 publishes train-*.parquet and test-*.parquet")


def parquet_rows(files: list[str | Path], required: list[str]):
    """Every row of the files as ((file, row number from 1), dict), one row group in memory at a time."""
    import pyarrow.parquet as pq

    for path in files:
        try:
            parquet = pq.ParquetFile(path)
        except (OSError, ValueError) as err:  # missing, or not parquet
            raise InputError(path, f"cannot be read as parquet ({err})") from None
        columns = parquet.schema_arrow.names
        missing = [c for c in required if c not in columns]
        if missing:
            raise InputError(path, f"missing column(s) {', '.join(missing)}; it has {', '.join(columns)}")
        number = 0
        for group in range(parquet.num_row_groups):
            for row in parquet.read_row_group(group).to_pylist():
                number += 1
                yield (path, number), row


class ImageWriter:
    """Each image written once, from its original bytes, as it is first met; an img_id met again
    must bring the same bytes. Holds digests, not images."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True)
        self.directory = directory
        self.first: dict[str, tuple[str, int, str]] = {}  # img_id -> (digest, row, file name)
        self.id_of: dict[str, str] = {}  # file name -> img_id

    def add(self, image_id: str, value, where) -> str:
        data = value.get("bytes") if isinstance(value, dict) else value
        if not isinstance(data, (bytes, bytearray)) or not data:
            raise InputError(where[0], "no image bytes", where[1], "image")
        digest = hashlib.sha256(data).hexdigest()
        if image_id in self.first:
            seen_digest, row, name = self.first[image_id]
            if seen_digest != digest:
                _checked_image(data, where)  # unreadable bytes are named as such first
                raise InputError(
                    where[0], f"img_id {image_id!r} has other image bytes than on row {row}", where[1], "image"
                )
            return name
        data = _checked_image(data, where)  # once per image: the same bytes met again are known by their digest
        name = f"{image_id}{_extension(data)}"
        (self.directory / name).write_bytes(data)
        self.first[image_id] = (digest, where[1], name)
        self.id_of[name] = image_id
        return name


def _checked_image(data: bytes, where) -> bytes:
    """An image's original bytes (from a Hugging Face datasets Image column, {bytes, path}, or plain
    bytes), opened once to be sure they are an image."""
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


def _write(directory: Path, splits: dict[str, list[dict]]) -> None:
    for split, records in splits.items():
        write_jsonl(directory / f"{split}.jsonl", records)

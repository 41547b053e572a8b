"""Preference pairs in the flat shape RLAIF-V publishes on the Hugging Face Hub (and POVID and the
sets made after them): parquet rows of an image's bytes (`image`), a `question`, a `chosen` and a
`rejected` answer, with provenance columns (`ds_name`, `origin_dataset`, `origin_split`, `idx`, ...)
kept on the record. Each image is written once, named by its content; each row becomes a record
whose `answer` is the chosen one and `rejected` the other (vlft.data.records)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from vlft.errors import InputError
from vlft.files import atomic_path
from vlft.data.importers.common import Refusals, UniqueIds, plain, required_text, text
from vlft.data.importers.kvasir import ImageWriter, _write, parquet_rows

PAIR_COLUMNS = ["image", "question", "chosen", "rejected"]


def import_pairs(
    parquet_files: list[str | Path], out_dir: str | Path, split: str = "train", skip_bad_rows: bool = False
) -> dict:
    """One record a row: the image written once by its bytes' digest, the question, the chosen
    answer as `answer` and the rejected one as `rejected`; a row whose two answers are the same is
    refused with its place (it prefers nothing)."""
    records, ids, refusals = [], UniqueIds(), Refusals(out_dir, skip_bad_rows)
    with atomic_path(out_dir) as tmp:
        images = ImageWriter(tmp / "images")
        for where, row in parquet_rows(parquet_files, PAIR_COLUMNS):
            with refusals.row(where):
                cell = row["image"]
                data = cell.get("bytes") if isinstance(cell, dict) else cell
                if not isinstance(data, (bytes, bytearray)):
                    raise InputError(where[0], "holds no image bytes", where[1], "image")
                name = images.add(hashlib.sha256(data).hexdigest()[:16], cell, where)
                chosen, rejected = required_text(row, "chosen", where), required_text(row, "rejected", where)
                if chosen == rejected:
                    raise InputError(
                        where[0], "the same as 'chosen': a pair needs two different answers", where[1], "rejected"
                    )
                row_id = text(row.get("idx")) or f"{Path(where[0]).stem}-{where[1]}"
                provenance = {k: plain(v) for k, v in row.items() if k not in PAIR_COLUMNS + ["idx", "image_path"]}
                question = required_text(row, "question", where)
                record = {"id": ids.add(row_id, where), "image": name, "question": question}
                records.append(record | {"answer": chosen, "rejected": rejected} | provenance)
        refused = refusals.finish()
        _write(tmp, {split: records})
    summary = {"records": len(records), "images": len(images.id_of), "splits": {split: len(records)}}
    return summary | refused | ids.summary()

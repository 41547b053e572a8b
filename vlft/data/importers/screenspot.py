"""ScreenSpot click data as its authors and republishers publish it: one record per instruction,
the target box in the image's pixels as `box` [x1, y1, x2, y2], its centre as the answer.

- ScreenSpot v1 (SeeClick) and v2: `img_filename`, `instruction`, `bbox` as x, y, width, height,
  `data_type` (text, icon), `data_source`.
- ScreenSpot-Pro: `img_filename`, `instruction`, `bbox` as corners, `img_size` [width, height],
  `ui_type` (text, icon), `application`, `platform`, `group`, `id`.
- Republications name the file `image` or `file_name` (the Hub mirror, whose boxes are corners).

Fields we do not use are kept on the record under their own names (a filter or the report may want
`platform` or `data_source`)."""

from __future__ import annotations

from pathlib import Path

from vlft.errors import InputError
from vlft.data.importers.common import UniqueIds, json_rows, write_splits

FILE_FIELDS = ("img_filename", "image", "file_name")
CATEGORY_FIELDS = ("data_type", "ui_type")
# Our record's own fields: a published field of the same name is not copied over them.
RECORD_FIELDS = ("id", "image", "question", "answer", "box", "point", "category", "width", "height", "image_path")


def box_layout(rows: list[dict], asked: str) -> str:
    """How a file's boxes are written: as asked, or (auto) corners where the file is ScreenSpot-Pro
    (its rows carry `img_size` and `ui_type`) or the Hub mirror (`file_name`), else x, y, w, h."""
    if asked != "auto":
        return asked
    pro = any(isinstance(r, dict) and ("img_size" in r or "ui_type" in r) for r in rows)
    mirror = any(isinstance(r, dict) and "file_name" in r for r in rows)
    return "xyxy" if pro or mirror else "xywh"


def import_screenspot(files: list[str | Path], out_dir: str | Path, bbox: str = "auto", split: str = "test") -> dict:
    """Click records from ScreenSpot v1, v2 or Pro files (or their republications); images stay
    where they are. A box must have positive area and, where the row gives `img_size`, lie inside it."""
    records, ids, layouts = [], UniqueIds(), {}
    for path in files:
        rows = json_rows(path)
        layout = layouts[str(path)] = box_layout([row for _, row in rows], bbox)
        for where, row in rows:
            records.append(_click_record(row, where, layout, ids))
    write_splits(out_dir, {split: records})
    return {"records": len(records), "splits": {split: len(records)}, "bbox": layouts}


def _click_record(row, where, layout: str, ids: UniqueIds) -> dict:
    path, number = where
    if not isinstance(row, dict):
        raise InputError(path, "each record must be a JSON object", number)
    file_field = next((f for f in FILE_FIELDS if f in row), None)
    if file_field is None:
        raise InputError(path, f"missing (the image's file, as {' or '.join(FILE_FIELDS)})", number, "img_filename")
    for field in ("instruction", "bbox"):
        if field not in row:
            raise InputError(path, "missing", number, field)
    box = row["bbox"]
    if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box)):
        raise InputError(path, f"must be 4 numbers, not {box!r}", number, "bbox")
    x1, y1, a, b = box
    x2, y2 = (x1 + a, y1 + b) if layout == "xywh" else (a, b)
    if not (x2 > x1 and y2 > y1):
        raise InputError(path, f"an empty box {box!r} as {layout}", number, "bbox")
    size = row.get("img_size")
    if size is not None and not (0 <= x1 and 0 <= y1 and x2 <= size[0] and y2 <= size[1]):
        raise InputError(
            path,
            f"{box!r} read as {layout} is [{x1}, {y1}, {x2}, {y2}], outside the {size[0]}x{size[1]} image "
            "(img_size); give --bbox for this file's layout",
            number,
            "bbox",
        )
    category = next((row[f] for f in CATEGORY_FIELDS if row.get(f) is not None), None)
    kept = {
        k: v for k, v in row.items() if k not in RECORD_FIELDS + FILE_FIELDS + CATEGORY_FIELDS + ("bbox", "instruction")
    }
    return {
        "id": ids.add(str(row.get("id", f"{Path(path).stem}-{number}")), where),
        "image": row[file_field],
        "question": row["instruction"],
        "answer": f"({(x1 + x2) / 2:g}, {(y1 + y2) / 2:g})",
        "box": [x1, y1, x2, y2],
        "category": category,
        **kept,
    }

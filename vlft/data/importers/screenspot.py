"""ScreenSpot click data as its authors and republishers publish it: one record per instruction,
the target box in the image's pixels as `box` [x1, y1, x2, y2], its centre as the answer.

- ScreenSpot v1 (SeeClick) and v2: `img_filename`, `instruction`, `bbox` as x, y, width, height,
  `data_type` (text, icon), `data_source`.
- ScreenSpot-Pro: `img_filename`, `instruction`, `bbox` as corners, `img_size` [width, height],
  `ui_type` (text, icon), `application`, `platform`, `group`, `id`.
- Republications name the file `image` or `file_name`. The Hub's mirror (rootsautomation/ScreenSpot,
  parquet with the screenshot's bytes in `image` and its name in `file_name`) writes its boxes as
  corners in fractions of the image (0-1), as lmms-eval's ScreenSpot task reads them; they are
  converted to pixels with the image's own size.

UI-R1's rows are ScreenSpot's with an `action`: its click steps are read, its other steps (typing,
scrolling) skipped and counted by action. Fields we do not use are kept on the record under their
own names (a filter or the report may want `platform` or `data_source`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from vlft.errors import InputError
from vlft.files import atomic_path
from vlft.data.importers.common import Refusals, UniqueIds, json_rows, write_splits
from vlft.data.importers.kvasir import ImageWriter, parquet_rows
from vlft.data.importers.targets import CLICK_ACTIONS, action_of, image_size, units_of

FILE_FIELDS = ("img_filename", "image", "file_name")
CATEGORY_FIELDS = ("data_type", "ui_type")
# Our record's own fields: a published field of the same name is not copied over them.
RECORD_FIELDS = ("id", "image", "question", "answer", "box", "point", "category", "width", "height", "image_path")


def box_layout(rows: list[dict], asked: str) -> str | None:
    """How a file's boxes are written: as asked, or (auto) corners where the file is ScreenSpot-Pro
    (its rows carry `img_size` and `ui_type`) or the Hub mirror (`file_name`); x, y, width, height
    where it is SeeClick's ScreenSpot or a republication of it (`data_type`, `data_source`) or where
    a box cannot be corners (its second corner not beyond its first); else None: corners and
    x, y, width, height would both read (UI-R1's test.json), and guessing would move its boxes."""
    if asked != "auto":
        return asked
    rows = [r for r in rows if isinstance(r, dict)]
    if any("img_size" in r or "ui_type" in r or "file_name" in r for r in rows):
        return "xyxy"
    if any("data_type" in r or "data_source" in r for r in rows):
        return "xywh"
    boxes = [r.get("bbox") for r in rows]
    boxes = [b for b in boxes if isinstance(b, list) and len(b) == 4 and all(isinstance(v, (int, float)) for v in b)]
    if any(b[2] <= b[0] or b[3] <= b[1] for b in boxes):
        return "xywh"
    return None


def box_units(rows: list[dict], asked: str) -> str:
    """Whether a file's boxes are in pixels or in fractions of the image: as asked, or (auto)
    fractions where every number of every box lies within 0-1 (no box of a real screenshot does in
    pixels: it would be under a pixel wide), else pixels."""
    if asked != "auto":
        return asked
    boxes = [r.get("bbox") for r in rows if isinstance(r, dict)]
    return units_of([[v for v in b if isinstance(v, (int, float))] for b in boxes if isinstance(b, list)])


def import_screenspot(
    files: list[str | Path],
    out_dir: str | Path,
    bbox: str = "auto",
    split: str = "test",
    image_root: str | Path | None = None,
    units: str = "auto",
    skip_bad_rows: bool = False,
) -> dict:
    """Click records from ScreenSpot v1, v2 or Pro JSON files, or the Hub mirror's parquet files
    (their screenshots written once to `<out>/images/`); images of JSON files stay where they are.
    A box must have positive area and lie inside its image, whose size comes from `img_size`, the
    parquet's bytes or the file under `image_root`; boxes in fractions need that size."""
    records, ids, layouts, all_units, skipped = [], UniqueIds(), {}, {}, Counter()
    refusals = Refusals(out_dir, skip_bad_rows)
    with atomic_path(out_dir) as tmp:
        images = None
        for path in files:
            parquet = str(path).endswith(".parquet")
            if parquet and images is None:
                images = ImageWriter(tmp / "images")
            rows = (
                list(parquet_rows([path], ["file_name", "bbox", "instruction", "image"]))
                if parquet
                else json_rows(path)
            )
            layout = layouts[str(path)] = box_layout([row for _, row in rows], bbox)
            if layout is None:
                raise InputError(
                    path,
                    "its boxes read both as corners and as x, y, width, height, and nothing in the file says "
                    "which: give --bbox xyxy or --bbox xywh",
                )
            unit = all_units[str(path)] = box_units([row for _, row in rows], units)
            for where, row in rows:
                if isinstance(row, dict) and action_of(row, None) not in (None, *CLICK_ACTIONS):
                    skipped[action_of(row, None)] += 1  # UI-R1's steps of other actions: no click record
                    continue
                with refusals.row(where):
                    size = None
                    if parquet:
                        cell = row.pop("image")
                        row["file_name"] = images.add(Path(str(row["file_name"])).stem, cell, where)
                        size = image_size(images.directory / row["file_name"], where)
                    records.append(_click_record(row, where, layout, unit, ids, size, image_root))
        refused = refusals.finish()
        write_splits(tmp, {split: records}, new=False)
    summary = {"records": len(records), "splits": {split: len(records)}, "bbox": layouts, "bbox_units": all_units}
    summary |= refused | ids.summary() | ({"skipped_actions": dict(skipped)} if skipped else {})
    return summary | ({"images": len(images.id_of)} if images is not None else {})


def _click_record(row, where, layout: str, units: str, ids: UniqueIds, size, image_root) -> dict:
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
    size_from = "its bytes"
    if size is None and row.get("img_size") is not None:
        size, size_from = tuple(row["img_size"]), "img_size"
    if size is None and image_root is not None:
        size, size_from = image_size(Path(image_root) / row[file_field], where), "its file"
    read_as = layout
    if units == "fractions":
        if size is None:
            raise InputError(
                path,
                f"{box!r} is in fractions of the image (0-1): give --image-root, where its image "
                f"{row[file_field]!r} is, so that it can be converted to pixels",
                number,
                "bbox",
            )
        x1, y1, x2, y2 = x1 * size[0], y1 * size[1], x2 * size[0], y2 * size[1]
        read_as = f"{layout} in fractions"
    if size is not None and not (0 <= x1 and 0 <= y1 and x2 <= size[0] and y2 <= size[1]):
        raise InputError(
            path,
            f"{box!r} read as {read_as} is [{x1:g}, {y1:g}, {x2:g}, {y2:g}], outside the {size[0]}x{size[1]} image ({size_from}); "
            "give --bbox (and --bbox-units) for this file's layout",
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

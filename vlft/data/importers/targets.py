"""An answer that is a place on the image, as RL datasets publish one: a box solution (VLM-R1's REC
`solution`, GUI-R1's `gt_bbox`: [x1, y1, x2, y2], as a list or as text in R1-style tags), a point
([x, y]), or a click action (GUI-R1's `gt_action`, AndroidControl's {"action_type": "click", "x",
"y"}). Such a row becomes a click record: its target in the image's pixels as `box` or `point`, the
target's centre its answer, which a click stage learns and its rewards and the evaluation judge
(vlft.data.clicks, vlft.data.rewards). A box solution thus trains a click inside the box: our click
stages answer with a point, not a box. Steps whose action is no click (typing, scrolling, going
back) make no click record: they are skipped, counted by their action."""

from __future__ import annotations

import json
from pathlib import Path

from vlft.errors import InputError
from vlft.data.importers.common import ANSWER_TAG, plain

CLICK_ACTIONS = ("click", "tap")
# Where the published rows name a step's action: GUI-R1's and UI-R1's row fields, AndroidControl's key.
ACTION_FIELDS = ("gt_action", "action", "action_type")


def action_of(row: dict, cell) -> str | None:
    """The step's action, lower case: an action object's own (AndroidControl's `action_type`), else
    the row's action field; None where the row names no action."""
    if isinstance(cell, dict):
        kind = next((cell[f] for f in ACTION_FIELDS if isinstance(cell.get(f), str)), None)
    else:
        kind = next((row[f] for f in ACTION_FIELDS if isinstance(row.get(f), str)), None)
    return kind.strip().lower() if kind else None


def target_values(cell, where, field: str) -> list[float] | None:
    """The numbers of the place an answer cell names ([x, y] or [x1, y1, x2, y2]), or None where
    it names no place (a text answer). Refused: a list of numbers that is neither, and an action
    object without its x and y."""
    cell = plain(cell)
    if isinstance(cell, dict):
        if not any(f in cell for f in ACTION_FIELDS):
            return None  # an object that is no action: the flat importer refuses it as an object
        values = [cell.get("x"), cell.get("y")]
        if not all(_number(v) for v in values):
            raise InputError(
                where[0], f"an action without a place (x and y): fields {', '.join(cell)}", where[1], field
            )
        return values
    if isinstance(cell, str):  # a place as text only in R1-style answer tags: "[3, 4]" alone may be a set
        tagged = ANSWER_TAG.findall(cell)
        try:
            cell = json.loads(tagged[-1]) if tagged else None
        except json.JSONDecodeError:
            return None
    if not (isinstance(cell, list) and len(cell) > 1 and all(_number(v) for v in cell)):
        return None
    if len(cell) not in (2, 4):
        raise InputError(
            where[0], f"a list of {len(cell)} numbers: a place is 2 (a point) or 4 (a box's corners)", where[1], field
        )
    return cell


def units_of(targets: list[list[float]]) -> str:
    """A file's targets are in fractions of the image where every number of every one lies within
    0-1 (GUI-R1's training rows; no target on a real image is under a pixel wide), else pixels."""
    numbers = [v for target in targets for v in target]
    return "fractions" if numbers and all(0 <= v <= 1 for v in numbers) else "pixels"


def click_fields(values: list[float], units: str, size: tuple[int, int], where, field: str) -> dict:
    """A click record's answer and `box` or `point`, in the image's pixels; refused where the
    target leaves the image or a box has no area (x, y, width, height is not read here:
    the screenspot importer's --bbox reads that layout)."""
    width, height = size
    if units == "fractions":
        values = [round(v * (width, height)[i % 2], 2) for i, v in enumerate(values)]
    inside = all(0 <= v <= (width, height)[i % 2] for i, v in enumerate(values))
    if len(values) == 2:
        if not inside:
            raise InputError(
                where[0], f"point {values} ({units}) is outside the {width}x{height} image", where[1], field
            )
        return {"answer": f"({values[0]:g}, {values[1]:g})", "point": values}
    x1, y1, x2, y2 = values
    if not (inside and x2 > x1 and y2 > y1):
        raise InputError(
            where[0],
            f"box {values} ({units}) is not [x1, y1, x2, y2] of positive area inside the {width}x{height} image",
            where[1],
            field,
        )
    return {"answer": f"({(x1 + x2) / 2:g}, {(y1 + y2) / 2:g})", "box": values}


def image_size(path: Path, where) -> tuple[int, int]:
    """The image's size as prepare_split reads it (vlft.data.records.check_image: orientation applied)."""
    from vlft.data.records import check_image

    size = check_image(path)
    if isinstance(size, str):
        raise InputError(where[0], f"its image {path}: {size}", where[1], "image")
    return size


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

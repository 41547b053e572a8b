"""An answer that is a place on the image, as RL datasets publish one: a box solution (VLM-R1's REC
`solution`, GUI-R1's `gt_bbox`: [x1, y1, x2, y2], as a list or as text in R1-style tags), a point
([x, y]), or a click action (GUI-R1's `gt_action`, AndroidControl's {"action_type": "click", "x",
"y"}). Such a row becomes a click record: its target in the image's pixels as `box` or `point`, the
target's centre its answer, which a click stage learns and its rewards and the evaluation judge
(vlft.data.clicks, vlft.data.rewards). A box solution thus trains a click inside the box: our click
stages answer with a point, not a box. Steps whose action is no click (typing, scrolling, going
back) make no click record: they are skipped, counted by their action.

Chat rows' places are read here too: ms-swift's grounding rows (`objects` filling `<ref-object>` and
`<bbox>`) and a box or point written in the answer in a Qwen family's syntax."""

from __future__ import annotations

import json
from pathlib import Path

from vlft.errors import InputError
from vlft.data.clicks import Frame, released_frame, written_targets
from vlft.data.importers.common import ANSWER_TAG, plain

# What a box written in an answer is measured in: a family's own coordinates (vlft.data.clicks), or pixels.
ANSWER_COORDINATES = {"qwen3-vl": "qwen3_vl", "qwen2.5-vl": "qwen2_5_vl", "qwen2-vl": "qwen2_vl", "pixels": None}
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


def conversation_target(row: dict, rounds: list, where, image_file: Path, coordinates: str | None) -> tuple[list, dict]:
    """A chat row's rounds and its click record's fields (`box` or `point`; none for a conversation
    that asks for no place): of a grounding row (ms-swift's `objects`) or of a target written in
    the answer in a Qwen family's syntax."""
    if "objects" in row:
        return _grounding(row, rounds, where, image_file)
    if any(written_targets(answer) for _, answer in rounds):
        return _written_target(rounds, where, image_file, coordinates)
    if any("<ref-object>" in t or "<bbox>" in t for pair in rounds for t in pair):
        raise InputError(where[0], "has <ref-object> or <bbox> placeholders but no 'objects' to fill them", where[1])
    return rounds, {}


def _grounding(row: dict, rounds: list[tuple[str, str]], where, image_file: Path) -> tuple[list, dict]:
    """ms-swift's grounding row as a click record. ms-swift fills `<ref-object>` placeholders with
    `objects.ref` and `<bbox>` ones with `objects.bbox`, each in order through the conversation; a
    row whose answer places one box asks for one target: its question (the referring expressions
    filled in) and that box (pixels, corners) make the record, the box's centre its answer. Refused
    where it places several boxes or none, or asks about a box instead of for one."""
    from vlft.data.records import check_image

    path, number = where
    objects = row["objects"] if isinstance(row["objects"], dict) else {}
    refs, boxes = list(objects.get("ref") or []), list(objects.get("bbox") or [])
    if len(rounds) != 1:
        raise InputError(path, f"a grounding row of {len(rounds)} rounds: a click record has one", number, "objects")
    question, answer = rounds[0]
    if "<bbox>" in question:
        raise InputError(
            path,
            "asks about a box (<bbox> in the question), as a grounded caption does: ms-swift writes that box in "
            "each model family's own coordinates, and a record's question is one fixed text, so only rows that "
            "ask for a target (click records) are read",
            number,
        )
    placed = answer.count("<bbox>")
    if placed != 1 or len(boxes) != 1:
        raise InputError(
            path,
            f"asks for {max(placed, len(boxes))} targets ({placed} <bbox> in the answer, {len(boxes)} in objects.bbox): "
            "a click record has one",
            number,
            "objects",
        )
    asked = question.count("<ref-object>")
    if asked > len(refs):
        raise InputError(path, f"{asked} <ref-object> in the question, {len(refs)} in objects.ref", number, "objects")
    for ref in refs[:asked]:
        question = question.replace("<ref-object>", str(ref), 1)
    box = boxes[0]
    if not (isinstance(box, list) and len(box) in (2, 4) and all(isinstance(v, (int, float)) for v in box)):
        raise InputError(path, f"must be 2 numbers (a point) or 4 (a box), not {box!r}", number, "objects.bbox")
    kind = objects.get("bbox_type", "real")
    if kind == "norm1":  # fractions of the image's width and height
        size = check_image(image_file)
        if isinstance(size, str):
            raise InputError(path, f"{size}: {image_file} (its size turns the norm1 box into pixels)", number)
        box = [round(v * size[i % 2], 2) for i, v in enumerate(box)]
    elif kind != "real":
        raise InputError(path, f"bbox_type {kind!r}: only 'real' (pixels) and 'norm1' are read", number, "objects")
    if len(box) == 2:  # a point to click, as ms-swift's "click(start_box='<bbox>')" example has
        return [(question, f"({box[0]:g}, {box[1]:g})")], {"point": box}
    x1, y1, x2, y2 = box
    return [(question, f"({(x1 + x2) / 2:g}, {(y1 + y2) / 2:g})")], {"box": box}


def _written_target(rounds: list[tuple[str, str]], where, image_file: Path, coordinates: str | None):
    """A box or point written in the answer in a Qwen family's syntax, as a click record: the
    family's coordinate convention undone to the image's pixels (as a click stage's are), its centre
    the answer. Refused where the answer writes several targets, where the conversation has more
    rounds than one, or where the syntax does not say which family's coordinates it is in."""
    from vlft.data.records import check_image

    path, number = where
    question, answer = rounds[-1]
    targets = written_targets(answer)
    if len(rounds) != 1 or len(targets) != 1:
        raise InputError(
            path,
            f"writes {sum(len(written_targets(a)) for _, a in rounds)} targets in {len(rounds)} rounds: a click record "
            "asks for one target in one round",
            number,
        )
    if coordinates is None and "<|box_start|>" not in answer:
        raise InputError(
            path,
            'writes a target as Qwen2.5-VL and Qwen3-VL do ("bbox_2d", "point_2d"), in pixels of the resized image or '
            f"on a 0-1000 grid: give --answer-coordinates ({', '.join(ANSWER_COORDINATES)})",
            number,
        )
    family = ANSWER_COORDINATES[coordinates] if coordinates else "qwen2_vl"
    size = check_image(image_file)
    if isinstance(size, str):
        raise InputError(path, f"{size}: {image_file} (its size turns the written target into pixels)", number)
    width, height = size
    frame = released_frame(family, width, height) if family else Frame(width, height, width, height, "absolute")
    values = targets[0]
    if len(values) not in (2, 4):
        raise InputError(path, f"a written target of {len(values)} numbers: a point has 2, a box 4", number)
    limits = frame.limits()
    if not all(0 <= v <= limits[i % 2] for i, v in enumerate(values)):
        raise InputError(
            path, f"the written target {values} leaves the {limits[0]}x{limits[1]} it is measured in", number
        )
    pixels = [round(c, 2) for i in range(0, len(values), 2) for c in frame.to_original(values[i], values[i + 1])]
    if len(pixels) == 2:
        return [(question, f"({pixels[0]:g}, {pixels[1]:g})")], {"point": pixels}
    x1, y1, x2, y2 = pixels
    if not (x2 > x1 and y2 > y1):
        raise InputError(path, f"the written box {values} has no area", number)
    return [(question, f"({(x1 + x2) / 2:g}, {(y1 + y2) / 2:g})")], {"box": pixels}

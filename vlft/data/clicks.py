"""Click prediction: an image and an instruction in, a point out, judged by whether it lands in the
target element's box.

Records give the target in pixels of the original image: a `point`, or a `box` [x1, y1, x2, y2]
whose centre is the target when no point is given. The model is taught and read in its family's
own coordinates: Qwen3-VL and Qwen2-VL locate on a 0-1000 grid relative to the image, Qwen2.5-VL in
absolute pixels of the image as resized for it (the very resize the pixel cache made, read off the
cache's patch grid). An answer is parsed from any of the forms these models emit, clamped to the
image, mapped back to original pixels and scored there.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from vlft.data.answers import AnswerFormat, final_answer
from vlft.errors import ConfigError, InputError
from vlft.families import FAMILIES

RELATIVE_GRID = 1000
# The coordinates each family was pretrained to give (by the `model_type` of its config).
COORDINATES_OF_FAMILY = {model_type: family.coordinates for model_type, family in FAMILIES.items()}
# A number on its own: not part of a word such as "point_2d" or "bbox_2d".
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w])")


@dataclass(frozen=True)
class Frame:
    """One image as the model sees it: original size, resized size, the family's coordinates."""

    width: int
    height: int
    resized_width: int
    resized_height: int
    coordinates: str  # "relative" (0-1000 of the image) or "absolute" (pixels of the resized image)

    def _scale(self) -> tuple[float, float]:
        """Model units per original pixel, along x and y."""
        if self.coordinates == "relative":
            return RELATIVE_GRID / self.width, RELATIVE_GRID / self.height
        return self.resized_width / self.width, self.resized_height / self.height

    def limits(self) -> tuple[int, int]:
        if self.coordinates == "relative":
            return RELATIVE_GRID, RELATIVE_GRID
        return self.resized_width, self.resized_height

    def to_model(self, x: float, y: float) -> tuple[int, int]:
        """Original pixels -> the integer point the model is taught to say."""
        sx, sy = self._scale()
        lx, ly = self.limits()
        return min(max(round(x * sx), 0), lx), min(max(round(y * sy), 0), ly)

    def to_original(self, x: float, y: float) -> tuple[float, float]:
        """A point the model said -> original pixels, clamped to the image."""
        sx, sy = self._scale()
        lx, ly = self.limits()
        return min(max(x, 0), lx) / sx, min(max(y, 0), ly) / sy


@dataclass(frozen=True)
class Convention:
    """How one model family locates: its coordinates and the pixel size of a patch of its grid."""

    coordinates: str
    patch_size: int

    @classmethod
    def of(cls, model_config) -> "Convention":
        family = model_config.model_type
        if family not in COORDINATES_OF_FAMILY:
            known = ", ".join(sorted(COORDINATES_OF_FAMILY))
            raise ConfigError(
                f"answer_format: click needs a model family whose coordinates are known ({known}), not '{family}'"
            )
        return cls(COORDINATES_OF_FAMILY[family], model_config.vision_config.patch_size)

    def frame(self, record: dict, grid_thw: list[int]) -> Frame:
        """The frame of a prepared record whose image the cache holds with this patch grid."""
        _, grid_h, grid_w = grid_thw
        return Frame(
            record["width"], record["height"], grid_w * self.patch_size, grid_h * self.patch_size, self.coordinates
        )


def convention_for(answer_format: str, model_config) -> Convention | None:
    """The model family's coordinates where a stage answers with clicks, else None."""
    return Convention.of(model_config) if answer_format == AnswerFormat.CLICK else None


def target_point(record: dict, where: str) -> tuple[float, float]:
    """The point to click, in original pixels: the record's point, or its box's centre."""
    if record.get("point") is not None:
        return tuple(record["point"])
    if record.get("box") is not None:
        x1, y1, x2, y2 = record["box"]
        return (x1 + x2) / 2, (y1 + y2) / 2
    raise InputError(where, f"record {record['id']} has neither a point nor a box to click")


def point_text(x: int, y: int) -> str:
    return f"({x}, {y})"


def target_text(record: dict, frame: Frame, where: str) -> str:
    """What a click stage trains the model to say for this record."""
    return point_text(*frame.to_model(*target_point(record, where)))


_N = r"(-?\d+(?:\.\d+)?)"
# The forms a point or box is given in by these models, boxes first (their centre is taken): a box
# as four numbers in brackets ("bbox_2d": [x1, y1, x2, y2]) or as two points ((x1,y1),(x2,y2), as
# Qwen2-VL writes it inside <|box_start|>); a point as (x, y), [x, y] ("point_2d"), <point>x y</point>
# or x=.., y=... Numbers anywhere else in an answer are no point: the untrained base model scored
# clicks from stray numbers in its prose ("3 buttons and 2 icons") before these were required.
POINT_FORMS = [
    (4, re.compile(rf"\[\s*{_N}\s*,\s*{_N}\s*,\s*{_N}\s*,\s*{_N}\s*\]")),
    (4, re.compile(rf"\(\s*{_N}\s*,\s*{_N}\s*\)\s*,?\s*\(\s*{_N}\s*,\s*{_N}\s*\)")),
    (2, re.compile(rf"\(\s*{_N}\s*,\s*{_N}\s*\)")),
    (2, re.compile(rf"\[\s*{_N}\s*,\s*{_N}\s*\]")),
    (2, re.compile(rf"<point>\s*{_N}[\s,]+{_N}\s*</point>")),
    (2, re.compile(rf"\bx\s*[=:]\s*{_N}\s*,?\s*y\s*[=:]\s*{_N}")),
]


def parse_point(text: str) -> tuple[float, float] | None:
    """The point an answer gives, in the model's units, from the first of POINT_FORMS its final
    answer holds (a box's centre for a box); None when it gives none in any of them."""
    answer = final_answer(text)
    found = [(m.start(), count, m) for count, form in POINT_FORMS if (m := form.search(answer))]
    if not found:
        return None
    _, count, match = min(found, key=lambda f: (f[0], -f[1]))  # the first in the text; a box over its corner
    numbers = [float(n) for n in match.groups()]
    if count == 4:
        x1, y1, x2, y2 = numbers
        return (x1 + x2) / 2, (y1 + y2) / 2
    return numbers[0], numbers[1]


# Targets written into an answer as the Qwen families write them: Qwen2.5-VL's and Qwen3-VL's JSON
# ("bbox_2d": [x1, y1, x2, y2], "point_2d": [x, y]) and Qwen2-VL's <|box_start|>(x1,y1),(x2,y2)<|box_end|>.
WRITTEN_TARGETS = re.compile(r'"(?:bbox_2d|point_2d)"\s*:\s*\[([^\]]*)\]|<\|box_start\|>(.*?)<\|box_end\|>', re.S)
# The image processor each family's released checkpoints ship (preprocessor_config.json): the
# resize its absolute coordinates are in (merge 2 x patch 14; min and max pixels).
RELEASED_RESIZE = {"qwen2_5_vl": (28, 3136, 12845056)}


def written_targets(text: str) -> list[list[float]]:
    """The numbers of each box or point an answer writes in a Qwen family's syntax."""
    return [[float(n) for n in NUMBER.findall(a or b)] for a, b in WRITTEN_TARGETS.findall(text)]


def released_frame(family: str, width: int, height: int) -> Frame:
    """The frame of an image of this size as a family's released checkpoint sees it: the resize
    its processor makes, where its coordinates are absolute pixels of the resized image."""
    resized_height, resized_width = height, width
    if COORDINATES_OF_FAMILY[family] == "absolute":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor, min_pixels, max_pixels = RELEASED_RESIZE[family]
        resized_height, resized_width = smart_resize(height, width, factor, min_pixels, max_pixels)
    return Frame(width, height, resized_width, resized_height, COORDINATES_OF_FAMILY[family])


def in_box(x: float, y: float, box: list[float]) -> bool:
    """Inside or on the edge of [x1, y1, x2, y2]."""
    x1, y1, x2, y2 = box
    return x1 <= x <= x2 and y1 <= y <= y2


def score(record: dict, answer: str, frame: Frame, where: str) -> dict:
    """A click answer judged in original pixels: the point, whether it is in the target box, and
    its distance to the target over the image's diagonal. An answer without a point is wrong, and
    counted as unparseable. A record with a point and no box has no box to land in: its `correct`
    is None, and only the distance judges it."""
    target = target_point(record, where)
    box = record.get("box")
    said = parse_point(answer)
    if said is None:
        return {"point": None, "correct": False if box else None, "parsed": False, "distance": None}
    x, y = frame.to_original(*said)
    return {
        "point": [round(x, 2), round(y, 2)],
        "correct": in_box(x, y, box) if box else None,
        "parsed": True,
        "distance": math.dist((x, y), target) / math.hypot(frame.width, frame.height),
    }

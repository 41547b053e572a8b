"""A synthetic click dataset: screens with one button or icon among plain text labels, and an
instruction naming it; the target is its box in pixels.

Screens are 160x96 pixels, a 5x3 grid of 32-pixel cells: each element fills whole cells (an icon
one, a button two side by side, a wide button three), so each cell is one merged image token of a
32-pixel-patch model and the target is learnable from the tokens a small model sees.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from PIL import Image, ImageDraw

from vlft.demo import write_splits

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (235, 200, 30)}
LABELS = ("OK", "Save", "Open", "Send", "Undo", "Help")
CELL, COLUMNS, ROWS = 32, 5, 3
# (kind, width in cells): the category of the target is its kind.
ELEMENTS = (("icon", 1), ("button", 2), ("button", 3))


def make_screen(index: int, rng: random.Random) -> tuple[dict, Image.Image]:
    """One clickable element (a button, or an icon) among one or two plain text labels."""
    image = Image.new("RGB", (COLUMNS * CELL, ROWS * CELL), (250, 250, 250))
    pen = ImageDraw.Draw(image)
    free = {(row, col) for row in range(ROWS) for col in range(COLUMNS)}

    def place(span: int) -> list[int]:
        nonlocal free
        places = [(r, c) for r, c in sorted(free) if all((r, c + i) in free for i in range(span))]
        row, col = rng.choice(places)
        free -= {(row, col + i) for i in range(span)}
        return [col * CELL, row * CELL, (col + span) * CELL, (row + 1) * CELL]  # edges, in pixels

    kind, span = rng.choice(ELEMENTS)
    color, label = rng.choice(list(COLORS)), rng.choice(LABELS)
    box = place(span)
    inset = rng.randint(1, 3)
    shape = [box[0] + inset, box[1] + inset, box[2] - 1 - inset, box[3] - 1 - inset]
    if kind == "icon":
        pen.ellipse(shape, fill=COLORS[color])
        named = f"the {color} icon"
    else:
        pen.rounded_rectangle(shape, radius=6, fill=COLORS[color])
        pen.text((shape[0] + 5, shape[1] + 9), label, fill=(255, 255, 255))
        named = f"the {label} button"
    for _ in range(rng.randint(1, 2)):
        text_box = place(2)
        pen.text((text_box[0] + 4, text_box[1] + 10), rng.choice(LABELS).lower() + ":", fill=(90, 90, 90))
    record = {
        "id": f"{index:05d}",
        "image": f"{index:05d}.png",
        "question": f"Click {named}.",
        # The target as a sentence, for a reader; a click stage teaches the point from the box.
        "answer": f"{named} at {box}",
        "box": box,
        "category": kind,
    }
    return record, image


def make_dataset(splits: dict[str, str | Path], image_root: str | Path, sizes: dict[str, int], seed: int) -> None:
    """One JSONL per split, images under <image_root>/<split>/; each output appears whole or not at all."""
    write_splits(lambda rng: (make_screen(i, rng) for i in itertools.count()), splits, image_root, sizes, seed)


def corpus() -> list[str]:
    """Every kind of text the dataset holds (and the points a click stage says), for the demo tokenizer."""
    rng = random.Random(0)
    texts = []
    for index in range(200):
        record, _ = make_screen(index, rng)
        texts += [record["question"], record["answer"]]
    # Element centres on the 0-1000 grid: multiples of 100 across, 167, 500 and 833 down.
    texts += [f"({x}, {y})" for x in range(100, 1000, 100) for y in (167, 500, 833)]
    return texts

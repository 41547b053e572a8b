"""A synthetic VQA dataset: shapes of several colors on a 3x3 grid, four question categories,
chain-of-thought answers that end in 'Final answer: ...'.

Each shape fills one cell of a 3x3 grid of 32-pixel cells, so every cell is one merged image
token of a 32-pixel-patch model: the answers are learnable from the tokens a small model sees.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from PIL import Image, ImageDraw

from vlft.demo import write_splits
from vlft.files import read_jsonl, write_jsonl

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (235, 200, 30)}
SHAPES = ("circle", "square", "triangle")
COLUMNS = ("left", "center", "right")
CELL = 32
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five")
# Curricula sort or filter by difficulty: one attribute to read is easier than a count.
DIFFICULTY = {"color": 1, "yes/no": 2, "location": 3, "count": 4}


def other(values, value):
    """The value after `value` among `values`: a wrong answer the image contradicts, chosen
    without a random draw (so the images and right answers stay those of the same seed)."""
    values = list(values)
    return values[(values.index(value) + 1) % len(values)]


def wrong_count(n: int) -> int:
    return n + 1 if n < 4 else n - 1


def draw(cells: list[tuple[int, int]], shape: str, color: str, rng: random.Random) -> Image.Image:
    image = Image.new("RGB", (3 * CELL, 3 * CELL), (245, 245, 245))
    pen = ImageDraw.Draw(image)
    for row, col in cells:
        pad = rng.randint(3, 7)
        x0, y0, x1, y1 = col * CELL + pad, row * CELL + pad, (col + 1) * CELL - pad, (row + 1) * CELL - pad
        if shape == "circle":
            pen.ellipse((x0, y0, x1, y1), fill=COLORS[color])
        elif shape == "square":
            pen.rectangle((x0, y0, x1, y1), fill=COLORS[color])
        else:
            pen.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=COLORS[color])
    return image


def make_record(index: int, category: str, rng: random.Random) -> tuple[dict, Image.Image]:
    shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    all_cells = [(r, c) for r in range(3) for c in range(3)]
    if category == "count":
        cells = rng.sample(all_cells, rng.randint(1, 4))
        counted = ", ".join(NUMBER_WORDS[i] for i in range(1, len(cells) + 1))
        question = "How many shapes are there?"
        answer = f"I count the {color} {shape}s one by one: {counted}. Final answer: {len(cells)}"
        wrong = wrong_count(len(cells))
        miscounted = ", ".join(NUMBER_WORDS[i] for i in range(1, wrong + 1))
        rejected = f"I count the {color} {shape}s one by one: {miscounted}. Final answer: {wrong}"
    else:
        cells = [rng.choice(all_cells)]
        column = COLUMNS[cells[0][1]]
        if category == "color":
            question = "What color is the shape?"
            answer = f"There is one {shape} and it is filled with {color}. Final answer: {color}"
            wrong = other(COLORS, color)
            rejected = f"There is one {shape} and it is filled with {wrong}. Final answer: {wrong}"
        elif category == "location":
            question = "Where is the shape?"
            answer = f"The {color} {shape} is in the {column} column of the image. Final answer: {column}"
            wrong = other(COLUMNS, column)
            rejected = f"The {color} {shape} is in the {wrong} column of the image. Final answer: {wrong}"
        else:
            asked = color if rng.random() < 0.5 else rng.choice([c for c in COLORS if c != color])
            question = f"Is there a {asked} shape?"
            verdict = "yes" if asked == color else "no"
            answer = f"The only shape is a {color} {shape}, and {asked} was asked. Final answer: {verdict}"
            seen = other(COLORS, color) if asked == color else asked
            rejected = f"The only shape is a {seen} {shape}, and {asked} was asked. Final answer: {other(('yes', 'no'), verdict)}"
    record = shapes_record(f"{index:05d}", index, question, answer, category, len(cells))
    return record | {"rejected": rejected}, draw(cells, shape, color, rng)


def shapes_record(record_id: str, image_index: int, question: str, answer: str, category: str, shapes: int) -> dict:
    return {
        "id": record_id,
        "image": f"{image_index:05d}.png",
        "question": question,
        "answer": answer,
        "category": category,
        "difficulty": DIFFICULTY[category],
        "shapes": shapes,
    }


def make_scene(index: int, rng: random.Random, most: int) -> list[tuple[dict, Image.Image | None]]:
    """One image and up to `most` questions about it, one of each category that applies (where is
    the shape: only for a single shape), as Kvasir-VQA asks several of each image. The image comes
    with the first record; the others name it."""
    shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    all_cells = [(r, c) for r in range(3) for c in range(3)]
    cells = rng.sample(all_cells, 1 if rng.random() < 0.5 else rng.randint(2, 4))
    one = len(cells) == 1
    asked = color if rng.random() < 0.5 else rng.choice([c for c in COLORS if c != color])
    verdict = "yes" if asked == color else "no"

    def shapes_are(fill: str) -> str:
        return f"The only shape is a {fill} {shape}" if one else f"The shapes are {fill} {shape}s"

    def count_answer(n: int) -> str:
        counted = ", ".join(NUMBER_WORDS[i] for i in range(1, n + 1))
        return f"I count the {color} {shape}s one by one: {counted}. Final answer: {n}"

    def color_answer(fill: str) -> str:
        seen = (
            f"There is one {shape} and it is filled with {fill}."
            if one
            else f"There are {len(cells)} {shape}s and they are filled with {fill}."
        )
        return f"{seen} Final answer: {fill}"

    # Each question with its right answer and a wrong one the image contradicts (the preference
    # stage's rejected answer), the wrong one made without a random draw.
    seen = other(COLORS, color) if asked == color else asked
    questions = [
        ("count", "How many shapes are there?", count_answer(len(cells)), count_answer(wrong_count(len(cells)))),
        (
            "color",
            "What color is the shape?" if one else "What color are the shapes?",
            color_answer(color),
            color_answer(other(COLORS, color)),
        ),
        (
            "yes/no",
            f"Is there a {asked} shape?",
            f"{shapes_are(color)}, and {asked} was asked. Final answer: {verdict}",
            f"{shapes_are(seen)}, and {asked} was asked. Final answer: {other(('yes', 'no'), verdict)}",
        ),
    ]
    if one:
        column = COLUMNS[cells[0][1]]
        where = "The {} {} is in the {} column of the image. Final answer: {}"
        questions.append(
            (
                "location",
                "Where is the shape?",
                where.format(color, shape, column, column),
                where.format(color, shape, other(COLUMNS, column), other(COLUMNS, column)),
            )
        )
    image = draw(cells, shape, color, rng)
    scene = []
    for number, (category, question, answer, rejected) in enumerate(questions[:most]):
        record = shapes_record(f"{index:05d}-{number}", index, question, answer, category, len(cells))
        scene.append((record | {"rejected": rejected}, image if number == 0 else None))
    return scene


def make_dataset(
    splits: dict[str, str | Path],
    image_root: str | Path,
    sizes: dict[str, int],
    seed: int,
    questions_per_image: int = 1,
) -> None:
    """One JSONL per split, images under <image_root>/<split>/; each output appears whole or not at
    all. `questions_per_image` above 1: each image is asked up to that many questions (make_scene)."""
    if questions_per_image == 1:

        def records_of(rng):
            for index in itertools.count():
                yield make_record(index, list(DIFFICULTY)[index % len(DIFFICULTY)], rng)

    else:

        def records_of(rng):
            for index in itertools.count():
                yield from make_scene(index, rng, questions_per_image)

    write_splits(records_of, splits, image_root, sizes, seed)


def corpus() -> list[str]:
    """Every kind of text the dataset holds, for training the demo tokenizer."""
    rng = random.Random(0)
    texts = []
    for index in range(400):
        record, _ = make_record(index, list(DIFFICULTY)[index % len(DIFFICULTY)], rng)
        texts += [record["question"], record["answer"]]
    return texts


def questions_on_shared_images(root: Path, images: int, per_image: int, seed: int = 3) -> Path:
    """A raw split of images x per_image records in root/train.jsonl (images under root/images), the
    questions of each image consecutive; the records of an image keep their own questions and answers
    (each made for another image of the same kind: what they ask is irrelevant to the tests and
    benchmarks of image sharing that use it, only that they differ)."""
    make_dataset({"train": root / "raw.jsonl"}, root / "images", {"train": images * per_image}, seed=seed)
    records = read_jsonl(root / "raw.jsonl")
    for index, record in enumerate(records):
        record["image"] = records[index - index % per_image]["image"]
    write_jsonl(root / "train.jsonl", records)
    return root / "train.jsonl"

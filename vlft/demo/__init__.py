"""The built-in demo: synthetic datasets and a tiny Qwen3-VL, made locally, nothing downloaded."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Callable, Iterator

from PIL import Image

from vlft.files import atomic_path, write_jsonl


def write_splits(
    records_of: Callable[[random.Random], Iterator[tuple[dict, Image.Image | None]]],
    splits: dict[str, str | Path],
    image_root: str | Path,
    sizes: dict[str, int],
    seed: int,
) -> None:
    """One JSONL per split of the first records of `records_of(rng)` (each with its image, or
    None where an earlier record's image is its own), their images under <image_root>/<split>/;
    each output appears whole or not at all."""
    records_by_split = {}
    with atomic_path(image_root) as tmp:
        for split_index, split in enumerate(sorted(sizes)):
            rng = random.Random(seed * 1000 + split_index)
            (tmp / split).mkdir(parents=True)
            records = []
            for record, image in itertools.islice(records_of(rng), sizes[split]):
                record["image"] = f"{split}/{record['image']}"
                if image is not None:
                    image.save(tmp / record["image"])
                records.append(record)
            records_by_split[split] = records
    for split, records in records_by_split.items():
        write_jsonl(splits[split], records)

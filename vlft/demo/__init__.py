"""The built-in demo: synthetic datasets and a tiny Qwen3-VL, made locally, nothing downloaded."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

from PIL import Image

from vlft.files import atomic_path, write_jsonl


def write_splits(
    make_record: Callable[[int, random.Random], tuple[dict, Image.Image]],
    splits: dict[str, str | Path],
    image_root: str | Path,
    sizes: dict[str, int],
    seed: int,
) -> None:
    """One JSONL per split of `make_record(index, rng)`'s records, their images under
    <image_root>/<split>/; each output appears whole or not at all."""
    records_by_split = {}
    with atomic_path(image_root) as tmp:
        for split_index, split in enumerate(sorted(sizes)):
            rng = random.Random(seed * 1000 + split_index)
            (tmp / split).mkdir(parents=True)
            records = []
            for index in range(sizes[split]):
                record, image = make_record(index, rng)
                record["image"] = f"{split}/{record['image']}"
                image.save(tmp / record["image"])
                records.append(record)
            records_by_split[split] = records
    for split, records in records_by_split.items():
        write_jsonl(splits[split], records)

"""A few images of an imported dataset, with every question asked about them: a smoke study's data
(config/examples/kvasir-vqa-smoke.yaml), which checks the whole chain in minutes before a study of
hours. The records are the source's, unchanged, naming the same image files: the sample's config
keeps the source's `image_root`. Each split keeps its first N images (in the records' order), so that
the sample is the same every time, and a split with fewer keeps them all."""

from __future__ import annotations

from pathlib import Path

from vlft.errors import InputError
from vlft.files import atomic_path, read_jsonl, write_jsonl


def sample_splits(source: str | Path, out: str | Path, images: dict[str, int]) -> dict:
    """`images`: split -> how many images; <source>/<split>.jsonl -> <out>/<split>.jsonl, written whole
    or not at all. The summary counts each split's images and records kept, and the records left out."""
    source = Path(source)
    summary = {}
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        for split, count in images.items():
            path = source / f"{split}.jsonl"
            if not path.is_file():
                raise InputError(path, f"no such split in {source} (an importer's output: <split>.jsonl files)")
            kept_images, kept, left_out = set(), [], 0
            for record in read_jsonl(path):
                if record["image"] not in kept_images and len(kept_images) == count:
                    left_out += 1
                    continue
                kept_images.add(record["image"])
                kept.append(record)
            write_jsonl(tmp / f"{split}.jsonl", kept)
            summary[split] = {"images": len(kept_images), "records": len(kept), "records_left_out": left_out}
    return summary

"""What counting a Kvasir-sized split costs a dry run (vlft.costs): 58,849 records on 6,500 images of
1036x1288 pixels, chain-of-thought answers of about 60 words; the first count (every record read,
every image's header, every question and answer tokenized) and a later dry run's (the counts read
back from .snakemake/vlft/counts/).

    python benchmarks/count_cost.py --work /tmp/count-cost --tokenizer results/demo/tiny-qwen3-vl/tokenizer.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from PIL import Image

from vlft.costs import CountsMemo, ModelShape

WORDS = "the polyp is small and red near the left wall so the answer is yes there are two instruments".split()


def make_split(work: Path, images: int, records: int) -> Path:
    root = work / "images"
    root.mkdir(parents=True, exist_ok=True)
    for i in range(images):
        path = root / f"{i:05d}.jpg"
        if not path.exists():
            Image.new("RGB", (1288, 1036), (i % 256, 80, 120)).save(path, quality=50)
    rng = random.Random(0)
    lines = []
    for i in range(records):
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 100)))
        question = " ".join(rng.choice(WORDS) for _ in range(10))
        lines.append(
            json.dumps(
                {
                    "id": str(i),
                    "image": f"{i % images:05d}.jpg",
                    "question": question,
                    "answer": answer,
                    "category": ["yes/no", "color", "count", "location", "instrument"][i % 5],
                }
            )
        )
    split = work / "train.jsonl"
    split.write_text("\n".join(lines) + "\n")
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--images", type=int, default=6500)
    parser.add_argument("--records", type=int, default=58849)
    args = parser.parse_args()
    split = make_split(args.work, args.images, args.records)
    shape = ModelShape(7.57e9, 32, args.tokenizer)
    timings = {}
    # The first dry run counts; the next reads the counts back; a stage with a new filter selects
    # from the record table already counted (one pass over the records' JSON, nothing tokenized).
    for label, filters in (("first", {}), ("again", {}), ("another_filter", {"category": ["color", "count"]})):
        started = time.perf_counter()
        memo = CountsMemo(args.work / "counts")
        counts = memo.counts("kvasir-sized", split, args.work / "images", shape, (65536, 1336320), filters)
        timings[f"{label}_s"] = round(time.perf_counter() - started, 3)
    print(
        json.dumps(
            {
                **timings,
                "records": counts.records,
                "images": counts.images,
                "answer_tokens": counts.answer_tokens(),
                "image_tokens": counts.image_tokens,
            }
        )
    )


if __name__ == "__main__":
    main()

"""The host's time to lay out one packed row of a GRPO update: Kvasir-like images, each with its
questions' G sampled answers (vlft.forward.packing.pack_groups), on the CPU with the tiny Qwen3-VL
and images of about 1,100 tokens each. No GPU: this is the host work a prompts-twice GRPO step does
at the step, after its rollout (an SFT step lays its rows out a step ahead, in a thread).

    python benchmarks/row_layout_host.py --images 4 --questions 9 --generations 8 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from vlft.demo.shapes import questions_on_shared_images
from vlft.caches.image_cache import PixelSettings, build_image_cache
from vlft.data.prompts import PromptBuilder, Sample
from vlft.data.records import prepare_split
from vlft.data.stage_data import load_stage_data
from vlft.demo.tiny_model import make_tiny_model
from vlft.modeling import load_base_model, load_image_processor, load_tokenizer, rope_index
from vlft.forward.image_groups import ImageGroup
from vlft.forward.packing import pack_groups


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlft-row-layout"))
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--questions", type=int, default=9, help="questions an image")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--answer-tokens", type=int, default=20)
    parser.add_argument("--image-tokens", type=int, default=1100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def main() -> None:
    args = parse_args()

    root = args.work
    if not (root / "pixels").exists():
        root.mkdir(parents=True, exist_ok=True)
        raw = questions_on_shared_images(root, images=args.images, per_image=args.questions)
        make_tiny_model(root / "model", family="qwen3_vl")
        prepare_split(raw, root / "images", root / "prepared.jsonl")
        pixels = args.image_tokens * 32 * 32  # a merged patch of 32 x 32 pixels a token
        settings = PixelSettings.from_processor(load_image_processor(root / "model"), pixels, pixels)
        build_image_cache(root / "prepared.jsonl", root / "images", root / "pixels", settings)
    model = load_base_model(root / "model", torch.device("cpu"), torch.float32)
    builder = PromptBuilder(load_tokenizer(root / "model"), model.config.image_token_id)
    data = load_stage_data([str(root / "prepared.jsonl")], [str(root / "pixels")], builder, {}, "final", 10**6)
    keys = list(data.samples)
    groups = []
    for image in range(args.images):
        answers = []
        for key in keys[image * args.questions : (image + 1) * args.questions]:
            prompt = data.samples[key].input_ids[: data.samples[key].prompt_length]
            for n in range(args.generations):
                drawn = f"{key}#{n}"
                data.images[drawn] = data.images[key]
                answer = [100 + n + i for i in range(args.answer_tokens)]
                answers.append(Sample(drawn, prompt + answer, [-100] * len(prompt) + answer, len(prompt)))
        groups.append(ImageGroup.of(answers))
    positions = rope_index(model)
    seconds = []
    for _ in range(args.repeats + 1):  # the first warms the allocator and the caches' files
        started = time.perf_counter()
        row = pack_groups(groups, data.images, builder, positions)
        seconds.append(time.perf_counter() - started)
    result = {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "row_tokens": row["input_ids"].shape[1],
        "answers": sum(len(g.samples) for g in groups),
        "prompt_tokens": [data.samples[k].prompt_length for k in keys[:: args.questions]],
        "seconds": [round(s, 4) for s in seconds[1:]],
        "median_s": statistics.median(seconds[1:]),
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

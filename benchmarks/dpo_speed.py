"""A DPO step against an image-grouped SFT step over the same images with the same two answers each.

The training benchmark's workload (benchmarks/train_speed.py: JPEGs of six sizes, answers of 20 to
400 tokens, the 8B with random weights): P images, each with one question and two answers. DPO
trains on P pairs (the first answer chosen, the second rejected); SFT on 2P records, the two answers
to each image's question, with `image_groups` (each image's prompt once for both). Both from the
vision cache, packed under one token budget, 16 pairs (or 16 images' 32 answers) a step. Its figure:
the seconds a step per image, DPO over SFT (the issue's bound: at most 1.3).

    python benchmarks/dpo_speed.py --arch qwen3-vl-8b --images 128 --max-batch-tokens 12288 --out benchmarks/results/dpo
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


from train_speed import (
    build_caches,
    build_model,
    commit_of,
    image_processor_for,
    make_tokenizer,
    make_workload,
    our_settings,
    run_ours,
)
from vlft.data.records import prepare_split
from vlft.files import read_jsonl, write_jsonl

STEP_IMAGES = 16


def paired(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """The workload's records taken two by two (two on each image): as pair records (the first's
    question, its answer chosen, the second's rejected), and as the same two answers to that question."""
    pairs, answers = [], []
    for first, second in zip(rows[0::2], rows[1::2]):
        pairs.append(dict(first, rejected=second["answer"]))
        answers += [first, dict(second, question=first["question"])]
    return pairs, answers


def pairs_and_answers(work: Path, images: int, tokenizer) -> tuple[Path, Path]:
    """The same images, questions and answers two ways: P pair records, and 2P answer records."""
    pairs, answers = paired(read_jsonl(make_workload(work, 2 * images, tokenizer, 0, 2)))
    for name, records in (("pairs", pairs), ("answers", answers)):
        (work / name).mkdir(parents=True, exist_ok=True)
        write_jsonl(work / name / "raw.jsonl", records)
        prepare_split(work / name / "raw.jsonl", work / "images", work / name / "prepared.jsonl")
    return work / "pairs", work / "answers"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlft-dpo-bench"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-batch-tokens", type=int, default=12288)
    parser.add_argument("--commit")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    tokenizer = make_tokenizer()
    pairs, answers = pairs_and_answers(args.work, args.images, tokenizer)
    model = build_model(args.arch, tokenizer, "cuda")
    image_processor = image_processor_for(model)
    model_dir = args.work / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    image_processor.save_pretrained(model_dir)
    for directory in (pairs, answers):
        (directory / "images").symlink_to(args.work / "images", target_is_directory=True)
        build_caches(directory, image_processor, model)
    del model
    torch.cuda.empty_cache()

    base = dict(our_settings(args.steps), max_batch_tokens=args.max_batch_tokens, micro_batch=STEP_IMAGES)
    runs = {
        "sft, image groups, 2 answers an image": (answers, dict(base, image_groups=True, micro_batch=2 * STEP_IMAGES)),
        "dpo, a pair an image": (pairs, dict(base, method="dpo", rpo_alpha=None)),
    }
    results = {}
    for name, (directory, settings) in runs.items():
        started = time.time()
        run = run_ours(
            model_dir,
            directory / "prepared.jsonl",
            directory / "vision",
            args.steps,
            args.warmup,
            settings,
            args.work / name.split(",")[0],
        )
        seconds = sum(run["step_s"])
        images = sum(run["samples"]) / 2  # two answers an image, either way
        results[name] = {
            "s_per_step": seconds / len(run["step_s"]),
            "images_per_s": images / seconds,
            "peak_gib": run["peak_gib"],
            "steps_measured": len(run["step_s"]),
            "job_s": time.time() - started,
        }
        torch.cuda.empty_cache()
    sft, dpo = results.values()
    report = {
        "arch": args.arch,
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit_of(args.commit),
        "images": args.images,
        "max_batch_tokens": args.max_batch_tokens,
        "runs": results,
        "dpo_over_sft_per_image": sft["images_per_s"] / dpo["images_per_s"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"dpo_speed_{args.arch}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

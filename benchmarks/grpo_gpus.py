"""A reward stage on 1 and N GPUs: its steps' time, each process drawing its share of a step's
answers (vlft.training.grpo's `_shares`), against a checkout whose processes each drew them all
(`--before`).

The GRPO benchmark's workload (benchmarks/grpo_speed.py: the same random-weight model, JPEGs,
questions and settings), trained through `scripts/train.py --processes N` as the train rule runs a
stage with `gpus: N`; a step's seconds are read from the stage's own log (its samples over its
samples a second), the steps after the warm-up.

    python benchmarks/grpo_gpus.py --arch qwen3-vl-2b --processes 1 2 --before .before --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from gpu_scaling import train_job
from grpo_speed import questions
from train_speed import build_caches, build_model, commit_of, image_processor_for, our_settings
from vlft.demo.tiny_model import make_tokenizer


def run(code: Path, work: Path, model_dir: Path, prompts: Path, settings: dict, processes: int, label: str) -> dict:
    """The stage through `code`'s scripts/train.py on the first `processes` GPUs."""
    out = work / label
    started = time.time()
    status = train_job(code, model_dir, prompts, prompts / "vision", settings, out, list(range(processes)))
    if status != 0:
        log = Path(f"{out}.log")
        said = [line for line in log.read_text().splitlines() if line.startswith("error: ")] if log.exists() else []
        return {"error": f"exit {status}; see {out}.log", "said": said[-1:]}
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "max_batch_tokens_auto": summary.get("max_batch_tokens_auto"),
        "prompts_once": [row.get("prompts_once") for row in rows],
        "step_s": [round(row["samples"] / row["samples_per_s"], 4) for row in rows],
        "reward": [round(row["reward"], 4) for row in rows],
        "timing_s/gen": [round(row["timing_s/gen"], 4) for row in rows],
        "rank_tokens": [row.get("rank_tokens") for row in rows],
        "peak_gib_main_process": summary["peak_memory_gb"],
        "job_s": round(time.time() - started, 1),
    }


def budget_of(given: str):
    return given if given == "auto" else int(given)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--before", type=Path, help="a checkout whose code also runs the most processes")
    parser.add_argument("--prompts", type=int, default=16, help="questions a step")
    parser.add_argument("--questions-per-image", type=int, default=1)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=20)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--max-batch-tokens", nargs="+", default=["12288"], help="a number or auto; several: a run of each, one GPU"
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlft-grpo-gpus"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit")
    return parser.parse_args()


def main():
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    images = args.prompts * args.steps // args.questions_per_image
    prompts, _, _ = questions(
        args.work, images, args.questions_per_image, args.generations, tokenizer, args.max_completion_length
    )
    model = build_model(args.arch, tokenizer, "cuda")
    model_dir = args.work / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    image_processor_for(model).save_pretrained(model_dir)
    (prompts / "images").unlink(missing_ok=True)
    (prompts / "images").symlink_to(args.work / "images", target_is_directory=True)
    build_caches(prompts, image_processor_for(model), model)
    del model
    torch.cuda.empty_cache()
    settings = dict(
        our_settings(args.steps),
        answer_format="final",
        max_batch_tokens=budget_of(args.max_batch_tokens[0]),
        method="grpo",
        beta=0.0,
        image_groups=args.questions_per_image > 1,
        micro_batch=args.prompts,
        num_generations=args.generations,
        max_completion_length=args.max_completion_length,
        rewards={"format": 1.0},
    )
    runs = [(REPO, n, f"{n} GPU(s)", settings) for n in args.processes]
    if args.before:
        runs.append((args.before.resolve(), max(args.processes), f"{max(args.processes)} GPU(s), before", settings))
    for budget in args.max_batch_tokens[1:]:
        runs.append(
            (REPO, 1, f"1 GPU(s), max_batch_tokens {budget}", settings | {"max_batch_tokens": budget_of(budget)})
        )
    results = {}
    for code, processes, label, settings in runs:
        result = run(code, args.work, model_dir, prompts, settings, processes, label.replace(" ", "_").replace(",", ""))
        if "step_s" in result:
            measured = result["step_s"][args.warmup :]
            result["s_per_step"] = sum(measured) / len(measured)
        results[label] = result
        print(label, json.dumps(result), flush=True)
    out = {
        "arch": args.arch,
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit_of(args.commit),
        "command": " ".join(sys.argv),
        "runs": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"grpo_gpus_{args.arch}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

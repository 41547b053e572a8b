"""Training and evaluation on 1, 2 (and 4) GPUs: samples/s of the training benchmark's workload,
through scripts/train.py and scripts/evaluate.py as the train and evaluate rules run them
(`--processes N`: one process a GPU; training data-parallel, evaluation sharing out the split).

    python benchmarks/gpu_scaling.py --arch qwen3-vl-8b --processes 1 2 --out benchmarks/results
    # Kvasir's shape: 9 questions an image, image groups on and off, runs side by side where GPUs allow
    python benchmarks/gpu_scaling.py --arch qwen3-vl-8b --processes 1 2 4 --questions-per-image 9 \
        --image-groups both --side-by-side --skip-evaluation --out benchmarks/results

With `--side-by-side`, runs that together fit the GPUs run at once, each on GPUs of its own (two
1-GPU runs, two 2-GPU runs on 4 GPUs): they share the host's CPUs and disk, not a GPU. With image
groups a step's samples come in whole images; each process's tokens in each step (the per-step
log's `rank_tokens`) give the spread of work between processes: the busiest over the mean.
`--before PATH` also runs the largest image-grouped case with the code of another checkout (the
sharing before groups could be cut between processes), for comparison.

The workload, model and settings are train_speed.py's (random-weight Qwen3-VL, JPEGs of 720x576 to
1920x1080, chain-of-thought answers of 20 to 400 tokens, 16 samples a step, vision cache, compiled
layers, packed micro-batches under a token budget). Each run trains from the same caches; the
steps after the warm-up are timed from the stage's own per-step log. Efficiency at N GPUs:
samples/s at N over N x samples/s at 1. The evaluation answers the workload's questions with the
1-GPU run's adapter (greedy, --max-new-tokens, batches of 32) and is timed whole, model loading
included, as a job is; its predictions at N GPUs are compared with those at 1. Prints a table and
writes benchmarks/results/gpu_scaling-<arch>-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from train_speed import (
    MAX_PIXELS,
    MIN_PIXELS,
    SAMPLES_PER_STEP,
    build_model,
    commit_of,
    image_processor_for,
    make_workload,
    our_settings,
)
from vlft.demo.tiny_model import make_tokenizer
from vlft.caches.image_cache import PixelSettings, build_image_cache
from vlft.data.records import prepare_split


def prepare(work: Path, arch: str, images: int, questions_per_image: int) -> Path:
    """The workload, the model saved as a checkpoint directory, its pixel and vision caches."""
    from vlft.caches.vision_cache import build_vision_cache

    tokenizer = make_tokenizer()
    raw = make_workload(work, images * questions_per_image, tokenizer, 0, questions_per_image)
    prepare_split(raw, work / "images", work / "prepared.jsonl")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: to try it on a tiny model
    model = build_model(arch, tokenizer, device)
    processor = image_processor_for(model)
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    processor.save_pretrained(work / "model")
    build_image_cache(
        work / "prepared.jsonl",
        work / "images",
        work / "pixels",
        PixelSettings.from_processor(processor, MIN_PIXELS, MAX_PIXELS),
        threads=16,
    )
    build_vision_cache(work / "pixels", model, work / "vision", max_gb=1000, device=device)
    return work / "model"


def train_job(code: Path, model_dir: Path, split: Path, cache: Path, settings: dict, out: Path, gpus: list[int]) -> int:
    """A stage through `code`'s scripts/train.py, as the train rule runs it with `gpus: len(gpus)`, on
    those GPUs: its outputs in `out`, what it prints in `out`.log; its exit status."""
    processes = len(gpus)
    command = [sys.executable, str(code / "scripts/train.py"), "--model", str(model_dir)]
    command += ["--prepared", str(split / "prepared.jsonl"), "--caches", str(cache)]
    command += ["--settings", json.dumps(settings), "--checkpoints", str(out / "ckpt"), "--checkpoint-every", "100000"]
    command += [
        "--adapter",
        str(out / "adapter"),
        "--log",
        str(out / "log.jsonl"),
        "--summary",
        str(out / "summary.json"),
    ]
    command += ["--threads", str(8 * processes), "--processes", str(processes)]
    command += [] if torch.cuda.is_available() else ["--cpu-fallback", "1"]  # a trial run on the CPU
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)),
        PYTHONPATH=os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")])),
    )
    with open(f"{out}.log", "w") as log:
        return subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def run(
    work: Path, model_dir: Path, settings: dict, processes: int, warmup: int, gpus: list[int], label: str, code=REPO
) -> dict:
    out = work / label
    cache = work / ("vision" if settings["vision_cache"] else "pixels")
    started = time.time()
    status = train_job(code, model_dir, work, cache, settings, out, gpus[:processes])
    if status != 0:
        return {"error": f"exit {status}; see {out}.log"}
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()][warmup:]
    seconds = sum(row["samples"] / row["samples_per_s"] for row in rows)
    tokens = sum(row["tokens_per_s"] * row["samples"] / row["samples_per_s"] for row in rows)
    spreads = [
        max(row["rank_tokens"]) / (sum(row["rank_tokens"]) / len(row["rank_tokens"]))
        for row in rows
        if "rank_tokens" in row
    ]
    return {
        "samples_per_s": sum(row["samples"] for row in rows) / seconds,
        "tokens_per_s": tokens / seconds,
        "steps_measured": len(rows),
        "samples_per_step": sum(row["samples"] for row in rows) / len(rows),
        "busiest_over_mean_tokens": sum(spreads) / len(spreads) if spreads else None,
        "peak_gib_main_process": json.loads((out / "summary.json").read_text())["peak_memory_gb"],
        "job_wall_s": time.time() - started,
        "gpus": gpus,
        "final_loss": rows[-1]["loss"],
    }


def run_all(planned: list[tuple], total_gpus: int, side_by_side: bool, deadline: float, **common) -> dict:
    """Each (label, settings, processes, code) run; side by side, those that fit the GPUs at once
    (a wave of equal GPU counts). A run not started by the deadline is reported as skipped."""
    from concurrent.futures import ThreadPoolExecutor

    results, waves = {}, []
    for item in planned:
        wave = waves[-1] if waves else None
        fits = wave and side_by_side and wave[0][2] == item[2] and sum(i[2] for i in wave) + item[2] <= total_gpus
        (wave.append(item) if fits else waves.append([item]))
    for wave in waves:
        if time.time() > deadline:
            results.update({label: {"skipped": "out of time"} for label, *_ in wave})
            continue
        with ThreadPoolExecutor(len(wave)) as pool:
            futures, first = {}, 0
            for label, settings, processes, code in wave:
                gpus = list(range(first, first + processes))
                first += processes
                futures[label] = pool.submit(
                    run, settings=settings, processes=processes, gpus=gpus, label=label, code=code, **common
                )
            results.update({label: future.result() for label, future in futures.items()})
    return results


def evaluate(work: Path, model_dir: Path, settings: dict, processes: int, adapter: Path) -> dict:
    out = work / f"eval-gpus-{processes}"
    command = [sys.executable, str(REPO / "scripts/evaluate.py"), "--model", str(model_dir)]
    command += ["--adapter", str(adapter), "--prepared", str(work / "prepared.jsonl")]
    command += ["--cache", str(work / "pixels"), "--settings", json.dumps(settings)]
    command += ["--predictions", str(out / "predictions.jsonl"), "--metrics", str(out / "metrics.json")]
    command += ["--threads", str(8 * processes), "--processes", str(processes)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, range(processes))))
    with open(work / f"eval-gpus-{processes}.log", "w") as log:
        done = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}; see {work}/eval-gpus-{processes}.log"}
    metrics = json.loads((out / "metrics.json").read_text())
    return {"samples_per_s": metrics["samples_per_s"], "job_wall_s": metrics["wall_time_s"], "loss": metrics["loss"]}


def same_predictions(work: Path, processes: int) -> float:
    """The share of samples answered at N GPUs exactly as at 1."""
    one, many = (
        [
            json.loads(line)["prediction"]
            for line in (work / f"eval-gpus-{n}/predictions.jsonl").read_text().splitlines()
        ]
        for n in (1, processes)
    )
    return sum(a == b for a, b in zip(one, many)) / len(one)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, help="a config in benchmarks/configs/, e.g. qwen3-vl-8b")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="GPU counts to run, 1 first")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlft-scaling"))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--questions-per-image", type=int, default=1, help="records on each image (Kvasir: about 9)")
    parser.add_argument("--image-groups", choices=["off", "on", "both"], default="off")
    parser.add_argument("--side-by-side", action="store_true", help="runs that fit the GPUs together run at once")
    parser.add_argument("--before", type=Path, help="a checkout whose code also runs the largest grouped case")
    parser.add_argument("--deadline", type=float, default=1e9, help="seconds after which no further run starts")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--max-batch-tokens", type=int, default=12288)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="of the evaluation's answers")
    parser.add_argument("--skip-evaluation", action="store_true")
    parser.add_argument(
        "--pixels", action="store_true", help="train from the pixel cache, the vision tower run every step"
    )
    parser.add_argument("--commit", help="the commit the code is at, where the checkout has no git history")
    return parser.parse_args()


def training_runs(args, work: Path, model_dir: Path, began: float) -> tuple[dict, list]:
    """The stage trained on each number of GPUs, with and without image groups (and with --before,
    the earlier code on the most GPUs), each with its efficiency against one GPU."""
    settings = our_settings(args.steps) | {"vision_cache": not args.pixels, "max_batch_tokens": args.max_batch_tokens}
    groupings = {"off": [False], "on": [True], "both": [False, True]}[args.image_groups]
    planned = [
        (f"groups-{'on' if grouped else 'off'}-gpus-{n}", settings | {"image_groups": grouped}, n, REPO)
        for n in args.processes
        for grouped in groupings
    ]
    if args.before:
        largest = max(args.processes)
        planned.append((f"groups-on-gpus-{largest}-before", settings | {"image_groups": True}, largest, args.before))
    common = dict(work=work, model_dir=model_dir, warmup=args.warmup)
    runs = run_all(planned, torch.cuda.device_count() or 1, args.side_by_side, began + args.deadline, **common)
    for label, result in runs.items():
        base = runs.get(label.split("-gpus-")[0] + "-gpus-1", {}).get("samples_per_s")
        if base and "samples_per_s" in result:
            result["efficiency"] = result["samples_per_s"] / (len(result["gpus"]) * base)

    return runs, planned


def evaluation_runs(args, work: Path, model_dir: Path, adapter: Path) -> dict:
    """The first run's adapter evaluated on each number of GPUs, against one GPU's answers."""
    evaluations = {}
    if not args.skip_evaluation:
        eval_settings = {"answer_format": "cot", "max_new_tokens": args.max_new_tokens, "batch_size": 32}
        evaluations = {
            n: evaluate(work, model_dir, eval_settings | {"max_seq_len": 8192}, n, adapter) for n in args.processes
        }
        base = evaluations.get(1, {}).get("samples_per_s")
        for n, result in evaluations.items():
            if base and "samples_per_s" in result:
                result["efficiency"] = result["samples_per_s"] / (n * base)
            if "error" not in result and "error" not in evaluations.get(1, {"error": 1}):
                result["same_predictions_as_1_gpu"] = same_predictions(work, n)

    return evaluations


def report_of(args, runs: dict, evaluations: dict, prepare_s: float) -> tuple[dict, str]:
    commit = commit_of(args.commit)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    report = {
        "arch": args.arch,
        "device": f"{torch.cuda.device_count()}x {device}",
        "date": datetime.date.today().isoformat(),
        "commit": commit or "unknown",
        "command": " ".join(sys.argv),
        "images": args.images,
        "questions_per_image": args.questions_per_image,
        "samples_per_step": SAMPLES_PER_STEP,
        "max_batch_tokens": args.max_batch_tokens,
        "vision_cache": not args.pixels,
        "side_by_side": args.side_by_side,
        "prepare_s": prepare_s,
        "runs": runs,
        "evaluation": {"max_new_tokens": args.max_new_tokens, **{str(n): r for n, r in evaluations.items()}},
    }
    return report, device


def print_tables(args, report: dict, runs: dict, evaluations: dict) -> None:
    print(
        f"\n{args.arch} on {report['device']}, {args.questions_per_image} questions an image, budget {args.max_batch_tokens}"
    )
    print(
        f"{'run':<26} {'samples/step':>12} {'samples/s':>10} {'tokens/s':>10} {'efficiency':>10}"
        f" {'busiest/mean':>12} {'peak GiB':>9} {'job s':>7}"
    )
    for label, r in runs.items():
        if "samples_per_s" not in r:
            print(f"{label:<26} {r}")
            continue
        spread = r["busiest_over_mean_tokens"]
        print(
            f"{label:<26} {r['samples_per_step']:>12.1f} {r['samples_per_s']:>10.2f} {r['tokens_per_s']:>10.0f}"
            f" {r.get('efficiency', float('nan')):>10.3f} {spread if spread else float('nan'):>12.3f}"
            f" {r['peak_gib_main_process']:>9.1f} {r['job_wall_s']:>7.0f}"
        )
    if evaluations:
        print(f"evaluation, {args.images} images, {args.max_new_tokens} new tokens at most, whole jobs")
        print(f"{'GPUs':>5} {'samples/s':>10} {'efficiency':>10} {'job s':>7} {'same answers':>12}")
        for n, r in evaluations.items():
            if "error" in r:
                print(f"{n:>5} {r['error']}")
                continue
            print(
                f"{n:>5} {r['samples_per_s']:>10.2f} {r.get('efficiency', float('nan')):>10.3f} {r['job_wall_s']:>7.0f}"
                f" {r.get('same_predictions_as_1_gpu', float('nan')):>12.1%}"
            )


def main():
    args = parse_args()
    began = time.time()
    work = args.work / args.arch
    work.mkdir(parents=True, exist_ok=True)
    model_dir = prepare(work, args.arch, args.images, args.questions_per_image)
    prepare_s = time.time() - began
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    runs, planned = training_runs(args, work, model_dir, began)
    evaluations = evaluation_runs(args, work, model_dir, work / f"{planned[0][0]}/adapter")
    report, device = report_of(args, runs, evaluations, prepare_s)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"gpu_scaling-{args.arch}-{device.replace(' ', '_')}-{datetime.datetime.now():%Y-%m-%d-%H%M}.json"
    (args.out / name).write_text(json.dumps(report, indent=2))
    print_tables(args, report, runs, evaluations)


if __name__ == "__main__":
    main()

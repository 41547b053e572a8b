"""The workflow itself, through Snakemake, on a GPU machine: a Kvasir-like study in miniature.

Builds 512 train and 128 validation JPEGs of 720x576 to 1920x1080 with chain-of-thought answers
of 20 to 400 tokens (train_speed.py's workload), a random-weight Qwen3-VL checkpoint saved as a
local directory, and a config of two experiments (the second's stage 2 starts from its stage 1)
with the fast path on (vision cache, compiled layers, token budget). Then runs
`snakemake all --cores N --resources gpu=G` on it (prepare, cache_images, cache_vision, train,
evaluate, report) and prints each rule's wall time from the jobs' own logs (first line: when it
started; last write: when it ended), and the report's job table.

    python benchmarks/workflow_gpu.py --arch qwen3-vl-2b --out benchmarks/results

`--study kvasir` runs config/examples/kvasir-vqa-qwen3-vl-8b.yaml itself (its five experiments and
eight stages, every setting as written) on data of Kvasir's shape, scaled down: Kvasir-VQA's 9 short
questions an image with their `category`, Kvasir-VQA-x1's 25 composed questions an image with their
`difficulty` 1-3, `--kvasir-images` images for training in each (and a sixth of that for validation);
the evaluations answer in at most --max-new-tokens. With several GPUs it also samples each GPU's
utilization once a second (nvidia-smi) for the busy fraction.

    python benchmarks/workflow_gpu.py --study kvasir --arch qwen3-vl-8b --gpus 4 --cores 64 --kvasir-images 48
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

from train_speed import MAX_PIXELS, MIN_PIXELS, build_model, image_processor_for, make_workload
from vlft.demo.tiny_model import make_tokenizer

STARTED = re.compile(r"; started (\S+ \S+)")
WORKFLOW_PARTS = ("Snakefile", "workflow", "config", "scripts", "profiles", "vlft", "pyproject.toml")


def copy_workflow(workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    for part in WORKFLOW_PARTS:
        subprocess.run(["cp", "-r", str(REPO / part), str(workdir)], check=True)


def save_checkpoint(model_dir: Path, arch: str, tokenizer) -> Path:
    """A random-weight model of `arch` saved as a local checkpoint directory, as a downloaded one is."""
    import torch

    model = build_model(arch, tokenizer, "cuda" if torch.cuda.is_available() else "cpu")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    image_processor_for(model).save_pretrained(model_dir)
    return model_dir


def make_study(work: Path, arch: str, n_train: int, n_val: int, max_new_tokens: int, eval_every: int = 0) -> Path:
    tokenizer = make_tokenizer()
    raw = make_workload(work / "data", n_train + n_val, tokenizer)
    rows = raw.read_text().splitlines()
    (work / "data/train.jsonl").write_text("\n".join(rows[:n_train]) + "\n")
    (work / "data/val.jsonl").write_text("\n".join(rows[n_train:]) + "\n")

    model_dir = save_checkpoint(work / "model", arch, tokenizer)

    config = {
        "results": "results",
        "model": {"path": str(model_dir)},
        "datasets": {
            "study": {
                "image_root": str(work / "data/images"),
                "splits": {"train": str(work / "data/train.jsonl"), "val": str(work / "data/val.jsonl")},
            }
        },
        "evaluation": {"max_new_tokens": max_new_tokens, "batch_size": 32, "resources": {"gpus": 1}},
        "defaults": {
            "dataset": "study",
            "train_splits": ["train"],
            "eval_splits": ["val"],
            "answer_format": "cot",
            "micro_batch": 4,
            "grad_accum": 4,
            "min_pixels": MIN_PIXELS,
            "max_pixels": MAX_PIXELS,
            "max_seq_len": 2048,
            "vision_cache": True,
            "compile": True,
            "max_batch_tokens": 16384,
            "resources": {"gpus": 1},
        },
        "experiments": {
            "exp1": {"stages": [{"name": "main"}]},
            "exp4": {
                "stages": [
                    {"name": "stage1", "epochs": 1},
                    {"name": "stage2", "init_from": "stage1", "learning_rate": 5.0e-5},
                ]
            },
        },
    }
    if eval_every:  # exp4 stage 2 evaluates as it trains and keeps its best adapter
        watched = {"eval_every": eval_every, "eval_samples": 64, "keep": "best"}
        config["experiments"]["exp4"]["stages"][1] |= watched
    path = work / "study.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


KVASIR_CATEGORIES = ["yes/no", "single choice", "multiple choice", "color", "location", "count"]


def make_kvasir_study(work: Path, arch: str, images: int, max_new_tokens: int, save_model: bool = True) -> Path:
    """The Kvasir example's config on data of its two datasets' shapes, `images` training images each."""
    tokenizer = make_tokenizer()
    val_images = max(1, images // 6)
    datasets = {}
    for name, per_image in (("kvasir", 9), ("kvasir-x1", 25)):
        raw = make_workload(work / name, (images + val_images) * per_image, tokenizer, 0, per_image, short_answers=True)
        rows = [json.loads(line) for line in raw.read_text().splitlines()]
        for i, row in enumerate(rows):
            question = i % per_image
            row |= {"category": KVASIR_CATEGORIES[question % 6]} if name == "kvasir" else {}
            row |= {"difficulty": question % 3 + 1, "question_class": ["abnormality"]} if name == "kvasir-x1" else {}
        cut = images * per_image
        splits = {"train": rows[:cut], "val": rows[cut:], "test": rows[cut:]}
        for split, part in splits.items():
            (work / name / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        datasets[name] = {
            "image_root": str(work / name / "images"),
            "splits": {split: str(work / name / f"{split}.jsonl") for split in splits},
        }
    model_dir = save_checkpoint(work / "model", arch, tokenizer) if save_model else work / "model"

    config = yaml.safe_load((REPO / "config/examples/kvasir-vqa-qwen3-vl-8b.yaml").read_text())
    config |= {"results": "results", "model": {"path": str(model_dir)}, "datasets": datasets}
    config["evaluation"]["max_new_tokens"] = max_new_tokens
    # Predicted for the GPU this machine has (the example names the H100 its researcher gets).
    config["planning"] = {"device": None}
    path = work / "study.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


SMOKE_HUB_ID = "Qwen/Qwen3-VL-8B-Instruct"


def make_kvasir_smoke(work: Path, workdir: Path, arch: str, images: int, max_new_tokens: int) -> tuple[Path, dict]:
    """config/examples/kvasir-vqa-smoke.yaml as written, in the workflow's directory: the two
    datasets' imports at data/kvasir and data/kvasir-x1 (Kvasir's shapes, `images` training images
    each), sampled by the README's commands; the model a random-weight `arch` laid out in a Hugging
    Face cache (HF_HOME) under the Hub id the config names, offline, so that its fetch_model job
    takes it as on a machine that fetched it. The evaluations answer in at most `max_new_tokens`
    (random weights never end an answer early). Returns the config and the environment to run with."""
    config = yaml.safe_load(make_kvasir_study(work, arch, images, 256, save_model=False).read_text())
    for name in ("kvasir", "kvasir-x1"):
        (workdir / "data" / name).mkdir(parents=True, exist_ok=True)
        for split, records in config["datasets"][name]["splits"].items():
            (workdir / "data" / name / f"{split}.jsonl").write_text(Path(records).read_text())
        (workdir / "data" / name / "images").symlink_to(config["datasets"][name]["image_root"])
    readme = (REPO / "README.md").read_text()
    samples = [line for line in readme.splitlines() if line.startswith("python scripts/import_dataset.py sample")]
    assert len(samples) == 2, samples
    for command in samples:
        subprocess.run(command, shell=True, cwd=workdir, check=True)
    home = work / "hf-home"
    snapshot = home / f"hub/models--{SMOKE_HUB_ID.replace('/', '--')}/snapshots/{'0' * 40}"
    save_checkpoint(snapshot, arch, make_tokenizer())
    (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
    (snapshot.parents[1] / "refs/main").write_text("0" * 40)
    config = yaml.safe_load((REPO / "config/examples/kvasir-vqa-smoke.yaml").read_text())
    config["evaluation"]["max_new_tokens"] = max_new_tokens
    path = work / "kvasir-vqa-smoke.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}


def gpu_busy(samples: Path) -> dict:
    """Each GPU's share of the sampled seconds with a job's memory on it, and its mean utilization."""
    per_gpu: dict[str, list[tuple[float, float]]] = {}
    for line in samples.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[1].isdigit():
            per_gpu.setdefault(parts[0], []).append((float(parts[1]), float(parts[2])))
    return {
        gpu: {
            "seconds": len(rows),
            "with_a_job": sum(memory > 2000 for _, memory in rows) / len(rows),
            "mean_utilization": sum(util for util, _ in rows) / len(rows) / 100,
        }
        for gpu, rows in per_gpu.items()
    }


def rule_times(results: Path) -> list[dict]:
    """Each job's rule, target and wall time, from its log: started (first line) to last write."""
    rows = []
    for log in sorted((results / "logs").rglob("*.log")):
        if log.name.endswith(".attempts.log"):
            continue
        match = STARTED.search(log.read_text(errors="replace")[:2000])
        if not match:
            continue
        started = datetime.fromisoformat(match.group(1)).timestamp()
        rel = log.relative_to(results / "logs")
        rows.append(
            {"rule": Path(rel.parts[0]).stem, "job": str(rel.with_suffix("")), "wall_s": log.stat().st_mtime - started}
        )
    return rows


TOOK = re.compile(r"^took (\d+) s, predicted (\d+) s", re.M)
# The dry run's one-time lines and its whole study's wall time (vlft.study_costs.StudyCosts.lines).
ONCE_A_GPU = re.compile(r"once a GPU, before its first (train|evaluate) job: ([\d.]+ (?:s|min|h))")
ONCE_A_SHAPE = re.compile(r"once an evaluation shape .*: (\d+) x ([\d.]+ (?:s|min|h))")
PREDICTED_WALL = re.compile(r"wall time ([\d.]+ (?:s|min|h)) at")


def seconds_of(duration: str) -> float:
    """A duration as the dry run writes it ("50 s", "6.5 min", "1.20 h") in seconds."""
    value, unit = duration.split()
    return float(value) * {"s": 1, "min": 60, "h": 3600}[unit]


def one_time_costs(dry_run: str) -> tuple[dict[str, float], float]:
    """What the dry run predicts once a GPU, before its first job of each kind (train, evaluate), and
    once an evaluation shape."""
    per_kind = {m.group(1): seconds_of(m.group(2)) for m in ONCE_A_GPU.finditer(dry_run)}
    shape = ONCE_A_SHAPE.search(dry_run)
    return per_kind, (seconds_of(shape.group(2)) if shape else 0.0)


def predicted_against_measured(results: Path, dry_run: str = "", gpus: int = 1) -> dict:
    """Each training and evaluation job's predicted time (the plan's, made before any of the study's
    jobs ran: its `predicted_s` resource) against what it took, from the last line of its log, and
    its fixed cost: what it took less its own work (the time its summary or metrics give). Each GPU's
    first job of each kind pays what the dry run predicts once a GPU for that kind (the compile, the
    model's first read), and the first evaluation of each split its decode step's compile for that shape: those jobs are
    predicted with the dry run's one-time lines added (`predicted_whole_s`), and counted with the
    rest. `refined` predicts each later job again with the median measured/predicted ratio of the
    others of its kind (leave one out), as a dry run does once jobs of the study have run."""
    jobs = []
    for log in sorted((results / "logs").rglob("*.log")):
        rel = log.relative_to(results / "logs")
        if log.name.endswith(".attempts.log") or rel.parts[0] not in ("train", "evaluate"):
            continue
        text = log.read_text(errors="replace")
        took, started = TOOK.search(text), STARTED.search(text[:2000])
        if took and started and int(took.group(2)):
            measured, predicted = int(took.group(1)), int(took.group(2))
            jobs.append(
                {
                    "job": str(rel.with_suffix("")),
                    "kind": rel.parts[0],
                    "started": started.group(1),
                    "predicted_s": predicted,
                    "measured_s": measured,
                    "ratio": round(measured / predicted, 3),
                    "fixed_s": fixed_cost(results, str(rel.with_suffix("")), measured),
                }
            )
    jobs.sort(key=lambda job: job["started"])
    once_a_gpu, once_a_shape = one_time_costs(dry_run)
    for job in jobs:
        job["shape"] = evaluation_shape(results, job["job"]) if job["kind"] == "evaluate" else "train"
    # Each GPU's first job of each kind, and each evaluation shape's first job.
    kind_firsts = {j["job"] for kind in ("train", "evaluate") for j in [j for j in jobs if j["kind"] == kind][:gpus]}
    shape_firsts = {next(j["job"] for j in jobs if j["shape"] == s) for s in {j["shape"] for j in jobs} - {"train"}}
    gpu_firsts = {j["job"] for j in jobs[:gpus]}
    for job in jobs:
        once = once_a_gpu.get(job["kind"], 0.0) * (job["job"] in kind_firsts)
        once += once_a_shape * (job["job"] in shape_firsts)
        job["predicted_whole_s"] = round(job["predicted_s"] + once)
        job["ratio_whole"] = round(job["measured_s"] / job["predicted_whole_s"], 3)
        job["first_of_its_kind"] = job["job"] in kind_firsts | shape_firsts
    rest = [j for j in jobs if not j["first_of_its_kind"]]
    for job in rest:
        others = [o["ratio"] for o in rest if o["kind"] == job["kind"] and o is not job]
        job["refined_s"] = round(job["predicted_s"] * statistics.median(others)) if others else None

    def error(key, among):
        errors = [abs(j[key] - j["measured_s"]) / j["measured_s"] for j in among if j.get(key)]
        return round(statistics.median(errors), 3) if errors else None

    later_fixed = [j["fixed_s"] for j in jobs if j["job"] not in gpu_firsts and j["fixed_s"] is not None]
    return {
        "jobs": jobs,
        "one_time_s": {"once_a_gpu": once_a_gpu, "once_an_evaluation_shape": once_a_shape},
        "median_error": error("predicted_whole_s", jobs),
        "worst_ratio": max((max(j["ratio_whole"], 1 / j["ratio_whole"]) for j in jobs), default=None),
        "median_error_after_firsts": error("predicted_s", rest),
        "median_error_refined": error("refined_s", rest),
        "largest_fixed_s_after_the_gpus_first_job": max(later_fixed, default=None),
    }


def fixed_cost(results: Path, job: str, measured_s: int) -> float | None:
    """What a job took beyond its own work: its launch, imports, model load and exit, from its
    measured time less the wall time its summary (training) or metrics (evaluation) give."""
    kind, *name = job.split("/")
    own = (
        results
        / ("train" if kind == "train" else "eval")
        / Path(*name)
        / ("summary.json" if kind == "train" else "metrics.json")
    )
    try:
        return round(measured_s - json.loads(own.read_text())["wall_time_s"], 1)
    except (OSError, ValueError, KeyError):
        return None


def evaluation_shape(results: Path, job: str) -> str:
    """An evaluation job's decode-step shape, as the dry run keys it: the dataset and split (all this
    study's evaluations share their pixel range)."""
    _, experiment, stage, split = job.split("/")
    metrics = json.loads((results / "eval" / experiment / stage / split / "metrics.json").read_text())
    return f"{metrics['dataset']}/{split}"


SNAKEMAKE_TIME = re.compile(r"^\[(\w{3} \w{3} +\d+ [\d:]+ \d{4})\]$")
SNAKEMAKE_JOB = re.compile(r"^\s*jobid: (\d+)$")
SNAKEMAKE_RULE = re.compile(r"^(?:local)?rule (\w+):$")
SNAKEMAKE_DONE = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)$")


def snakemake_timeline(log: Path) -> list[dict]:
    """Each job's rule, start and end in seconds from Snakemake's first timestamp (its log has
    whole seconds): where the run's time went between and around the jobs."""
    stamp, rule, first, jobs = None, None, None, {}
    for line in log.read_text(errors="replace").splitlines():
        if match := SNAKEMAKE_TIME.match(line):
            stamp = datetime.strptime(match.group(1), "%a %b %d %H:%M:%S %Y").timestamp()
            first = stamp if first is None else first
        elif match := SNAKEMAKE_RULE.match(line):
            rule = match.group(1)
        elif (match := SNAKEMAKE_JOB.match(line)) and rule:
            jobs[match.group(1)] = {"rule": rule, "start_s": stamp - first, "end_s": None}
            rule = None
        elif (match := SNAKEMAKE_DONE.match(line)) and match.group(1) in jobs:
            jobs[match.group(1)]["end_s"] = stamp - first
    return sorted(jobs.values(), key=lambda job: job["start_s"])


def promises(result: dict, forecast: dict, returncode, args) -> dict[str, bool]:
    """What the README promises of a study run on the GPU, each True where this run holds to it:
    the run finished, its jobs ran warm, each GPU job's fixed cost after the GPU's first is small, and
    the dry run's predictions (made before any job ran) came true."""
    wall = result["predicted_wall_s"]
    fixed = forecast["largest_fixed_s_after_the_gpus_first_job"]
    return {
        "snakemake exited 0": returncode == 0,
        f"at least {args.min_warm_share:.0%} of the jobs run warm": result["warm_share"] >= args.min_warm_share,
        f"each GPU job's fixed cost at most {args.max_fixed_s:.0f} s after the GPU's first": fixed is not None
        and fixed <= args.max_fixed_s,
        f"median prediction error at most {args.max_median_error:.0%}": forecast["median_error"] is not None
        and forecast["median_error"] <= args.max_median_error,
        f"no prediction off by more than {args.max_ratio}x": forecast["worst_ratio"] is not None
        and forecast["worst_ratio"] <= args.max_ratio,
        f"the study's wall time within {args.max_median_error:.0%} of the prediction": wall is not None
        and abs(wall - result["snakemake_s"]) <= args.max_median_error * result["snakemake_s"],
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3-vl-2b", help="a config in benchmarks/configs/")
    parser.add_argument("--study", choices=["two-experiments", "kvasir", "kvasir-smoke"], default="two-experiments")
    parser.add_argument("--kvasir-images", type=int, default=48, help="training images in each dataset")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlft-workflow"))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results")
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--val", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="random weights never stop early")
    parser.add_argument("--cores", type=int, default=16)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=420, help="seconds for the Snakemake run")
    parser.add_argument(
        "--eval-every", type=int, default=0, help="exp4 stage 2 evaluates every this many steps (64 records)"
    )
    parser.add_argument(
        "--warm-start", choices=["on", "off"], default="on", help="jobs run by a warm process (vlft.jobs.warm_start)"
    )
    # What the README promises; the script exits 1 where this run breaks any of them.
    parser.add_argument("--min-warm-share", type=float, default=0.9, help="of the jobs run by a warm process")
    parser.add_argument("--max-fixed-s", type=float, default=15.0, help="a GPU job's cost beyond its own work")
    parser.add_argument("--max-median-error", type=float, default=0.15, help="of the predictions, and of the wall time")
    parser.add_argument(
        "--max-ratio", type=float, default=1.5, help="the worst prediction's took/predicted, either way"
    )
    parser.add_argument(
        "--build-only", action="store_true", help="build the study's data, model and workflow copy, then stop"
    )
    parser.add_argument("--resume", action="store_true", help="carry on with the study an earlier run left in --work")
    return parser.parse_args()


def build_study(args, work: Path, workdir: Path) -> tuple[Path, dict]:
    """The study's config (its data and model made) and the copy of the workflow it runs in, or, with
    --resume, those a stopped run left; the environment its jobs need beside."""
    extra_env = {}
    if args.resume:
        # The study a run stopped by its time limit left, carried on where it stopped: the machine
        # must have kept --work (a warm one keeps ignored paths of the repository between calls).
        config = work / ("kvasir-vqa-smoke.yaml" if args.study == "kvasir-smoke" else "study.yaml")
        home = work / "hf-home"
        extra_env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"} if home.is_dir() else {}
    elif args.study == "kvasir":
        config = make_kvasir_study(work, args.arch, args.kvasir_images, args.max_new_tokens)
    elif args.study == "kvasir-smoke":
        copy_workflow(workdir)
        config, extra_env = make_kvasir_smoke(work, workdir, args.arch, args.kvasir_images, args.max_new_tokens)
    else:
        config = make_study(work, args.arch, args.train, args.val, args.max_new_tokens, args.eval_every)
    if not args.resume and args.study != "kvasir-smoke":
        copy_workflow(workdir)
    return config, extra_env


def predicted_plan_of(args, work: Path, workdir: Path, command: list[str], env: dict) -> str:
    """The plan's own dry run first: what it predicts each job and the whole study will take (made by
    the --build-only call where the study was built by one)."""
    dry_run_file = work / "dry-run.txt"
    if args.resume and dry_run_file.exists():
        return dry_run_file.read_text()
    dry_run = subprocess.run(
        command + ["-n"], cwd=workdir, env=env | {"VLFT_WARM_START": "0"}, capture_output=True, text=True
    )
    predicted_plan = (
        dry_run.stderr[dry_run.stderr.find("Predicted time of the jobs") :]
        if "Predicted time" in dry_run.stderr
        else dry_run.stderr[-3000:]
    )
    dry_run_file.write_text(predicted_plan)
    return predicted_plan


def run_study(args, work: Path, workdir: Path, command: list[str], env: dict):
    """Snakemake over the study, GPUs sampled where several: its log, exit, seconds and GPU samples."""
    started = time.time()
    snakemake_log = args.out / f"workflow_gpu-{args.study}-{args.arch}.log"
    busy_samples = work / "gpu-samples.csv"
    query = ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-l", "1"]
    sampler = (
        subprocess.Popen(query, stdout=busy_samples.open("w"), stderr=subprocess.DEVNULL) if args.gpus > 1 else None
    )
    with open(snakemake_log, "w") as log:
        try:
            status = subprocess.run(
                command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout
            )
            returncode = status.returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
    run_s = time.time() - started
    if sampler:
        sampler.terminate()

    return snakemake_log, returncode, run_s, busy_samples if sampler else None


def stage_and_evaluation_results(results: Path) -> tuple[dict, dict]:
    """Each trained stage's summary and each evaluation's metrics, as the study wrote them."""
    summaries = {}
    for path in sorted((results / "train").rglob("summary.json")):
        summary = json.loads(path.read_text())
        summaries[str(path.parent.relative_to(results / "train"))] = {
            k: summary.get(k)
            for k in (
                "steps",
                "samples",
                "wall_time_s",
                "samples_per_s",
                "peak_memory_gb",
                "eval_s",
                "eval_share",
                "kept",
            )
        }
        if "evaluations_during_training" in summary:  # (step, accuracy, loss, seconds) of each
            summaries[str(path.parent.relative_to(results / "train"))]["during"] = [
                (r["step"], round(r["accuracy"], 4), round(r["loss"], 4), round(r["seconds"], 1))
                for r in summary["evaluations_during_training"]
            ]
    evaluations = {}
    for path in sorted((results / "eval").rglob("metrics.json")):
        metrics = json.loads(path.read_text())
        evaluations[str(path.parent.relative_to(results / "eval"))] = {
            k: metrics.get(k) for k in ("n", "wall_time_s", "samples_per_s")
        }
    return summaries, evaluations


def keep_logs(args, results: Path) -> None:
    # The jobs' own logs and per-step training logs beside it, for where each job's time went.
    logs = args.out / f"workflow_gpu-{args.study}-{args.arch}-logs"
    subprocess.run(["cp", "-r", str(results / "logs"), str(logs)], check=False)
    for path in (results / "train").rglob("log.jsonl"):
        target = logs / "train-steps" / path.parent.relative_to(results / "train")
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", str(path), str(target)], check=False)


def print_summary(
    result: dict, by_rule: dict, summaries: dict, evaluations: dict, build_s: float, run_s: float, args
) -> None:
    returncode, warm_jobs, timeline = (
        result["snakemake_exit"],
        result["jobs_run_by_a_warm_process"],
        result["snakemake_timeline"],
    )
    predicted_plan = result["dry_run_before"]
    print(f"data and model built in {build_s:.0f} s; snakemake: exit {returncode} after {run_s:.0f} s")
    print(f"warm start {args.warm_start}: {warm_jobs} jobs run by a warm process")
    print(
        "timeline (Snakemake's log, whole seconds): "
        + ", ".join(
            f"{job['rule']} {job['start_s']:.0f}-{job['end_s'] if job['end_s'] is None else round(job['end_s'])}"
            for job in timeline
        )
    )
    print(f"{'rule':<14} {'jobs':>4} {'wall s (each)':<40}")
    for rule, walls in sorted(by_rule.items()):
        print(f"{rule:<14} {len(walls):>4} {', '.join(f'{w:.0f}' for w in walls)}")
    for name, summary in summaries.items():
        print(f"train {name}: {summary}")
    for name, metrics in evaluations.items():
        print(f"evaluate {name}: {metrics}")
    print(predicted_plan)
    forecast = result["predicted_against_measured"]
    print(
        f"forecast: median error {forecast['median_error']} (first jobs with the one-time lines), worst "
        f"{forecast['worst_ratio']}x; whole study predicted {result['predicted_wall_s']} s, Snakemake took {run_s:.0f} s; "
        f"largest fixed cost after the GPU's first job {forecast['largest_fixed_s_after_the_gpus_first_job']} s"
    )
    for job in forecast["jobs"]:
        first = " (first of its kind or shape: the one-time costs)" if job["first_of_its_kind"] else ""
        print(
            f"{job['job']}: predicted {job['predicted_s']} s, took {job['measured_s']} s, refined {job.get('refined_s')}{first}"
        )
    print(
        f"median error {forecast['median_error']}, refined {forecast['median_error_refined']}, worst ratio {forecast['worst_ratio']}"
    )
    if result["gpu_busy"]:
        print(f"GPU busy (share of seconds with a job; mean utilization): {result['gpu_busy']}")


def measured(args, results: Path, command, snakemake_log, busy_samples, build_s, run_s, returncode, predicted_plan):
    """What the run did: each job's time, the timeline, warm jobs, the stages' and evaluations'
    figures, the forecast against it, and which promises hold."""
    times = rule_times(results)
    timeline = snakemake_timeline(snakemake_log)
    warm_jobs = sum(
        "run by a warm process" in log.read_text(errors="replace")[:4000]
        for log in (results / "logs").rglob("*.log")
        if not log.name.endswith(".attempts.log")  # a training job's log again, across its attempts
    )
    by_rule: dict[str, list[float]] = {}
    for row in times:
        by_rule.setdefault(row["rule"], []).append(row["wall_s"])
    summaries, evaluations = stage_and_evaluation_results(results)
    jobs_csv = results / "report/jobs.csv"
    result = {
        "arch": args.arch,
        "study": args.study,
        "scale": (
            {"kvasir_images": args.kvasir_images} if args.study == "kvasir" else {"train": args.train, "val": args.val}
        ),
        "command": " ".join(command[1:]),
        "gpu_busy": gpu_busy(busy_samples) if busy_samples else None,
        "build_data_and_model_s": round(build_s, 1),
        "snakemake_s": round(run_s, 1),
        "snakemake_exit": returncode,
        "warm_start": args.warm_start,
        "jobs_run_by_a_warm_process": warm_jobs,
        "jobs": times,
        "snakemake_timeline": timeline,
        "train": summaries,
        "evaluate": evaluations,
        "report_jobs": list(csv.DictReader(jobs_csv.open())) if jobs_csv.exists() else None,
        "dry_run_before": predicted_plan,
        "predicted_against_measured": predicted_against_measured(results, predicted_plan, args.gpus),
    }
    forecast = result["predicted_against_measured"]
    predicted_wall = PREDICTED_WALL.search(predicted_plan)
    result["predicted_wall_s"] = seconds_of(predicted_wall.group(1)) if predicted_wall else None
    all_jobs = sum(1 for log in (results / "logs").rglob("*.log") if not log.name.endswith(".attempts.log"))
    result["warm_share"] = round(warm_jobs / all_jobs, 3) if all_jobs else 0.0
    result["promises"] = promises(result, forecast, returncode, args)
    return result, by_rule, summaries, evaluations


def main():
    args = parse_args()
    work = args.work / args.arch
    workdir = work / "workflow"
    started = time.time()
    config, extra_env = build_study(args, work, workdir)
    build_s = time.time() - started
    results = workdir / ("results/kvasir-smoke" if args.study == "kvasir-smoke" else "results")
    command = [sys.executable, "-m", "snakemake", "all", "--configfile", str(config)]
    command += ["--cores", str(args.cores), "--resources", f"gpu={args.gpus}"]
    command += ["--rerun-incomplete"] if args.resume else []
    # The jobs' scripts import vlft from this copy, whether or not the project is installed here.
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(workdir), os.environ.get("PYTHONPATH")]))}
    env["VLFT_WARM_START"] = "1" if args.warm_start == "on" else "0"
    env |= extra_env
    predicted_plan = predicted_plan_of(args, work, workdir, command, env)
    if args.build_only:
        print(predicted_plan)
        print(f"data, model and the workflow's copy built in {build_s:.0f} s under {work}: run again with --resume")
        return
    snakemake_log, returncode, run_s, busy_samples = run_study(args, work, workdir, command, env)
    result, by_rule, summaries, evaluations = measured(
        args, results, command, snakemake_log, busy_samples, build_s, run_s, returncode, predicted_plan
    )
    (args.out / f"workflow_gpu-{args.study}-{args.arch}.json").write_text(json.dumps(result, indent=1))
    keep_logs(args, results)
    print_summary(result, by_rule, summaries, evaluations, build_s, run_s, args)
    broken = [name for name, held in result["promises"].items() if not held]
    if broken:
        print(f"promises that no longer hold: {', '.join(broken)}")
        sys.exit(1)


if __name__ == "__main__":
    main()

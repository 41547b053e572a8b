"""What planning costs at a million records: a study whose train split holds 1,000,000 records on 8
image files, its dry runs timed (wall clock and peak memory) before and after its splits are
prepared, and prepare_split's peak memory at 100,000 and 1,000,000 records.

    python benchmarks/plan_cost.py --work /tmp/plan-cost --out benchmarks/results/plan-cost

CPU only. Snakemake's SLURM executor plugin asks `scontrol show config` when it is imported; where
SLURM is installed but its controller is down that call waits 9 s, so the dry runs are timed with
`scontrol` shadowed by a failing one (`--keep-scontrol` times them as they come).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
PARTS = ("Snakefile", "workflow", "config", "profiles", "scripts", "vlft")


def make_split(path: Path, records: int, images: int) -> None:
    with open(path, "w") as out:
        for i in range(records):
            color = ("red", "green", "blue")[i % 3]
            row = {"id": i, "image": f"img{i % images}.png", "question": "What color is the shape?"}
            out.write(json.dumps(row | {"answer": color, "category": color}) + "\n")


def make_study(work: Path, records: int) -> None:
    for part in PARTS:
        source = REPO / part
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, work / part)
    subprocess.run([sys.executable, "scripts/make_tiny_model.py", "--output", "models/tiny"], cwd=work, check=True)
    data = work / "data"
    (data / "images").mkdir(parents=True)
    for i in range(8):
        Image.new("RGB", (96, 96), (i * 30, 100, 200)).save(data / "images" / f"img{i}.png")
    make_split(data / "train.jsonl", records, 8)
    make_split(data / "test.jsonl", 200, 8)
    config = {
        "model": {"path": "models/tiny"},
        "datasets": {
            "vqa": {"image_root": "data/images", "splits": {"train": "data/train.jsonl", "test": "data/test.jsonl"}}
        },
        "defaults": {"dataset": "vqa", "train_splits": ["train"], "eval_splits": ["test"]},
        "experiments": {"exp1": {"stages": [{"name": "main"}, {"name": "two", "filter": {"category": "red"}}]}},
    }
    (work / "config/study.yaml").write_text(yaml.safe_dump(config))


def timed(command: list[str], cwd: Path, env: dict) -> dict:
    """Wall seconds and peak resident memory (MB) of one command, from GNU time."""
    began = time.perf_counter()
    result = subprocess.run(["/usr/bin/time", "-f", "%M", *command], cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
    return {"wall_s": round(wall, 2), "peak_mb": round(int(result.stderr.strip().splitlines()[-1]) / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--keep-scontrol", action="store_true")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    make_study(args.work, args.records)
    env = dict(os.environ)
    if not args.keep_scontrol:
        shadow = args.work / "shadow"
        shadow.mkdir()
        (shadow / "scontrol").symlink_to(shutil.which("false"))
        env["PATH"] = f"{shadow}:{env['PATH']}"
    dry_run = [sys.executable, "-m", "snakemake", "--configfile", "config/study.yaml", "--dry-run", "--quiet", "all"]
    prepare = [sys.executable, "-m", "snakemake", "--configfile", "config/study.yaml", "--cores", "4"]
    prepared = ["results/prepared/vqa/train.jsonl", "results/prepared/vqa/test.jsonl"]
    figures = {"records": args.records, "image_files": 8, "cpus": os.cpu_count()}
    figures["dry_run_first"] = timed(dry_run, args.work, env)  # reads the split once, hashes it
    print(figures, flush=True)
    figures["dry_run_again_unprepared"] = timed(dry_run, args.work, env)
    figures["prepare_both_splits"] = timed([*prepare, *prepared], args.work, env)
    figures["dry_run_prepared"] = timed(dry_run, args.work, env)
    # A SLURM job starts as Snakemake planning its one job again: the same plan, then its job.
    figures["job_start_plan"] = timed([*prepare, "--dry-run", prepared[0]], args.work, env)
    small = args.work / "data/train-100k.jsonl"
    make_split(small, args.records // 10, 8)
    for name, split in (("prepare_split_tenth", small), ("prepare_split_all", args.work / "data/train.jsonl")):
        command = [sys.executable, "scripts/prepare_split.py", "--records", str(split), "--image-root", "data/images"]
        figures[name] = timed([*command, "--output", str(args.work / f"{name}.jsonl")], args.work, env)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_cost.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()

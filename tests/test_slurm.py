"""profiles/slurm against a real SLURM cluster (scripts/slurm_cluster.sh): the demo through sbatch, and a
training job killed at its time limit that resumes on retry and ends where an uninterrupted run ends."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import DEMO_THREADS, copy_workflow, site_profile, snakemake

pytestmark = pytest.mark.slow

# Per-job logs: each job's own log (its first line says where it ran) and SLURM's output of the job.
PLACEMENT = re.compile(r"host \S+, SLURM job (\d+), CUDA_VISIBLE_DEVICES=(\S+)")


def slurm_run(workdir, profile, *targets, timeout=1800):
    return snakemake(workdir, "--profile", "profiles/slurm", "--profile", str(profile), *targets, timeout=timeout)


def read_job_output(path):
    """A job's output as text. slurmstepd writes its own lines into the same file, and when it stops a
    job it can land inside a character the job was writing (a progress bar's block), so bytes that are
    not UTF-8 are replaced rather than failing the read."""
    return path.read_text(errors="replace")


def placement(log_file):
    match = PLACEMENT.search(read_job_output(log_file))
    assert match, f"{log_file} does not say where it ran"
    return match.group(1), match.group(2)


def sacct_states(job_ids):
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(line.split("|", 1) for line in out.split())


@pytest.fixture(scope="module")
def slurm_demo(slurm_cluster, tmp_path_factory):
    workdir = copy_workflow(tmp_path_factory.mktemp("slurm-demo"))
    profile = site_profile(tmp_path_factory.mktemp("site"))
    slurm_run(workdir, profile, "all")
    return workdir


def test_demo_through_sbatch_gives_the_local_runs_results(slurm_demo, demo_workdir):
    local = sorted(p.relative_to(demo_workdir) for p in (demo_workdir / "results/eval").rglob("metrics.json"))
    through_slurm = sorted(p.relative_to(slurm_demo) for p in (slurm_demo / "results/eval").rglob("metrics.json"))
    assert through_slurm == local and len(local) == 2 * 9  # val and test of the base model and 8 stages
    # The same jobs on the same machine with the same threads (site_profile): the same float
    # operations in the same order, so the same results to the last bit.
    for path in local:
        ours, theirs = (
            result_fields(json.loads((workdir / path).read_text())) for workdir in (slurm_demo, demo_workdir)
        )
        assert ours == theirs, path
    assert (slurm_demo / "results/report/index.html").exists()


def result_fields(metrics: dict) -> dict:
    """What a job computed, without how fast it ran; per-category accuracies flattened."""
    fields = {k: v for k, v in metrics.items() if k not in ("samples_per_s", "wall_time_s", "accuracy_by_category")}
    fields.update({f"accuracy/{c}": v for c, v in metrics.get("accuracy_by_category", {}).items()})
    return fields


def test_gpu_jobs_get_a_gpu_from_slurm_and_cpu_jobs_none(slurm_demo):
    logs = slurm_demo / "results/logs"
    gpu_jobs = list(logs.glob("train/*/*.log")) + list(logs.glob("evaluate/*/*/*.log"))
    cpu_jobs = (
        list(logs.glob("prepare_split/*/*.log")) + list(logs.glob("cache_images/*/*/*.log")) + [logs / "report.log"]
    )
    assert len(gpu_jobs) == 8 + 2 * 9 and len(cpu_jobs) == 3 + 3 + 1
    placements = {log: placement(log) for log in gpu_jobs + cpu_jobs}
    for log in gpu_jobs:
        assert placements[log][1] in {"0", "1"}, f"{log}: a GPU job saw CUDA_VISIBLE_DEVICES={placements[log][1]}"
    for log in cpu_jobs:
        assert placements[log][1] == "none", f"{log}: a CPU job saw CUDA_VISIBLE_DEVICES={placements[log][1]}"
    # Every job really went through SLURM and ended there as completed.
    job_ids = [job for job, _ in placements.values()]
    assert set(sacct_states(job_ids).values()) == {"COMPLETED"}


def test_slurm_output_of_each_job_lands_under_snakemake_slurm_logs(slurm_demo):
    for rule in ("make_demo_dataset", "prepare_split", "cache_images", "train", "evaluate", "report"):
        outputs = list((slurm_demo / ".snakemake/slurm_logs" / f"rule_{rule}").rglob("*.log"))
        assert outputs, f"no SLURM output of rule {rule}"
    # The job's own output is in it too, with the SLURM job it ran as.
    train_output = next((slurm_demo / ".snakemake/slurm_logs/rule_train/exp4_stage2").glob("*.log"))
    job, gpus = placement(train_output)
    assert train_output.stem == job and gpus in {"0", "1"}


# A training stage with more work than its first attempt's one-minute time limit allows.
LONG_STAGE = {
    "long": {
        "stages": [
            {
                "name": "main",
                "epochs": 25,
                "lora_dropout": 0.1,
                "checkpoint_every": 1000,
                "resources": {"runtime": 1, "mem_mb": 4000, "gpus": 1},
            }
        ]
    }
}


def test_a_job_killed_at_its_time_limit_resumes_on_retry_and_matches_an_uninterrupted_run(slurm_cluster, tmp_path):
    workdir = copy_workflow(tmp_path / "work")
    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    config["experiments"] = LONG_STAGE
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(config))
    # No early SIGUSR1 here: what stops the first attempt is SLURM's own SIGTERM at the time limit.
    # The stage needs about 3.5 minutes of a 2-core machine; attempts get 1, 2, 3 (and 4) minutes,
    # so one more retry than the profile's keeps a slower machine from running out of attempts.
    profile = site_profile(tmp_path / "site", retries=3, **{"set-resources": {"train": {"slurm_extra": ""}}})
    adapter = "results/train/long/main/adapter"

    slurm_run(workdir, profile, adapter)

    job_outputs = sorted(
        (workdir / ".snakemake/slurm_logs/rule_train/long_main").glob("*.log"), key=lambda p: int(p.stem)
    )
    states = sacct_states([p.stem for p in job_outputs])
    assert len(job_outputs) >= 2 and states[job_outputs[0].stem] == "TIMEOUT", states
    assert states[job_outputs[-1].stem] == "COMPLETED", states
    first = read_job_output(job_outputs[0])
    assert "SIGTERM received: saved a checkpoint after step" in first, first[-3000:]
    stopped_at = int(re.search(r"saved a checkpoint after step (\d+)", first).group(1))
    second = read_job_output(job_outputs[1])
    assert f"resuming from step {stopped_at}" in second
    summary = json.loads((workdir / "results/train/long/main/summary.json").read_text())
    log = [json.loads(line) for line in (workdir / "results/train/long/main/log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == list(range(1, summary["steps"] + 1))

    interrupted = load_file(workdir / adapter / "adapter_model.safetensors")
    shutil.copytree(workdir / adapter, tmp_path / "interrupted")
    # The same stage again, uninterrupted, on this machine with the same threads.
    snakemake(workdir, "--cores", str(DEMO_THREADS), "--forcerun", adapter, adapter)
    uninterrupted = load_file(workdir / adapter / "adapter_model.safetensors")
    assert "resuming" not in (workdir / "results/logs/train/long/main.log").read_text().split("train.py: host")[-1]
    # A resumed run restores every tensor and random state of the step it stopped after, then
    # repeats the uninterrupted run's operations on the same values: equal to the last bit.
    assert interrupted.keys() == uninterrupted.keys()
    for name in interrupted:
        assert torch.equal(interrupted[name], uninterrupted[name]), name

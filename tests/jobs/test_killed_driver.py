"""Snakemake itself killed mid-run (kill -9): the next run redoes what was unfinished, nothing that was
complete, and never takes a half-written output for a complete one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests.helpers import copy_demo_upstream, snakemake

pytestmark = pytest.mark.slow

INCOMPLETE = re.compile(r"Incomplete output files|Forced execution")


def running_jobs(session_id: int) -> list[str]:
    """Command lines of the job scripts running in the driver's process session."""
    jobs = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) != session_id:
                continue
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
        args = [a.decode() for a in cmdline if a]
        # A job's process: its script's own (python scripts/...), or the launcher's that hands it to
        # a warm process and waits for it (python -m vlft.jobs.launch [--gpus N] scripts/...).
        launched = args[1:3] == ["-m", "vlft.jobs.launch"] and any(a.startswith("scripts/") for a in args)
        if len(args) > 1 and (args[1].startswith("scripts/") or launched):
            jobs.append(" ".join(args))
    return jobs


def planned_jobs_with_reasons(workdir) -> dict[str, str]:
    """Each job a dry run plans: its first output and why Snakemake plans it."""
    text = snakemake(workdir, "--cores", "2", "--dry-run").stdout
    jobs = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", text):
        output = re.search(r"^\s+output: (.+)$", block, re.MULTILINE)
        reason = re.search(r"^\s+reason: (.+)$", block, re.MULTILINE)
        if output and reason:
            jobs[output.group(1).split(",")[0].strip()] = reason.group(1)
    return jobs


def smaller_demo(workdir):
    """The demo's shapes experiments exp1 to exp3 (five stages, three of them a curriculum), evaluated
    on val, each stage one epoch. What a killed driver leaves behind depends on which jobs were
    complete or running, not on how many there were or how long they ran."""
    path = workdir / "config/config.yaml"
    config = yaml.safe_load(path.read_text())
    config["experiments"] = {name: config["experiments"][name] for name in ("exp1", "exp2", "exp3")}
    config["defaults"]["epochs"] = 1
    for stage in config["experiments"]["exp3"]["stages"]:
        stage.pop("epochs", None)
    del config["datasets"]["screens"], config["demo"]["datasets"]["screens"]
    config["defaults"]["eval_splits"] = ["val"]
    path.write_text(yaml.safe_dump(config))


def test_a_killed_driver_leaves_nothing_half_done_behind(demo_workdir, tmp_path):
    # The demo's data, model and caches as its run left them: the jobs to run are stages,
    # evaluations and the report, 13 of them.
    workdir = copy_demo_upstream(demo_workdir, tmp_path / "work")
    smaller_demo(workdir)
    driver = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", "2"],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # Wait until some training stages are complete and others are running.
    deadline = time.time() + 600
    while time.time() < deadline:
        done = list((workdir / "results/train").glob("*/*/summary.json"))
        running = [job for job in running_jobs(driver.pid) if "scripts/train.py" in job]
        if len(done) >= 2 and running:
            break
        assert driver.poll() is None, "the run ended before it could be killed"
        time.sleep(0.5)
    else:
        pytest.fail("no training stage ran within 10 minutes")

    # Freeze the driver and its jobs, note what ran, then kill -9 them all: the driver first, the
    # jobs with it, as when the machine or session running them goes down.
    os.killpg(driver.pid, signal.SIGSTOP)
    interrupted = running_jobs(driver.pid)
    existing = {p.relative_to(workdir).as_posix() for p in (workdir / "results").rglob("*")}
    os.kill(driver.pid, signal.SIGKILL)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()

    # The README's recovery: unlock the directory, run again.
    snakemake(workdir, "--unlock")
    planned = planned_jobs_with_reasons(workdir)
    interrupted_outputs = {
        output for output in planned if any(f" {output}" in job or f"={output}" in job for job in interrupted)
    }
    # What was running is redone, every job of it, even where its outputs exist on disk ...
    assert interrupted and len(interrupted_outputs) == len(interrupted), (interrupted, planned)
    # ... and nothing that was complete is: a planned job's output is either missing or one Snakemake
    # marked incomplete (rerun-incomplete reports those as forced).
    for output, reason in planned.items():
        if output in existing:
            assert INCOMPLETE.search(reason), f"{output} was complete but is planned again: {reason}"

    snakemake(workdir, "--cores", "2")
    assert (workdir / "results/report/index.html").exists()
    assert planned_jobs_with_reasons(workdir) == {}


def test_ctrl_c_to_the_driver_alone_stops_its_training_job_at_a_checkpoint_and_the_rerun_resumes_there(
    demo_workdir, tmp_path
):
    """`kill -INT` on Snakemake, not on its jobs: the training job saved nothing and ran on to its
    end, its outputs were then taken for incomplete and the rerun trained the stage from step 0."""
    workdir = copy_demo_upstream(demo_workdir, tmp_path / "work")
    path = workdir / "config/config.yaml"
    config = yaml.safe_load(path.read_text())
    steps = 300  # long enough to be running when signalled, some 40 s on one core
    config["experiments"] = {"exp1": config["experiments"]["exp1"]}
    config["experiments"]["exp1"]["stages"][0]["max_steps"] = steps
    path.write_text(yaml.safe_dump(config))
    adapter = "results/train/exp1/main/adapter"
    driver = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", "2", adapter],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # no terminal's Ctrl-C reaches the jobs: the driver alone is signalled
    )
    deadline = time.time() + 300
    while not any(
        len(log.read_text().splitlines()) >= 5 for log in workdir.glob("results/checkpoints/exp1/main/*/log.jsonl")
    ):
        assert driver.poll() is None and time.time() < deadline, "the stage ended or stalled before step 5"
        time.sleep(0.1)
    os.kill(driver.pid, signal.SIGINT)
    output, _ = driver.communicate(timeout=120)
    assert driver.returncode != 0 and "Ctrl-C: stopping" in output, output
    assert running_jobs(driver.pid) == []  # none left behind, running on to its end
    job_log = (workdir / "results/logs/train/exp1/main.log").read_text()
    [step] = map(int, re.findall(rf"SIGINT received after step (\d+) of {steps}: saving a checkpoint", job_log))
    assert 5 <= step < steps, job_log
    assert [p.name for p in workdir.glob("results/checkpoints/exp1/main/*/step-*")][-1] == f"step-{step:08d}"
    assert not (workdir / adapter).exists()

    snakemake(workdir, "--cores", "2", adapter)
    assert f"resuming from step {step}" in (workdir / "results/logs/train/exp1/main.log").read_text()
    summary = json.loads((workdir / "results/train/exp1/main/summary.json").read_text())
    assert summary["resumed_from_step"] == step and summary["steps"] == steps
    assert adapter not in planned_jobs_with_reasons(workdir)

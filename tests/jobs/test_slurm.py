"""profiles/slurm against a real SLURM cluster (scripts/slurm_cluster.sh): the demo through sbatch; a
training job that stops before its time limit, resumes on retry and ends where an uninterrupted run
ends; a cancelled job the driver retries; a driver killed while its job runs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers import snakemake, wait_for
from tests.slurm_runs import (
    BACKGROUND_SLURM_RUNS,
    CANCELLED_JOB_RUN,
    CHANGED_STAGE_RUN,
    LONG_ADAPTER,
    RESUMED_STAGE_RUN,
    SLURM_DEMO_EXPERIMENTS,
    long_stage_workflow,
    site_profile,
    TWO_GPU_STAGE_RUN,
    TWO_GPU_TARGETS,
    TWO_NODE_STAGE_RUN,
    start_cancelled_job,
    start_resumed_stage,
    start_two_gpu_stage,
    start_two_node_stage,
    training_steps_done,
)

from vlft.files import read_jsonl

pytestmark = pytest.mark.slow

# Per-job logs: each job's own log (its first line says where it ran) and SLURM's output of the job.
PLACEMENT = re.compile(r"host \S+, SLURM job (\d+), CUDA_VISIBLE_DEVICES=([^;\s]+)")


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
    return dict(line.split("|", 1) for line in out.splitlines() if line)


@pytest.fixture(scope="module")
def slurm_demo(slurm_demo_run):
    """The demo through sbatch, as the run started when the session began (conftest) finished it."""
    status = slurm_demo_run.driver.wait(timeout=3600)
    assert status == 0, f"the demo through SLURM failed:\n{slurm_demo_run.output.read_text()[-5000:]}"
    return slurm_demo_run.workdir


@pytest.fixture
def cluster_to_itself(slurm_cluster, request):
    """A cluster that runs no other test's jobs: tests that read its whole queue first wait for the
    runs this session started in the background (conftest), where it started them."""
    for key in BACKGROUND_SLURM_RUNS:
        run = request.session.stash.get(key, None)
        if getattr(run, "thread", None) is not None:  # a run whose driver a thread starts and waits for
            run.thread.join(timeout=3600)
        elif run is not None:
            run.driver.wait(timeout=3600)


@pytest.fixture
def two_gpu_stage(slurm_cluster, demo_workdir, request, tmp_path):
    """exp1 on 2 GPUs through SLURM, started in the background as soon as the demo existed
    (conftest's demo_workdir), or now where it was not."""
    return request.session.stash.get(TWO_GPU_STAGE_RUN, None) or start_two_gpu_stage(demo_workdir, tmp_path)


@pytest.fixture
def changed_stage(slurm_demo_run, request):
    """exp4 stage 1 changed on a copy of the demo through SLURM and `all` rerun, started with the
    SLURM demo (conftest's slurm_demo_run) where this session runs the test."""
    run = request.session.stash.get(CHANGED_STAGE_RUN, None)
    assert run is not None, "started by slurm_demo_run when the session selects this test"
    return run


@pytest.fixture
def cancelled_job(slurm_cluster, demo_workdir, request, tmp_path):
    """The long stage through SLURM, its job cancelled once it trains, started in the background as
    soon as the demo existed (conftest's demo_workdir), or now where it was not."""
    return request.session.stash.get(CANCELLED_JOB_RUN, None) or start_cancelled_job(demo_workdir, tmp_path)


@pytest.fixture
def resumed_stage(slurm_cluster, demo_workdir, request, tmp_path):
    """The long stage through SLURM and its uninterrupted copy, started in the background as soon as
    the demo existed (conftest's demo_workdir), or now where they were not."""
    run = request.session.stash.get(RESUMED_STAGE_RUN, None)
    return run or start_resumed_stage(demo_workdir, tmp_path)


@pytest.fixture
def two_node_stage(slurm_cluster, demo_workdir, request, tmp_path):
    """The long stage across two nodes through SLURM and its one-process copy, started in the
    background as soon as the demo existed (conftest's demo_workdir), or now where they were not."""
    run = request.session.stash.get(TWO_NODE_STAGE_RUN, None)
    return run or start_two_node_stage(demo_workdir, tmp_path)


def test_demo_through_sbatch_gives_the_local_runs_results(slurm_demo, demo_workdir):
    local = sorted(
        p.relative_to(demo_workdir)
        for p in (demo_workdir / "results/eval").rglob("metrics.json")
        if p.relative_to(demo_workdir / "results/eval").parts[0] in ("base", *SLURM_DEMO_EXPERIMENTS)
    )
    through_slurm = sorted(p.relative_to(slurm_demo) for p in (slurm_demo / "results/eval").rglob("metrics.json"))
    # Val and test of the base model and 4 stages on the shapes (exp1, exp4's two, exp7); test of
    # the base model and click_grpo's 2 stages on the screens.
    assert through_slurm == local and len(local) == 2 * (4 + 1) + 3
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
    # A stage's attempts log (every attempt's output, appended) is no job of its own.
    trains = [log for log in logs.glob("train/*/*.log") if not log.name.endswith(".attempts.log")]
    gpu_jobs = trains + list(logs.glob("evaluate/*/*/*.log"))
    cpu_jobs = (
        list(logs.glob("prepare_split/*/*.log")) + list(logs.glob("cache_images/*/*/*.log")) + [logs / "report.log"]
    )
    # 6 stages; the evaluations of 4 of them and of the base model on val and test of the shapes,
    # of the 2 click stages and the base model on test of the screens. Shapes have 3 splits, screens 2.
    assert len(gpu_jobs) == 6 + 2 * (4 + 1) + 3 and len(cpu_jobs) == 5 + 5 + 1
    placements = {log: placement(log) for log in gpu_jobs + cpu_jobs}
    for log in gpu_jobs:
        assert placements[log][1] in {"0", "1"}, f"{log}: a GPU job saw CUDA_VISIBLE_DEVICES={placements[log][1]}"
    for log in cpu_jobs:
        assert placements[log][1] == "none", f"{log}: a CPU job saw CUDA_VISIBLE_DEVICES={placements[log][1]}"
    # Every job really went through SLURM and ended there as completed.
    job_ids = [job for job, _ in placements.values()]
    assert set(sacct_states(job_ids).values()) == {"COMPLETED"}


def test_slurm_output_of_each_job_lands_under_snakemake_slurm_logs(slurm_demo):
    for rule in (
        "make_demo_shapes",
        "make_demo_screens",
        "prepare_split",
        "cache_images",
        "train",
        "evaluate",
        "report",
    ):
        outputs = list((slurm_demo / ".snakemake/slurm_logs" / f"rule_{rule}").rglob("*.log"))
        assert outputs, f"no SLURM output of rule {rule}"
    # The job's own output is in it too, with the SLURM job it ran as.
    train_output = next((slurm_demo / ".snakemake/slurm_logs/rule_train/exp4_stage2").glob("*.log"))
    job, gpus = placement(train_output)
    assert train_output.stem == job and gpus in {"0", "1"}


def job_outputs_of_long_stage(workdir):
    """SLURM's output of each job of the long stage, oldest first."""
    return sorted((workdir / ".snakemake/slurm_logs/rule_train/long_main").glob("*.log"), key=lambda p: int(p.stem))


def test_a_job_stops_before_its_time_limit_resumes_on_retry_and_matches_an_uninterrupted_run(resumed_stage):
    workdir, reference = resumed_stage.workdir, resumed_stage.reference
    try:
        status = resumed_stage.driver.wait(timeout=1800)
        assert status == 0, f"the stage through SLURM failed:\n{resumed_stage.output.read_text()[-5000:]}"
    finally:
        assert resumed_stage.uninterrupted.wait(timeout=900) == 0, resumed_stage.reference_output.read_text()[-3000:]

    job_outputs = job_outputs_of_long_stage(workdir)
    states = sacct_states([p.stem for p in job_outputs])
    assert len(job_outputs) >= 2 and states[job_outputs[-1].stem] == "COMPLETED", states
    resumed_from = 0
    for output in job_outputs[:-1]:
        # Each earlier attempt stopped by itself before its limit, with a checkpoint: FAILED (the
        # trainer's exit status 75 failed the job's step), not TIMEOUT, which would mean it straddled it.
        assert states[output.stem] == "FAILED", (states, output)
        text = read_job_output(output)
        assert f"resuming from step {resumed_from}" in text or resumed_from == 0
        plain = re.search(
            r"the job's time limit is (\d+) s away: stopped after step (\d+) of (\d+) with a checkpoint saved; "
            r"the retry \(or a rerun\) resumes from step (\d+)",
            text,
        )
        assert plain and int(plain.group(1)) > 0 and plain.group(2) == plain.group(4), text[-3000:]
        resumed_from = int(plain.group(2))
    assert f"resuming from step {resumed_from}" in read_job_output(job_outputs[-1])
    summary = json.loads((workdir / "results/train/long/main/summary.json").read_text())
    log = [json.loads(line) for line in (workdir / "results/train/long/main/log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == list(range(1, summary["steps"] + 1))
    # Every attempt's own log is kept, in order.
    attempts = (workdir / "results/logs/train/long/main.attempts.log").read_text()
    assert re.findall(r"^attempt (\d+)", attempts, re.MULTILINE) == [str(n + 1) for n in range(len(job_outputs))]

    assert "resuming" not in (reference / "results/logs/train/long/main.log").read_text()
    interrupted, uninterrupted = (
        load_file(root / LONG_ADAPTER / "adapter_model.safetensors") for root in (workdir, reference)
    )
    # A resumed run restores every tensor and random state of the step it stopped after, then
    # repeats the uninterrupted run's operations on the same values: equal to the last bit.
    assert interrupted.keys() == uninterrupted.keys()
    for name in interrupted:
        assert torch.equal(interrupted[name], uninterrupted[name]), name


def test_a_stage_across_two_nodes_stopped_by_its_time_limit_and_a_signal_ends_with_one_process_adapter(
    two_node_stage,
):
    """resources.nodes: 2 through profiles/slurm: one SLURM job on node1 and node2 (two hosts of
    their own, scripts/slurm_cluster.sh), one process on each, started by srun and torchrun. Its
    first attempt stops before its one-minute limit; a later one is stopped by SIGTERM sent to
    node2's processes alone, and both processes stop after the same step with one checkpoint; each
    retry resumes where the last stopped, and the adapter is the one process's, bit for bit."""
    run = two_node_stage
    run.thread.join(timeout=3600)
    try:
        status = run.driver.wait(timeout=3600)
        assert run.problem is None, f"{run.problem}\n{run.output.read_text()[-3000:]}"
        assert status == 0, f"the stage across two nodes failed:\n{run.output.read_text()[-5000:]}"
    finally:
        assert run.uninterrupted.wait(timeout=900) == 0, run.reference_output.read_text()[-3000:]

    job_outputs = job_outputs_of_long_stage(run.workdir)
    texts = [read_job_output(output) for output in job_outputs]
    states = sacct_states([p.stem for p in job_outputs])
    nodes = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", "JobID,NodeList", "-j", ",".join(p.stem for p in job_outputs)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert nodes == [f"{p.stem}|node[1-2]" for p in job_outputs], nodes
    assert states[job_outputs[-1].stem] == "COMPLETED", states
    assert "2 data-parallel processes on 2 nodes" in texts[-1], texts[-1][-3000:]
    causes, resumed_from = [], 0
    for output, text in zip(job_outputs[:-1], texts[:-1]):
        if resumed_from:
            assert f"resuming from step {resumed_from}" in text, text[-3000:]
        stop = re.search(r"(the job's time limit is \d+ s away|SIGTERM received): stopped after step (\d+) of", text)
        if stop is None:  # SLURM ended it at its limit during the start-up on both nodes, before a step
            assert states[output.stem] == "TIMEOUT" and "saving a checkpoint" not in text, (states, text[-3000:])
            continue
        causes.append("time limit" if stop.group(1).startswith("the job's") else "SIGTERM")
        resumed_from = int(stop.group(2))
        # Said once, by the process that saves, however many processes received the signal.
        assert len(re.findall(r"saving a checkpoint", text)) == 1, text[-3000:]
    assert f"resuming from step {resumed_from}" in texts[-1]
    assert causes[0] == "time limit" and "SIGTERM" in causes, causes
    assert resumed_from >= run.signalled

    summary = json.loads((run.workdir / "results/train/long/main/summary.json").read_text())
    assert summary["processes"] == 2 and summary["resumed_from_step"] == resumed_from
    assert [row["step"] for row in read_jsonl(run.workdir / "results/train/long/main/log.jsonl")] == list(
        range(1, summary["steps"] + 1)
    )
    across, alone = (
        load_file(root / LONG_ADAPTER / "adapter_model.safetensors") for root in (run.workdir, run.reference)
    )
    assert across.keys() == alone.keys()
    for name in across:
        assert torch.equal(across[name], alone[name]), name


def queued_jobs():
    """SLURM job ids in the queue (pending or running)."""
    return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout.split()


def start_driver(workdir, profile, *targets):
    return subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--profile", "profiles/slurm", "--profile", str(profile), *targets],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def test_a_cancelled_job_is_retried_from_its_checkpoint_within_the_status_check_bound(cancelled_job):
    """The long stage's job cancelled after 50 steps (tests/slurm_runs.py's start_cancelled_job): the driver
    resubmits it within its status checks' bound, and the new job resumes from the checkpoint the
    cancelled one saved."""
    run = cancelled_job
    run.canceller.join(timeout=1200)
    assert run.problem is None, f"{run.problem}\n{run.output.read_text()[-3000:]}"
    assert run.driver.wait(timeout=900) == 0, run.output.read_text()[-3000:]
    outputs = job_outputs_of_long_stage(run.workdir)
    assert [p.stem for p in outputs][0] == run.cancelled and len(outputs) == 2
    assert sacct_states([run.cancelled])[run.cancelled].startswith("CANCELLED")
    first = read_job_output(outputs[0])
    stopped = re.search(r"SIGTERM received: stopped after step (\d+) of \d+ with a checkpoint saved", first)
    assert stopped, first[-3000:]
    assert f"resuming from step {stopped.group(1)}" in read_job_output(outputs[1])
    print(f"the driver resubmitted the cancelled job {run.reaction_s:.0f} s after scancel")


def test_after_a_killed_driver_a_rerun_redoes_no_job_that_completed(cluster_to_itself, demo_workdir, tmp_path):
    workdir = long_stage_workflow(demo_workdir, tmp_path / "work", epochs=2, runtime=30)
    profile = site_profile(tmp_path / "site")
    driver = start_driver(workdir, profile, LONG_ADAPTER)
    wait_for(lambda: training_steps_done(workdir) >= 10, 300, "the job to train")
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    # The orphaned job goes on and completes on the cluster.
    wait_for(lambda: not queued_jobs(), 600, "the orphaned job to end")
    (job,) = [p.stem for p in job_outputs_of_long_stage(workdir)]
    # The accounting database hears of the job's end after the queue does: seen RUNNING there once
    # the queue was empty (CI, 2026-11-25).
    wait_for(lambda: sacct_states([job])[job] not in ("RUNNING", "COMPLETING"), 60, "the accounting to record its end")
    assert sacct_states([job])[job] == "COMPLETED"
    dry_run = slurm_run(workdir, profile, LONG_ADAPTER, "--dry-run")
    assert "Nothing to be done" in dry_run.stdout + dry_run.stderr, dry_run.stdout


def test_a_stage_given_two_gpus_trains_on_both_in_one_slurm_job(two_gpu_stage, demo_workdir):
    """exp1 given 2 of the cluster's GPUs: one SLURM job holding both, with two training processes
    (on this machine's CPU: the cluster's GPUs are fake) taking the 1-GPU stage's steps; its
    evaluation, given 2 GPUs too, shares the split out and answers every sample."""
    workdir = two_gpu_stage.workdir
    status = two_gpu_stage.driver.wait(timeout=1800)
    assert status == 0, f"the 2-GPU stage through SLURM failed:\n{two_gpu_stage.output.read_text()[-5000:]}"
    epochs = yaml.safe_load((demo_workdir / "config/config.yaml").read_text())["defaults"]["epochs"]
    metrics = TWO_GPU_TARGETS[1]

    # The newest SLURM output of each rule (a retry's, where there was one).
    train_output = max((workdir / ".snakemake/slurm_logs/rule_train/exp1_main").glob("*.log"), key=os.path.getmtime)
    job, gpus = placement(train_output)
    assert gpus == "0,1"
    assert "attempt 1, 2 data-parallel processes" in read_job_output(train_output)
    eval_output = max((workdir / ".snakemake/slurm_logs/rule_evaluate").rglob("*.log"), key=os.path.getmtime)
    eval_job, eval_gpus = placement(eval_output)
    assert eval_gpus == "0,1" and "the split shared out among 2 processes" in read_job_output(eval_output)
    assert set(sacct_states([job, eval_job]).values()) == {"COMPLETED"}

    one_gpu, two_gpus = (read_jsonl(root / "results/train/exp1/main/log.jsonl") for root in (demo_workdir, workdir))
    assert len(two_gpus) * epochs == len(one_gpu) and len(two_gpus) >= 50
    assert two_gpus[-1]["loss"] < two_gpus[0]["loss"] / 3
    answered = json.loads((workdir / metrics).read_text())
    assert answered["n"] == json.loads((demo_workdir / metrics).read_text())["n"]


def test_a_stage_changed_after_its_outputs_were_lost_reruns_through_slurm_with_what_starts_from_it(changed_stage):
    """The sequence of a failed retraining, on a copy of the demo through SLURM (tests/slurm_runs.py's
    start_changed_stage): exp4 stage 1 edited, its outputs deleted (as Snakemake deletes a failed
    job's), then `all` again: stage 1, stage 2 (trained from the old stage 1), their evaluations and
    the report are recomputed through SLURM, nothing else."""
    run = changed_stage
    run.thread.join(timeout=3600)
    assert run.problem is None, run.problem
    assert run.driver.returncode == 0, f"`all` after the change failed:\n{run.output.read_text()[-5000:]}"
    workdir = run.workdir
    redone = {p.relative_to(workdir / "results/eval").parent for p in run.before if p.stat().st_mtime != run.before[p]}
    assert {str(p) for p in redone} == {
        f"exp4/{stage}/{split}" for stage in ("stage1", "stage2") for split in ("val", "test")
    }
    for stage in ("stage1", "stage2"):
        trained = json.loads((workdir / f"results/train/exp4/{stage}/summary.json").read_text())
        assert trained["resumed_from_step"] == 0
        assert len(list((workdir / f".snakemake/slurm_logs/rule_train/exp4_{stage}").glob("*.log"))) == 2
    assert (workdir / "results/report/index.html").stat().st_mtime > run.report
    again = slurm_run(workdir, run.profile, "all", "--dry-run")
    assert "Nothing to be done" in again.stdout + again.stderr


def test_a_plan_says_what_the_partition_cannot_give_and_caps_threads_at_its_cpus(slurm_cluster, tmp_path):
    """The README's trial as written (no max-threads): jobs asking for more threads than the test
    cluster's node has CPUs get its CPUs, and a stage asking for more GPUs and evaluations asking for
    more memory than its node has are each named in one line, with the keys that set them, before
    anything is submitted (a dry run)."""
    from tests.helpers import REPO, copy_workflow

    partition = subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%c|%m|%G"], capture_output=True, text=True)
    cpus, mem_mb, _ = partition.stdout.split("\n")[0].split("|")
    workdir = copy_workflow(tmp_path / "study")
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["experiments"]["exp1"]["stages"][0]["resources"] = {"gpus": 4}
    config["evaluation"]["resources"] = {"mem_mb": int(mem_mb) + 1}
    config["evaluation"]["threads"] = int(cpus) + 4
    (workdir / "big.yaml").write_text(yaml.safe_dump(config))
    profile = site_profile(tmp_path / "site")
    settings = yaml.safe_load((profile / "config.yaml").read_text())
    del settings["max-threads"]
    (profile / "config.yaml").write_text(yaml.safe_dump(settings))

    # --cores: a dry run without it shows every job 1 thread (the driver's own cores bound them).
    run = slurm_run(
        workdir, profile, "all", "--configfile", "big.yaml", "--dry-run", "--printshellcmds", "--cores", "256"
    )
    said = [line for line in run.stderr.splitlines() if line.startswith("partition debug")]
    # Each once, in the order Snakemake plans the jobs.
    assert sorted(said) == sorted(
        [
            f"partition debug: its nodes have {cpus} CPUs, so jobs that ask for more threads (the rules' threads, "
            "resources.threads of a stage, "
            f"evaluation.threads) get {cpus}; a partition of larger nodes gives them more",
            "partition debug offers at most 2 GPUs a node, but train exp1/main asks for 4 (resources.gpus of the "
            "stage or of defaults): it would wait in the queue forever or be refused",
            f"partition debug offers at most {mem_mb} MB of memory a node, but evaluate asks for {int(mem_mb) + 1} MB "
            "(evaluation.resources.mem_mb): it would wait in the queue forever or be refused",
        ]
    )
    # What would be submitted: the jobs that asked for more threads (8, and evaluation.threads) get
    # the node's CPUs, as their shell lines say.
    threads = [int(n) for n in re.findall(r"vlft\.jobs\.launch .* --threads (\d+)", run.stdout + run.stderr)]
    assert threads and max(threads) == int(cpus)

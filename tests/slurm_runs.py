"""The SLURM runs a session starts in the background as soon as what they start from exists (they
mostly wait on the driver's status checks): the demo through profiles/slurm, and the scenarios of
tests/jobs/test_slurm.py, which checks what they did. Each run is kept in the session's stash under
its key."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.helpers import DEMO_THREADS, copy_demo_upstream, wait_for

# The wait policy of OpenMP threads this session was given, if any (tests/conftest.py's
# threads_share_cores_politely sets PASSIVE while SLURM runs work in the background).
OWN_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")


def start_slurm_driver(workdir: Path, profile: Path, targets: list[str], output: Path) -> subprocess.Popen:
    """Snakemake through profiles/slurm and a site's `profile` (site_profile) in `workdir`, in the
    background, its terminal's output into the file `output`. From now on, until it ends, what this
    session starts waits passively (threads_share_cores_politely), the local demo among them."""
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--profile", "profiles/slurm", "--profile", str(profile), *targets],
        cwd=workdir,
        stdout=output.open("w"),
        stderr=subprocess.STDOUT,
    )


def long_stage_workflow(demo_workdir, directory, epochs, runtime=1):
    """The demo workflow with one training stage of `epochs` (50 steps each) under a time limit of
    `runtime` minutes x attempt, its data, model and caches those the demo made: the stage's job is
    the only one to run."""
    workdir = copy_demo_upstream(demo_workdir, directory)
    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    stage = {
        "name": "main",
        "epochs": epochs,
        "lora_dropout": 0.1,
        "checkpoint_every": 1000,
        "resources": {"runtime": runtime, "mem_mb": 4000, "gpus": 1},
    }
    config["experiments"] = {"long": {"stages": [stage]}}
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(config))
    return workdir


LONG_ADAPTER = "results/train/long/main/adapter"


# Epochs of the stage that must outlast its first one-minute attempt. An attempt stops once 20 s
# for saving and two steps would no longer fit, so after its start-up (about 10 s) it trains for
# about 30 s; 25 epochs (1,250 steps) took 69 s on one thread of a 2-core machine, so the stage
# needs a second attempt even on a machine twice as fast. It runs beside other tests, which slow
# it: its five attempts (1 + 2 + ... + 5 minutes) cover one four times as slow.
RESUMED_STAGE_EPOCHS = 25


RESUMED_STAGE_TEST = "test_a_job_stops_before_its_time_limit_resumes_on_retry_and_matches_an_uninterrupted_run"


RESUMED_STAGE_RUN = pytest.StashKey[SimpleNamespace]()


def start_uninterrupted(reference: Path, output: Path) -> subprocess.Popen:
    """The long stage of the workflow in `reference` on this machine, in one thread, in the
    background: what a stage stopped and resumed through SLURM must end with."""
    return subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", "1", LONG_ADAPTER],
        cwd=reference,
        stdout=output.open("w"),
        stderr=subprocess.STDOUT,
    )


def start_resumed_stage(demo_workdir: Path, directory: Path) -> SimpleNamespace:
    """The long stage of RESUMED_STAGE_EPOCHS through SLURM under attempts of 1, 2, 3 (4 and 5) minutes
    (retries beyond the profile's keep a slower machine from running out of attempts), and
    the same stage uninterrupted, in a copy of the same workflow on this machine; both in the
    background, as soon as the demo exists (demo_workdir), since they mostly wait: the SLURM run
    for its time limits and the driver's status checks. One thread each (`--cores 1` here,
    `max-threads: 1` there), so that neither run's threads wait on the other's.
    tests/jobs/test_slurm.py checks what they did."""
    workdir = long_stage_workflow(demo_workdir, directory / "work", RESUMED_STAGE_EPOCHS)
    reference = shutil.copytree(workdir, directory / "reference")
    reference_output = directory / "reference.out"
    uninterrupted = start_uninterrupted(reference, reference_output)
    profile = site_profile(directory / "site", retries=4, **{"max-threads": 1})
    output = directory / "driver.out"
    driver = start_slurm_driver(workdir, profile, [LONG_ADAPTER], output)
    return SimpleNamespace(
        workdir=workdir,
        reference=reference,
        driver=driver,
        output=output,
        uninterrupted=uninterrupted,
        reference_output=reference_output,
    )


TWO_GPU_STAGE_RUN = pytest.StashKey[SimpleNamespace]()


TWO_GPU_STAGE_TEST = "test_a_stage_given_two_gpus_trains_on_both_in_one_slurm_job"


def start_two_gpu_stage(demo_workdir: Path, directory: Path) -> SimpleNamespace:
    """The demo's exp1 given 2 of the cluster's GPUs, and its evaluation on val given 2 too, through
    SLURM from the demo's data, in the background as soon as the demo exists (it mostly waits on the
    driver's status checks). One epoch of the stage's four: the two processes' steps are checked
    equal to one process's in float64 by tests/training/test_distributed.py; here, that SLURM gives one job
    both GPUs and they train. tests/jobs/test_slurm.py checks what it did."""
    workdir = copy_demo_upstream(demo_workdir, directory / "work")
    config_path = workdir / "config/config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["experiments"] = {"exp1": config["experiments"]["exp1"]}
    config["experiments"]["exp1"]["stages"][0] |= {"epochs": 1}
    config["experiments"]["exp1"]["stages"][0]["resources"] = {"runtime": 30, "mem_mb": 4000, "gpus": 2}
    config["evaluation"]["resources"]["gpus"] = 2
    config_path.write_text(yaml.safe_dump(config))
    output = directory / "driver.out"
    driver = start_slurm_driver(workdir, site_profile(directory), list(TWO_GPU_TARGETS), output)
    return SimpleNamespace(workdir=workdir, driver=driver, output=output)


TWO_GPU_TARGETS = ("results/train/exp1/main/adapter", "results/eval/exp1/main/val/metrics.json")


def jobs_of(workdir: Path) -> list[str]:
    """The SLURM job ids in the queue (pending or running) of the workflow in `workdir`."""
    queue = subprocess.run(["squeue", "-h", "-o", "%i|%Z"], capture_output=True, text=True, check=True).stdout
    return [job for job, directory in (line.split("|", 1) for line in queue.splitlines()) if directory == str(workdir)]


def training_steps_done(workdir: Path) -> int:
    logs = list((workdir / "results/checkpoints/long/main").glob("*/log.jsonl"))
    return len(logs[0].read_text().splitlines()) if logs else 0


# How long the driver may take to see a job's end: the plugin's status checks come at most 180 s
# apart (profiles/slurm/config.yaml), and a check takes well under a second here.
STATUS_CHECK_BOUND_S = 180 + 20


CANCELLED_JOB_RUN = pytest.StashKey[SimpleNamespace]()


CANCELLED_JOB_TEST = "test_a_cancelled_job_is_retried_from_its_checkpoint_within_the_status_check_bound"


def start_cancelled_job(demo_workdir: Path, directory: Path) -> SimpleNamespace:
    """The long stage of 8 epochs through SLURM, its job cancelled (scancel) once it has trained 50
    steps, by a thread that then waits for the driver to resubmit it; in the background as soon as
    the demo exists, since the run mostly waits on the driver's status checks. tests/jobs/test_slurm.py
    checks what it did (`cancelled`: the job's id, `reaction_s`: the seconds from scancel to the
    resubmission, `problem`: what stopped the thread)."""
    workdir = long_stage_workflow(demo_workdir, directory / "work", epochs=8, runtime=30)
    output = directory / "driver.out"
    driver = start_slurm_driver(workdir, site_profile(directory), [LONG_ADAPTER], output)
    run = SimpleNamespace(workdir=workdir, driver=driver, output=output, cancelled=None, reaction_s=None, problem=None)

    def cancel_once_training():
        try:
            wait_for(lambda: training_steps_done(workdir) >= 50, 900, "the job to train 50 steps")
            (run.cancelled,) = jobs_of(workdir)
            subprocess.run(["scancel", run.cancelled], check=True)
            cancelled_at = time.time()
            wait_for(lambda: set(jobs_of(workdir)) - {run.cancelled}, STATUS_CHECK_BOUND_S, "the driver to resubmit")
            run.reaction_s = time.time() - cancelled_at
        except Exception as error:  # the test reports it
            run.problem = error

    run.canceller = threading.Thread(target=cancel_once_training, daemon=True)
    run.canceller.start()
    return run


TWO_NODE_STAGE_RUN = pytest.StashKey[SimpleNamespace]()


TWO_NODE_STAGE_TEST = (
    "test_a_stage_across_two_nodes_stopped_by_its_time_limit_and_a_signal_ends_with_one_process_adapter"
)


# The stage across two nodes: one sample a process a step (micro-batches of 1, 2 a step), so that
# the two processes' summed gradients are the one process's accumulated ones to the last bit (a + b
# is b + a); no dropout, whose draws differ between one process and two. 1,200 steps: two processes
# took 35 to 82 ms a step here, so an attempt of one or two minutes, which trains for what is left
# after its start-up on both nodes and 20 s for saving, takes part of them even on a machine several
# times as fast. On a busy machine the start-up can outlast a one-minute attempt (SLURM then ends it).
TWO_NODE_STAGE = {"epochs": 3, "micro_batch": 1, "grad_accum": 2, "lora_dropout": 0.0}


def start_two_node_stage(demo_workdir: Path, directory: Path) -> SimpleNamespace:
    """The long stage (TWO_NODE_STAGE) across node1 and node2 of the cluster (partition `nodes`, one GPU
    each: one process a node) under attempts of 1, 2, 3 (4 and 5) minutes; once an attempt stopped
    before its time limit, and its retry resumed and trained 20 steps, a thread sends SIGTERM to the
    training processes of node2 alone. Beside
    it, on this machine, the same stage in one process, uninterrupted. In the background as soon
    as the demo exists. tests/jobs/test_slurm.py checks what they did (`signalled`: the step the
    thread saw before it signalled, `problem`: what stopped the thread)."""
    workdir = long_stage_workflow(demo_workdir, directory / "work", epochs=TWO_NODE_STAGE["epochs"])
    config_path = workdir / "config/config.yaml"
    config = yaml.safe_load(config_path.read_text())
    [stage] = config["experiments"]["long"]["stages"]
    stage |= TWO_NODE_STAGE
    reference = shutil.copytree(workdir, directory / "reference")
    config_path.write_text(
        yaml.safe_dump(
            config | {"experiments": {"long": {"stages": [stage | {"resources": stage["resources"] | {"nodes": 2}}]}}}
        )
    )
    (reference / "config/config.yaml").write_text(yaml.safe_dump(config))
    reference_output = directory / "reference.out"
    uninterrupted = start_uninterrupted(reference, reference_output)
    across = {"slurm_account": "demo", "slurm_partition": "nodes"}
    profile = site_profile(directory / "site", retries=4, **{"max-threads": 1, "default-resources": across})
    output = directory / "driver.out"
    driver = start_slurm_driver(workdir, profile, [LONG_ADAPTER], output)
    run = SimpleNamespace(
        workdir=workdir,
        reference=reference,
        driver=driver,
        output=output,
        uninterrupted=uninterrupted,
        reference_output=reference_output,
        signalled=None,
        problem=None,
    )

    def signal_node2_once_resumed():
        attempts = workdir / "results/logs/train/long/main.attempts.log"

        def said() -> str:
            return attempts.read_text() if attempts.exists() else ""

        try:
            wait_for(lambda: "the job's time limit is" in said(), 1200, "an attempt stopped before its time limit")
            stopped = said().index("the job's time limit is")
            wait_for(lambda: "resuming from step" in said()[stopped:], 900, "its retry to resume")
            resumed = training_steps_done(workdir)
            wait_for(lambda: training_steps_done(workdir) >= resumed + 20, 600, "the retry to train 20 steps")
            run.signalled = training_steps_done(workdir)
            for pid in node_processes("node2", "scripts/train.py"):
                os.kill(pid, signal.SIGTERM)
        except Exception as error:  # the test reports it
            run.problem = error

    run.thread = threading.Thread(target=signal_node2_once_resumed, daemon=True)
    run.thread.start()
    return run


def node_processes(node: str, command: str) -> list[int]:
    """The processes in an emulated node's namespace (scripts/slurm_cluster.sh) whose command line
    holds `command`."""
    listed = subprocess.run(["ip", "netns", "pids", f"vlft-{node}"], capture_output=True, text=True, check=True)
    found = []
    for pid in listed.stdout.split():
        try:
            if command in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(pid))
        except OSError:  # it ended
            pass
    return found


# Each scenario's stash key: (the test that checks it, what starts it).
BACKGROUND_SCENARIOS = {
    RESUMED_STAGE_RUN: (RESUMED_STAGE_TEST, start_resumed_stage),
    TWO_GPU_STAGE_RUN: (TWO_GPU_STAGE_TEST, start_two_gpu_stage),
    CANCELLED_JOB_RUN: (CANCELLED_JOB_TEST, start_cancelled_job),
    TWO_NODE_STAGE_RUN: (TWO_NODE_STAGE_TEST, start_two_node_stage),
}


def slurm_problem() -> str | None:
    """Why no SLURM cluster can be used here, or None when one answers."""
    if shutil.which("sbatch") is None:
        return "no SLURM client (sbatch) on this machine; start one with scripts/slurm_cluster.sh start"
    ping = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    if ping.returncode != 0 or "idle" not in ping.stdout and "mix" not in ping.stdout:
        return f"no idle SLURM node answers (sinfo: {ping.stdout.strip() or ping.stderr.strip()})"
    return None


SLURM_DEMO_RUN = pytest.StashKey[SimpleNamespace]()


CHANGED_STAGE_RUN = pytest.StashKey[SimpleNamespace]()


CHANGED_STAGE_TEST = "test_a_stage_changed_after_its_outputs_were_lost_reruns_through_slurm_with_what_starts_from_it"


# The SLURM runs this session starts in the background: tests that read the whole queue wait for them.
BACKGROUND_SLURM_RUNS = (SLURM_DEMO_RUN, *BACKGROUND_SCENARIOS, CHANGED_STAGE_RUN)


# The README's pipelines that run in the background once the SLURM runs end (tests/readme_pipelines.py's
# start_readme_pipelines): a thread, and each command's outcome.
README_PIPELINES_RUN = pytest.StashKey[SimpleNamespace]()


def background_runs_working(session: pytest.Session, keys=(*BACKGROUND_SLURM_RUNS, README_PIPELINES_RUN)) -> bool:
    """Whether a run of `keys` (by default every background run) still works: its driver, its
    reference run on this machine or its thread."""
    for key in keys:
        run = session.stash.get(key, None)
        processes = [getattr(run, name, None) for name in ("driver", "uninterrupted")]
        if any(process is not None and process.poll() is None for process in processes):
            return True
        if getattr(run, "thread", None) is not None and run.thread.is_alive():
            return True
    return False


# The demo's experiments the run through SLURM trains: one of each kind (a single stage, a curriculum
# with keep: best, DPO from another experiment's stage, SFT then GRPO on the screens), every rule of
# the workflow among their jobs. The rest of the demo adds jobs of the same rules, whose SLURM
# handling is the same; on CI's 2 cores they would double the run (each SLURM job imports torch anew).
SLURM_DEMO_EXPERIMENTS = ("exp1", "exp4", "exp7", "click_grpo")


def start_changed_stage(slurm_demo: SimpleNamespace, directory: Path) -> SimpleNamespace:
    """The sequence of a failed retraining, on a copy of the demo through SLURM once it has finished
    (its own tests read the original): exp4 stage 1 edited, its outputs deleted (as Snakemake deletes
    a failed job's), then `all` again through SLURM. A thread waits for the demo, prepares the copy
    and runs the driver, in the background from the session's start: the run mostly waits on the
    driver's status checks. tests/jobs/test_slurm.py checks what it did (`before`: each metrics file's
    time before, `report`: the report's, `problem`: what stopped the thread)."""
    run = SimpleNamespace(workdir=directory / "work", output=directory / "driver.out", driver=None, problem=None)
    run.profile = site_profile(directory / "site")

    def change_and_rerun():
        try:
            status = slurm_demo.driver.wait()
            assert status == 0, f"the demo through SLURM failed:\n{slurm_demo.output.read_text()[-3000:]}"
            shutil.copytree(slurm_demo.workdir, run.workdir, symlinks=True)  # times kept: nothing is out of date
            config_path = run.workdir / "config/config.yaml"
            config = yaml.safe_load(config_path.read_text())
            config["experiments"]["exp4"]["stages"][0]["learning_rate"] = 1.0e-3
            config_path.write_text(yaml.safe_dump(config))
            shutil.rmtree(run.workdir / "results/train/exp4/stage1")
            run.before = {p: p.stat().st_mtime for p in (run.workdir / "results").rglob("metrics.json")}
            run.report = (run.workdir / "results/report/index.html").stat().st_mtime
            run.driver = start_slurm_driver(run.workdir, run.profile, ["all"], run.output)
            run.driver.wait()
        except Exception as error:  # the test reports it
            run.problem = error

    run.thread = threading.Thread(target=change_and_rerun, daemon=True)
    run.thread.start()
    return run


def site_profile(directory: Path, **extra) -> Path:
    """A site's own small profile, given after profiles/slurm: the account and partition of the
    cluster from scripts/slurm_cluster.sh, the local demo's threads (within the CPUs it offers, at
    least 4), quick first status check."""
    import yaml

    settings = {
        "default-resources": {"slurm_account": "demo", "slurm_partition": "debug"},
        "max-threads": DEMO_THREADS,
        "slurm-init-seconds-before-status-checks": 2,
        **extra,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(settings))
    return directory

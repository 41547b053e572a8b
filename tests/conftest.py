"""Shared fixtures: a fresh copy of the workflow, as a new user's clone, and helpers to run Snakemake in it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

# Pipelines run side by side in this suite (the demo through SLURM beside the local demo and other
# tests) on few cores. Threads of jobs that share a core must sleep at their barriers, not spin, or
# each waits on the other's descheduled threads (scripts/slurm_cluster.sh sets the same for SLURM
# jobs). How threads wait changes no result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
WORKFLOW_PARTS = ("Snakefile", "workflow", "config", "scripts", "profiles", "vlft", "pyproject.toml")


def copy_workflow(target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    for part in WORKFLOW_PARTS:
        source = REPO / part
        if source.is_dir():
            shutil.copytree(source, target / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target / part)
    return target


# What the demo's run made that a stage's jobs start from: its datasets and model, prepared records,
# image caches, and Snakemake's records of them.
DEMO_UPSTREAM = ("demo", "prepared", "cache")


def copy_demo_upstream(demo_workdir: Path, target: Path) -> Path:
    """A copy of the finished demo without its trainings, evaluations, report, logs and checkpoints:
    a workflow whose config keeps the demo's data and model finds them done and runs only stages."""

    def leave_out(directory, names):
        return [n for n in names if Path(directory) == demo_workdir / "results" and n not in DEMO_UPSTREAM]

    shutil.copytree(demo_workdir, target, symlinks=True, ignore=leave_out)
    return target


def snakemake(
    workdir: Path, *args: str, check: bool = True, timeout: float | None = None
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", *args], cwd=workdir, capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def planned_outputs(workdir: Path, *args: str) -> set[str]:
    """The first output of every job a dry run plans, e.g. 'results/train/exp4/stage2/adapter'."""
    result = snakemake(workdir, "--dry-run", *args)
    text = result.stdout + result.stderr
    if "Nothing to be done" in text:
        return set()
    return {m.group(1).split(",")[0].strip() for m in re.finditer(r"^\s+output: (.+)$", text, re.MULTILINE)} | {
        f"rule:{m.group(1)}" for m in re.finditer(r"^(?:local)?rule (\w+):$", text, re.MULTILINE) if m.group(1) == "all"
    }


# Two layouts of one computation in float64 (u = 2^-53, about 1.1e-16) differ only in the order
# of their sums, and a sum of n terms in any order is within n * u of its terms' magnitude. The
# longest sums in these tests are under 10^4 terms (a token's attention, the head over a batch's
# answers, a gradient over every token), and a tiny model of 2 layers, trained for at most a few
# hundred steps, amplifies such differences by far less than 10^4: so they stay below
# 10^4 * 10^4 * u, about 1e-8. A real difference (one sample attending to another, a token lost, a
# step resumed from the wrong state) shows at 1e-4 or more.
FLOAT64_RTOL = 1e-8


def assert_close_normwise(got, want, rtol: float, msg: str = "") -> None:
    """|got - want| <= rtol * |want| over the whole tensor: an element that cancels to near zero
    carries the rounding of its terms, not of itself, so elementwise relative error says nothing there."""
    import torch

    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    assert got.shape == want.shape, msg
    error, scale = (got - want).norm().item(), want.norm().item()
    assert error <= rtol * scale, f"{msg}: relative error {error / scale:.2e} > {rtol:.0e}"


def tiny_family_data(root: Path, family: str, raw: Path) -> Path:
    """A tiny model of `family` in root/model, and the records of `raw` (images in root/images)
    prepared and pixel-cached as a stage reads them: root/prepared.jsonl, root/pixels."""
    from vlft.demo.tiny_model import make_tiny_model
    from vlft.caches.image_cache import PixelSettings, build_image_cache
    from vlft.modeling import load_image_processor
    from vlft.data.records import prepare_split

    make_tiny_model(root / "model", family=family)
    prepare_split(raw, root / "images", root / "prepared.jsonl")
    pixels = PixelSettings.from_processor(load_image_processor(root / "model"), 4096, 16384)
    build_image_cache(root / "prepared.jsonl", root / "images", root / "pixels", pixels)
    return root


def questions_on_shared_images(root, images: int, per_image: int, seed: int = 3):
    """A raw split of images x per_image records, the questions of each image consecutive; the
    records of an image keep their own questions and answers (each made for another image of the
    same kind: what they ask is irrelevant here, only that they differ)."""
    from vlft.demo.shapes import make_dataset
    from vlft.files import read_jsonl, write_jsonl

    make_dataset({"train": root / "raw.jsonl"}, root / "images", {"train": images * per_image}, seed=seed)
    records = read_jsonl(root / "raw.jsonl")
    for index, record in enumerate(records):
        record["image"] = records[index - index % per_image]["image"]
    write_jsonl(root / "train.jsonl", records)
    return root / "train.jsonl"


def tiny_stage_settings(**overrides) -> dict:
    """A tiny model's stage settings as the train rule hands them over: the schema's defaults, the
    pixel bounds of tiny_family_data, rank 8, and `overrides`."""
    from vlft.config import stage_defaults
    from vlft.stage_params import RUN_ONLY_KEYS

    settings = stage_defaults() | {
        "init_from": None,
        "min_pixels": 4096,
        "max_pixels": 16384,
        "lora_r": 8,
        "lora_alpha": 16,
    }
    return {k: v for k, v in (settings | overrides).items() if k not in RUN_ONLY_KEYS}


# Fixtures that run whole pipelines: a test that uses one is slow, whatever its own marks say, so
# that `-m "not slow"` (the README's fast part) never starts a demo or a cluster run.
PIPELINE_FIXTURES = {"demo_workdir", "slurm_cluster", "slurm_demo_run"}


def plan_of_stages(tmp_path: Path, train: Path, stages: list[dict]):
    """The plan of one experiment `e` of `stages` on one dataset `d` whose train split is `train`
    (images under tmp_path/images), as build_plan makes it from a user's config."""
    from vlft.config import resolve_config
    from vlft.plan import build_plan

    config = {
        "model": {"path": str(tmp_path / "model")},
        "datasets": {"d": {"image_root": str(tmp_path / "images"), "splits": {"train": str(train)}}},
        "defaults": {"dataset": "d", "eval_splits": [], "min_pixels": 4096, "max_pixels": 16384},
        "experiments": {"e": {"stages": stages}},
    }
    return build_plan(resolve_config(config))


def train_float64(inputs, settings: dict, out: Path, stop=None) -> None:
    """A stage trained in float64 into `out` (adapter, log.jsonl, summary.json, ckpt), as the tests
    that compare two ways of taking the same steps train it."""
    import torch

    from vlft.training.train import train_stage

    train_stage(
        inputs,
        settings,
        out / "adapter",
        out / "log.jsonl",
        out / "summary.json",
        out / "ckpt",
        1000,
        stop=stop,
        dtype=torch.float64,
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if PIPELINE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


# The README's quick start, after its install: the whole demo pipeline.
DEMO_COMMAND = "snakemake --cores all"
# The threads each job of it gets: the rules ask for 8, `--cores all` caps them at the machine's.
DEMO_THREADS = min(8, os.cpu_count())


@pytest.fixture(scope="session")
def demo_workdir(tmp_path_factory, request) -> Path:
    """The whole demo pipeline, run once, exactly as the README's quick start runs it."""
    workdir = copy_workflow(tmp_path_factory.mktemp("demo"))
    run = snakemake(workdir, *DEMO_COMMAND.split()[1:])
    (workdir.parent / "terminal.txt").write_text(run.stdout + run.stderr)  # what the terminal showed
    # The SLURM scenarios that start from the demo's data, in the background from now on.
    selected = {item.name for item in request.session.items}
    for key, (test, start) in BACKGROUND_SCENARIOS.items():
        if test in selected and slurm_problem() is None:
            request.session.stash[key] = start(workdir, tmp_path_factory.mktemp(test[:30]))
    yield workdir
    for key in BACKGROUND_SCENARIOS:
        run = request.session.stash.get(key, None)
        for process in (run.driver, getattr(run, "uninterrupted", None)) if run else ():
            if process is not None and process.poll() is None:  # the session ended early (-x, Ctrl-C)
                process.terminate()
                process.wait(timeout=120)


def start_slurm_driver(workdir: Path, profile: Path, targets: list[str], output: Path) -> subprocess.Popen:
    """Snakemake through profiles/slurm and a site's `profile` (site_profile) in `workdir`, in the
    background, its terminal's output into the file `output`."""
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


def start_resumed_stage(demo_workdir: Path, directory: Path) -> SimpleNamespace:
    """The long stage of RESUMED_STAGE_EPOCHS through SLURM under attempts of 1, 2, 3 (4 and 5) minutes
    (retries beyond the profile's keep a slower machine from running out of attempts), and
    the same stage uninterrupted, in a copy of the same workflow on this machine; both in the
    background, as soon as the demo exists (demo_workdir), since they mostly wait: the SLURM run
    for its time limits and the driver's status checks. One thread each (`--cores 1` here,
    `max-threads: 1` there), so that neither run's threads wait on the other's.
    tests/test_slurm.py checks what they did."""
    workdir = long_stage_workflow(demo_workdir, directory / "work", RESUMED_STAGE_EPOCHS)
    reference = shutil.copytree(workdir, directory / "reference")
    reference_output = directory / "reference.out"
    uninterrupted = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", "1", LONG_ADAPTER],
        cwd=reference,
        stdout=reference_output.open("w"),
        stderr=subprocess.STDOUT,
    )
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
    equal to one process's in float64 by tests/test_distributed.py; here, that SLURM gives one job
    both GPUs and they train. tests/test_slurm.py checks what it did."""
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


def wait_for(condition, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


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
    the demo exists, since the run mostly waits on the driver's status checks. tests/test_slurm.py
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


# Each scenario's stash key: (the test that checks it, what starts it).
BACKGROUND_SCENARIOS = {
    RESUMED_STAGE_RUN: (RESUMED_STAGE_TEST, start_resumed_stage),
    TWO_GPU_STAGE_RUN: (TWO_GPU_STAGE_TEST, start_two_gpu_stage),
    CANCELLED_JOB_RUN: (CANCELLED_JOB_TEST, start_cancelled_job),
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from vlft.demo.tiny_model import make_tiny_model

    path = tmp_path_factory.mktemp("model") / "tiny"
    make_tiny_model(path)
    return path


def need(program: str) -> None:
    """A program a test drives (graphviz's dot, Chromium): where CI runs, it must be there."""
    if shutil.which(program) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{program} is not installed, and CI must run this test (.ci/run installs it)")
        pytest.skip(f"{program} is not installed")


def slurm_problem() -> str | None:
    """Why no SLURM cluster can be used here, or None when one answers."""
    if shutil.which("sbatch") is None:
        return "no SLURM client (sbatch) on this machine; start one with scripts/slurm_cluster.sh start"
    ping = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    if ping.returncode != 0 or "idle" not in ping.stdout and "mix" not in ping.stdout:
        return f"no idle SLURM node answers (sinfo: {ping.stdout.strip() or ping.stderr.strip()})"
    return None


@pytest.fixture(scope="session")
def slurm_cluster():
    """A SLURM cluster to submit to: skipped where there is none, a failure where CI asks for one
    (VLFT_REQUIRE_SLURM=1, set by .ci/run after scripts/slurm_cluster.sh start)."""
    problem = slurm_problem()
    if problem and os.environ.get("VLFT_REQUIRE_SLURM") == "1":
        pytest.fail(f"SLURM required (VLFT_REQUIRE_SLURM=1) but {problem}")
    if problem:
        pytest.skip(problem)


SLURM_DEMO_RUN = pytest.StashKey[SimpleNamespace]()
CHANGED_STAGE_RUN = pytest.StashKey[SimpleNamespace]()
CHANGED_STAGE_TEST = "test_a_stage_changed_after_its_outputs_were_lost_reruns_through_slurm_with_what_starts_from_it"
# The SLURM runs this session starts in the background: tests that read the whole queue wait for them.
BACKGROUND_SLURM_RUNS = (SLURM_DEMO_RUN, *BACKGROUND_SCENARIOS, CHANGED_STAGE_RUN)
# The demo's experiments the run through SLURM trains: one of each kind (a single stage, a curriculum
# with keep: best, DPO from another experiment's stage, SFT then GRPO on the screens), every rule of
# the workflow among their jobs. The rest of the demo adds jobs of the same rules, whose SLURM
# handling is the same; on CI's 2 cores they would double the run (each SLURM job imports torch anew).
SLURM_DEMO_EXPERIMENTS = ("exp1", "exp4", "exp7", "click_grpo")


@pytest.fixture(scope="session")
def slurm_demo_run(slurm_cluster, tmp_path_factory, request) -> SimpleNamespace:
    """The demo (SLURM_DEMO_EXPERIMENTS of it) through `--profile profiles/slurm`, its driver started in the background as the
    session begins (start_the_slurm_demo_early), so that while it waits on the cluster's status
    checks the local demo and other tests use the cores. tests/test_slurm.py waits for it."""
    workdir = copy_workflow(tmp_path_factory.mktemp("slurm-demo"))
    config_file = workdir / "config/config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["experiments"] = {name: config["experiments"][name] for name in SLURM_DEMO_EXPERIMENTS}
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    profile = site_profile(tmp_path_factory.mktemp("site"))
    output = workdir.parent / "driver.out"
    driver = start_slurm_driver(workdir, profile, ["all"], output)
    run = SimpleNamespace(workdir=workdir, driver=driver, output=output)
    request.session.stash[SLURM_DEMO_RUN] = run
    changed = None
    if CHANGED_STAGE_TEST in {item.name for item in request.session.items}:
        changed = start_changed_stage(run, tmp_path_factory.mktemp("changed-stage"))
        request.session.stash[CHANGED_STAGE_RUN] = changed
    yield run
    for process in (driver, getattr(changed, "driver", None)):
        if process is not None and process.poll() is None:  # the session ended early (-x, Ctrl-C): stop it
            process.terminate()
            process.wait(timeout=120)


def start_changed_stage(slurm_demo: SimpleNamespace, directory: Path) -> SimpleNamespace:
    """The sequence of a failed retraining, on a copy of the demo through SLURM once it has finished
    (its own tests read the original): exp4 stage 1 edited, its outputs deleted (as Snakemake deletes
    a failed job's), then `all` again through SLURM. A thread waits for the demo, prepares the copy
    and runs the driver, in the background from the session's start: the run mostly waits on the
    driver's status checks. tests/test_slurm.py checks what it did (`before`: each metrics file's
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


@pytest.fixture(scope="session", autouse=True)
def start_the_slurm_demo_early(request):
    """Starts slurm_demo_run before the first test where a test of this session reads it and a
    cluster answers."""
    if slurm_problem() is None and any("slurm_demo_run" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("slurm_demo_run")


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


@pytest.fixture(scope="module")
def small_stage(tmp_path_factory, tiny_model_dir):
    """16 records of the demo's shapes, prepared and cached, and the demo's exp1 settings."""
    from vlft.demo.shapes import make_dataset
    from vlft.caches.image_cache import PixelSettings, build_image_cache
    from vlft.modeling import load_image_processor
    from vlft.data.records import prepare_split
    from vlft.plan import build_plan
    from vlft.training.train import StageInputs

    root = tmp_path_factory.mktemp("small-stage")
    make_dataset({"train": root / "train.jsonl"}, root / "images", {"train": 16}, seed=0)
    prepare_split(root / "train.jsonl", root / "images", root / "prepared.jsonl")
    pixels = PixelSettings.from_processor(load_image_processor(tiny_model_dir), 4096, 16384)
    build_image_cache(root / "prepared.jsonl", root / "images", root / "cache", pixels)
    inputs = StageInputs(str(tiny_model_dir), [str(root / "prepared.jsonl")], [str(root / "cache")], None)
    settings = build_plan(yaml.safe_load((REPO / "config/config.yaml").read_text())).stage("exp1", "main")
    return inputs, settings.train_params() | {"compile": False}


class KilledAfter:
    """A job killed after `steps` steps, with no chance to save (kill -9, a node lost)."""

    def __init__(self, steps: int):
        self.steps, self.seen = steps, 0

    def reason(self):
        self.seen += 1
        if self.seen == self.steps:
            raise KeyboardInterrupt


class StopAfter:
    """Stands in for a SIGTERM arriving while step `n` runs."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def reason(self):
        self.calls += 1
        return "SIGTERM received" if self.calls == self.n else None

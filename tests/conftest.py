"""The suite's fixtures: the demo run once, a tiny model, a SLURM cluster and the runs started on it
in the background (tests/slurm_runs.py). Helpers the tests share are in tests/helpers.py."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from tests.helpers import DEMO_COMMAND, REPO, copy_workflow, snakemake
from tests.slurm_runs import (
    BACKGROUND_SCENARIOS,
    CHANGED_STAGE_RUN,
    CHANGED_STAGE_TEST,
    SLURM_DEMO_EXPERIMENTS,
    SLURM_DEMO_RUN,
    OWN_WAIT_POLICY,
    README_PIPELINES_RUN,
    background_runs_working,
    site_profile,
    slurm_problem,
    start_changed_stage,
    start_slurm_driver,
)

# torch loaded before any test sets OMP_WAIT_POLICY (threads_share_cores_politely), so that this
# process's OpenMP threads keep the default wait, spinning briefly at their barriers.
torch_threads = torch.get_num_threads()


@pytest.fixture(autouse=True)
def threads_share_cores_politely(request):
    """While a SLURM run of this session works in the background (tests/slurm_runs.py), pipelines
    share CI's few cores, and threads that spin at their barriers wait on each other's descheduled
    threads: a 2-thread training job beside another took many times as long. Then the pipelines this
    test starts wait passively, as the cluster's jobs do (scripts/slurm_cluster.sh), and this
    process's torch uses one thread. Alone, they keep the default wait: on a 2-core VM a passive one
    makes a training job slower, for waking a sleeping core is slow (../benchmarks/README.md has the
    figures). How threads wait or how many there are changes no result beyond rounding."""
    if background_runs_working(request.session):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        torch.set_num_threads(1)
    else:
        if OWN_WAIT_POLICY is None:
            os.environ.pop("OMP_WAIT_POLICY", None)
        torch.set_num_threads(torch_threads)


# Fixtures that run whole pipelines: a test that uses one is slow, whatever its own marks say, so
# that `-m "not slow"` (the README's fast part) never starts a demo or a cluster run.
PIPELINE_FIXTURES = {"demo_workdir", "slurm_cluster", "slurm_demo_run"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if PIPELINE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


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
    # The README's pipelines that run in copies of their own, in the background once the SLURM runs end.
    if "test_readme_command_runs_as_written" in {getattr(item, "originalname", None) for item in request.session.items}:
        from tests.readme_pipelines import start_readme_pipelines

        model = request.getfixturevalue("tiny_model_dir")
        directory = tmp_path_factory.mktemp("readme-pipelines")
        request.session.stash[README_PIPELINES_RUN] = start_readme_pipelines(request.session, workdir, model, directory)
    yield workdir
    for key in BACKGROUND_SCENARIOS:
        run = request.session.stash.get(key, None)
        for process in (run.driver, getattr(run, "uninterrupted", None)) if run else ():
            if process is not None and process.poll() is None:  # the session ended early (-x, Ctrl-C)
                process.terminate()
                process.wait(timeout=120)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from vlft.demo.tiny_model import make_tiny_model

    path = tmp_path_factory.mktemp("model") / "tiny"
    make_tiny_model(path)
    return path


@pytest.fixture(scope="session")
def slurm_cluster():
    """A SLURM cluster to submit to: skipped where there is none, a failure where CI asks for one
    (VLFT_REQUIRE_SLURM=1, set by .ci/run after scripts/slurm_cluster.sh start)."""
    problem = slurm_problem()
    if problem and os.environ.get("VLFT_REQUIRE_SLURM") == "1":
        pytest.fail(f"SLURM required (VLFT_REQUIRE_SLURM=1) but {problem}")
    if problem:
        pytest.skip(problem)


@pytest.fixture(scope="session")
def slurm_demo_run(slurm_cluster, tmp_path_factory, request) -> SimpleNamespace:
    """The demo (SLURM_DEMO_EXPERIMENTS of it) through `--profile profiles/slurm`, its driver started in the background as the
    session begins (start_the_slurm_demo_early), so that while it waits on the cluster's status
    checks the local demo and other tests use the cores. tests/jobs/test_slurm.py waits for it."""
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


@pytest.fixture(scope="session", autouse=True)
def start_the_slurm_demo_early(request):
    """Starts slurm_demo_run before the first test where a test of this session reads it and a
    cluster answers."""
    if slurm_problem() is None and any("slurm_demo_run" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("slurm_demo_run")


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

"""Faults a researcher meets: what the project deletes, damaged files, a GPU job without a GPU, a
schedule that cannot train. Each case reproduces the fault as described, on real files."""

import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import yaml

from conftest import REPO
from vlft.config import resolve_config
from vlft.errors import ConfigError, DeviceError
from vlft.files import atomic_path, read_jsonl, remove_inside
from vlft.modeling import cuda_problem, require_gpus
from vlft.plan import build_plan


def test_nothing_outside_the_owning_directory_is_deleted(tmp_path):
    owner, outside = tmp_path / "results/checkpoints/exp", tmp_path / "elsewhere"
    (owner / "run").mkdir(parents=True)
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    for path in [owner / "..", owner / "../../..", owner / "run/../..", owner, owner / "."]:
        with pytest.raises(
            RuntimeError, match="refusing to delete .*: it is not inside .*, the directory this step owns"
        ):
            remove_inside(path, owner)
    # A link inside the owner that points outside is removed as a link; what it points to stays.
    (owner / "link").symlink_to(outside)
    remove_inside(owner / "link", owner)
    assert not (owner / "link").exists() and (outside / "keep.txt").read_text() == "x"
    # And reached through a link from outside, the owner's contents are still its own.
    (tmp_path / "alias").symlink_to(owner)
    remove_inside(tmp_path / "alias/run", owner)
    assert not (owner / "run").exists() and owner.is_dir()


def test_a_killed_writers_temporary_directory_is_removed_by_the_next_write_of_its_target(tmp_path):
    """A killed job leaves `.<target>.tmp-<pid>` behind (423 MB for a cache); the next job that writes
    the target removes it, and nobody else's temporary files."""
    target = tmp_path / "cache"
    stale = tmp_path / f".cache.tmp-{os.getpid() + 1}"
    (stale / "shard").mkdir(parents=True)
    other = tmp_path / ".cache2.tmp-1"
    other.mkdir()
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "index.json").write_text("{}")
    assert not stale.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".cache2.tmp-1", "cache"]


def run_train_script(*arguments: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "scripts/train.py"), "--model", "none", "--prepared", "none"]
    command += ["--caches", "none", "--settings", "{}", "--checkpoints", "none"]
    command += ["--adapter", "none", "--log", "none", "--summary", "none", *arguments]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is not usable")
def test_a_job_that_asked_for_a_gpu_and_finds_none_usable_fails_at_once_naming_the_host_and_cuda():
    """An 8B stage on a node whose driver fails must not train on the CPU for days."""
    started = time.time()
    result = run_train_script("--processes", "1")
    assert result.returncode == 1 and time.time() - started < 60
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert line == (
        f"error: host {socket.gethostname()}: this job asked for 1 GPU(s), but CUDA is not usable: "
        f"{cuda_problem()}; set the job's resources gpus to 0 to run it on the CPU"
    )
    # A hidden GPU and a CUDA torch give CUDA's own words; here at least the build says why.
    assert cuda_problem()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is not usable")
def test_cpu_runs_happen_where_no_gpu_was_asked_for_or_the_config_allows_them(monkeypatch, capsys):
    require_gpus(0, cpu_fallback=False)
    assert capsys.readouterr().out == ""
    monkeypatch.delenv("RANK", raising=False)
    require_gpus(2, cpu_fallback=True)
    assert capsys.readouterr().out == (
        f"host {socket.gethostname()}: no usable GPU ({cuda_problem()}): running on the CPU, as cpu_fallback allows\n"
    )
    with pytest.raises(DeviceError, match="asked for 2 GPU"):
        require_gpus(2, cpu_fallback=False)


def test_the_demo_alone_lets_gpu_jobs_fall_back_to_the_cpu():
    """The demo asks for GPUs and runs on a laptop; a study's config (the examples) never falls back."""
    assert resolve_config(yaml.safe_load((REPO / "config/config.yaml").read_text()))["cpu_fallback"] is True
    for example in sorted((REPO / "config/examples").glob("*.yaml")):
        assert resolve_config(yaml.safe_load(example.read_text()))["cpu_fallback"] is False, example


@pytest.fixture(scope="module")
def small_stage(tmp_path_factory, tiny_model_dir):
    """16 records of the demo's shapes, prepared and cached, and the demo's exp1 settings."""
    from vlft.demo.shapes import make_dataset
    from vlft.image_cache import PixelSettings, build_image_cache
    from vlft.modeling import load_image_processor
    from vlft.records import prepare_split
    from vlft.train import StageInputs

    root = tmp_path_factory.mktemp("small-stage")
    make_dataset({"train": root / "train.jsonl"}, root / "images", {"train": 16}, seed=0)
    prepare_split(root / "train.jsonl", root / "images", root / "prepared.jsonl")
    pixels = PixelSettings.from_processor(load_image_processor(tiny_model_dir), 4096, 16384)
    build_image_cache(root / "prepared.jsonl", root / "cache", pixels)
    inputs = StageInputs(str(tiny_model_dir), [str(root / "prepared.jsonl")], [str(root / "cache")], None)
    settings = build_plan(yaml.safe_load((REPO / "config/config.yaml").read_text())).stage("exp1", "main")
    return inputs, settings.train_params() | {"compile": False}


def test_the_logged_learning_rate_is_the_one_the_step_used(small_stage, tmp_path):
    """Cosine with 2 warmup steps of 4: the steps use 0, 1/2, 1 and 1/2 of the rate (HF's schedule);
    the log said 1/2, 1, 1/2, 0, the rate of the step after."""
    from vlft.train import train_stage

    inputs, settings = small_stage
    settings = settings | {"max_steps": 4, "warmup_ratio": 0.5, "micro_batch": 4, "learning_rate": 1e-3}
    train_stage(inputs, settings, tmp_path / "a", tmp_path / "log.jsonl", tmp_path / "s.json", tmp_path / "c", 100)
    logged = [row["lr"] for row in read_jsonl(tmp_path / "log.jsonl")]
    assert logged == pytest.approx([0.0, 0.5e-3, 1e-3, 0.5e-3], rel=1e-12, abs=1e-18)


def test_a_schedule_that_never_leaves_warmup_is_refused_when_the_config_is_read():
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["experiments"]["exp1"]["stages"][0]["max_steps"] = 1
    with pytest.raises(ConfigError) as refused:
        build_plan(config)
    assert str(refused.value) == (
        "experiments.exp1.stages[0].max_steps: all 1 of its steps are warmup (warmup_ratio 0.05 of 1 is 1 step(s), "
        "the first at learning rate 0), so it never trains at learning_rate; give it more steps, or warmup_ratio: 0"
    )
    config["experiments"]["exp1"]["stages"][0].update(max_steps=None, warmup_ratio=1)
    with pytest.raises(ConfigError, match=r"^experiments.exp1.stages\[0\].warmup_ratio: 1 makes every step warmup"):
        build_plan(config)
    # Without warmup, or with a schedule that has none, one step trains.
    config["experiments"]["exp1"]["stages"][0].update(max_steps=1, warmup_ratio=0)
    build_plan(config)
    config["experiments"]["exp1"]["stages"][0].update(warmup_ratio=0.5, lr_schedule="constant")
    build_plan(config)


def test_a_stage_whose_records_make_too_few_steps_for_its_warmup_is_refused_before_it_trains(small_stage, tmp_path):
    """Epochs over few records: the step count is known only in the job, which refuses at once."""
    from vlft.train import train_stage

    inputs, settings = small_stage
    settings = settings | {"epochs": 1, "max_steps": None, "micro_batch": 16, "warmup_ratio": 0.05}
    with pytest.raises(ConfigError) as refused:
        train_stage(inputs, settings, tmp_path / "a", tmp_path / "log.jsonl", tmp_path / "s.json", tmp_path / "c", 100)
    assert str(refused.value).startswith("this stage's 16 records make 1 step(s): all 1 of its steps are warmup")
    assert not (tmp_path / "a").exists() and not (tmp_path / "log.jsonl").exists()

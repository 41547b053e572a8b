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
from vlft.errors import DeviceError
from vlft.files import atomic_path, remove_inside
from vlft.modeling import cuda_problem, require_gpus


def test_nothing_outside_the_owning_directory_is_deleted(tmp_path):
    owner, outside = tmp_path / "results/checkpoints/exp", tmp_path / "elsewhere"
    (owner / "run").mkdir(parents=True)
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    for path in [owner / "..", owner / "../../..", owner / "run/../..", owner, owner / "."]:
        with pytest.raises(RuntimeError, match="refusing to delete .*: it is not inside .*, the directory this step owns"):
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

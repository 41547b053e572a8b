"""GPU jobs where no GPU is usable: one line at once, or the CPU where the config allows it."""

import socket
import subprocess
import sys
import time
import pytest
import torch
import yaml
from tests.helpers import REPO
from vlft.config import resolve_config
from vlft.errors import DeviceError
from vlft.modeling import cuda_problem, require_gpus


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
        f"{cuda_problem()}; to run on the CPU, set `cpu_fallback: true` in the config (every job that asks "
        "for a GPU runs without one), or set to 0 each key that asks for one: `resources.gpus` of the stage "
        "or of `defaults` (training and vision caches) and `evaluation.resources.gpus` (evaluations)"
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
    """The demo asks for GPUs and runs on a laptop, as do the examples run on its data (demo-*.yaml,
    on its tiny model or a tiny model of their own); a study's config (the other examples) never falls back."""
    assert resolve_config(yaml.safe_load((REPO / "config/config.yaml").read_text()))["cpu_fallback"] is True
    for example in sorted((REPO / "config/examples").glob("*.yaml")):
        on_the_demo = example.name.startswith("demo-")
        assert "results/demo/shapes" in example.read_text() or not on_the_demo, example
        assert resolve_config(yaml.safe_load(example.read_text()))["cpu_fallback"] is on_the_demo, example

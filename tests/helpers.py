"""What many tests share: a fresh copy of the workflow, as a new user's clone; Snakemake run in it;
the tiny models' data and stage settings; float64 comparisons; stand-ins for a stop or a kill."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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


def image_groups_rtol(family: str, questions_on_a_prefix: int, tower_trains: bool = False) -> float:
    """The tolerance of an image group's loss and gradients against each question alone, in float64.

    Two computations round in float32 whatever the model's dtype: transformers' Gated DeltaNet (a
    hybrid family's, vlft.demo.tiny_model.HYBRID_FAMILIES), its decay and its gated norm; and every
    vision tower's rotary embedding (apply_rotary_pos_emb_vision casts its queries and keys with
    .float()), which gradients cross only where the tower trains (`tower_trains`). A row with an
    image's prefix once rounds the prefix's gradient there summed over its questions; each question
    alone rounds its own part before the weights' gradients sum them. Each rounding is within
    float32's unit, so the two differ by at most that unit times the questions on one prefix,
    normwise; a question that misses its prefix's state differs at 1e-3 and more. Elsewhere every
    family computes in float64 throughout."""
    import torch
    from vlft.demo.tiny_model import HYBRID_FAMILIES

    if family not in HYBRID_FAMILIES and not tower_trains:
        return FLOAT64_RTOL
    return max(FLOAT64_RTOL, questions_on_a_prefix * torch.finfo(torch.float32).eps)


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


def train_float64(inputs, settings: dict, out: Path, stop=None, parallelism: str = "replicate") -> None:
    """A stage trained in float64 into `out` (adapter, log.jsonl, summary.json, ckpt), as the tests
    that compare two ways of taking the same steps train it; `parallelism`: the stage's
    resources.parallelism, where several processes train it."""
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
        parallelism=parallelism,
    )


# The README's quick start, after its install: the whole demo pipeline.
DEMO_COMMAND = "snakemake --cores all"


# The threads each job of it gets: the rules ask for 8, `--cores all` caps them at the machine's.
DEMO_THREADS = min(8, os.cpu_count())


def wait_for(condition, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def need(program: str) -> None:
    """A program a test drives (graphviz's dot, Chromium): where CI runs, it must be there."""
    if shutil.which(program) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{program} is not installed, and CI must run this test (.ci/run installs it)")
        pytest.skip(f"{program} is not installed")


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


def delta_rule_in_input_dtype(
    query, key, value, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs
):
    """The gated delta rule token by token, as transformers' `torch_recurrent_gated_delta_rule` does
    it, in the inputs' own dtype: transformers' torch functions compute in float32 whatever they are
    given, so a float64 test of a hybrid model puts this in their place (and
    tests/forward/test_hybrid_layers.py checks it against theirs) to keep its arithmetic float64
    throughout."""
    import torch

    dtype = query.dtype
    heads = value.shape[2]
    if query.shape[2] != heads:  # each query/key head serves consecutive value heads
        query, key = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (query, key))
    query, key, value, beta, g = (t.transpose(1, 2).to(dtype) for t in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query, key = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (query, key))
    query = query / query.shape[-1] ** 0.5
    batch, _, length, k_dim = key.shape
    state = (
        torch.zeros(batch, heads, k_dim, value.shape[-1], dtype=dtype)
        if initial_state is None
        else initial_state.to(dtype)
    )
    out = []
    for t in range(length):
        state = state * g[:, :, t].exp()[..., None, None]
        remembered = (state * key[:, :, t, :, None]).sum(-2)
        delta = (value[:, :, t] - remembered) * beta[:, :, t, None]
        state = state + key[:, :, t, :, None] * delta[:, :, None, :]
        out.append((state * query[:, :, t, :, None]).sum(-2))
    return torch.stack(out, dim=2).transpose(1, 2), state if output_final_state else None


def seven_step_stage(root, raw, tiny_model_dir, **overrides):
    """The demo's exp1 stage on a raw split, in steps of 8 samples, 7 of them, no dropout."""
    import yaml

    from vlft.caches.image_cache import PixelSettings, build_image_cache
    from vlft.data.records import prepare_split
    from vlft.modeling import load_image_processor
    from vlft.plan import build_plan
    from vlft.training.train import StageInputs

    prepare_split(raw, root / "images", root / "prepared.jsonl")
    pixels = PixelSettings.from_processor(load_image_processor(tiny_model_dir), 4096, 16384)
    build_image_cache(root / "prepared.jsonl", root / "images", root / "cache", pixels)
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    settings = build_plan(config).stage("exp1", "main").train_params() | {
        "micro_batch": 8,
        "grad_accum": 1,
        "max_steps": 7,
        "lora_dropout": 0.0,
        **overrides,
    }
    inputs = StageInputs(str(tiny_model_dir), [str(root / "prepared.jsonl")], [str(root / "cache")], None)
    return inputs, settings

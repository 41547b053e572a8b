"""`max_batch_tokens: auto` (vlft.training.token_budget): the choice from a measurement, and the CPU's answer.
The measurement itself needs a GPU: benchmarks/train_speed.py --max-batch-tokens auto measures it
under a memory cap (benchmarks/README.md, "Smaller GPUs")."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tests.helpers import tiny_stage_settings
from vlft.caches.image_cache import PixelSettings, build_image_cache
from vlft.modeling import load_image_processor
from vlft.data.records import prepare_split
from vlft.training.token_budget import SAFETY, STEP, choose
from vlft.training.train import StageInputs, train_stage

GIB, MIB = 2**30, 2**20


def test_the_budget_fills_the_memory_left_to_the_safety_margin_in_whole_steps():
    # The 8B under a 40 GiB cap: some 17 GiB held, 4.5 MiB a token.
    tokens = (40 * GIB * SAFETY - 17 * GIB) / (4.5 * MIB)
    assert choose(40 * GIB, 17 * GIB, 4.5 * MIB, 1600) == int(tokens) // STEP * STEP == 4096
    # Less than a STEP above the longest sample: the longest sample's length, not below it.
    assert choose(40 * GIB, 17 * GIB, 4.5 * MIB, int(tokens) - 10) == int(tokens) - 10
    # Not even the longest sample fits: none (the job says so, naming the options that help).
    assert choose(40 * GIB, 17 * GIB, 4.5 * MIB, int(tokens) + 1) is None
    assert choose(20 * GIB, 19 * GIB, 4.5 * MIB, 1) is None


def test_auto_on_a_cpu_keeps_micro_batch_samples_and_says_why(tmp_path, tiny_model_dir):
    from vlft.demo.shapes import make_dataset

    make_dataset({"train": tmp_path / "train.jsonl"}, tmp_path / "images", {"train": 24}, seed=4)
    prepare_split(tmp_path / "train.jsonl", tmp_path / "images", tmp_path / "prepared.jsonl")
    pixels = PixelSettings.from_processor(load_image_processor(tiny_model_dir), 4096, 16384)
    build_image_cache(tmp_path / "prepared.jsonl", tmp_path / "images", tmp_path / "cache", pixels)
    inputs = StageInputs(str(tiny_model_dir), [str(tmp_path / "prepared.jsonl")], [str(tmp_path / "cache")], None)

    def train(name, budget):
        out = tmp_path / name
        settings = tiny_stage_settings(max_steps=3, micro_batch=8, max_batch_tokens=budget)
        summary = train_stage(
            inputs, settings, out / "a", out / "log.jsonl", out / "s.json", out / "ckpt", 100, dtype=torch.float64
        )
        return summary, load_file(out / "a/adapter_model.safetensors")

    auto, auto_adapter = train("auto", "auto")
    assert auto["max_batch_tokens_auto"] == {
        "max_batch_tokens": None,
        "why": "no GPU: micro_batch samples a micro-batch",
    }
    none, none_adapter = train("none", None)
    assert "max_batch_tokens_auto" not in none
    assert all(torch.equal(auto_adapter[k], none_adapter[k]) for k in none_adapter)

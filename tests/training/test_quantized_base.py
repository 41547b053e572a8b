"""QLoRA (`quantization_bit: 4`): a stage trains on a 4-bit NF4 base, and its adapter serves on the
full-precision base, as the evaluation and export use it. On the CPU, through bitsandbytes' own CPU
path; the memory it saves is measured on the GPU (benchmarks/README.md, "Smaller GPUs")."""

from __future__ import annotations

from pathlib import Path

import bitsandbytes
import pytest
import torch

from tests.helpers import tiny_stage_settings
from vlft.generation.evaluate import evaluate_split
from vlft.files import read_jsonl
from vlft.caches.image_cache import PixelSettings, build_image_cache
from vlft.modeling import load_base_model, load_image_processor
from vlft.data.records import prepare_split
from vlft.training.train import StageInputs, train_stage

EVALUATION = {"answer_format": "final", "max_seq_len": 4096, "max_new_tokens": 8, "batch_size": 8}


@pytest.fixture(scope="module")
def split(tmp_path_factory, tiny_model_dir) -> Path:
    from vlft.demo.shapes import make_dataset

    root = tmp_path_factory.mktemp("qlora")
    make_dataset({"train": root / "train.jsonl"}, root / "images", {"train": 32}, seed=2)
    prepare_split(root / "train.jsonl", root / "images", root / "prepared.jsonl")
    pixels = PixelSettings.from_processor(load_image_processor(tiny_model_dir), 4096, 16384)
    build_image_cache(root / "prepared.jsonl", root / "images", root / "cache", pixels)
    return root


def test_the_language_models_linear_layers_load_in_4bit_and_the_tower_does_not(tiny_model_dir):
    model = load_base_model(tiny_model_dir, torch.device("cpu"), torch.float32, quantization_bit=4)
    layer = model.model.language_model.layers[0]
    assert isinstance(layer.self_attn.q_proj, bitsandbytes.nn.Linear4bit)
    assert layer.self_attn.q_proj.weight.quant_state.quant_type == "nf4"
    assert isinstance(layer.mlp.down_proj, bitsandbytes.nn.Linear4bit)
    # The tower as it is (the vision cache is its output), and the output layer.
    assert not any(isinstance(m, bitsandbytes.nn.Linear4bit) for m in model.model.visual.modules())
    assert type(model.lm_head) is torch.nn.Linear


def test_a_stage_trains_on_a_4bit_base_and_its_adapter_serves_on_the_full_precision_base(
    tmp_path, tiny_model_dir, split
):
    inputs = StageInputs(str(tiny_model_dir), [str(split / "prepared.jsonl")], [str(split / "cache")], None)

    def train(name: str, **overrides) -> list[dict]:
        settings = tiny_stage_settings(max_steps=16, micro_batch=8, learning_rate=3e-3, warmup_ratio=0, **overrides)
        out = tmp_path / name
        train_stage(inputs, settings, out / "adapter", out / "log.jsonl", out / "summary.json", out / "ckpt", 1000)
        return read_jsonl(out / "log.jsonl")

    quantized = train("nf4", quantization_bit=4)
    full = train("full")
    # Another base computes the first step: not the full-precision model's loss (4-bit rounding of
    # every weight is far above float32's), and yet it learns.
    assert abs(quantized[0]["loss"] - full[0]["loss"]) > 1e-4 * full[0]["loss"]
    assert quantized[-1]["loss"] < quantized[0]["loss"] / 2

    # The adapter on the full-precision base (merged, as the evaluation loads it) answers the split
    # it trained on at a far lower loss than the base model alone.
    def loss(adapter: str | None) -> float:
        return evaluate_split(
            str(tiny_model_dir),
            adapter,
            str(split / "prepared.jsonl"),
            str(split / "cache"),
            EVALUATION,
            tmp_path / "predictions.jsonl",
            tmp_path / "metrics.json",
        )["loss"]

    assert loss(str(tmp_path / "nf4/adapter")) < loss(None) / 2

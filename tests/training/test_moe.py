"""A mixture of experts (Qwen3-VL-MoE's shape, tiny): LoRA on its attention and on its experts' 3D
weights (PEFT's target_parameters, vlft.modeling.expert_weights), saved, loaded and merged for the
evaluation, computing what the adapter computes. Its training steps are tests/training/test_sharding.py's
(sharded on two processes, equal to one process) and its forward tests/forward/test_fast_path.py's."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import FLOAT64_RTOL, assert_close_normwise
from vlft.config import stage_defaults
from vlft.errors import ConfigError
from vlft.demo.tiny_model import make_tiny_model
from vlft.modeling import load_base_model, unwrapped, with_adapter, with_new_adapter


def test_an_moe_adapter_reaches_every_experts_weights_and_merges_into_what_it_computes(tmp_path):
    make_tiny_model(tmp_path / "model", family="qwen3_vl_moe")
    cpu, dtype = torch.device("cpu"), torch.float64
    settings = stage_defaults() | {"lora_dropout": 0.0}
    model = with_new_adapter(load_base_model(tmp_path / "model", cpu, dtype), settings)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    for layer in (0, 1):
        on_experts = [name for name in trained if f"layers.{layer}.mlp.experts." in name]
        assert len(on_experts) == 4, on_experts  # A and B of gate_up_proj's and of down_proj's
    torch.manual_seed(0)
    with torch.no_grad():  # as if trained: B away from its zero start
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    ids = torch.randint(0, 100, (1, 24))
    with torch.no_grad():
        adapted = unwrapped(model).model.language_model(input_ids=ids).last_hidden_state
        base = load_base_model(tmp_path / "model", cpu, dtype).model.language_model(input_ids=ids).last_hidden_state
    assert (adapted - base).norm() > 0.01 * base.norm()  # the experts' LoRA changes what the model computes
    model.save_pretrained(tmp_path / "adapter")
    merged = with_adapter(load_base_model(tmp_path / "model", cpu, dtype), str(tmp_path / "adapter"), trainable=False)
    merged = merged.merge_and_unload()  # as the evaluation loads it (vlft.generation.evaluate)
    with torch.no_grad():
        answered = merged.model.language_model(input_ids=ids).last_hidden_state
    assert_close_normwise(answered, adapted, FLOAT64_RTOL, "merged")
    # With dropout, which PEFT's LoRA on the experts' weights does not take: one sentence, naming the key.
    with pytest.raises(ConfigError, match=r"^lora_dropout: 0.05 on a mixture of experts .* give lora_dropout: 0"):
        with_new_adapter(load_base_model(tmp_path / "model", cpu, dtype), stage_defaults())

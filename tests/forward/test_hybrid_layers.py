"""A packed row through a hybrid model's Gated DeltaNet layers (a tiny Qwen3.5 of transformers' own
classes) gives every sample the loss and LoRA gradients it gets alone, in float64; transformers'
own functions, as they are, carry one sample's convolution window and recurrent state into the next."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from vlft.caches.image_cache import ImageCache
from vlft.data.prompts import PromptBuilder
from vlft.demo.shapes import make_dataset
from vlft.files import read_jsonl
from vlft.forward import linear_attention
from vlft.forward.batching import collate, to_device
from vlft.forward.loss import answer_loss_sum
from vlft.forward.packing import pack, use_packed_attention
from vlft.modeling import load_base_model, load_tokenizer, rope_index, with_new_adapter
from tests.helpers import FLOAT64_RTOL, assert_close_normwise, tiny_family_data

FLOAT64 = torch.float64
CPU = torch.device("cpu")
# The attention and MLP projections, and the DeltaNet layers' own (queries-keys-values, gate, output).
LORA = {
    "lora_r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    + ["in_proj_qkv", "in_proj_z", "out_proj"],
}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny Qwen3.5 (three DeltaNet layers, then attention) with LoRA in float64, and 5 samples of
    varied answer lengths with their images."""
    root = tmp_path_factory.mktemp("qwen3_5")
    make_dataset({"train": root / "train.jsonl"}, root / "images", {"train": 5}, seed=1)
    tiny_family_data(root, "qwen3_5", root / "train.jsonl")
    torch.manual_seed(0)
    model = with_new_adapter(load_base_model(root / "model", CPU, FLOAT64), LORA)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # non-zero, so that every LoRA gradient is
            param.data.normal_(0, 0.02)
    tokenizer = load_tokenizer(root / "model")
    builder = PromptBuilder(tokenizer, model.config.image_token_id)
    cache = ImageCache(root / "pixels")
    records = read_jsonl(root / "prepared.jsonl")
    samples = [
        builder.sample(
            r["id"], r, r["answer"] + " because" * (3 * i), cache.num_image_tokens(cache.image_of(r["id"])), 1024
        )
        for i, r in enumerate(records)
    ]
    images = {r["id"]: (cache, cache.image_of(r["id"])) for r in records}
    return model, samples, images, builder, tokenizer.pad_token_id


def gradients(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def each_alone(model, samples, images, builder, pad_id):
    """Each sample in a batch of its own (no padding, the model's own attention): the summed loss and gradients."""
    model.zero_grad()
    total = 0.0
    for sample in samples:
        batch = collate([sample], images, builder, pad_id, rope_index=rope_index(model))
        loss, _ = answer_loss_sum(model, to_device(batch, CPU, FLOAT64))
        loss.backward()
        total += loss.item()
    return total, gradients(model)


def packed_row(model, samples, images, builder):
    model = copy.deepcopy(model)
    model.zero_grad()
    use_packed_attention(model)
    loss, _ = answer_loss_sum(model, to_device(pack(samples, images, builder, rope_index(model)), CPU, FLOAT64))
    loss.backward()
    return loss.item(), gradients(model)


def largest_relative_error(got: dict, want: dict) -> float:
    return max(((got[n] - want[n]).norm() / want[n].norm()).item() for n in want)


def test_a_packed_row_on_deltanet_layers_gives_each_sample_its_loss_and_gradients_alone(hybrid):
    model, samples, images, builder, pad_id = hybrid
    alone, alone_grads = each_alone(model, samples, images, builder, pad_id)
    assert all(g.abs().sum() > 0 for g in alone_grads.values())
    assert any("in_proj_qkv" in name for name in alone_grads)  # the DeltaNet layers' adapters are checked too
    packed, packed_grads = packed_row(model, samples, images, builder)
    assert packed == pytest.approx(alone, rel=FLOAT64_RTOL)
    for name, grad in alone_grads.items():
        assert_close_normwise(packed_grads[name], grad, FLOAT64_RTOL, name)


def test_transformers_own_functions_mix_the_samples_of_a_packed_row(hybrid, monkeypatch):
    """The failure the test above guards against, shown: with the modeling module's functions as
    transformers ships them, the same packed row's loss and gradients are those of no sample alone."""
    model, samples, images, builder, pad_id = hybrid
    use_packed_attention(copy.deepcopy(model))  # the replacements in place, as a packed job has them
    modeling = importlib.import_module(linear_attention.HYBRID_MODELING[0])
    for name in (linear_attention.CONV, linear_attention.DELTA_RULE):
        monkeypatch.setattr(modeling, name, getattr(modeling, name).vlft_plain)
    monkeypatch.setattr("vlft.forward.packing.respect_segments", lambda: None)
    alone, alone_grads = each_alone(model, samples, images, builder, pad_id)
    packed, packed_grads = packed_row(model, samples, images, builder)
    # Far above float64's rounding (FLOAT64_RTOL): a sample reading the one before it.
    assert abs(packed - alone) > 1e4 * FLOAT64_RTOL * alone
    assert largest_relative_error(packed_grads, alone_grads) > 1e-3


@pytest.mark.parametrize("lengths", [[7, 1, 2, 9], [3], [1, 1, 1]])
def test_the_segments_convolution_is_each_segments_own(lengths):
    """Segments shorter than the kernel included: each equals a causal convolution of it alone."""
    torch.manual_seed(1)
    channels, kernel = 6, 4
    row = torch.randn(1, channels, sum(lengths), dtype=FLOAT64)
    weight, bias = torch.randn(channels, kernel, dtype=FLOAT64), torch.randn(channels, dtype=FLOAT64)
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
    got = linear_attention.segment_causal_conv1d(row, weight, bias, "silu", cu_seqlens)
    pieces = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        alone = torch.nn.functional.conv1d(
            row[..., start:end], weight[:, None], bias, padding=kernel - 1, groups=channels
        )
        pieces.append(torch.nn.functional.silu(alone[..., : end - start]))
    torch.testing.assert_close(got, torch.cat(pieces, dim=-1), rtol=FLOAT64_RTOL, atol=0)


def test_a_shared_prefix_on_deltanet_layers_is_refused_not_computed_wrong(hybrid):
    """An image group's row hands each question no prefix state yet: said, not trained wrong."""
    model, samples, images, builder, _ = hybrid
    use_packed_attention(copy.deepcopy(model))
    modeling = importlib.import_module(linear_attention.HYBRID_MODELING[0])
    tokens = torch.zeros(1, 4, 2, 16, dtype=FLOAT64)
    with pytest.raises(NotImplementedError, match="image groups and kept prompts do not yet run"):
        getattr(modeling, linear_attention.DELTA_RULE)(
            tokens,
            tokens,
            tokens,
            tokens[..., 0],
            tokens[..., 0],
            packed_cu_seqlens=torch.tensor([0, 4]),
            packed_prefix_index=torch.tensor([0]),
        )

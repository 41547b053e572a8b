"""The generation engine on a hybrid model (a tiny Qwen3.5 of transformers' own classes: Gated
DeltaNet layers beside attention): each row's convolution window and recurrent state held beside
the attention layers' keys and values, handed on from its prompt's prefill (an image's prefix
once, a scored reference answer after the prompt) and updated at each step."""

from __future__ import annotations

import pytest
import torch

from vlft.generation.engine import Engine
from vlft.generation.kv_cache import SlotCache
from vlft.modeling import language_model
from tests.generation.test_generation import assert_answers_are_generates, images_asked_about, model_with


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return images_asked_about(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")


def test_a_hybrid_models_answers_are_generates_token_for_token(hybrid):
    assert_answers_are_generates("qwen3_5", hybrid, model_with(hybrid, "none"), trained=False)


def test_a_hybrid_engine_counts_its_rows_states_in_what_it_holds(hybrid):
    """The states do not grow with a row's length: what a kept engine is sized by counts them."""
    model = model_with(hybrid, "none")
    text = language_model(model)
    linear = [layer.linear_attn for layer in text.layers if hasattr(layer, "linear_attn")]
    assert len(linear) == 3 and len(text.layers) == 4
    per_row = SlotCache.bytes_per_row(model)
    conv = sum(m.conv_dim * m.conv_kernel_size * 4 for m in linear)  # float32 weights here
    recurrent = sum(m.num_v_heads * m.head_k_dim * m.head_v_dim * 4 for m in linear)
    assert per_row == conv + recurrent > 0
    engine = Engine(model, slots=3, max_length=200)
    assert engine.bytes == Engine.cache_bytes(model, 3, 200, None)
    assert engine.bytes == 3 * (engine.cache.length * SlotCache.bytes_per_token(model) + per_row)
    engine.release()
    assert SlotCache.bytes_per_row(model_with_attention_only()) == 0


def model_with_attention_only():
    from vlft.demo.tiny_model import make_config, make_tokenizer
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(make_config(make_tokenizer(), 64, 2))


def test_a_rows_window_serves_both_ways_transformers_reads_a_layers_states(hybrid):
    """Newer transformers releases ask the cache for a layer's states (`get_conv_state(i)`); older ones ask
    `has_previous_state(i)` and read `cache.layers[i].conv_states[0]`. Both reach the same rows,
    and an update through either lands in the slot cache."""
    model = model_with(hybrid, "none")
    cache = SlotCache(model, slots=3, length=256)
    index = next(iter(cache.states))
    cache.states[index].conv.normal_()
    window = cache.window(2, 256)
    for view in (window, window.layer(index)):
        assert view.has_previous_state(index, state_idx=0) and not view.is_recording_past(index)
        assert not view.layers[index].record_past
        newer, older = view.get_conv_state(index), view.layers[index].conv_states[0]
        assert newer.shape[0] == older.shape[0] == 2 and torch.equal(newer, older)
        older.add_(1.0)  # transformers' decode updates the window in place
        assert torch.equal(cache.states[index].conv[:2], older)
        state = torch.randn_like(view.layers[index].recurrent_states[0])
        view.update_recurrent_state(state, index)
        assert torch.equal(cache.states[index].recurrent[:2], state)
    assert torch.all(cache.states[index].recurrent[2] == 0)  # the row past the window untouched

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
from vlft.modeling import compile_decoder_layers
from tests.helpers import (
    FLOAT64_RTOL,
    assert_close_normwise,
    delta_rule_in_input_dtype,
    image_groups_rtol,
    tiny_family_data,
)

FLOAT64 = torch.float64
CPU = torch.device("cpu")
# At most this many questions on one image's prefix in the fixture (tests.helpers.image_groups_rtol).
QUESTIONS_ON_A_PREFIX = 3
GROUPED_RTOL = image_groups_rtol("qwen3_5", QUESTIONS_ON_A_PREFIX)
# The attention and MLP projections, and the DeltaNet layers' own (queries-keys-values, gate, output).
LORA = {
    "lora_r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "vision_lora": False,
    "train_merger": False,
    "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    + ["in_proj_qkv", "in_proj_z", "out_proj"],
}


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A tiny Qwen3.5 (three DeltaNet layers, then attention) and 5 records, prepared and cached."""
    root = tmp_path_factory.mktemp("qwen3_5")
    make_dataset({"train": root / "train.jsonl"}, root / "images", {"train": 5}, seed=1)
    return tiny_family_data(root, "qwen3_5", root / "train.jsonl")


@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    """The tiny Qwen3.5 with LoRA in float64, and 5 samples of varied answer lengths with their images."""
    root = hybrid_dir
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
    each_alone = linear_attention.LinearPieces(cu_seqlens.tolist(), [-1] * len(lengths))
    got = linear_attention.pieces_causal_conv1d(row, weight, bias, "silu", each_alone)
    pieces = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        alone = torch.nn.functional.conv1d(
            row[..., start:end], weight[:, None], bias, padding=kernel - 1, groups=channels
        )
        pieces.append(torch.nn.functional.silu(alone[..., : end - start]))
    torch.testing.assert_close(got, torch.cat(pieces, dim=-1), rtol=FLOAT64_RTOL, atol=0)


def test_kept_prompts_on_deltanet_layers_are_refused_not_computed_wrong(hybrid):
    """A reward stage's answers after kept prompts would need each prompt's state, which is not
    handed on yet: said, not trained wrong."""
    model, samples, images, builder, _ = hybrid
    use_packed_attention(copy.deepcopy(model))
    modeling = importlib.import_module(linear_attention.HYBRID_MODELING[0])
    tokens = torch.zeros(1, 4, 2, 16, dtype=FLOAT64)
    with pytest.raises(NotImplementedError, match="kept prompts do not yet run"):
        getattr(modeling, linear_attention.DELTA_RULE)(
            tokens,
            tokens,
            tokens,
            tokens[..., 0],
            tokens[..., 0],
            packed_cu_seqlens=torch.tensor([0, 4]),
            packed_own_prompt_index=torch.tensor([0]),
        )


@pytest.fixture
def float64_delta_rule(monkeypatch):
    """transformers' delta rule computes in float32 whatever it is given: in its place, for packed
    rows and samples alone alike, the same rule in the inputs' dtype."""
    linear_attention.respect_segments()
    modeling = importlib.import_module(linear_attention.HYBRID_MODELING[0])
    monkeypatch.setattr(getattr(modeling, linear_attention.DELTA_RULE), "vlft_plain", delta_rule_in_input_dtype)


def test_the_float64_delta_rule_is_transformers_rule_in_float64():
    """What the tests below put in place of transformers' function computes what it computes, to
    float32's rounding (theirs): each output sums at most `length` tokens' contributions through a
    state of `k_dim` rows, so their difference stays within length * k_dim * float32's unit."""
    modeling = importlib.import_module(linear_attention.HYBRID_MODELING[0])
    theirs = getattr(modeling, linear_attention.DELTA_RULE)
    theirs = getattr(theirs, "vlft_plain", theirs)
    torch.manual_seed(3)
    length, k_heads, v_heads, k_dim, v_dim = 150, 2, 4, 16, 8  # past one 64-token chunk, grouped heads
    query, key = (torch.randn(1, length, k_heads, k_dim, dtype=FLOAT64) for _ in range(2))
    value = torch.randn(1, length, v_heads, v_dim, dtype=FLOAT64)
    g = -torch.rand(1, length, v_heads, dtype=FLOAT64)
    beta = torch.rand(1, length, v_heads, dtype=FLOAT64)
    state = torch.randn(1, v_heads, k_dim, v_dim, dtype=FLOAT64)
    options = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_out, want_state = theirs(query, key, value, g, beta, **options)
    got_out, got_state = delta_rule_in_input_dtype(query, key, value, g, beta, **options)
    bound = length * k_dim * torch.finfo(torch.float32).eps
    assert_close_normwise(got_out, want_out, bound, "output")
    assert_close_normwise(got_state, want_state, bound, "final state")
    # Far below what a state carried wrong does: the same rule from no state.
    wrong, _ = delta_rule_in_input_dtype(query, key, value, g, beta, output_final_state=True)
    assert ((wrong - want_out).norm() / want_out.norm()).item() > 100 * bound


@pytest.mark.parametrize("rule", ["transformers' chunked rule", "float64 token by token"])
def test_pieces_side_by_side_are_each_piece_alone(rule):
    """Pieces of a row padded into one call of the delta rule, two of them from a parent's state:
    each piece's output and final state are those of its own call. The chunked rule (float32
    inside) rounds its chunks' sums by up to length * k_dim * float32's unit, as above; the
    token-by-token one in float64 adds the padding's exact zeros alone."""
    modeling = importlib.import_module(linear_attention.HYBRID_MODELING[0])
    theirs = getattr(modeling, linear_attention.DELTA_RULE)
    plain = getattr(theirs, "vlft_plain", theirs) if rule.startswith("transformers") else delta_rule_in_input_dtype
    torch.manual_seed(4)
    lengths, k_heads, v_heads, k_dim, v_dim = [150, 40, 97], 2, 4, 16, 8
    row = sum(lengths)
    query, key = (torch.randn(1, row, k_heads, k_dim, dtype=FLOAT64) for _ in range(2))
    value = torch.randn(1, row, v_heads, v_dim, dtype=FLOAT64)
    g = -torch.rand(1, row, v_heads, dtype=FLOAT64)
    beta = torch.rand(1, row, v_heads, dtype=FLOAT64)
    states = torch.randn(3, v_heads, k_dim, v_dim, dtype=FLOAT64)
    bounds = [0, 150, 190, 287]
    spans = list(zip(bounds, bounds[1:]))
    tensors = (query, key, value, g, beta)
    options = dict(use_qk_l2norm_in_kernel=True)
    outs, finals = linear_attention.side_by_side(plain, tensors, spans, states, **options)
    bound = (
        FLOAT64_RTOL if plain is delta_rule_in_input_dtype else max(lengths) * k_dim * torch.finfo(torch.float32).eps
    )
    for n, (start, end) in enumerate(spans):
        piece = (t[:, start:end] for t in tensors)
        want_out, want_state = plain(*piece, initial_state=states[n : n + 1], output_final_state=True, **options)
        assert outs[n].shape == want_out.shape
        assert_close_normwise(outs[n], want_out, bound, f"piece {n}'s output")
        assert_close_normwise(finals[n : n + 1], want_state, bound, f"piece {n}'s final state")


@pytest.mark.parametrize("lengths", [[5], [100, 90, 10, 9, 300, 80], [64] * 7])
def test_pieces_batched_side_by_side_pad_at_most_a_quarter(lengths):
    """Every piece in one batch exactly, the longest first, a batch's padded tokens within 1.25
    times its own."""
    batches = linear_attention.similar_lengths(lengths)
    assert sorted(n for batch in batches for n in batch) == list(range(len(lengths)))
    for batch in batches:
        longest = max(lengths[n] for n in batch)
        assert lengths[batch[0]] == longest
        assert longest * len(batch) <= 1.25 * sum(lengths[n] for n in batch)
    assert len(linear_attention.similar_lengths([64] * 7)) == 1


@pytest.fixture(scope="module")
def grouped(hybrid, hybrid_dir):
    """Questions sharing images: three on the first image, two on the second, one alone on the third."""
    _, samples, images, builder, _ = hybrid
    records = {r["id"]: r for r in read_jsonl(hybrid_dir / "prepared.jsonl")}
    asked = [("How many shapes are there?", "Two."), ("What colour is the largest?", "Red, because" + " it" * 5)]
    grouped_samples, grouped_images, groups = [], dict(images), []
    for first, extra in ((samples[0], asked), (samples[1], asked[:1]), (samples[2], [])):
        group = [first]
        cache, image = images[first.record_id]
        for n, (question, answer) in enumerate(extra):
            key = f"{first.record_id}-asked-{n}"
            grouped_images[key] = (cache, image)
            record = dict(records[first.record_id], question=question)
            group.append(builder.sample(key, record, answer, cache.num_image_tokens(image), 1024))
        groups.append(group)
        grouped_samples += group
    return groups, grouped_samples, grouped_images


@pytest.mark.parametrize("prefix_once", [True, False], ids=["prefix once", "prefix gathered"])
def test_an_image_groups_row_on_deltanet_layers_gives_each_question_its_loss_and_gradients_alone(
    hybrid, grouped, float64_delta_rule, prefix_once
):
    """Each question after its image's prefix starts the DeltaNet layers from the prefix's
    recurrent state and convolution window; the gradient through that state sums over the
    questions. In float64 (but for transformers' own float32 parts: GROUPED_RTOL), against each
    question run alone through the model's own path."""
    from vlft.forward.image_groups import ImageGroup, RowLayout
    from vlft.forward.packing import pack_groups

    model, _, _, builder, pad_id = hybrid
    groups, samples, images = grouped
    alone, alone_grads = each_alone(model, samples, images, builder, pad_id)
    image_groups = [ImageGroup.of(g) for g in groups]
    assert [g.shared > 0 for g in image_groups] == [True, True, False]
    row = pack_groups(image_groups, images, builder, rope_index(model))
    if not prefix_once:  # as an evaluation's prefill lays it out: each question's keys gathered whole
        row = {k: v for k, v in row.items() if not k.startswith("packed_")}
        layout = RowLayout.of([(g.shared, [len(s.input_ids) for s in g.samples]) for g in image_groups])
        row |= layout.attention_inputs(prefix_once=False)
    assert row["input_ids"].shape[1] < sum(len(s.input_ids) for s in samples)  # the prefixes laid out once
    grouped_model = copy.deepcopy(model)
    grouped_model.zero_grad()
    use_packed_attention(grouped_model)
    loss, _ = answer_loss_sum(grouped_model, to_device(row, CPU, FLOAT64))
    loss.backward()
    assert loss.item() == pytest.approx(alone, rel=FLOAT64_RTOL)
    grads = gradients(grouped_model)
    assert max(len(g) for g in groups) == QUESTIONS_ON_A_PREFIX
    for name, grad in alone_grads.items():
        assert_close_normwise(grads[name], grad, GROUPED_RTOL, name)


def test_without_the_prefix_state_the_questions_are_those_of_no_question_alone(hybrid, grouped, float64_delta_rule):
    """The failure the test above guards against: the same row with every piece from zero (the
    questions not handed the prefix's state) gives other losses."""
    from vlft.forward.image_groups import ImageGroup
    from vlft.forward.packing import pack_groups

    model, _, _, builder, pad_id = hybrid
    groups, samples, images = grouped
    alone, _ = each_alone(model, samples, images, builder, pad_id)
    row = pack_groups([ImageGroup.of(g) for g in groups], images, builder, rope_index(model))
    row["packed_linear_parents"] = torch.full_like(row["packed_linear_parents"], -1)
    grouped_model = copy.deepcopy(model)
    use_packed_attention(grouped_model)
    with torch.no_grad():
        loss, _ = answer_loss_sum(grouped_model, to_device(row, CPU, FLOAT64))
    assert abs(loss.item() - alone) > 1e4 * FLOAT64_RTOL * alone


def test_a_row_with_shared_prefixes_and_no_pieces_is_refused():
    """Segments that read a prefix beyond their own stretch, with no word of where their
    DeltaNet state starts from, would start it from zero: refused."""
    with pytest.raises(ValueError, match="needs its linear-attention pieces"):
        linear_attention.LinearPieces.of(
            {"packed_cu_seqlens": torch.tensor([0, 4]), "packed_key_index": torch.arange(4)}
        )


@pytest.mark.parametrize("prefix", [2, 7])
def test_the_convolution_after_a_prefix_reads_the_prefixs_tail(prefix):
    """Pieces [prefix][a][b][alone]: a and b each as the prefix and it computed alone, the prefix
    shorter than the kernel's reach included."""
    torch.manual_seed(2)
    channels, kernel, own = 5, 4, [3, 1, 6]
    lengths = [prefix] + own
    row = torch.randn(1, channels, sum(lengths), dtype=FLOAT64)
    weight, bias = torch.randn(channels, kernel, dtype=FLOAT64), torch.randn(channels, dtype=FLOAT64)
    bounds = torch.tensor([0] + lengths).cumsum(0).tolist()
    pieces = linear_attention.LinearPieces(bounds, [-1, 0, 0, -1])
    got = linear_attention.pieces_causal_conv1d(row, weight, bias, "silu", pieces)

    def alone(inputs):
        out = torch.nn.functional.conv1d(inputs, weight[:, None], bias, padding=kernel - 1, groups=channels)
        return torch.nn.functional.silu(out[..., : inputs.shape[-1]])

    stretch = [row[..., s:e] for s, e in zip(bounds[:-1], bounds[1:])]
    want = [
        alone(stretch[0]),
        alone(torch.cat([stretch[0], stretch[1]], -1))[..., prefix:],
        alone(torch.cat([stretch[0], stretch[2]], -1))[..., prefix:],
        alone(stretch[3]),
    ]
    torch.testing.assert_close(got, torch.cat(want, dim=-1), rtol=FLOAT64_RTOL, atol=0)
    # The window a piece hands on is the last `kernel` inputs it read, zeros before its sample.
    source, valid = pieces.windows(kernel, CPU)
    b_alone = torch.nn.functional.pad(torch.cat([stretch[0], stretch[2]], -1), (kernel, 0))
    b_window = b_alone[..., -kernel:]
    torch.testing.assert_close(row[0][:, source[2]] * valid[2], b_window[0], rtol=0, atol=0)


def test_a_piece_cut_after_a_short_one_reads_back_through_its_parents():
    """[prefix][prompt, 1 token, from the prefix][answer, from the prompt] (a prefill's scored
    request on an image group): the answer's taps reach past its one-token parent into the prefix."""
    torch.manual_seed(4)
    channels, kernel, lengths = 3, 4, [5, 1, 4]
    row = torch.randn(1, channels, sum(lengths), dtype=FLOAT64)
    weight = torch.randn(channels, kernel, dtype=FLOAT64)
    pieces = linear_attention.LinearPieces(torch.tensor([0] + lengths).cumsum(0).tolist(), [-1, 0, 1])
    got = linear_attention.pieces_causal_conv1d(row, weight, None, None, pieces)
    alone = torch.nn.functional.conv1d(row, weight[:, None], padding=kernel - 1, groups=channels)[..., : row.shape[-1]]
    torch.testing.assert_close(got, alone, rtol=FLOAT64_RTOL, atol=0)  # one sample, in three pieces


def test_compiled_deltanet_layers_run_new_rows_without_compiling_again(hybrid):
    """A training job compiles its decoder layers once (vlft.modeling.compile_decoder_layers):
    a packed row's pieces are Python numbers that differ every step, and traced into the layer's
    graph they made it compile again for every row (a 9B's first steps never ended on the GPU).
    Rows of other lengths and piece bounds reuse what the first rows compiled."""
    from torch._dynamo.testing import CompileCounter

    model, samples, images, builder, _ = hybrid
    model = copy.deepcopy(model)
    use_packed_attention(model)
    counter = CompileCounter()
    compile_decoder_layers(model, backend=counter)

    def row(chosen):
        batch = to_device(pack(chosen, images, builder, rope_index(model)), CPU, FLOAT64)
        answer_loss_sum(model, batch)[0].backward()

    try:
        row(samples[:2])
        row(samples[1:4])  # the first rows compile for dynamic shapes
        compiled = counter.frame_count
        assert compiled > 0
        row(samples[2:])
        row(samples[::2])
        assert counter.frame_count == compiled
    finally:
        torch._dynamo.reset()

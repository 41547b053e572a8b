"""Answers' attention over their kept prompts in two parts, a shared prefix read once and each
answer's own keys, merged by log-sum-exp (vlft.forward.prefix_attention), against the plain
attention over each answer's keys laid out whole: outputs and gradients, forward and backward."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import FLOAT64_RTOL, assert_close_normwise
from vlft.forward.image_groups import RowLayout
from vlft.forward.packing import packed_attention
from vlft.forward.prefix_attention import FlashKernels, ReferenceKernels, kernels_for
from vlft.training.shared_prompts import _after_prompts, _gathered

# Kept prompts as a prefill lays them out (positions among all prompt keys): two answers' prompts
# on prefix 0-6, each with its own last prompt token (7, then 8); a third prompt on that prefix
# after another prefix's, so it starts a run of its own; two questions on one image's prefix
# 12-16, each with its own 3 and 2 tokens (an image group).
PROMPTS = [
    list(range(0, 7)) + [7],
    list(range(0, 7)) + [8],
    list(range(9, 12)),
    list(range(0, 7)) + [7],
    list(range(12, 17)) + [17, 18, 19],
    list(range(12, 17)) + [20, 21],
]
SHARED = [7, 7, 2, 7, 5, 5]
ANSWER_LENGTHS = [4, 1, 3, 6, 3, 5]
PROMPT_KEYS = 22

# Where the two parts' kernels run: the CPU reference's blocks of segments (each part whole, a few
# segments a block, one segment a block), and a GPU's flash kernels in bf16.
KERNELS = [("cpu", ReferenceKernels.BLOCK_SCORES), ("cpu", 40), ("cpu", 1)] + (
    [("cuda", None)] if torch.cuda.is_available() else []
)


def attention_inputs(layout: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in layout.items()}


def answers_attention(query, key, value, prompt_keys, prompt_values, layout: dict, device):
    lengths = ANSWER_LENGTHS
    output, _ = packed_attention(
        None,
        query,
        key,
        value,
        None,
        scaling=0.125,
        packed_cu_seqlens=torch.tensor([0] + lengths, device=device).cumsum(0, dtype=torch.int32),
        packed_max_seqlen=max(lengths),
        packed_prompt_keys=prompt_keys,
        packed_prompt_values=prompt_values,
        **attention_inputs(layout, device),
    )
    return output


@pytest.mark.parametrize("device, block_scores", KERNELS)
def test_a_shared_prefix_read_once_gives_each_answer_the_attention_over_its_whole_keys(
    device, block_scores, monkeypatch
):
    """8 query heads share 2 key/value heads, as in Qwen-VL. Against the attention over each
    answer's keys gathered whole (its prompt's, then its own tokens'), which
    test_packed_attention_attends_within_each_sample_only checks against an explicit mask; on a
    GPU in bf16, the flash kernels against that path's float32 arithmetic. On the CPU, the
    reference's blocks of segments: each part whole, a few segments a block, one segment a block."""
    if block_scores is not None:
        monkeypatch.setattr(ReferenceKernels, "BLOCK_SCORES", block_scores)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float64
    prompts = [torch.tensor(p) for p in PROMPTS]
    tokens = sum(ANSWER_LENGTHS)
    query = torch.randn(1, 8, tokens, 64, device=device, dtype=dtype, requires_grad=True)
    key, value = (torch.randn(1, 2, tokens, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    prompt_keys, prompt_values = (
        torch.randn(1, 2, PROMPT_KEYS, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(2)
    )
    inputs = (query, key, value, prompt_keys, prompt_values)
    two_parts = _after_prompts(prompts, SHARED, ANSWER_LENGTHS)
    # The third answer's prompt is a prefix of its own (2 tokens) and one more; the fourth's is the
    # first prefix again, after another: four prefix runs in all.
    assert two_parts["packed_prefix_cu_seqlens_q"].tolist() == [0, 5, 8, 14, 22]
    got = answers_attention(*inputs, two_parts, device)
    whole = [x.detach().to(reference_dtype(dtype)).requires_grad_() for x in inputs]
    want = answers_attention(*whole, _gathered(prompts, ANSWER_LENGTHS, PROMPT_KEYS), device)
    assert got.shape == want.shape == (1, tokens, 8, 64)
    assert_same_attention_and_gradients(got, inputs, want, whole)


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the plain path computes in: the bf16 values in float32 (exactly enough), else their own."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


def assert_same_attention_and_gradients(got, inputs, want, whole) -> None:
    """Two parts' attention `got` from `inputs`, against the plain path's `want` from `whole`: the
    outputs and the inputs' gradients of the outputs' squared sum."""
    dtype = inputs[0].dtype
    gradients = torch.autograd.grad(got.to(reference_dtype(dtype)).square().sum(), inputs)
    expected_gradients = torch.autograd.grad(want.square().sum(), whole)
    for got_one, want_one in zip((got, *gradients), (want, *expected_gradients)):
        if dtype == torch.bfloat16:
            # Each part's kernel rounds its weights and output to bf16 (2^-9 each), the merge its
            # output once more, and the backward also the incoming gradient and two
            # intermediates, as the plain kernel does: at most 6 roundings, 6 * 2^-9 as whole
            # tensors. A key in the wrong part, or a part's share misweighted, is of order 1.
            assert_close_normwise(got_one, want_one, 6 * 2**-9)
        else:
            assert_close_normwise(got_one, want_one, FLOAT64_RTOL)


def test_the_flash_kernels_run_only_where_they_can():
    """On the CPU, and in float32 or float64 anywhere, the reference's arithmetic runs."""
    assert kernels_for(torch.zeros(1, dtype=torch.float64)) is ReferenceKernels
    assert kernels_for(torch.zeros(1, dtype=torch.bfloat16)) is ReferenceKernels
    if torch.cuda.is_available():
        assert kernels_for(torch.zeros(1, dtype=torch.bfloat16, device="cuda")) is FlashKernels
        assert kernels_for(torch.zeros(1, dtype=torch.float32, device="cuda")) is ReferenceKernels


def test_compiled_as_one_op_it_computes_what_it_computes_eagerly():
    """A compiled decoder layer calls the two-part attention as one custom op (the answers' forward
    on a GPU): its fake kernels give the real ones' shapes, strides and dtypes (torch.library's own
    checks), and compiled whole, with dynamic shapes, forward and backward equal the eager ones."""
    torch.manual_seed(0)
    prompts = [torch.tensor(p) for p in PROMPTS]
    tokens = sum(ANSWER_LENGTHS)
    inputs = [
        torch.randn(1, heads, length, 64, dtype=torch.float64, requires_grad=True)
        for heads, length in [(8, tokens), (2, tokens), (2, tokens), (2, PROMPT_KEYS), (2, PROMPT_KEYS)]
    ]
    layout = _after_prompts(prompts, SHARED, ANSWER_LENGTHS)
    query, key, value, prompt_keys, prompt_values = inputs
    own_k = torch.cat([prompt_keys.index_select(2, layout["packed_own_prompt_index"]), key], 2)
    own_v = torch.cat([prompt_values.index_select(2, layout["packed_own_prompt_index"]), value], 2)
    own_k, own_v = (t.index_select(2, layout["packed_key_index"]) for t in (own_k, own_v))
    prefix_k, prefix_v = (t.index_select(2, layout["packed_prefix_index"]) for t in (prompt_keys, prompt_values))
    lengths = torch.tensor([0] + ANSWER_LENGTHS).cumsum(0, dtype=torch.int32)
    op_inputs = (
        *(t[0].transpose(0, 1).detach().requires_grad_() for t in (query, prefix_k, prefix_v, own_k, own_v)),
        None,
        layout["packed_prefix_cu_seqlens_q"],
        layout["packed_prefix_cu_seqlens_k"],
        layout["packed_prefix_max_seqlen_q"],
        layout["packed_prefix_max_seqlen_k"],
        lengths,
        layout["packed_cu_seqlens_k"],
        max(ANSWER_LENGTHS),
        layout["packed_max_seqlen_k"],
        0.125,
    )
    torch.library.opcheck(torch.ops.vlft.prefix_then_own.default, op_inputs)

    def attention(*tensors):
        return answers_attention(*tensors, layout, "cpu")

    eager = attention(*inputs)
    compiled = torch.compile(attention, dynamic=True, fullgraph=True)(*inputs)
    assert torch.equal(compiled, eager)
    eager_gradients = torch.autograd.grad(eager.square().sum(), inputs)
    compiled_gradients = torch.autograd.grad(compiled.square().sum(), inputs)
    assert all(torch.equal(c, e) for c, e in zip(compiled_gradients, eager_gradients))


# An image group's row as pack_groups lays it out (RowLayout.of: each group's shared prefix and its
# samples' whole lengths): three questions on a 6-token prefix, a sample alone, two questions on a
# 3-token prefix.
ROW_GROUPS = [(6, [10, 9, 11]), (0, [7]), (3, [5, 6])]


def row_attention(query, key, value, inputs: dict, device):
    output, _ = packed_attention(None, query, key, value, None, scaling=0.125, **attention_inputs(inputs, device))
    return output


@pytest.mark.parametrize("device, block_scores", KERNELS)
def test_an_image_groups_row_reads_each_prefix_once_and_gives_each_sample_its_whole_keys_attention(
    device, block_scores, monkeypatch
):
    """Each group's prefix a segment of its own, read once by all its samples' own tokens, against
    each sample's keys gathered whole (`prefix_once=False`, an evaluation's prefill; what
    test_fast_path.py's test_packed_attention_attends_within_each_sample_only checks against an
    explicit mask): outputs and the gradients of queries, keys and values, the prefixes' summed
    over their samples."""
    if block_scores is not None:
        monkeypatch.setattr(ReferenceKernels, "BLOCK_SCORES", block_scores)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float64
    layout = RowLayout.of(ROW_GROUPS)
    inputs = layout.attention_inputs()
    # The prefixes' own segments split their groups' first samples: 6 | 4, 9 - 6, 11 - 6, 7, 3 | 2, 6 - 3.
    assert inputs["packed_cu_seqlens"].diff().tolist() == [6, 4, 3, 5, 7, 3, 2, 3]
    assert inputs["packed_prefix_index"].tolist() == list(range(6)) + list(range(25, 28))
    assert inputs["packed_prefix_cu_seqlens_q"].diff().tolist() == [12, 5]
    tokens = layout.segments[-1][1]
    query = torch.randn(1, 8, tokens, 64, device=device, dtype=dtype, requires_grad=True)
    key, value = (torch.randn(1, 2, tokens, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    got = row_attention(query, key, value, inputs, device)
    whole = [x.detach().to(reference_dtype(dtype)).requires_grad_() for x in (query, key, value)]
    gathered = layout.attention_inputs(prefix_once=False)
    assert gathered["packed_key_index"].tolist()[:19] == list(range(10)) + list(range(6)) + [10, 11, 12]
    want = row_attention(*whole, gathered, device)
    assert got.shape == want.shape == (1, tokens, 8, 64)
    assert_same_attention_and_gradients(got, (query, key, value), want, whole)


def test_an_image_groups_row_compiled_as_one_op_computes_what_it_computes_eagerly():
    """The row's two parts as one custom op inside a compiled decoder layer (a training stage's on a
    GPU): the fake kernels' shapes, strides and dtypes with some queries on a prefix (torch.library's
    own checks), and forward and backward compiled whole, with dynamic shapes, equal to eager."""
    torch.manual_seed(0)
    layout = RowLayout.of(ROW_GROUPS)
    inputs = layout.attention_inputs()
    tokens = layout.segments[-1][1]
    query, key, value = (
        torch.randn(1, heads, tokens, 64, dtype=torch.float64, requires_grad=True) for heads in (8, 2, 2)
    )
    prefix_k, prefix_v = (t.index_select(2, inputs["packed_prefix_index"]) for t in (key, value))
    op_inputs = (
        *(t[0].transpose(0, 1).detach().requires_grad_() for t in (query, prefix_k, prefix_v, key, value)),
        inputs["packed_prefix_query_index"],
        inputs["packed_prefix_cu_seqlens_q"],
        inputs["packed_prefix_cu_seqlens_k"],
        inputs["packed_prefix_max_seqlen_q"],
        inputs["packed_prefix_max_seqlen_k"],
        inputs["packed_cu_seqlens"],
        inputs["packed_cu_seqlens"],
        inputs["packed_max_seqlen"],
        inputs["packed_max_seqlen"],
        0.125,
    )
    torch.library.opcheck(torch.ops.vlft.prefix_then_own.default, op_inputs)

    def attention(*tensors):
        return row_attention(*tensors, inputs, "cpu")

    eager = attention(query, key, value)
    compiled = torch.compile(attention, dynamic=True, fullgraph=True)(query, key, value)
    assert torch.equal(compiled, eager)
    eager_gradients = torch.autograd.grad(eager.square().sum(), (query, key, value))
    compiled_gradients = torch.autograd.grad(compiled.square().sum(), (query, key, value))
    assert all(torch.equal(c, e) for c, e in zip(compiled_gradients, eager_gradients))

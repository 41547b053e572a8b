"""Packed micro-batches: a step's samples laid end to end in one row, with no padding at all.

Grouping samples by length still pads each micro-batch to its longest sample; on the benchmark's
Kvasir-like mix of sample lengths that is a sizeable share of the tokens computed (benchmarks/README.md). A packed row computes
only real tokens. What keeps the samples apart:

- positions: each sample's M-RoPE positions are its own, computed as if it were alone (`pack`);
- attention: causal within each sample and never across, from the samples' boundaries
  (`cu_seqlens`, as flash-attention's variable-length kernels take them), in `packed_attention`;
  with image groups (vlft.forward.image_groups) the samples on one image share its prefix, laid out once;
- the loss: only answer tokens are scored, and the last token of one sample predicts nothing.

So a packed micro-batch gives each sample the loss and gradients it gets alone or padded.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from functools import partial
from typing import Callable

import torch
from transformers import AttentionInterface

from vlft.forward.batching import collate, pinned
from vlft.forward.image_groups import ImageGroup, RowLayout, group_rows
from vlft.forward.linear_attention import respect_segments
from vlft.forward.prefix_attention import Parts, prefix_then_own
from vlft.modeling import is_hybrid_model, language_model, unwrapped
from vlft.data.prompts import PromptBuilder, Sample

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # optional
    flash_attn_varlen_func = None

try:  # torch's own flash-attention kernel for variable lengths (torch >= 2.10)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

# The name under which the language model's attention layers find `packed_attention`.
PACKED_ATTENTION = "vlft_packed"


def packed_batches(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """A step's samples in as few rows of at most `max_tokens` tokens as first-fit by decreasing
    length finds (a sample longer than the budget gets a row of its own): vlft.forward.image_groups'
    rows, every sample a group of one."""
    rows = group_rows([ImageGroup([s], 0) for s in samples], max_tokens, None)
    return [[group.samples[0] for group in row] for row in rows]


def pack(samples: list[Sample], images: dict, builder: PromptBuilder, rope_index: Callable, pin: bool = False) -> dict:
    """One packed row of samples, each alone (a group of one)."""
    return pack_groups([ImageGroup([s], 0) for s in samples], images, builder, rope_index, pin)


def pack_groups(
    groups: list[ImageGroup],
    images: dict,
    builder: PromptBuilder,
    rope_index: Callable,
    pin: bool = False,
    held: dict | None = None,
) -> dict:
    """One packed row on the host: each group's first sample whole, then its other samples without
    the prefix they share (vlft.forward.image_groups). Every sample is collated alone first, so its
    positions are its own; what each sample attends to is the row's layout (RowLayout). `held`:
    images read already, by their source, not read again (vlft.forward.batching.collate)."""
    layout = RowLayout.of([(g.shared, [len(s.input_ids) for s in g.samples]) for g in groups])
    segments = iter(layout.segments)
    positions = PromptPositions(rope_index)
    pieces: dict[str, list] = {key: [] for key in ("input_ids", "labels", "mm_token_type_ids", "position_ids")}
    grids, row_images, answer_positions, answer_targets, answer_owners = [], [], [], [], []
    for group in groups:
        for n, sample in enumerate(group.samples):
            drop = group.shared if n else 0  # the prefix, laid out with the group's first sample
            # A batch of one has no padding, so the pad id is never written. Collated without the
            # prefix (never an answer token: vlft.forward.image_groups.shared_prefix_length): an
            # image's 1,000-3,000 prompt tokens are not made into tensors again for each answer.
            whole = partial(collate, [sample], images, builder, pad_id=0, read_images=False)
            own = collate([without_prefix(sample, drop)], images, builder, pad_id=0, read_images=n == 0, held=held)
            own["position_ids"] = positions(sample, own, drop, whole)
            for key in pieces:
                pieces[key].append(own[key])
            if n == 0:
                grids.append(own["image_grid_thw"])
                row_images += own["images"]
            # Each sample alone is a batch of one: its answer positions are offsets within it.
            answer_positions.append(own["answer_positions"] + next(segments)[0])
            answer_targets.append(own["answer_targets"])
            answer_owners.append(torch.full_like(own["answer_targets"], len(answer_owners)))
    row = {key: torch.cat(values, dim=-1) for key, values in pieces.items()}
    row["image_grid_thw"] = torch.cat(grids)
    row["answer_positions"] = torch.cat(answer_positions)
    row["answer_targets"] = torch.cat(answer_targets)
    row["answer_owners"] = torch.cat(answer_owners)
    row["sample_ids"] = [s.record_id for g in groups for s in g.samples]
    row.update(layout.attention_inputs())
    row["images"] = row_images
    return pinned(row) if pin else row


def without_prefix(sample: Sample, drop: int) -> Sample:
    """`sample` without its first `drop` tokens, which lie in its prompt."""
    if not drop:
        return sample
    return Sample(sample.record_id, sample.input_ids[drop:], sample.labels[drop:], sample.prompt_length - drop)


class PromptPositions:
    """Each sample's M-RoPE positions as the model's own function gives them for the sample alone,
    its prompt's computed once for all the samples that ask it on the same image (a reward stage's
    G answers to a question, a preference pair's two answers): an answer holds no image, so its
    positions follow its prompt's largest one by one in all three parts, as the function lays out
    text. Computed once a prompt, a Kvasir-like step's layout costs the host less than with each
    answer's positions computed alone (benchmarks/row_layout_host.py, benchmarks/README.md)."""

    def __init__(self, rope_index: Callable):
        self.rope_index = rope_index
        self.known: dict[tuple, torch.Tensor] = {}  # (prompt ids, image grids) -> the prompt's positions

    def __call__(self, sample: Sample, own: dict, drop: int, whole: Callable[[], dict]) -> torch.Tensor:
        """The positions (3, 1, tokens) of `sample` past its first `drop` tokens (of its prompt),
        `own` those tokens collated alone; `whole()` collates the sample whole, where its prompt's
        positions are not known yet or an image follows its prompt."""
        prompt = sample.prompt_length
        if (own["mm_token_type_ids"][0, prompt - drop :] != 0).any():  # an image after the prompt: the whole sample
            return self._of(whole(), len(sample.input_ids))[..., drop:]
        key = (tuple(sample.input_ids[:prompt]), tuple(own["image_grid_thw"].flatten().tolist()))
        if key not in self.known:
            self.known[key] = self._of(whole(), prompt)
        before = self.known[key]
        answer = torch.arange(1, len(sample.input_ids) - prompt + 1, dtype=before.dtype) + before.max()
        return torch.cat([before[..., drop:], answer.expand(3, 1, -1)], dim=-1)

    def _of(self, alone: dict, tokens: int) -> torch.Tensor:
        """The positions of the first `tokens` of a sample collated alone."""
        return self.rope_index(
            input_ids=alone["input_ids"][:, :tokens],
            mm_token_type_ids=alone["mm_token_type_ids"][:, :tokens],
            image_grid_thw=alone["image_grid_thw"],
            attention_mask=alone["attention_mask"][:, :tokens],
        )[0]


def _varlen_kernel() -> Callable | None:
    """Causal variable-length flash attention on (tokens, heads, dim) tensors, where one is installed."""
    # Causal with fewer queries than keys aligns the queries with the last keys (bottom right), in
    # flash-attention and in torch's kernel built on it: what a sample after a shared prefix needs.
    if flash_attn_varlen_func is not None:
        return lambda q, k, v, cu_q, cu_k, max_q, max_k, scale: flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True
        )
    if varlen_attn is not None:
        parameters = inspect.signature(varlen_attn).parameters
        # torch 2.10 takes is_causal; later versions a window, (-1, 0) being causal.
        causal = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
        if "enable_gqa" in parameters:
            causal["enable_gqa"] = True
        return lambda q, k, v, cu_q, cu_k, max_q, max_k, scale: varlen_attn(
            q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, **causal
        )
    return None


VARLEN_KERNEL = _varlen_kernel()


def packed_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    packed_cu_seqlens=None,
    packed_max_seqlen=None,
    packed_key_index=None,
    packed_cu_seqlens_k=None,
    packed_max_seqlen_k=None,
    packed_prompt_keys=None,
    packed_prompt_values=None,
    packed_prefix_index=None,
    packed_prefix_cu_seqlens_q=None,
    packed_prefix_cu_seqlens_k=None,
    packed_prefix_max_seqlen_q=None,
    packed_prefix_max_seqlen_k=None,
    packed_own_prompt_index=None,
    packed_prefix_query_index=None,
    **kwargs,
):
    """Attention over a packed row: each query segment causally over its keys, nothing else.

    Takes and returns transformers' attention-interface shapes (query (1, heads, tokens, dim),
    output (1, tokens, heads, dim)). A segment's keys are its own tokens, or, with
    `packed_key_index`, the row positions it names: a shared prefix and then the segment's own
    tokens, the segment's queries aligned with the last of them. With `packed_prompt_keys` and
    `packed_prompt_values` (this layer's keys and values of prompts an earlier forward computed,
    vlft.training.shared_prompts), the row's positions come after theirs and `packed_key_index`
    names positions of both; with `packed_prefix_index` too, the segments attend to the prompts'
    shared prefixes apart from their own keys (`prefix_and_own_attention`). With
    `packed_prefix_index` and no prompts (an image group's row, RowLayout.attention_inputs), the
    queries `packed_prefix_query_index` names attend to the row's prefixes apart from their own
    segments, each prefix's keys read once for all of its queries. On a GPU with bf16 or
    fp16, one variable-length flash kernel call; elsewhere (the CPU, float32) SDPA per segment.
    """
    if packed_cu_seqlens is None or query.shape[0] != 1:
        raise ValueError("packed attention takes one packed row and its packed_cu_seqlens (vlft.forward.packing.pack)")
    if packed_prefix_index is not None:
        in_row = packed_prompt_keys is None  # an image group's row: its own segments' keys are its own
        prefixes = Parts(
            packed_prefix_cu_seqlens_q,
            packed_prefix_cu_seqlens_k,
            packed_prefix_max_seqlen_q,
            packed_prefix_max_seqlen_k,
            packed_cu_seqlens,
            packed_cu_seqlens if in_row else packed_cu_seqlens_k,
            packed_max_seqlen,
            packed_max_seqlen if in_row else packed_max_seqlen_k,
            packed_prefix_query_index,
        )
        prompts = None if in_row else (packed_prompt_keys, packed_prompt_values)
        own = (packed_own_prompt_index, packed_key_index)
        return prefix_and_own_attention(query, key, value, prompts, packed_prefix_index, own, prefixes, scaling), None
    cu_k, max_k = packed_cu_seqlens, packed_max_seqlen
    if packed_prompt_keys is not None:
        key, value = torch.cat([packed_prompt_keys, key], dim=2), torch.cat([packed_prompt_values, value], dim=2)
    if packed_key_index is not None:
        # The prefix's keys and values gathered once for each sample on it: the backward pass sums
        # the samples' gradients back into the one prefix.
        key, value = key.index_select(2, packed_key_index), value.index_select(2, packed_key_index)
        cu_k, max_k = packed_cu_seqlens_k, packed_max_seqlen_k
    if VARLEN_KERNEL is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, dim)
        return VARLEN_KERNEL(q, k, v, packed_cu_seqlens, cu_k, packed_max_seqlen, max_k, scaling)[None], None
    return _attention_per_segment(query, key, value, packed_cu_seqlens, cu_k, scaling), None


def _attention_per_segment(query, key, value, cu_q, cu_k, scaling):
    """SDPA over each query segment and its keys in turn (where no flash kernel runs)."""
    query_bounds, key_bounds = cu_q.tolist(), cu_k.tolist()
    pieces = []
    for q_start, q_end, k_start, k_end in zip(query_bounds[:-1], query_bounds[1:], key_bounds[:-1], key_bounds[1:]):
        queries, keys = q_end - q_start, k_end - k_start
        # Causal, the queries aligned with the last keys (what is_causal does for equal lengths).
        mask = (
            None
            if queries == keys
            else torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril(keys - queries)
        )
        piece = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, q_start:q_end],
            key[:, :, k_start:k_end],
            value[:, :, k_start:k_end],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1],
        )
        pieces.append(piece)
    return torch.cat(pieces, dim=2).transpose(1, 2)


def prefix_and_own_attention(query, key, value, prompts, prefix_index, own, parts: Parts, scaling):
    """Queries' attention over shared prefixes, each read once for all the queries on it, and their
    own keys (vlft.forward.prefix_attention). With `prompts` (answers after kept prompts): the kept
    prompts' keys and values; `prefix_index`: the prefixes' positions among them; `own`: the
    positions of each answer's own prompt tokens past its prefix, and each answer's own keys among
    those, then this row's. Without (an image group's row): the prefixes' positions in the row, and
    each segment's own keys are its own tokens."""
    if prompts is None:
        prompt_keys, prompt_values, own_k, own_v = key, value, key, value
    else:
        (prompt_keys, prompt_values), (own_prompt_index, own_index) = prompts, own
        own_k = torch.cat([prompt_keys.index_select(2, own_prompt_index), key], dim=2).index_select(2, own_index)
        own_v = torch.cat([prompt_values.index_select(2, own_prompt_index), value], dim=2).index_select(2, own_index)
    prefix_k, prefix_v = prompt_keys.index_select(2, prefix_index), prompt_values.index_select(2, prefix_index)
    q, prefix_k, prefix_v, own_k, own_v = (t[0].transpose(0, 1) for t in (query, prefix_k, prefix_v, own_k, own_v))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return prefix_then_own(q, prefix_k, prefix_v, own_k, own_v, parts, scale)[None]


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def use_packed_attention(model) -> None:
    """The language model's attention layers take packed rows, and only those. For an attention
    implementation of this name transformers builds no attention mask, which a packed row must
    not get; the vision tower keeps its own attention. A hybrid model's linear-attention layers
    take the row's samples apart too (vlft.forward.linear_attention)."""
    if is_hybrid_model(model):
        respect_segments()
    unwrapped(model).set_attn_implementation({"text_config": PACKED_ATTENTION})


@contextmanager
def packed_attention_while(model):
    """The language model's attention packed for a while, its own put back after. Nothing is
    switched where it is packed already (a training stage's model, whose rollouts this serves):
    a switch walks every module of an 8B's PEFT model, each way."""
    config = language_model(unwrapped(model)).config
    own = config._attn_implementation
    if own == PACKED_ATTENTION:
        yield
        return
    use_packed_attention(model)
    try:
        yield
    finally:
        unwrapped(model).set_attn_implementation({"text_config": own})

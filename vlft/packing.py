"""Packed micro-batches: a step's samples laid end to end in one row, with no padding at all.

Grouping samples by length still pads each micro-batch to its longest sample; on the benchmark's
mix of 450 to 1,700-token samples that is 11 to 17% of the tokens computed. A packed row computes
only real tokens. What keeps the samples apart:

- positions: each sample's M-RoPE positions are its own, computed as if it were alone (`pack`);
- attention: causal within each sample and never across, from the samples' boundaries
  (`cu_seqlens`, as flash-attention's variable-length kernels take them), in `packed_attention`;
- the loss: only answer tokens are scored, and the last token of one sample predicts nothing.

So a packed micro-batch gives each sample the loss and gradients it gets alone or padded.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from transformers import AttentionInterface

from vlft.batching import collate, pinned
from vlft.modeling import unwrapped
from vlft.prompts import PromptBuilder, Sample

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
    length finds (a sample longer than the budget gets a row of its own)."""
    rows: list[list[Sample]] = []
    room: list[int] = []
    for sample in sorted(samples, key=lambda s: len(s.input_ids), reverse=True):
        length = len(sample.input_ids)
        row = next((i for i, left in enumerate(room) if left >= length), None)
        if row is None:
            rows.append([])
            room.append(max_tokens)
            row = len(rows) - 1
        rows[row].append(sample)
        room[row] -= length
    return rows


def pack(samples: list[Sample], images: dict, builder: PromptBuilder, rope_index: Callable, pin: bool = False) -> dict:
    """One packed row on the host: each sample collated alone (so its positions are its own), then
    laid end to end; `packed_cu_seqlens` marks where each sample starts and ends, and
    `packed_max_seqlen` is the longest (the attention kernel's two extra inputs)."""
    # A batch of one has no padding, so the pad id is never written.
    alone = [collate([s], images, builder, pad_id=0, rope_index=rope_index) for s in samples]
    lengths = [len(s.input_ids) for s in samples]
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0, dtype=torch.int32)
    row = {key: torch.cat([one[key] for one in alone], dim=1) for key in ("input_ids", "labels", "mm_token_type_ids")}
    row["position_ids"] = torch.cat([one["position_ids"] for one in alone], dim=-1)
    row["image_grid_thw"] = torch.cat([one["image_grid_thw"] for one in alone])
    # Each sample alone is a batch of one: its answer positions are offsets within it.
    row["answer_positions"] = torch.cat([one["answer_positions"] + start for one, start in zip(alone, cu_seqlens)])
    row["answer_targets"] = torch.cat([one["answer_targets"] for one in alone])
    row["packed_cu_seqlens"] = cu_seqlens
    row["packed_max_seqlen"] = max(lengths)
    row["images"] = [image for one in alone for image in one["images"]]
    return pinned(row) if pin else row


def _varlen_kernel() -> Callable | None:
    """Causal variable-length flash attention on (tokens, heads, dim) tensors, where one is installed."""
    if flash_attn_varlen_func is not None:
        return lambda q, k, v, cu, longest, scale: flash_attn_varlen_func(
            q, k, v, cu, cu, longest, longest, softmax_scale=scale, causal=True
        )
    if varlen_attn is not None:
        parameters = inspect.signature(varlen_attn).parameters
        # torch 2.10 takes is_causal; later versions a window, (-1, 0) being causal.
        causal = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
        if "enable_gqa" in parameters:
            causal["enable_gqa"] = True
        return lambda q, k, v, cu, longest, scale: varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, **causal)
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
    **kwargs,
):
    """Attention over a packed row: causal within each sample, none across samples.

    Takes and returns transformers' attention-interface shapes (query (1, heads, tokens, dim),
    output (1, tokens, heads, dim)). On a GPU with bf16 or fp16, one variable-length flash kernel
    call; elsewhere (the CPU, float32) SDPA per sample.
    """
    if packed_cu_seqlens is None or query.shape[0] != 1:
        raise ValueError("packed attention takes one packed row and its packed_cu_seqlens (vlft.packing.pack)")
    if VARLEN_KERNEL is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, dim)
        return VARLEN_KERNEL(q, k, v, packed_cu_seqlens, packed_max_seqlen, scaling)[None], None
    bounds = packed_cu_seqlens.tolist()
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        piece = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            is_causal=True,
            scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1],
        )
        pieces.append(piece)
    return torch.cat(pieces, dim=2).transpose(1, 2), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def use_packed_attention(model) -> None:
    """The language model's attention layers take packed rows, and only those. For an attention
    implementation of this name transformers builds no attention mask, which a packed row must
    not get; the vision tower keeps its own attention."""
    unwrapped(model).set_attn_implementation({"text_config": PACKED_ATTENTION})

"""Packed rows through linear-attention layers (Qwen3.5's Gated DeltaNet): each sample's short
convolution window and recurrent state start from zero at its first token, forward and backward,
as when it runs alone.

A Gated DeltaNet layer carries information along the row by two means besides attention: a causal
convolution over the last `kernel` tokens, and a recurrent state (the delta rule) updated token by
token. transformers' torch path computes both over the whole row and ignores the samples' bounds
(`causal_conv1d_fn` takes no boundaries; its delta rule's torch fallback drops `cu_seqlens`), so a
packed sample would read the tail of the one before it. Here each is computed per sample:

- the convolution: one pass over the row, each of its `kernel` taps masked where it would reach
  into the sample before (exact, and the row's tokens read once);
- the delta rule: flash-linear-attention's varlen kernel with the samples' `cu_seqlens` where it is
  installed (transformers then resolves its `chunk_gated_delta_rule` to it), else transformers' own
  torch function once per sample.

Both replace the functions of transformers' modeling modules that the layer calls, and take effect
only for a packed row (a call that carries `packed_cu_seqlens`, vlft.forward.packing); any other
call goes to transformers' function unchanged.
"""

from __future__ import annotations

import importlib
from functools import wraps

import torch
from transformers.activations import ACT2FN

# transformers' modeling modules of the families with Gated DeltaNet layers.
HYBRID_MODELING = ("transformers.models.qwen3_5.modeling_qwen3_5",)
CONV = "causal_conv1d_fn"
DELTA_RULE = "torch_chunk_gated_delta_rule"


def offsets_in_segments(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """Each token's index within its own segment (0 at every segment's first token)."""
    positions = torch.arange(length, device=cu_seqlens.device)
    starts = cu_seqlens[:-1].to(positions.device)
    segment = torch.searchsorted(starts, positions, right=True) - 1
    return positions - starts[segment]


def segment_causal_conv1d(hidden_states, weight, bias, activation, cu_seqlens):
    """transformers' depthwise causal convolution (hidden_states (1, channels, tokens), weight
    (channels, kernel)) over each segment alone: output t = sum over j < kernel of
    weight[kernel - 1 - j] * input[t - j], the taps with t - j before t's segment left out (as the
    zero padding of a segment computed alone leaves them)."""
    kernel, length = weight.shape[-1], hidden_states.shape[-1]
    inputs = hidden_states.to(weight.dtype)
    offsets = offsets_in_segments(cu_seqlens, length)
    out = inputs * weight[:, kernel - 1, None]
    for back in range(1, kernel):
        shifted = torch.nn.functional.pad(inputs, (back, 0))[..., :length]
        out = out + shifted * (weight[:, kernel - 1 - back, None] * (offsets >= back).to(inputs.dtype))
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def _segments_conv(plain):
    @wraps(plain)
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu_seqlens = kwargs.get("packed_cu_seqlens")
        if cu_seqlens is None:
            return plain(hidden_states, weight, bias, activation, **kwargs)
        return segment_causal_conv1d(hidden_states, weight, bias, activation, cu_seqlens)

    conv.vlft_plain = plain
    return conv


def _segments_delta_rule(plain, per_segment: bool):
    @wraps(plain)
    def delta_rule(query, key, value, g, beta, **kwargs):
        cu_seqlens = kwargs.pop("packed_cu_seqlens", None)
        if cu_seqlens is None:
            return plain(query, key, value, g, beta, **kwargs)
        if kwargs.get("initial_state") is not None:
            raise ValueError("a packed row's linear-attention layers start from no state")
        if kwargs.get("packed_key_index") is not None or kwargs.get("packed_prefix_index") is not None:
            # A shared prefix laid out once (an image group, kept prompts): each segment after it
            # would need the prefix's state, which these functions do not hand on yet.
            raise NotImplementedError("image groups and kept prompts do not yet run on linear-attention layers")
        options = {name: kwargs[name] for name in ("output_final_state", "use_qk_l2norm_in_kernel") if name in kwargs}
        if not per_segment:  # flash-linear-attention's kernel: the segments' bounds are its own input
            return plain(query, key, value, g, beta, cu_seqlens=cu_seqlens, **options)
        bounds = cu_seqlens.tolist()
        pieces = [
            plain(*(t[:, start:end] for t in (query, key, value, g, beta)), **options)[0]
            for start, end in zip(bounds[:-1], bounds[1:])
        ]
        return torch.cat(pieces, dim=1), None

    delta_rule.vlft_plain = plain
    return delta_rule


def respect_segments() -> None:
    """Every hybrid family's DeltaNet layers compute a packed row's samples apart (once a process:
    the replaced functions keep transformers' own for every other call)."""
    for name in HYBRID_MODELING:
        module = importlib.import_module(name)
        if hasattr(getattr(module, CONV), "vlft_plain"):
            continue
        delta_rule = getattr(module, DELTA_RULE)
        # transformers' own torch function (defined in the modeling module), or the kernel it
        # resolved in its place (flash-linear-attention's, which takes cu_seqlens).
        per_segment = delta_rule.__module__ == module.__name__
        setattr(module, CONV, _segments_conv(getattr(module, CONV)))
        setattr(module, DELTA_RULE, _segments_delta_rule(delta_rule, per_segment))

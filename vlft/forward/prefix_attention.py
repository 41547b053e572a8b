"""Attention over a shared prefix and each segment's own keys, in two parts merged by log-sum-exp.

A reward stage's update computes its sampled answers after their kept prompts
(vlft.training.shared_prompts): the G answers to one prompt all attend to its keys, then each
causally to its own. Gathering the prompt's keys once for every answer (packed_attention's
`packed_key_index`) copies them G times a layer, and its backward pass adds the G copies'
gradients back with atomics (a share of a GRPO step: benchmarks/README.md). Here
each prefix is read once for all of its answers' queries:

- the prefix part: every query of a prefix's answers over the prefix, all of it (no mask);
- the own part: each answer's queries causally over its own keys (what it attends to past the
  prefix), aligned with the last of them;
- merged as cascade attention merges them: with L = logaddexp(L_prefix, L_own),
  O = exp(L_prefix - L) O_prefix + exp(L_own - L) O_own, which is softmax attention over both.

The backward pass runs each part's kernel backward with the merged O and L (as ring attention
does): the kernel then takes its part's probabilities as exp(S - L), the shares of the whole
softmax, and D = rowsum(dO * O) of the whole output, so the two parts' dQ sum to the whole's and
each part's dK and dV are the whole's. Nothing is approximated: the sums are ordered differently.
tests/forward/test_prefix_attention.py checks it in float64 against the gathered keys' attention.

On a GPU the kernels are torch's variable-length flash attention (forward and backward); on a CPU
the same formulas in plain torch ops (`ReferenceKernels`), which the tests and the demo run.

An image group's packed row (vlft.forward.image_groups) is the same shape of attention: each
question after the group's prefix attends to all of it and causally to itself. There the prefix
part's queries are some of the row's (`Parts.prefix_rows`: each group's questions, not its prefix
itself), and the own part is every row token over its own segment's keys, the prefix being a
segment of its own. Gathering the prefix's keys for each of the 72 answers on a Kvasir image (9
questions, 8 answers each) made each layer's backward pass add 72 copies' gradients back with
colliding atomics, and reduce a key gradient 72 times the prefix's size over the query heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Parts:
    """Where a packed row's queries find their keys: `prefix_*` the prefixes, each with the run of
    queries that attend to it; `own_*` each segment's own keys, the same queries segment by segment.
    The bounds are flash attention's cumulative lengths (int32, on the queries' device). Where
    `prefix_rows` is given, only the queries it names (in order) attend to a prefix; None: all."""

    prefix_cu_q: torch.Tensor
    prefix_cu_k: torch.Tensor
    prefix_max_q: int
    prefix_max_k: int
    own_cu_q: torch.Tensor
    own_cu_k: torch.Tensor
    own_max_q: int
    own_max_k: int
    prefix_rows: torch.Tensor | None = None


class FlashKernels:
    """torch's variable-length flash attention: (tokens, heads, dim) tensors, its log-sum-exp
    (heads, tokens). The aten ops themselves, whose arguments have stayed put across torch
    releases (torch.nn.attention.varlen's own ops took new ones): key heads shared by several
    query heads, and causal attention aligned with the last keys, are the kernel's own."""

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
        )
        return out, lse

    @staticmethod
    def backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
        # No dropout: its random state is never read.
        rng, unused = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)
        return torch.ops.aten._flash_attention_backward(
            grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale
        )


class ReferenceKernels:
    """The flash kernels' arithmetic in plain torch ops (any device and dtype), over blocks of
    consecutive segments at once, each block's keys masked to their own segment's."""

    # A block's queries times keys, at most (a segment longer than this is a block alone): the
    # demo's answers' pass is one block a part, where a segment at a time (many tiny ones) had made
    # its GRPO stage slower on a CPU than the gathered keys' SDPA.
    BLOCK_SCORES = 1 << 20

    @staticmethod
    def _blocks(q, k, cu_q, cu_k, causal: bool):
        """Blocks of consecutive segments: each block's query and key slices and its mask (a query
        sees its own segment's keys, aligned with the last of them where causal, as flash
        attention aligns them), with the key heads repeated for the query heads that share them."""
        repeat = q.shape[1] // k.shape[1]
        bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
        first, segments = 0, len(bounds_q) - 1
        while first < segments:
            last = first + 1
            while (
                last < segments
                and (bounds_q[last + 1] - bounds_q[first]) * (bounds_k[last + 1] - bounds_k[first])
                <= ReferenceKernels.BLOCK_SCORES
            ):
                last += 1
            yield _block(q.device, bounds_q[first : last + 1], bounds_k[first : last + 1], causal) + (repeat,)
            first = last

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=_lse_dtype(q), device=q.device)
        for qs, ks, mask, repeat in ReferenceKernels._blocks(q, k, cu_q, cu_k, causal):
            keys, values = k[ks].repeat_interleave(repeat, 1), v[ks].repeat_interleave(repeat, 1)
            scores = torch.einsum("qhd,khd->hqk", q[qs], keys) * scale
            scores = scores.masked_fill(~mask, float("-inf"))
            block_lse = torch.logsumexp(scores, dim=-1)
            out[qs] = torch.einsum("hqk,khd->qhd", torch.exp(scores - block_lse[..., None]), values)
            lse[:, qs] = block_lse.to(lse.dtype)
        return out, lse

    @staticmethod
    def backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for qs, ks, mask, repeat in ReferenceKernels._blocks(q, k, cu_q, cu_k, causal):
            keys, values = k[ks].repeat_interleave(repeat, 1), v[ks].repeat_interleave(repeat, 1)
            scores = torch.einsum("qhd,khd->hqk", q[qs], keys) * scale
            scores = scores.masked_fill(~mask, float("-inf"))
            probabilities = torch.exp(scores - lse[:, qs, None].to(scores.dtype))  # shares of the whole softmax
            d_values = torch.einsum("hqk,qhd->khd", probabilities, grad[qs])
            d_probabilities = torch.einsum("qhd,khd->hqk", grad[qs], values)
            whole = (grad[qs] * out[qs]).sum(-1).transpose(0, 1)  # D = rowsum(dO * O), (heads, queries)
            d_scores = probabilities * (d_probabilities - whole[..., None]) * scale
            dq[qs] = torch.einsum("hqk,khd->qhd", d_scores, keys)
            d_keys = torch.einsum("hqk,qhd->khd", d_scores, q[qs])
            heads = k.shape[1]  # the query heads' shares summed into the key head they share
            dk[ks] += d_keys.unflatten(1, (heads, repeat)).sum(2)
            dv[ks] += d_values.unflatten(1, (heads, repeat)).sum(2)
        return dq, dk, dv


def _block(device, bounds_q: list[int], bounds_k: list[int], causal: bool):
    """The query and key slices of the segments between `bounds_q` and `bounds_k`, and the mask of
    which keys each query sees."""
    lengths_q = torch.tensor(bounds_q, device=device).diff()
    lengths_k = torch.tensor(bounds_k, device=device).diff()
    segment = torch.arange(len(lengths_q), device=device)
    segment_q, segment_k = segment.repeat_interleave(lengths_q), segment.repeat_interleave(lengths_k)
    mask = segment_q[:, None] == segment_k[None, :]
    if causal:
        starts_q = torch.tensor(bounds_q[:-1], device=device) - bounds_q[0]
        starts_k = torch.tensor(bounds_k[:-1], device=device) - bounds_k[0]
        within_q = torch.arange(len(segment_q), device=device) - starts_q[segment_q]
        within_k = torch.arange(len(segment_k), device=device) - starts_k[segment_k]
        mask &= within_k[None, :] <= (within_q + (lengths_k - lengths_q)[segment_q])[:, None]
    return slice(bounds_q[0], bounds_q[-1]), slice(bounds_k[0], bounds_k[-1]), mask


def kernels_for(query: torch.Tensor):
    """Flash attention's kernels where they run (a GPU, bf16 or fp16), the reference's elsewhere."""
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        return FlashKernels
    return ReferenceKernels


# A custom op, as torch's own varlen attention is, so that a compiled decoder layer (the answers'
# forward runs one) calls it as one opaque op: its arithmetic is the kernels', not traced.
@torch.library.custom_op("vlft::prefix_then_own", mutates_args=())
def _prefix_then_own(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    own_k: torch.Tensor,
    own_v: torch.Tensor,
    prefix_rows: Optional[torch.Tensor],
    prefix_cu_q: torch.Tensor,
    prefix_cu_k: torch.Tensor,
    prefix_max_q: int,
    prefix_max_k: int,
    own_cu_q: torch.Tensor,
    own_cu_k: torch.Tensor,
    own_max_q: int,
    own_max_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    kernels = kernels_for(q)
    own_out, own_lse = kernels.forward(q, own_k, own_v, own_cu_q, own_cu_k, own_max_q, own_max_k, True, scale)
    prefix_out, prefix_lse = kernels.forward(
        _rows(q, prefix_rows), prefix_k, prefix_v, prefix_cu_q, prefix_cu_k, prefix_max_q, prefix_max_k, False, scale
    )
    if prefix_rows is None:
        out, lse = _merged(prefix_out, prefix_lse, own_out, own_lse)
        return out.to(q.dtype).contiguous(), lse.contiguous()
    # The rows without a prefix keep their own part as it is; the merged rows are written over the
    # own part's output and log-sum-exp in place (the kernel's own fresh tensors: no copy of the row).
    rows_out, rows_lse = _merged(prefix_out, prefix_lse, own_out.index_select(0, prefix_rows), own_lse[:, prefix_rows])
    out = own_out.index_copy_(0, prefix_rows, rows_out.to(q.dtype))
    lse = own_lse.to(rows_lse.dtype).index_copy_(1, prefix_rows, rows_lse)
    return out.contiguous(), lse.contiguous()


def _rows(t: torch.Tensor, rows: torch.Tensor | None, dim: int = 0) -> torch.Tensor:
    """The rows of `t` that `rows` names (all of it where None), contiguous, as the kernels take them."""
    return t if rows is None else t.index_select(dim, rows).contiguous()


def _merged(prefix_out, prefix_lse, own_out, own_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Two parts' outputs ((tokens, heads, dim), each its log-sum-exp (heads, tokens)) merged into
    softmax attention over both parts' keys, in the log-sum-exp's dtype (float32 or float64)."""
    lse = torch.logaddexp(prefix_lse, own_lse)
    # (heads, tokens) to (tokens, heads, 1): each part's share of the whole softmax.
    prefix_share = torch.exp(prefix_lse - lse).transpose(0, 1)[..., None]
    own_share = torch.exp(own_lse - lse).transpose(0, 1)[..., None]
    return prefix_share * prefix_out.to(lse.dtype) + own_share * own_out.to(lse.dtype), lse


@_prefix_then_own.register_fake
def _(q, *keys_bounds_and_scale):
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), lse


@torch.library.custom_op("vlft::prefix_then_own_backward", mutates_args=())
def _prefix_then_own_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    own_k: torch.Tensor,
    own_v: torch.Tensor,
    prefix_rows: Optional[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    prefix_cu_q: torch.Tensor,
    prefix_cu_k: torch.Tensor,
    prefix_max_q: int,
    prefix_max_k: int,
    own_cu_q: torch.Tensor,
    own_cu_k: torch.Tensor,
    own_max_q: int,
    own_max_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    kernels, grad = kernels_for(q), grad.contiguous()
    # Each part's backward with the merged output and log-sum-exp: its probabilities are its
    # shares of the whole softmax, and D = rowsum(dO * O) is the whole output's.
    dq, d_own_k, d_own_v = kernels.backward(
        grad, q, own_k, own_v, out, lse, own_cu_q, own_cu_k, own_max_q, own_max_k, True, scale
    )
    dq_prefix, d_prefix_k, d_prefix_v = kernels.backward(
        *(_rows(t, prefix_rows) for t in (grad, q)),
        prefix_k,
        prefix_v,
        _rows(out, prefix_rows),
        _rows(lse, prefix_rows, dim=1),
        prefix_cu_q,
        prefix_cu_k,
        prefix_max_q,
        prefix_max_k,
        False,
        scale,
    )
    dq = dq + dq_prefix if prefix_rows is None else dq.index_add(0, prefix_rows, dq_prefix)
    gradients = dq, d_prefix_k, d_prefix_v, d_own_k, d_own_v
    return tuple(g.contiguous() for g in gradients)  # the layout the fake one gives


@_prefix_then_own_backward.register_fake
def _(grad, q, prefix_k, prefix_v, own_k, own_v, prefix_rows, out, lse, *bounds_and_scale):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, prefix_k, prefix_v, own_k, own_v))


def _setup_context(ctx, inputs, output):
    q, prefix_k, prefix_v, own_k, own_v, prefix_rows, *bounds_and_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, prefix_k, prefix_v, own_k, own_v, prefix_rows, out, lse)
    ctx.bounds_and_scale = bounds_and_scale


def _backward(ctx, grad, grad_lse):
    # The log-sum-exp is returned for the backward pass alone; nothing downstream differentiates it.
    gradients = _prefix_then_own_backward(grad, *ctx.saved_tensors, *ctx.bounds_and_scale)
    return (*gradients, None, *[None] * len(ctx.bounds_and_scale))


_prefix_then_own.register_autograd(_backward, setup_context=_setup_context)


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def prefix_then_own(q, prefix_k, prefix_v, own_k, own_v, parts: Parts, scale: float) -> torch.Tensor:
    """(tokens, heads, dim) queries' attention over their prefix's keys and values and their own."""
    p = parts
    out, _ = _prefix_then_own(
        q,
        prefix_k,
        prefix_v,
        own_k,
        own_v,
        p.prefix_rows,
        p.prefix_cu_q,
        p.prefix_cu_k,
        p.prefix_max_q,
        p.prefix_max_k,
        p.own_cu_q,
        p.own_cu_k,
        p.own_max_q,
        p.own_max_k,
        scale,
    )
    return out

"""Packed rows through linear-attention layers (Qwen3.5's Gated DeltaNet): each sample's short
convolution window and recurrent state start where they would alone, forward and backward.

A Gated DeltaNet layer carries information along the row by two means besides attention: a causal
convolution over the last `kernel` tokens, and a recurrent state (the delta rule) updated token by
token. transformers' torch path computes both over the whole row and ignores the samples' bounds
(`causal_conv1d_fn` takes no boundaries; its delta rule's torch fallback drops `cu_seqlens`), so a
packed sample would read the tail of the one before it. Here the row is computed in pieces
(`LinearPieces`): a piece starts from zero (a sample alone, an image's shared prefix) or from the end
of an earlier piece (each question of an image group after the prefix they share, as if the prefix
ran before it alone):

- the convolution: one pass over the row, each of its `kernel` taps reading the token it would read
  alone (the piece's own, or its parent's tail; none before a sample's first token);
- the delta rule: the pieces that start from zero first, then the others from their parents' final
  states; through flash-linear-attention's varlen kernel (`cu_seqlens`, `initial_state` per
  sequence) where it is installed and its backward computes right here (`flash_delta_rule`), else
  transformers' own torch function once a piece. The gradient through a prefix's state sums
  over the questions that start from it, as the autograd graph has them.

Both replace the functions of transformers' modeling modules that the layer calls, and take effect
only for a packed row (a call that carries `packed_cu_seqlens`, vlft.forward.packing); any other
call goes to transformers' function unchanged. A packed call that keeps a cache (a prefill) gets
every piece's final state as the layer's "final state"; vlft.generation.kv_cache hands each prompt's
state and convolution window to its row.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from dataclasses import dataclass, field
from functools import partial, wraps

import torch
from transformers.activations import ACT2FN

# transformers' modeling modules of the families with Gated DeltaNet layers.
HYBRID_MODELING = ("transformers.models.qwen3_5.modeling_qwen3_5",)
# A Gated DeltaNet layer's own projections that LoRA reaches where a stage's lora_target_modules
# name them (as ms-swift's all-linear does; in_proj_a and in_proj_b, a few outputs a head, it leaves out).
LINEAR_ATTENTION_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "out_proj")
CONV = "causal_conv1d_fn"
DELTA_RULE = "torch_chunk_gated_delta_rule"


# The last packed call's pieces, with the tensors they were read from: [cu_seqlens, parents, pieces].
_last_read: list = [None, None, None]


@dataclass
class LinearPieces:
    """How a packed row runs through linear-attention layers: consecutive pieces covering the row
    (`bounds`, as cu_seqlens), each starting from zero (`parents` -1) or from the end of the earlier
    piece of that index."""

    bounds: list[int]
    parents: list[int]
    _taps_read: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, kwargs: dict) -> "LinearPieces | None":
        """The pieces a packed call carries (vlft.forward.image_groups.RowLayout), or its segments
        each from zero; None for a call that is not packed."""
        cu_seqlens = kwargs.get("packed_linear_cu_seqlens", kwargs.get("packed_cu_seqlens"))
        if cu_seqlens is None:
            return None
        if kwargs.get("packed_prompt_keys") is not None or kwargs.get("packed_own_prompt_index") is not None:
            # Answers after kept prompts (a reward stage's update): each would need its prompt's
            # state, which the kept prompts do not hold yet.
            raise NotImplementedError("kept prompts do not yet run on linear-attention layers")
        shares_keys = kwargs.get("packed_key_index") is not None or kwargs.get("packed_prefix_index") is not None
        if shares_keys and kwargs.get("packed_linear_cu_seqlens") is None:
            # Segments that read keys beyond their own stretch, with no word of where each starts from.
            raise ValueError("a packed row with shared prefixes needs its linear-attention pieces (RowLayout)")
        parents = kwargs.get("packed_linear_parents")
        # Every layer of one forward is handed the same tensors: read them (from the device) once.
        if _last_read[0] is not cu_seqlens or _last_read[1] is not parents:
            bounds = cu_seqlens.tolist()
            pieces = cls(bounds, parents.tolist() if parents is not None else [-1] * (len(bounds) - 1))
            _last_read[:] = [cu_seqlens, parents, pieces]
        return _last_read[2]

    def as_inputs(self) -> dict:
        """What a packed call carries of them (read back by `of`)."""
        return {
            "packed_linear_cu_seqlens": torch.tensor(self.bounds, dtype=torch.int32),
            "packed_linear_parents": torch.tensor(self.parents),
        }

    def piece_ending_at(self, position: int) -> int:
        """The index of the piece that ends at row position `position`."""
        return self.bounds.index(position) - 1

    def taps(self, back: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """`_taps`, computed once a row (its layers all read them)."""
        key = (back, str(device))
        if key not in self._taps_read:
            self._taps_read[key] = self._taps(back, device)
        return self._taps_read[key]

    def _taps(self, back: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """For every row position, the position a convolution tap `back` tokens earlier reads when
        the position's sample runs alone (its own piece, else up its pieces' parents), and whether
        it reads one at all (not before the sample's first token)."""
        starts = torch.tensor(self.bounds[:-1], device=device)
        ends = torch.tensor(self.bounds[1:], device=device)
        parents = torch.tensor(self.parents, device=device)
        positions = torch.arange(self.bounds[-1], device=device)
        current = torch.searchsorted(starts, positions, right=True) - 1
        missing = back - (positions - starts[current])  # tokens to go back past the piece's start
        found = missing <= 0
        source = torch.where(found, positions - back, 0)
        for _ in range(back):  # a parent holds one token at least
            active = ~found & (current >= 0)
            if not active.any():
                break
            parent = torch.where(active, parents[current.clamp(min=0)], -1)
            at = parent.clamp(min=0)
            length = ends[at] - starts[at]
            inside = (parent >= 0) & (missing <= length)
            source = torch.where(inside, ends[at] - missing, source)
            found = found | inside
            missing = torch.where((parent >= 0) & ~inside, missing - length, missing)
            current = parent
        return source, found

    def windows(self, kernel: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each piece's convolution window after its last token, as transformers' cache keeps it (the
        last `kernel` inputs, oldest first, zero before the sample's start): the row positions
        (pieces, kernel) and whether each is read."""
        last = torch.tensor(self.bounds[1:], device=device) - 1
        columns = [self.taps(back, device) for back in range(kernel - 1, -1, -1)]
        source = torch.stack([s[last] for s, _ in columns], dim=1)
        valid = torch.stack([v[last] for _, v in columns], dim=1)
        return source, valid


def pieces_causal_conv1d(hidden_states, weight, bias, activation, pieces: LinearPieces):
    """transformers' depthwise causal convolution (hidden_states (1, channels, tokens), weight
    (channels, kernel)) over each sample as it runs alone: output t = sum over j < kernel of
    weight[kernel - 1 - j] * input[the token j before t in its sample], none before its first."""
    kernel = weight.shape[-1]
    inputs = hidden_states.to(weight.dtype)
    out = inputs * weight[:, kernel - 1, None]
    for back in range(1, kernel):
        source, valid = pieces.taps(back, inputs.device)
        tap = inputs.index_select(-1, source) * valid.to(inputs.dtype)
        out = out + tap * weight[:, kernel - 1 - back, None]
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def delta_rule_in_pieces(plain, varlen: bool, query, key, value, g, beta, pieces: LinearPieces, **options):
    """The delta rule of each piece, the pieces from zero first, then those whose parents are done,
    each from its parent's final state: through `plain` once for each such set, as
    flash-linear-attention's varlen kernel (`varlen`) or as transformers' torch function over the
    pieces side by side (`side_by_side`). Returns the row's output and every piece's final state
    (pieces, heads, key dim, value dim)."""
    count = len(pieces.parents)
    outputs, finals = [None] * count, [None] * count
    tensors = (query, key, value, g, beta)
    while None in finals:
        parents = pieces.parents
        ready = [i for i in range(count) if finals[i] is None and (parents[i] < 0 or finals[parents[i]] is not None)]
        ids = [i for i in ready if parents[i] < 0] or ready  # those from zero first
        spans = [(pieces.bounds[i], pieces.bounds[i + 1]) for i in ids]
        for batch in [list(range(len(ids)))] if varlen else similar_lengths([e - s for s, e in spans]):
            batch_ids = [ids[n] for n in batch]
            initial = torch.cat([finals[parents[i]] for i in batch_ids]) if parents[batch_ids[0]] >= 0 else None
            run = partial(_varlen, count=count) if varlen else side_by_side
            out, final = run(plain, tensors, [spans[n] for n in batch], initial, **options)
            for n, i in enumerate(batch_ids):
                outputs[i], finals[i] = out[n], final[n : n + 1]
    return torch.cat(outputs, dim=1), torch.cat(finals)


def similar_lengths(lengths: list[int], waste: float = 1.25) -> list[list[int]]:
    """The pieces (by index into `lengths`) in batches of similar length, longest first: a batch
    laid side by side takes its longest piece's length for each, at most `waste` times its tokens."""
    order = sorted(range(len(lengths)), key=lambda n: -lengths[n])
    batches: list[list[int]] = []
    for n in order:
        batch = batches[-1] if batches else None
        if batch and lengths[batch[0]] * (len(batch) + 1) <= waste * (sum(lengths[m] for m in batch) + lengths[n]):
            batch.append(n)
        else:
            batches.append([n])
    return batches


def side_by_side(plain, tensors, spans, initial, **options):
    """transformers' torch delta rule once over several pieces, each a batch row of its own padded
    with zeros after its end: a zero key, value, β and gate leave the recurrent state as it was
    (the function pads each chunk so itself), so each row's output and final state are its piece's
    alone. Returns each piece's output (1, tokens, heads, dim) and the final states."""
    if len(spans) == 1:
        (start, end), state = spans[0], initial
        out, final = plain(*(t[:, start:end] for t in tensors), initial_state=state, output_final_state=True, **options)
        return [out], final
    device = tensors[0].device
    lengths = torch.tensor([e - s for s, e in spans], device=device)
    steps = torch.arange(max(e - s for s, e in spans), device=device)
    inside = steps < lengths[:, None]  # (pieces, longest)
    index = torch.where(inside, torch.tensor([s for s, _ in spans], device=device)[:, None] + steps, 0)
    rows = [t[0][index] * inside.view(*inside.shape, *[1] * (t.dim() - 2)).to(t.dtype) for t in tensors]
    out, final = plain(*rows, initial_state=initial, output_final_state=True, **options)
    return [row[:length][None] for row, length in zip(out, lengths.tolist())], final


def _varlen(plain, tensors, spans, initial, *, count: int, **options):
    """flash-linear-attention's kernel once over the pieces, each its own sequence (`cu_seqlens`)."""
    query = tensors[0]
    whole = len(spans) == count
    index = None if whole else torch.cat([torch.arange(s, e) for s, e in spans]).to(query.device)
    inputs = tensors if whole else tuple(t.index_select(1, index) for t in tensors)
    lengths = [e - s for s, e in spans]
    cu = torch.tensor([0] + lengths, device=query.device).cumsum(0)
    out, final = plain(*inputs, initial_state=initial, output_final_state=True, cu_seqlens=cu, **options)
    return out.split(lengths, dim=1), final


# The wrappers below run eagerly inside a compiled decoder layer (a graph break each): their loops
# over a row's pieces, whose bounds are Python numbers that differ every step, would otherwise be
# traced into the graph and compiled again for each new row.
def _pieces_conv(plain):
    @torch.compiler.disable
    @wraps(plain)
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        pieces = LinearPieces.of(kwargs)
        if pieces is None:
            return conv.vlft_plain(hidden_states, weight, bias, activation, **kwargs)
        return pieces_causal_conv1d(hidden_states, weight, bias, activation, pieces)

    conv.vlft_plain = plain
    return conv


def _pieces_delta_rule(plain, varlen: bool):
    @torch.compiler.disable
    @wraps(plain)
    def delta_rule(query, key, value, g, beta, **kwargs):
        pieces = LinearPieces.of(kwargs)
        if pieces is None:
            return delta_rule.vlft_plain(query, key, value, g, beta, **kwargs)
        if kwargs.get("initial_state") is not None:
            raise ValueError("a packed row's linear-attention layers start from no state")
        options = {name: kwargs[name] for name in ("use_qk_l2norm_in_kernel",) if name in kwargs}
        out, finals = delta_rule_in_pieces(delta_rule.vlft_plain, varlen, query, key, value, g, beta, pieces, **options)
        return out, finals if kwargs.get("output_final_state") else None

    delta_rule.vlft_plain = plain
    return delta_rule


def flash_delta_rule():
    """flash-linear-attention's chunked delta rule where it is installed and its backward computes
    right on this machine, else None. It refuses its gated backward on Hopper GPUs under Triton 3.4
    up to 3.7.1, whose results there are wrong (its issue #640), unless tilelang serves it: a stage
    would run its first forward and stop at its first backward."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:
        return None
    refused = IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1
    return None if refused and importlib.util.find_spec("tilelang") is None else chunk_gated_delta_rule


def respect_segments() -> None:
    """Every hybrid family's DeltaNet layers compute a packed row's samples as each runs alone (once
    a process: the replaced functions keep transformers' own for every other call)."""
    for name in HYBRID_MODELING:
        module = importlib.import_module(name)
        if hasattr(getattr(module, CONV), "vlft_plain"):
            continue
        # transformers' own torch function, behind the wrapper that would hand the call to a kernel it
        # resolved (flash-linear-attention's whether or not its backward computes right here).
        torch_rule = inspect.unwrap(getattr(module, DELTA_RULE))
        flash = flash_delta_rule()
        setattr(module, CONV, _pieces_conv(getattr(module, CONV)))
        setattr(module, DELTA_RULE, _pieces_delta_rule(flash or torch_rule, varlen=flash is not None))

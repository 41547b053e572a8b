"""Cascade decoding: each prompt prefix that rows share kept once in the KV cache, and read once a
decode step for all the rows that answer after it.

Without it, each row of the engine's slot cache holds its prompt whole, and a decode step reads a
prefix that G rows share G times: a GRPO question's 8 sampled answers, or an image's questions, read
the image's 1,300 tokens of keys and values 8 times a step. Here a prefix lies once in a *prefix
slot* with up to `seats` rows seated at it, and each row's own row of the slot cache holds only what
follows the prefix (its own prompt tokens, then its answer). A row's attention is softmax attention
over two parts, each computed by flex_attention with its log-sum-exp:

- the prefix: the queries of all rows seated at a slot against the slot's keys, as one batch
  element, so that the kernel reads the prefix once for all of them;
- the row's own part: as the unshared step reads a row (its live blocks only);

merged exactly: softmax attention over the union of the keys is each part's output weighted by
exp(its log-sum-exp - the union's), as FlashInfer's and vLLM's cascade attention merge them. The
result differs from the unshared step's only in the order of the softmax's sums and the merge's few
roundings (tests/test_shared_prefixes.py states the bound and checks it).

Which requests share a slot is `seat_plan`'s, used alike by the scheduler (whether a group's
prefixes fit the free slots) and the engine (seating the rows it gives them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface

from vlft.generation.kv_cache import (
    KV_BLOCK,
    live_blocks,
    prompt_positions,
    refresh_live_blocks,
    write_positions,
)
from vlft.generation.requests import Request
from vlft.forward.image_groups import common_prefix
from vlft.modeling import head_dim, is_hybrid_model, language_model

CASCADE_ATTENTION = "vlft_cascade_decode"


@dataclass(frozen=True)
class Cascade:
    """How a generation lays out shared prefixes: `prefixes` slots of up to `seats` rows each; each
    row's own part up to `own_length` positions (its prompt past the prefix, and its answer; None:
    as long as a prompt and its answer)."""

    seats: int
    prefixes: int
    own_length: int | None = None


def prefixes_shareable(model) -> bool:
    """Whether a generation on `model` may keep its shared prefixes once: not on a hybrid model,
    whose rows each hold their linear-attention layers' states, while a prefix slot lays out only
    the attention layers' keys (each row then holds its prompt whole, as without a cascade)."""
    return not is_hybrid_model(model)


def cascade_for(prompts: list[tuple[str | None, list[int]]], slots: int, answer_room: int) -> Cascade | None:
    """The layout for prompts asked in this order, each (its image's id, its token ids), `slots`
    rows at a time, each answer up to `answer_room` tokens; None where no two consecutive prompts
    share an image (nothing to share). Seats: the most consecutive prompts on one image, up to
    `slots`. A row's own part: the longest prompt past the prefix it shares with the others on its
    image (a prefill of some of them shares at least as much), plus the answer. Prefix slots: twice
    what the rows fill with runs of the average length, so that a new run seldom waits for one."""
    runs: list[list[list[int]]] = []
    for n, (image, ids) in enumerate(prompts):
        if n and image is not None and prompts[n - 1][0] == image:
            runs[-1].append(ids)
        else:
            runs.append([ids])
    if not runs or max(map(len, runs)) < 2:
        return None
    # A run's shared prefix once for all its prompts (asked of each of them, a Kvasir-like step's
    # prompts on one image would be compared each with each, the host busy and the device idle).
    shared = [common_prefix(run, min(map(len, run)) - 1) if len(run) > 1 else None for run in runs]
    own = max(len(ids) - prefix if prefix is not None else 0 for run, prefix in zip(runs, shared) for ids in run)
    average = len(prompts) / len(runs)
    prefixes = min(slots, 2 * math.ceil(slots / average))
    return Cascade(seats=min(slots, max(map(len, runs))), prefixes=prefixes, own_length=own + answer_room)


def seat_plan(group: list[Request], seats: int) -> list[int]:
    """Each request's prefix among the group's (0, 1, ...): consecutive requests on one image share
    one, up to `seats` of them; a request alone, or without an image, has its own."""
    plan: list[int] = []
    seated = 0  # requests at the latest prefix
    for n, request in enumerate(group):
        same = n and request.image is not None and group[n - 1].image == request.image
        if same and seated < seats:
            plan.append(plan[-1])
            seated += 1
        else:
            plan.append(plan[-1] + 1 if plan else 0)
            seated = 1
    return plan


@dataclass
class PrefixLayer:
    """One layer's prefixes, as its attention reads them (handed to it with the decode step's layer
    call, as vlft.generation.kv_cache.LayerWindow is)."""

    keys: torch.Tensor  # prefixes, heads, length, dim
    values: torch.Tensor
    seated: torch.Tensor  # prefixes x seats: the row at each seat; the step's row count where empty
    seat_of: torch.Tensor  # rows: each row's seat, prefixes x seats where it has none
    live: BlockMask


class SharedPrefixes:
    """The prefix slots of a generation: their keys and values for every layer, who sits where (on
    the device, for the step, and on the host, for the engine), and which slots are free."""

    def __init__(self, model, cascade: Cascade, length: int, rows: int):
        text = language_model(model)
        config, weight = text.config, text.embed_tokens.weight
        slots, seats = cascade.prefixes, cascade.seats
        shape = (slots, config.num_key_value_heads, length, head_dim(config))
        self.keys = [torch.zeros(shape, device=weight.device, dtype=weight.dtype) for _ in text.layers]
        self.values = [torch.zeros(shape, device=weight.device, dtype=weight.dtype) for _ in text.layers]
        self.seats, self.rows = seats, rows
        device = weight.device
        self.seated = torch.full((slots, seats), rows, dtype=torch.long, device=device)
        self.seat_of = torch.full((rows,), slots * seats, dtype=torch.long, device=device)
        self.last = torch.full((slots,), -1, dtype=torch.long, device=device)  # each prefix's last position
        self.live = live_blocks(self.last, length, queries=seats)
        self.free = list(range(slots))
        self.seat_at: dict[int, tuple[int, int]] = {}  # row -> (slot, seat), on the host
        self.sitting = [0] * slots  # rows still seated at each slot

    def fill(self, prefilled, plan: list[int], shared: list[int], rows: list[int | None]) -> None:
        """The requests of a packed prefill that got a row (`rows`; None: answered by its first
        token) seated at free slots, one for each prefix of their `plan` (seat_plan's), and each
        slot's prefix (the first `shared` positions of its requests) written from the first of them."""
        pieces, slot_of, lasts, seatings = [], {}, [], []
        for request, (prefix, length, row) in enumerate(zip(plan, shared, rows)):
            if row is None:
                continue
            if prefix not in slot_of:
                slot_of[prefix] = slot = self.free.pop(0)
                pieces.append((slot, prompt_positions(prefilled.spans[request])[:length]))
                lasts.append((slot, length - 1))
            slot = slot_of[prefix]
            seat = self.sitting[slot]
            self.sitting[slot] += 1
            self.seat_at[row] = (slot, seat)
            seatings.append((slot, seat, row))
        # A write a state for all the rows seated (one a row took ms of the host for 64 rows).
        if seatings:
            slots, seats, seated_rows = (list(column) for column in zip(*seatings))
            self.last[[slot for slot, _ in lasts]] = torch.tensor([last for _, last in lasts], device=self.last.device)
            self.seated[slots, seats] = torch.tensor(seated_rows, device=self.seated.device)
            self.seat_of[seated_rows] = torch.tensor(
                [slot * self.seats + seat for slot, seat in zip(slots, seats)], device=self.seat_of.device
            )
        write_positions(self.keys, self.values, prefilled.cache, pieces)
        refresh_live_blocks(self.live, self.last)

    def leave(self, rows: list[int]) -> None:
        """Rows `rows` done: their seats emptied, and each slot freed with its last row, a write a
        state for them all. (A slot's rows are all seated by one prefill, so its seats are never
        handed out again while it is taken.)"""
        slots, seats = zip(*(self.seat_at.pop(row) for row in rows))
        self.seated[list(slots), list(seats)] = self.rows
        self.seat_of[list(rows)] = self.seated.numel()
        freed = []
        for slot in slots:
            self.sitting[slot] -= 1
            if not self.sitting[slot]:
                freed.append(slot)
        if freed:
            self.last[freed] = -1
            self.free.extend(freed)
            refresh_live_blocks(self.live, self.last)

    def layer(self, index: int) -> PrefixLayer:
        return PrefixLayer(self.keys[index], self.values[index], self.seated, self.seat_of, self.live)


def cascade_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, live=None, prefixes=None, **kw):
    """One new token of each row against its shared prefix (`prefixes`, a PrefixLayer) and its own
    part of the cache (`key`, `value`, read over its live blocks), merged by their log-sum-exps."""
    rows, heads, _, dim = query.shape
    own, own_lse = flex_attention(query, key, value, block_mask=live, scale=scaling, enable_gqa=True, return_lse=True)
    slots, seats = prefixes.seated.shape
    # Each seat's query (an empty seat's is zeros), a slot's seats as one batch element's queries.
    padded = torch.cat([query[:, :, 0], query.new_zeros(1, heads, dim)])
    seated = padded[prefixes.seated.view(-1)].view(slots, seats, heads, dim).transpose(1, 2)
    shared, shared_lse = flex_attention(
        seated,
        prefixes.keys,
        prefixes.values,
        block_mask=prefixes.live,
        scale=scaling,
        enable_gqa=True,
        return_lse=True,
    )
    # Back to each row by its seat; a row without one gets a part that weighs nothing.
    shared = torch.cat([shared.transpose(1, 2).reshape(slots * seats, heads, dim), shared.new_zeros(1, heads, dim)])
    shared_lse = torch.cat(
        [shared_lse.transpose(1, 2).reshape(slots * seats, heads), shared_lse.new_full((1, heads), -torch.inf)]
    )
    shared, shared_lse = shared[prefixes.seat_of], shared_lse[prefixes.seat_of]
    own, own_lse = own[:, :, 0], own_lse[:, :, 0]
    top = torch.maximum(own_lse, shared_lse)  # the own part's is finite: it holds the row's newest token
    own_weight, shared_weight = torch.exp(own_lse - top)[..., None], torch.exp(shared_lse - top)[..., None]
    wide = torch.promote_types(query.dtype, torch.float32)  # a GPU's bfloat16 parts merged in float32
    merged = (own.to(wide) * own_weight + shared.to(wide) * shared_weight) / (own_weight + shared_weight)
    return merged.to(query.dtype)[:, None], None


AttentionInterface.register(CASCADE_ATTENTION, cascade_attention)


def own_length(cascade: Cascade, max_length: int) -> int:
    """The positions a row's own part holds, a multiple of the cache's blocks."""
    length = cascade.own_length or max_length
    return -(-length // (2 * KV_BLOCK)) * 2 * KV_BLOCK

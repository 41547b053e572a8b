"""The generation engine's KV cache: `slots` rows allocated once, each row written at its own
length; windows of it for a decode step on fewer rows, and flex_attention's live blocks, so a
GPU's step reads each row only up to its own length."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from vlft.modeling import head_dim, language_model


class SlotCache:
    """Keys and values of `slots` sequences, each up to `length` tokens, for every layer.

    A decode step writes one token of each row at that row's own position (`write_at`) and
    attends over the whole row through a mask of its length: what the model's attention layers
    call as `past_key_values.update`.
    """

    def __init__(self, model, slots: int, length: int):
        """For `model`'s language model, on its device and in its dtype."""
        text = language_model(model)
        config, weight = text.config, text.embed_tokens.weight
        shape = (slots, config.num_key_value_heads, length, head_dim(config))
        self.keys = [torch.zeros(shape, device=weight.device, dtype=weight.dtype) for _ in text.layers]
        self.values = [torch.zeros(shape, device=weight.device, dtype=weight.dtype) for _ in text.layers]
        self.rows = torch.arange(slots, device=weight.device)
        self.write_at = torch.zeros(slots, dtype=torch.long, device=weight.device)
        # Where the rows' shared prefixes lie once (vlft.generation.shared_prefixes); None: each row holds its own.
        self.prefixes = None

    @staticmethod
    def bytes_per_token(model) -> int:
        """One token's keys and values over all layers of `model`'s language model."""
        text = language_model(model)
        config = text.config
        return 2 * len(text.layers) * config.num_key_value_heads * head_dim(config) * text.embed_tokens.weight.itemsize

    def fill(self, slots: list[int], prefilled, skip: list[int] | None = None) -> list[int]:
        """Copy each prompt of a packed prefill (vlft.generation.runner.Prefilled) into its row of
        `slots` (None: not kept), its stretches in order, so that its next token goes after them,
        past its first `skip` positions where given (they lie in its shared prefix,
        vlft.generation.shared_prefixes); one indexed copy a layer for all of them. Returns each
        kept prompt's length in its row."""
        skip = skip or [0] * len(slots)
        pieces = [
            (slot, prompt_positions(spans)[drop:])
            for slot, spans, drop in zip(slots, prefilled.spans, skip)
            if slot is not None
        ]
        lengths = write_positions(self.keys, self.values, prefilled.cache, pieces)
        if pieces:
            kept = torch.tensor([slot for slot, _ in pieces], device=self.rows.device)
            self.write_at[kept] = torch.tensor(lengths, device=self.rows.device)
        return lengths

    def move(self, source: int, target: int) -> None:
        """Row `source`'s keys and values, up to where its next token goes, into row `target`."""
        length = int(self.write_at[source])
        for keys, values in zip(self.keys, self.values):
            keys[target, :, :length] = keys[source, :, :length]
            values[target, :, :length] = values[source, :, :length]
        self.write_at[target] = length

    def release(self) -> None:
        """Its keys and values freed now, though the engine's objects that hold it sit in reference
        cycles (the decode step's layer calls) that only a collection would free."""
        self.keys.clear()
        self.values.clear()
        if self.prefixes is not None:
            self.prefixes.keys.clear()
            self.prefixes.values.clear()

    def window(self, rows: int, length: int) -> "CacheWindow":
        return CacheWindow(self, rows, length)


class CacheWindow:
    """The first `rows` rows of a SlotCache, their first `length` positions: what a decode step
    computes on when the rows past them are idle and no row is longer. It writes into the cache
    itself (so nothing is copied) and hands the attention views of the window."""

    def __init__(self, cache: SlotCache, rows: int, length: int):
        self.cache, self.length = cache, length
        self.rows, self.write_at = cache.rows[:rows], cache.write_at[:rows]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # Whatever else transformers passes (cache_kwargs, or kwargs= since 5.24) a slot cache does not use.
        return self.layer(layer_idx).update(key_states, value_states)

    def layer(self, index: int) -> "LayerWindow":
        return LayerWindow(self.cache.keys[index], self.cache.values[index], self.rows, self.write_at, self.length)


@dataclass
class LayerWindow:
    """One layer's part of a CacheWindow. A layer compiled for the decode step is handed this in
    place of the window: it holds that layer's keys and values as tensors, so one compiled graph
    serves every layer (indexing the window's lists by the layer's number, an int, would make the
    compiler trace each layer apart)."""

    keys: torch.Tensor
    values: torch.Tensor
    rows: torch.Tensor
    write_at: torch.Tensor
    length: int

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys[self.rows, :, self.write_at] = key_states[:, :, 0]
        self.values[self.rows, :, self.write_at] = value_states[:, :, 0]
        rows = self.rows.shape[0]
        return self.keys[:rows, :, : self.length], self.values[:rows, :, : self.length]


# The cache in blocks of this many positions: a GPU's step reads a row's blocks up to its length.
KV_BLOCK = 128


def live_blocks(write_at: torch.Tensor, length: int, queries: int = 1) -> BlockMask:
    """flex_attention's block mask over a cache of `length` positions a row: each row's `queries`
    attend to its positions up to `write_at` (where its newest token goes; -1: none), and the
    kernel reads none of the blocks past it. `refresh_live_blocks` keeps it in step as the rows grow."""
    if length % KV_BLOCK:
        raise ValueError(f"a GPU's decode step needs a cache length that is a multiple of {KV_BLOCK}, not {length}")
    slots, blocks = write_at.shape[0], length // KV_BLOCK
    every_block = torch.arange(blocks, dtype=torch.int32, device=write_at.device).expand(slots, 1, 1, blocks)

    def within(row, head, query, position):
        return position <= write_at[row]

    mask = BlockMask.from_kv_blocks(
        torch.ones(slots, 1, 1, dtype=torch.int32, device=write_at.device),
        every_block.contiguous(),
        BLOCK_SIZE=KV_BLOCK,
        mask_mod=within,
        seq_lengths=(queries, length),
        compute_q_blocks=False,  # nothing is differentiated
    )
    refresh_live_blocks(mask, write_at)
    return mask


def refresh_live_blocks(mask: BlockMask, write_at: torch.Tensor) -> None:
    mask.kv_num_blocks.copy_((write_at // KV_BLOCK + 1).view(-1, 1, 1))


def prompt_positions(spans: list[tuple[int, int]]) -> torch.Tensor:
    """The packed prefill's positions of a prompt laid out in `spans`, in order."""
    return torch.cat([torch.arange(start, end) for start, end in spans])


def write_positions(keys: list[torch.Tensor], values: list[torch.Tensor], source, pieces) -> list[int]:
    """For each (slot, positions) of `pieces`, the keys and values of a packed prefill's cache
    (`source`) at those positions written at the start of that slot of `keys` and `values` (a
    tensor a layer: slots, heads, positions, dim); one indexed copy a layer for all. Returns each
    piece's length."""
    lengths = [len(positions) for _, positions in pieces]
    if not pieces or not sum(lengths):
        return lengths
    device = keys[0].device
    slot = torch.cat([torch.full_like(positions, slot) for slot, positions in pieces]).to(device)
    to = torch.cat([torch.arange(len(positions)) for _, positions in pieces]).to(device)
    at = torch.cat([positions for _, positions in pieces]).to(device)
    for layer, (layer_keys, layer_values) in enumerate(zip(keys, values)):
        written = source.layers[layer]
        # (heads, positions, dim) gathered, written as (positions, heads, dim) at (slot, position).
        layer_keys[slot, :, to] = written.keys[0].index_select(1, at).transpose(0, 1)
        layer_values[slot, :, to] = written.values[0].index_select(1, at).transpose(0, 1)
    return lengths

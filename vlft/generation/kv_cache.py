"""The generation engine's KV cache: `slots` rows allocated once, each row written at its own
length; windows of it for a decode step on fewer rows, and flex_attention's live blocks, so a
GPU's step reads each row only up to its own length."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask


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

    @staticmethod
    def bytes_per_token(model) -> int:
        """One token's keys and values over all layers of `model`'s language model."""
        text = language_model(model)
        config = text.config
        return 2 * len(text.layers) * config.num_key_value_heads * head_dim(config) * text.embed_tokens.weight.itemsize

    def fill(self, slots: list[int], prefilled) -> list[int]:
        """Copy each prompt of a packed prefill (vlft.generation.runner.Prefilled) into its row of `slots` (None: not kept), its
        stretches in order, so that its next token goes after them; one indexed copy a layer for
        all of them. Returns each kept prompt's length."""
        rows, to, at = [], [], []
        for slot, spans in zip(slots, prefilled.spans):
            if slot is None:
                continue
            source = torch.cat([torch.arange(start, end) for start, end in spans])
            rows.append(torch.full_like(source, slot))
            to.append(torch.arange(len(source)))
            at.append(source)
        lengths = [len(positions) for positions in to]
        if not rows:
            return lengths
        device = self.rows.device
        rows, to, at = (torch.cat(index).to(device) for index in (rows, to, at))
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            source = prefilled.cache.layers[layer]
            # (heads, positions, dim) gathered, written as (positions, heads, dim) at (row, position).
            keys[rows, :, to] = source.keys[0].index_select(1, at).transpose(0, 1)
            values[rows, :, to] = source.values[0].index_select(1, at).transpose(0, 1)
        kept = [slot for slot in slots if slot is not None]
        self.write_at[torch.tensor(kept, device=device)] = torch.tensor(lengths, device=device)
        return lengths

    def move(self, source: int, target: int) -> None:
        """Row `source`'s keys and values, up to where its next token goes, into row `target`."""
        length = int(self.write_at[source])
        for keys, values in zip(self.keys, self.values):
            keys[target, :, :length] = keys[source, :, :length]
            values[target, :, :length] = values[source, :, :length]
        self.write_at[target] = length

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


def live_blocks(write_at: torch.Tensor, length: int) -> BlockMask:
    """flex_attention's block mask over a cache of `length` positions a row: each row attends to
    its positions up to `write_at` (where its newest token goes), and the kernel reads none of the
    blocks past it. `refresh_live_blocks` keeps it in step as the rows grow."""
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
        seq_lengths=(1, length),
        compute_q_blocks=False,  # nothing is differentiated
    )
    refresh_live_blocks(mask, write_at)
    return mask


def refresh_live_blocks(mask: BlockMask, write_at: torch.Tensor) -> None:
    mask.kv_num_blocks.copy_((write_at // KV_BLOCK + 1).view(-1, 1, 1))


def language_model(model):
    """The decoder stack of a Qwen-VL model (its embeddings, layers and final norm)."""
    return model.model.language_model


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

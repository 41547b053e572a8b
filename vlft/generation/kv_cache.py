"""The generation engine's KV cache: `slots` rows allocated once, each row written at its own
length; windows of it for a decode step on fewer rows, and flex_attention's live blocks, so a
GPU's step reads each row only up to its own length."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch.nn.attention.flex_attention import BlockMask
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionLayer

from vlft.forward.linear_attention import LinearPieces
from vlft.modeling import head_dim, language_model


class SlotCache:
    """Keys and values of `slots` sequences, each up to `length` tokens, for every attention layer;
    for every linear-attention layer (a hybrid model's Gated DeltaNet), each row's convolution
    window and recurrent state (`RowStates`).

    A decode step writes one token of each row at that row's own position (`write_at`) and
    attends over the whole row through a mask of its length: what the model's attention layers
    call as `past_key_values.update`; a linear-attention layer reads and updates its rows' states.
    """

    def __init__(self, model, slots: int, length: int):
        """For `model`'s language model, on its device and in its dtype."""
        text = language_model(model)
        config, weight = text.config, text.embed_tokens.weight
        shape = (slots, config.num_key_value_heads, length, head_dim(config))
        linear = linear_layers(config)
        zeros = partial(torch.zeros, shape, device=weight.device, dtype=weight.dtype)
        # None at a linear-attention layer: it keeps no keys.
        self.keys = [None if i in linear else zeros() for i in range(len(text.layers))]
        self.values = [None if i in linear else zeros() for i in range(len(text.layers))]
        self.states = {i: RowStates.of(text.layers[i].linear_attn, slots) for i in linear}
        self.slots, self.length = slots, length
        self.rows = torch.arange(slots, device=weight.device)
        self.write_at = torch.zeros(slots, dtype=torch.long, device=weight.device)
        # Where the rows' shared prefixes lie once (vlft.generation.shared_prefixes); None: each row holds its own.
        self.prefixes = None

    @staticmethod
    def bytes_per_token(model) -> int:
        """One token's keys and values over all attention layers of `model`'s language model."""
        text = language_model(model)
        config = text.config
        layers = len(text.layers) - len(linear_layers(config))
        return 2 * layers * config.num_key_value_heads * head_dim(config) * text.embed_tokens.weight.itemsize

    @staticmethod
    def bytes_per_row(model) -> int:
        """One row's states over all linear-attention layers of `model`'s language model (0 for
        a model of attention layers alone): they do not grow with its length."""
        text = language_model(model)
        return sum(RowStates.bytes_of(text.layers[i].linear_attn) for i in linear_layers(text.config))

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Everything it holds on the device."""
        keys = [t for t in self.keys + self.values if t is not None]
        return keys + [t for states in self.states.values() for t in (states.conv, states.recurrent)]

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
            if self.states:
                prompts = [n for n, slot in enumerate(slots) if slot is not None]
                prompts = torch.tensor(prompts, device=self.rows.device)
            for index, states in self.states.items():
                states.fill(kept, prefilled.cache.layers[index], prompts)
        return lengths

    def move(self, source: int, target: int) -> None:
        """Row `source`'s keys and values, up to where its next token goes, and its states, into row `target`."""
        length = int(self.write_at[source])
        for keys, values in zip(self.keys, self.values):
            if keys is not None:
                keys[target, :, :length] = keys[source, :, :length]
                values[target, :, :length] = values[source, :, :length]
        for states in self.states.values():
            states.conv[target] = states.conv[source]
            states.recurrent[target] = states.recurrent[source]
        self.write_at[target] = length

    def release(self) -> None:
        """Its keys, values and states freed now, though the engine's objects that hold it sit in
        reference cycles (the decode step's layer calls) that only a collection would free."""
        self.keys.clear()
        self.values.clear()
        self.states.clear()
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

    # A linear-attention layer's calls, on its rows' states.
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.layer(layer_idx).get_conv_state(layer_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.layer(layer_idx).get_recurrent_state(layer_idx)

    def update_recurrent_state(self, recurrent_states, layer_idx: int, *args, **kwargs) -> torch.Tensor:
        return self.layer(layer_idx).update_recurrent_state(recurrent_states, layer_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers (5.25 on) counts a layer's tokens as its decode updates the convolution in
        place; a slot cache counts each row's own (`write_at`)."""

    # Older transformers releases: the layer asks whether states exist, then reads them from `layers`.
    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return True

    @property
    def layers(self) -> "_ByIndex":
        return _ByIndex(self.layer)

    def layer(self, index: int) -> "LayerWindow | StatesWindow":
        if index in self.cache.states:
            return StatesWindow(self.cache.states[index], self.rows.shape[0])
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


@dataclass
class RowStates:
    """A linear-attention layer's state of each row: the last `kernel` inputs of its convolution
    (in the model's dtype, as transformers' cache keeps them) and its recurrent state (float32, as
    transformers' delta rule returns it whatever the model's dtype)."""

    conv: torch.Tensor  # (slots, channels, kernel)
    recurrent: torch.Tensor  # (slots, value heads, key dim, value dim)

    @classmethod
    def of(cls, layer, slots: int) -> "RowStates":
        """For a Gated DeltaNet layer of transformers (its sizes), on its device."""
        weight = layer.in_proj_qkv.weight
        conv = torch.zeros(slots, layer.conv_dim, layer.conv_kernel_size, device=weight.device, dtype=weight.dtype)
        shape = (slots, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
        return cls(conv, torch.zeros(shape, device=weight.device, dtype=torch.float32))

    @staticmethod
    def bytes_of(layer) -> int:
        conv = layer.conv_dim * layer.conv_kernel_size * layer.in_proj_qkv.weight.itemsize
        return conv + layer.num_v_heads * layer.head_k_dim * layer.head_v_dim * 4

    def fill(self, slots: torch.Tensor, prefilled, prompts: torch.Tensor) -> None:
        """Rows `slots` from a prefill's states (PromptStates) of the prompts at `prompts`."""
        self.conv[slots] = prefilled.conv_states[0].index_select(0, prompts).to(self.conv.dtype)
        self.recurrent[slots] = prefilled.recurrent_states[0].index_select(0, prompts).to(self.recurrent.dtype)


@dataclass
class StatesWindow:
    """A linear-attention layer's part of a CacheWindow: its first `rows` rows' states, which the
    layer's decode reads and updates in place (its convolution window through
    transformers' `causal_conv1d_update`, its recurrent state here)."""

    states: RowStates
    rows: int

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.states.conv[: self.rows]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.states.recurrent[: self.rows]

    def update_recurrent_state(self, recurrent_states, layer_idx: int, *args, **kwargs) -> torch.Tensor:
        return self.states.recurrent[: self.rows].copy_(recurrent_states)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    increase_count = CacheWindow.increase_count

    # Older transformers releases read a layer's states as `cache.layers[i].conv_states[0]` (and
    # `recurrent_states`, `record_past`) once `has_previous_state(i)` says they exist.
    record_past = False

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return True

    @property
    def layers(self) -> "_ByIndex":
        return _ByIndex(lambda index: self)

    @property
    def conv_states(self) -> dict:
        return {0: self.get_conv_state(0)}

    @property
    def recurrent_states(self) -> dict:
        return {0: self.get_recurrent_state(0)}


@dataclass
class _ByIndex:
    """`layers[i]` of a window: its layer i (a StatesWindow's: itself, whatever i)."""

    layer: object

    def __getitem__(self, index: int):
        return self.layer(index)


class PromptStates(LinearAttentionLayer):
    """A packed prefill's cache at one linear-attention layer: of every prompt, the convolution
    window and recurrent state it ends with (the states of the row's pieces that end at the
    prompts' last tokens, `ends`, and their windows' row positions and whether each is read,
    `windows`; vlft.forward.linear_attention), for SlotCache.fill. The row's own states, which
    transformers' layer would keep, mean nothing for a packed row."""

    def __init__(self, ends: torch.Tensor, windows: tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        self.ends, self.windows = ends, windows

    def update_conv_state(self, conv_states, state_idx: int = 0, **kwargs) -> torch.Tensor:
        source, valid = self.windows
        # (1, channels, tokens) -> each prompt's window (prompts, channels, kernel), zero before its start.
        self.conv_states[state_idx] = conv_states[0][:, source].transpose(0, 1) * valid[:, None].to(conv_states.dtype)
        self.has_previous_state[state_idx] = True
        return conv_states

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self.recurrent_states[state_idx] = recurrent_states.index_select(0, self.ends)
        return recurrent_states


def prompt_states_cache(model, pieces: LinearPieces, ends: list[int]):
    """The cache a hybrid model's packed prefill fills: transformers' own for its attention layers,
    PromptStates at its linear-attention layers."""
    text = language_model(model)
    cache = DynamicCache(config=text.config)
    linear = linear_layers(text.config)
    device = text.embed_tokens.weight.device
    # The prompts' windows, as row positions, once for all layers (they share one kernel size).
    kernel = text.layers[min(linear)].linear_attn.conv_kernel_size
    windows = tuple(t[ends].to(device) for t in pieces.windows(kernel, "cpu"))
    ends_at = torch.tensor(ends, device=device)
    for index in linear:
        cache.layers[index] = PromptStates(ends_at, windows)
    return cache


def linear_layers(config) -> set[int]:
    """The indices of a language model's linear-attention layers (none for attention alone)."""
    return {i for i, kind in enumerate(getattr(config, "layer_types", None) or ()) if kind == "linear_attention"}


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
    device = next(k for k in keys if k is not None).device
    slot = torch.cat([torch.full_like(positions, slot) for slot, positions in pieces]).to(device)
    to = torch.cat([torch.arange(len(positions)) for _, positions in pieces]).to(device)
    at = torch.cat([positions for _, positions in pieces]).to(device)
    for layer, (layer_keys, layer_values) in enumerate(zip(keys, values)):
        if layer_keys is None:  # a linear-attention layer: its states are RowStates'
            continue
        written = source.layers[layer]
        # (heads, positions, dim) gathered, written as (positions, heads, dim) at (slot, position).
        layer_keys[slot, :, to] = written.keys[0].index_select(1, at).transpose(0, 1)
        layer_values[slot, :, to] = written.values[0].index_select(1, at).transpose(0, 1)
    return lengths

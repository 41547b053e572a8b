"""Greedy generation for evaluation: continuous batching over a KV cache allocated once.

`model.generate` pads a batch to its longest prompt, grows its KV cache by concatenation at every
step, and keeps the batch together until its longest answer ends, so that short answers wait for
long ones. Here instead:

- the KV cache has `slots` rows, each as long as the longest prompt plus answer, allocated once;
- prompts are prefilled packed end to end, without padding, by the model's own forward (vision
  tower and all, through vlft.training.packing's attention), consecutive prompts on one image with its
  prefix once (vlft.training.image_groups), and each one's keys and values are copied into a free row;
- each decode step runs the language model's own layers on one token of every row, each row
  attending to its own length and at its own text position (past the image's M-RoPE positions);
  on a GPU it is compiled and replayed as a CUDA graph, its attention a flex_attention kernel
  that reads each row's cache only to its length;
- a row whose answer ends (end of turn, or its sample's token limit) takes the next prompt before
  the next step.

The model's layers do all the arithmetic; this module owns only the cache, the mask and the
schedule, so that the answers are the ones `generate` gives, token for token (on a CPU in float32,
where the step runs transformers' own attention; tests/test_generation.py).
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager, nullcontext
from functools import partial
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface

from vlft.training.image_groups import RowLayout, common_prefix
from vlft.training.loss import linear_cross_entropy_sums
from vlft.modeling import unwrapped
from vlft.training.packing import use_packed_attention

DECODE_ATTENTION = "vlft_slot_decode"


@dataclass
class Request:
    key: int  # the caller's name for the answer
    # One sample as model inputs (input_ids 1 x L, pixel_values, ...): its prompt, and where it is
    # scored, the reference answer after it.
    inputs: dict
    positions: torch.Tensor  # its M-RoPE positions (3 x 1 x L)
    max_new_tokens: int
    image: str | None = None  # the image's id in its cache: prompts on one image share its prefix
    image_tokens: int = 0  # the image's tokens in the prompt: what a prompt after one on its image costs less
    prompt_length: int | None = None  # where the prompt ends in `inputs`; None: all of it
    # Scored (the validation loss, in the same forward as the prompt's prefill): the positions of
    # `inputs` whose next token is a reference answer token, and those tokens.
    loss_positions: torch.Tensor | None = None
    loss_targets: torch.Tensor | None = None

    @property
    def prompt(self) -> int:
        return self.inputs["input_ids"].shape[1] if self.prompt_length is None else self.prompt_length


@dataclass
class Prefilled:
    """What one packed prefill gives: each prompt's first answer token, the cache it filled, each
    prompt's stretches of that cache in order (a shared prefix, then its own), each scored
    request's (loss sum, answer tokens) or None, and the tokens the forward computed."""

    firsts: list[int]
    cache: object
    spans: list[list[tuple[int, int]]]
    losses: list[tuple[float, int] | None]
    tokens: int


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
        shape = (slots, config.num_key_value_heads, length, _head_dim(config))
        self.keys = [torch.zeros(shape, device=weight.device, dtype=weight.dtype) for _ in text.layers]
        self.values = [torch.zeros(shape, device=weight.device, dtype=weight.dtype) for _ in text.layers]
        self.rows = torch.arange(slots, device=weight.device)
        self.write_at = torch.zeros(slots, dtype=torch.long, device=weight.device)

    @staticmethod
    def bytes_per_token(model) -> int:
        """One token's keys and values over all layers of `model`'s language model."""
        text = language_model(model)
        config = text.config
        return 2 * len(text.layers) * config.num_key_value_heads * _head_dim(config) * text.embed_tokens.weight.itemsize

    def fill(self, slots: list[int], prefilled: Prefilled) -> list[int]:
        """Copy each prompt of a packed prefill into its row of `slots` (None: not kept), its
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


def decode_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, live=None, **kwargs):
    """One new token of each row against its row of the cache, for a GPU's decode step.

    transformers' SDPA path, given a mask, reads every row's cache to its full length, and first
    repeats every key and value head for each query head that shares it (4x the cache's bytes for
    Qwen3-VL-8B). flex_attention's decoding kernel, given the rows' live blocks (`live`), reads
    each shared head once and each row only up to its own length: an idle row, or the unwritten
    end of a row, costs nothing.
    """
    output = flex_attention(query, key, value, block_mask=live, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2), None


AttentionInterface.register(DECODE_ATTENTION, decode_attention)


@contextmanager
def layer_calls(layers, calls):
    """Each of `layers` called through its entry of `calls` (None: its own forward, eagerly) while
    the block runs; the calls the layers had before (a training stage's compiled ones, from
    vlft.training.train.compile_decoder_layers) come back after."""
    before = [layer._compiled_call_impl for layer in layers]
    for layer, call in zip(layers, calls):
        layer._compiled_call_impl = call
    try:
        yield
    finally:
        for layer, call in zip(layers, before):
            layer._compiled_call_impl = call


def _call_layer(layer, *args, **kwargs):
    """A decoder layer's own call: compiled once, it runs every layer of the model (their weights
    are the graph's inputs, as torch.compile treats a module passed in)."""
    return layer._call_impl(*args, **kwargs)


def language_model(model):
    """The decoder stack of a Qwen-VL model (its embeddings, layers and final norm)."""
    return model.model.language_model


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecodeStep:
    """One greedy token for each of the cache's first `rows` rows, attending to their first
    `length` positions.

    On a CPU: eagerly, through transformers' SDPA, as `generate` runs it, on the rows and length in
    use. On a GPU: always every row and the cache's whole length, so that one shape is compiled
    once and replayed as one CUDA graph (one launch a step instead of some ten a layer); its
    attention (flex_attention over the rows' live blocks) still reads each row only to its own
    length."""

    def __init__(self, model, cache: SlotCache, compile: bool = False, attention: str | None = None):
        self.model, self.cache = model, cache
        self.text = language_model(model)
        device = cache.rows.device
        slots, length = cache.keys[0].shape[0], cache.keys[0].shape[2]
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)  # each row's latest token
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)  # its next text position
        self.chosen = torch.zeros(slots, dtype=torch.long, device=device)
        self.columns = torch.arange(length, device=device)
        # transformers' own SDPA on a CPU, for answers exactly as `generate` gives them.
        self.attention = attention or (DECODE_ATTENTION if device.type == "cuda" else "sdpa")
        # flex_attention's live blocks cover every row to the cache's length: its steps do too.
        self.live = live_blocks(cache.write_at, length) if self.attention == DECODE_ATTENTION else None
        # torch.compile fuses the elementwise work between a layer's matmuls (norms, rotary,
        # residuals) and builds flex_attention's kernel: on a GPU, some 40 kernels a layer become a
        # few. It compiles one decoder layer, which every layer then runs with its own weights and
        # its own part of the cache: tracing the whole step instead traced all its layers (9-13 s
        # in each evaluation job of the 2B, with inductor's cache warm). The rest of the step
        # (embedding, rotary tables, final norm, head) is a few kernels, and the CUDA graph
        # launches all of it at once anyway. One static shape: compiled for dynamic shapes with a
        # graph per (rows, length) bucket, the benchmark did not finish in 280 s for the 8B or the 2B.
        self.compiled_layer = torch.compile(_call_layer, dynamic=False) if compile else None
        # Where compiled, each layer is called through the compiled layer while the step runs.
        self.compiled_calls = (
            [partial(self._compiled_layer_call, i) for i in range(len(self.text.layers))] if compile else None
        )
        self.graphs = {} if device.type == "cuda" else None
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.capture_s = 0.0  # compiling and capturing, once a job

    @contextmanager
    def _as_the_step(self):
        """The language model's attention layers read their implementation from its config: the
        step's own while it runs (prefills use packed attention); its layers, where compiled,
        run through the step's compiled layer."""
        config = self.text.config
        prefill_attention = config._attn_implementation
        config._attn_implementation = self.attention
        try:
            with layer_calls(self.text.layers, self.compiled_calls) if self.compiled_calls else nullcontext():
                yield
        finally:
            config._attn_implementation = prefill_attention

    def _compiled_layer_call(self, index: int, *args, **kwargs):
        # The layer's own part of the cache window, under the name this transformers passes it by.
        name = "cache" if "cache" in kwargs else "past_key_values"
        kwargs[name] = kwargs[name].layer(index)
        return self.compiled_layer(self.text.layers[index], *args, **kwargs)

    def _run(self, rows: int, length: int) -> None:
        with self._as_the_step():
            self.chosen[:rows].copy_(self._next_tokens(rows, length))

    def logits(self, rows: int | None = None, length: int | None = None) -> torch.Tensor:
        """The rows' logits for their next tokens, computed eagerly, to check the step against a
        full forward; like a step, it writes the rows' latest tokens into the cache."""
        with self._as_the_step():
            return self._logits(rows or self.tokens.shape[0], length or self.columns.shape[0])

    def _next_tokens(self, rows: int, length: int) -> torch.Tensor:
        return self._logits(rows, length).argmax(-1)

    def _logits(self, rows: int, length: int) -> torch.Tensor:
        window = self.cache.window(rows, length)
        mask = self.columns[None, :length] <= window.write_at[:, None]
        live = {}
        if self.live is not None:
            refresh_live_blocks(self.live, self.cache.write_at)
            live["live"] = self.live
        # Text tokens after the image: all three M-RoPE components at the same position.
        positions = self.positions[:rows].view(1, rows, 1).expand(3, rows, 1)
        hidden = self.text(
            input_ids=self.tokens[:rows, None],
            attention_mask=mask[:, None, None, :],
            position_ids=positions,
            past_key_values=window,
            use_cache=True,
            **live,
        ).last_hidden_state
        return self.model.lm_head(hidden[:, -1])

    def _capture(self, rows: int, length: int):
        # Warm-up (compiles on first use, picks kernels): it writes each row's latest token where
        # the step itself will, the same values, so the rows that answer are not disturbed.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(rows, length)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._run(rows, length)
        return graph

    def __call__(self, rows: int, length: int) -> torch.Tensor:
        """The next token of rows 0 to `rows` - 1 (its first `rows` entries)."""
        if self.graphs is None:
            self._run(rows, length)
        else:
            if (rows, length) not in self.graphs:
                began = time.perf_counter()
                self.graphs[rows, length] = self._capture(rows, length)
                torch.cuda.synchronize()
                self.capture_s += time.perf_counter() - began
            self.graphs[rows, length].replay()
        return self.chosen


# The most tokens a prefill computes (prompts, and their reference answers where scored): on the 8B
# with 128 rows of 2,048 positions the job peaked at 58 GiB.
PACKED_ROW_TOKENS = 16384


def prefill(model, group: list[Request]) -> Prefilled:
    """The requests of `group` in one forward, packed end to end with no padding: consecutive ones
    on one image share its prefix, laid out once (vlft.training.image_groups), each attending to the prefix
    and to itself alone. A scored request's reference answer follows its prompt, so that its loss
    comes from the very forward that prefills the prompt (the prompt computed once, not again by a
    separate loss pass); only the prompt's keys and values go on to the cache."""
    runs = _image_runs(group)
    layout = RowLayout.of([(shared, [r.inputs["input_ids"].shape[1] for r in run]) for shared, run in runs])
    pieces = {key: [] for key in ("input_ids", "mm_token_type_ids", "positions")}
    images = {"pixel_values": [], "image_grid_thw": []}
    lasts, scored, targets, owners = [], [], [], []  # row positions: each prompt's last, the scored ones
    segments, spans = iter(layout.segments), iter(layout.key_spans)
    for shared, run in runs:
        for n, request in enumerate(run):
            drop = shared if n else 0
            for key in pieces:
                values = request.positions if key == "positions" else request.inputs[key]
                pieces[key].append(values[..., drop:])
            if n == 0:  # the image once for the run
                for key in images:
                    images[key].append(request.inputs[key])
            # The row position of the request's own token i (i >= drop) is start + i - drop.
            start = next(segments)[0]
            lasts.append(start + request.prompt - 1 - drop)
            if request.loss_targets is not None:
                scored.append(request.loss_positions + start - drop)
                targets.append(request.loss_targets)
                owners.append(torch.full_like(request.loss_targets, len(lasts) - 1))
    device = pieces["input_ids"][0].device
    attention = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in layout.attention_inputs().items()}
    outer = unwrapped(model)
    output = outer.model(
        input_ids=torch.cat(pieces["input_ids"], dim=1),
        mm_token_type_ids=torch.cat(pieces["mm_token_type_ids"], dim=1),
        pixel_values=torch.cat(images["pixel_values"]),
        image_grid_thw=torch.cat(images["image_grid_thw"]),
        position_ids=torch.cat(pieces["positions"], dim=-1),
        use_cache=True,
        **attention,
    )
    hidden = output.last_hidden_state[0]
    # Each prompt's last token predicts its first answer token.
    firsts = outer.lm_head(hidden[torch.tensor(lasts, device=device)]).argmax(-1).tolist()
    losses: list[tuple[float, int] | None] = [None] * len(group)
    if scored:
        owners = torch.cat(owners)
        sums = linear_cross_entropy_sums(
            hidden.index_select(0, torch.cat(scored)), outer.lm_head.weight, torch.cat(targets), owners, len(group)
        ).tolist()
        counts = torch.bincount(owners, minlength=len(group)).tolist()
        losses = [(sums[i], counts[i]) if r.loss_targets is not None else None for i, r in enumerate(group)]
    # Each request's stretches of the cache, cut at its prompt's end: the answer's keys are not kept.
    prompts = [_cut(request_spans, r.prompt) for request_spans, r in zip(spans, group)]
    return Prefilled(firsts, output.past_key_values, prompts, losses, layout.segments[-1][1])


def _cut(spans: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The stretches of a row that hold the first `length` positions of a sample laid out in `spans`."""
    kept = []
    for start, end in spans:
        end = min(end, start + length - sum(e - s for s, e in kept))
        if end > start:
            kept.append((start, end))
    return kept


def _image_runs(group: list[Request]) -> list[tuple[int, list[Request]]]:
    """Consecutive requests on one image, each run with the prompt prefix its requests share (0 for
    a request alone). The image's id decides, not its tokens: two images of one size have the very
    same placeholder tokens."""
    runs: list[list[Request]] = []
    for request in group:
        if runs and request.image is not None and runs[-1][0].image == request.image:
            runs[-1].append(request)
        else:
            runs.append([request])
    shared = [
        (
            common_prefix([r.inputs["input_ids"][0].tolist() for r in run], min(r.prompt for r in run) - 1)
            if len(run) > 1
            else 0
        )
        for run in runs
    ]
    return list(zip(shared, runs))


def greedy_answers(
    model,
    requests: Iterable[Request],
    slots: int,
    end_id: int,
    max_length: int,
    on_answer: Callable[[int, list[int]], None],
    prefill_tokens: int = PACKED_ROW_TOKENS,
    stats: dict | None = None,
    on_loss: Callable[[int, float, int], None] | None = None,
) -> None:
    """Answer every request greedily, `slots` at a time; `on_answer(key, token_ids)` as each ends
    (its ids end with `end_id` where the model said it, else at the request's token limit), and
    `on_loss(key, loss sum, answer tokens)` for each scored request, from its prefill.

    `max_length` bounds a request's prompt plus answer. Free rows are filled by packed prefills of
    up to `prefill_tokens` tokens computed (one prompt at least; a prompt after one on its image
    counts its own tokens). Requests are read as rows free up, so that their inputs need not all be
    on the device at once. `stats`, where given, gets the
    seconds of each phase (setting up, reading prompts, prefills, choosing rows, steps, their
    bookkeeping, handing answers over; the step's compile and capture apart), the steps, and the
    rows busy over all steps (synchronizing the device around each, which a benchmark can
    afford)."""
    text = language_model(model)
    config = text.config
    weight = text.embed_tokens.weight
    timer = _Timer(weight.device, stats)
    timer.start()
    # A multiple of 256: matmuls over an odd length (1724, say) leave the tensor cores' fast kernels.
    max_length = -(-max_length // 256) * 256
    cache = SlotCache(model, slots, max_length)
    prefill_attention = config._attn_implementation
    use_packed_attention(model)
    try:
        # Evaluating during training, the stage's layers are compiled for its steps: here they run
        # eagerly, as in an evaluate job, so that the prefills compute what the job's would.
        # Compiled, each layer's prefill through the KV cache was traced apart (on the GPU, dynamo
        # gave up at its limit of 8 recompiles in a stage's first evaluation).
        with layer_calls(text.layers, [None] * len(text.layers)):
            # Compiled on a GPU (13 s for an 8B on a fresh machine, once a job), where it halves a step.
            step = DecodeStep(model, cache, compile=weight.device.type == "cuda")
            timer.stop("setup_s")  # 3 s the first time a process compiles (torch's compiler loads), then ms
            timer.add("max_length", max_length)
            _answer_all(model, iter(requests), cache, step, end_id, on_answer, on_loss, prefill_tokens, timer)
        # The first step compiled and captured the step's graph: apart.
        timer.add("compile_s", step.capture_s)
        timer.add("step_s", -step.capture_s)
        timer.add("graphs", len(step.graphs or {}))
    finally:
        unwrapped(model).set_attn_implementation({"text_config": prefill_attention})
        timer.stop("setup_s")  # once a job, before the first prompt and after the last answer


def _answer_all(model, requests, cache, step, end_id, on_answer, on_loss, prefill_tokens, timer) -> None:
    slots, most_length = cache.rows.shape[0], cache.keys[0].shape[2]
    # With flex_attention's live blocks a step reads each row only to its own length, so it computes
    # on the whole cache (one shape, one CUDA graph); otherwise on the rows and length in use.
    whole = step.live is not None
    active = torch.zeros(slots, dtype=torch.long, device=cache.rows.device)  # 1 where a row answers
    busy: list[Request | None] = [None] * slots
    answers: list[list[int]] = [[] for _ in range(slots)]
    written = [0] * slots  # each row's length in the cache, as cache.write_at holds it on the device
    read_ahead: deque[Request] = deque()
    exhausted = False

    def read_one() -> bool:
        nonlocal exhausted
        request = next(requests, None)
        if request is None:
            exhausted = True
            return False
        read_ahead.append(request)
        return True

    def run_length() -> int:
        """How many requests at the head of the queue ask about one image (read ahead up to `slots`)."""
        n = 1
        while n < slots and (len(read_ahead) > n or read_one()):
            if read_ahead[n].image is None or read_ahead[n].image != read_ahead[0].image:
                break
            n += 1
        return n

    def next_group(most: int) -> list[Request]:
        """Requests for `most` free rows. The requests on one image go into one prefill whole,
        with the image once: where they do not fit the free rows, they wait for rows to free up
        while others still answer (a few decode steps, cheap beside computing the image again)."""
        group, tokens = [], 0
        answering = any(request is not None for request in busy)
        while len(group) < most and (read_ahead or read_one()):
            request = read_ahead[0]
            if not group or request.image is None or group[-1].image != request.image:
                run = run_length()
                if run > most - len(group) and (group or (answering and run <= slots)):
                    break
            # The tokens it adds to the prefill: after a prompt on its image, its own tokens alone.
            length = request.inputs["input_ids"].shape[1]
            if group and request.image is not None and group[-1].image == request.image:
                length -= request.image_tokens
            if group and tokens + length > prefill_tokens:
                break
            group.append(read_ahead.popleft())
            tokens += length
        return group

    def finished(slot: int) -> bool:
        answer = answers[slot]
        return answer[-1] == end_id or len(answer) >= busy[slot].max_new_tokens

    def release(slot: int) -> None:
        on_answer(busy[slot].key, answers[slot])
        busy[slot], written[slot] = None, 0
        active[slot], cache.write_at[slot] = 0, 0

    def move(source: int, target: int) -> None:
        cache.move(source, target)
        for state in (step.tokens, step.positions, active):
            state[target] = state[source]
        busy[target], answers[target], written[target] = busy[source], answers[source], written[source]
        busy[source], written[source] = None, 0
        active[source], cache.write_at[source] = 0, 0

    while True:
        free = [slot for slot in range(slots) if busy[slot] is None]
        while free and (group := next_group(len(free))):
            timer.stop("read_s")
            prefilled = prefill(model, group)
            rows_of = []  # each prompt's row, None where its first token answered it
            for request, first, loss in zip(group, prefilled.firsts, prefilled.losses):
                if loss is not None and on_loss is not None:
                    on_loss(request.key, *loss)
                slot = free.pop(0)
                busy[slot], answers[slot] = request, [first]
                if finished(slot):  # answered by its first token: its row stays free
                    on_answer(request.key, answers[slot])
                    busy[slot] = None
                    free.insert(0, slot)
                    rows_of.append(None)
                    continue
                rows_of.append(slot)
                step.tokens[slot] = first
                step.positions[slot] = request.positions[..., : request.prompt].max() + 1
                active[slot] = 1
            for slot, length in zip([s for s in rows_of if s is not None], cache.fill(rows_of, prefilled)):
                written[slot] = length
            timer.add("prefill_tokens", prefilled.tokens)  # shared prefixes once
            del prefilled
            timer.stop("prefill_s")
            timer.add("prefills", 1)
        timer.stop("read_s")
        if exhausted and not read_ahead and not whole:
            # No prompt is left to fill a free row: the rows still answering move down to the
            # lowest ones, so that steps compute on fewer rows as answers end.
            free = [slot for slot in range(slots) if busy[slot] is None]
            for source in reversed(range(slots)):
                if busy[source] is not None and free and free[0] < source:
                    move(source, free.pop(0))
                    free.append(source)
                    free.sort()
        answering = [slot for slot in range(slots) if busy[slot] is not None]
        if not answering:
            return

        # One token of each row up to the last that answers, over the cache up to the longest;
        # idle rows among them compute on what they hold, and nothing reads it.
        rows, length = slots, most_length
        if not whole:
            rows, length = answering[-1] + 1, max(written[slot] for slot in answering) + 1
        timer.stop("schedule_s")
        chosen = step(rows, length)
        timer.stop("step_s")
        step.tokens[:rows].copy_(chosen[:rows])
        cache.write_at += active
        step.positions += active
        chosen = chosen[:rows].tolist()
        timer.stop("bookkeeping_s")
        timer.add("decode_steps", 1)
        timer.add("busy_rows", len(answering))
        timer.add("computed_rows", rows)
        for slot in answering:
            answers[slot].append(chosen[slot])
            written[slot] += 1
            if finished(slot):
                release(slot)
        timer.stop("answers_s")


class _Timer:
    """Seconds between start and stop, summed by name into `totals` (the device synchronized at
    each); nothing at all where `totals` is None."""

    def __init__(self, device, totals: dict | None):
        self.device, self.totals, self.began = device, totals, 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        if self.totals is not None:
            self.began = self._now()

    def stop(self, name: str) -> None:
        """The seconds since the last start or stop, to `name`."""
        if self.totals is not None:
            now = self._now()
            self.add(name, now - self.began)
            self.began = now

    def add(self, name: str, amount) -> None:
        if self.totals is not None:
            self.totals[name] = self.totals.get(name, 0) + amount

"""The generation engine's model runner: a packed prefill of prompts (each image's prefix once) and
the decode step (one token of every row, compiled per decoder layer and replayed as a CUDA graph on
a GPU). Which token follows is the sampler's (vlft.generation.sampling); the model's own layers do
all the arithmetic."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from torch.nn.attention.flex_attention import flex_attention
from transformers import AttentionInterface

from vlft.generation.kv_cache import SlotCache, linear_layers, live_blocks, prompt_states_cache, refresh_live_blocks
from vlft.generation.requests import Request, asks_again
from vlft.generation.sampling import Greedy
from vlft.generation.shared_prefixes import CASCADE_ATTENTION
from vlft.modeling import cache_keyword, is_hybrid_model, language_model, output_cache, unwrapped
from vlft.forward.image_groups import RowLayout, common_prefix
from vlft.forward.loss import linear_cross_entropy_sums

DECODE_ATTENTION = "vlft_slot_decode"


@dataclass
class Prefilled:
    """What one packed prefill gives: each prompt's first answer token, the cache it filled, each
    prompt's stretches of that cache in order (a shared prefix, then its own), each scored
    request's (loss sum, answer tokens) or None, the tokens the forward computed, the length of
    the prefix each prompt shares with those beside it on its image (0: none), and each prompt's
    last hidden state, which scored its first answer token (a reward stage's update learns that
    token from it: vlft.training.shared_prompts)."""

    firsts: list[int]
    cache: object
    spans: list[list[tuple[int, int]]]
    losses: list[tuple[float, int] | None]
    tokens: int
    shared: list[int]
    last_hidden: torch.Tensor | None = None


def decode_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, live=None, **kwargs):
    """One new token of each row against its row of the cache, for a GPU's decode step.

    transformers' SDPA path, given a mask, reads every row's cache to its full length, and first
    repeats every key and value head for each query head that shares it (the cache's bytes times
    the query heads a key head serves). flex_attention's decoding kernel, given the rows' live blocks (`live`), reads
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
    vlft.modeling.compile_decoder_layers) come back after."""
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


try:
    # transformers 5.25 on wraps attention forwards in the kernels package's layers: each call sets
    # this routing table and resets it as it returns.
    from kernels._internals.layer.layer import _ACTIVE_KERNEL_FUNCS as KERNEL_ROUTES
except ImportError:  # older transformers, without the kernels package
    KERNEL_ROUTES = None


@contextmanager
def kernel_routes_kept():
    """The kernels package's routing table as the block found it. Compiled, a layer's reset of the
    table is lost: torch.compile drops Python state a frame writes after flex_attention (the decode
    attention) ran in it, so the table stayed set and the next layer's call, which the compiled
    graph guards to find it unset, compiled the layer again (tests/generation/test_generation.py)."""
    if KERNEL_ROUTES is None:
        yield
        return
    found = KERNEL_ROUTES.global_var, KERNEL_ROUTES.uses_global_var
    try:
        yield
    finally:
        KERNEL_ROUTES.global_var, KERNEL_ROUTES.uses_global_var = found


@contextmanager
def one_linear_attention_index(text):
    """Every linear-attention layer of the language model `text` under the first one's index
    while the block runs. transformers before 5.21 reads such a layer's states as
    `cache.layers[self.layer_idx]`, and torch.compile takes a module's int for a constant it
    guards: each layer compiled a graph of its own up to the recompile limit, and the rest ran
    eagerly (benchmarks/README.md). Handed its own part of the cache (a StatesWindow, the same
    states whatever the index), a layer's index means nothing to it."""
    modules = [text.layers[i].linear_attn for i in sorted(linear_layers(text.config))]
    indices = [module.layer_idx for module in modules]
    for module in modules:
        module.layer_idx = indices[0]
    try:
        yield
    finally:
        for module, index in zip(modules, indices):
            module.layer_idx = index


class DecodeStep:
    """The next token (the sampler's choice; greedy by default) of each of the cache's first `rows` rows, attending to their first
    `length` positions.

    On a CPU: eagerly, through transformers' SDPA, as `generate` runs it, on the rows and length in
    use. On a GPU: always every row and the cache's whole length, so that one shape is compiled
    once and replayed as one CUDA graph (one launch a step instead of some ten a layer); its
    attention (flex_attention over the rows' live blocks) still reads each row only to its own
    length."""

    def __init__(
        self,
        model,
        cache: SlotCache,
        compile: bool = False,
        backend: str = "inductor",
        attention: str | None = None,
        sampler=None,
        folded=None,
    ):
        self.model, self.cache, self.sampler = model, cache, sampler or Greedy()
        # The adapter folded into a copy of the weights (vlft.generation.folded_adapter), which the
        # step reads while it runs, where given.
        self.folded = folded
        self.text = language_model(model)
        device = cache.rows.device
        slots, length = cache.slots, cache.length
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)  # each row's latest token
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)  # its next text position
        self.chosen = torch.zeros(slots, dtype=torch.long, device=device)
        self.columns = torch.arange(length, device=device)
        # transformers' own SDPA on a CPU, for answers exactly as `generate` gives them; with
        # shared prefixes, the cascade's attention on either (its two parts are flex_attention's).
        self.prefixes = cache.prefixes
        self.attention = attention or (DECODE_ATTENTION if device.type == "cuda" else "sdpa")
        if self.prefixes is not None:
            self.attention = CASCADE_ATTENTION
        # flex_attention's live blocks cover every row to the cache's length: its steps do too.
        self.live = live_blocks(cache.write_at, length) if self.attention != "sdpa" else None
        # torch.compile fuses the elementwise work between a layer's matmuls (norms, rotary,
        # residuals) and builds flex_attention's kernel: on a GPU, some 40 kernels a layer become a
        # few. It compiles one decoder layer, which every layer then runs with its own weights and
        # its own part of the cache: tracing the whole step instead traced all its layers (seconds
        # in each evaluation job, with inductor's cache warm: benchmarks/README.md). The rest of the step
        # (embedding, rotary tables, final norm, head) is a few kernels, and the CUDA graph
        # launches all of it at once anyway. One static shape: compiled for dynamic shapes with a
        # graph per (rows, length) bucket, benchmarks/eval_speed.py did not finish (benchmarks/README.md).
        # (`backend`: the tests' aot_eager on a CPU, where inductor's C++ flex_attention lacks the
        # log-sum-exp the cascade reads and Qwen3.5's gated output.)
        self.compiled_layer = torch.compile(_call_layer, dynamic=False, backend=backend) if compile else None
        # Where compiled, or reading shared prefixes (a layer's own, handed to it with its call),
        # each layer is called through the step's layer call while the step runs.
        self.layer_calls = (
            [partial(self._layer_call, i) for i in range(len(self.text.layers))]
            if compile or self.prefixes is not None
            else None
        )
        self.graphs = {} if device.type == "cuda" else None
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.capture_s = 0.0  # compiling and capturing, once a job

    @contextmanager
    def _as_the_step(self):
        """The language model's attention layers read their implementation from its config: the
        step's own while it runs (prefills use packed attention); its layers, where compiled,
        run through the step's compiled layer, and read the folded adapter where there is one."""
        config = self.text.config
        prefill_attention = config._attn_implementation
        config._attn_implementation = self.attention
        try:
            with (
                layer_calls(self.text.layers, self.layer_calls) if self.layer_calls else nullcontext(),
                one_linear_attention_index(self.text) if self.layer_calls else nullcontext(),
                self.folded.folded_in() if self.folded else nullcontext(),
            ):
                yield
        finally:
            config._attn_implementation = prefill_attention

    def _layer_call(self, index: int, *args, **kwargs):
        # The layer's own part of the cache window, under the name this transformers passes it by,
        # and its part of the shared prefixes.
        name = "cache" if "cache" in kwargs else "past_key_values"
        kwargs[name] = kwargs[name].layer(index)
        if self.prefixes is not None:
            kwargs["prefixes"] = self.prefixes.layer(index)
        layer = self.text.layers[index]
        if not self.compiled_layer:
            return layer._call_impl(*args, **kwargs)
        with kernel_routes_kept():
            return self.compiled_layer(layer, *args, **kwargs)

    def _run(self, rows: int, length: int) -> None:
        with self._as_the_step():
            self.chosen[:rows].copy_(self._next_tokens(rows, length))

    def logits(self, rows: int | None = None, length: int | None = None) -> torch.Tensor:
        """The rows' logits for their next tokens, computed eagerly, to check the step against a
        full forward; like a step, it writes the rows' latest tokens into the cache."""
        with self._as_the_step():
            return self._logits(rows or self.tokens.shape[0], length or self.columns.shape[0])

    def _next_tokens(self, rows: int, length: int) -> torch.Tensor:
        return self.sampler.next(self._logits(rows, length))

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
            **{cache_keyword(self.text): window},
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

    def release(self) -> None:
        """Its CUDA graphs' and folded weights' memory freed now (the step sits in a reference cycle:
        its layer calls are bound to it)."""
        for graph in (self.graphs or {}).values():
            graph.reset()
        if self.folded:  # a writing of its copies that no step waited for is done before they are freed
            self.folded.ready()
        self.graphs, self.pool, self.layer_calls = {} if self.graphs is not None else None, None, None
        self.folded = None

    def __call__(self, rows: int, length: int) -> torch.Tensor:
        """The next token of rows 0 to `rows` - 1 (its first `rows` entries)."""
        if self.graphs is None:
            self._run(rows, length)
        else:
            if self.folded:  # its graph reads the folded copies: the run's writing of them done
                self.folded.ready()
            if (rows, length) not in self.graphs:
                began = time.perf_counter()
                self.graphs[rows, length] = self._capture(rows, length)
                torch.cuda.synchronize()
                self.capture_s += time.perf_counter() - began
            self.graphs[rows, length].replay()
        return self.chosen


# The most tokens a prefill computes (prompts, and their reference answers where scored): what keeps
# an 8B's evaluation at 128 rows within an 80 GB GPU (its peak: benchmarks/README.md).
PACKED_ROW_TOKENS = 16384


def prefill(model, group: list[Request], sampler=None) -> Prefilled:
    """The requests of `group` in one forward, packed end to end with no padding: consecutive ones
    on one image share its prefix, laid out once (vlft.forward.image_groups), each attending to the prefix
    and to itself alone. A request that asks again the prompt of the one before it (a reward stage's
    G answers to one question) is computed once with it: its first token is drawn from the same last
    hidden state and its cache is copied from the same positions. A scored request's reference
    answer follows its prompt, so that its loss comes from the very forward that prefills the prompt
    (the prompt computed once, not again by a separate loss pass); only the prompt's keys and values
    go on to the cache."""
    runs = _image_runs(group)
    # Each run's requests laid out, not those that ask the prompt before them again; a run left
    # with one request lies whole.
    laid_out = []
    for shared, run in runs:
        again = [n > 0 and asks_again(r, run[n - 1]) for n, r in enumerate(run)]
        own = [r for r, repeat in zip(run, again) if not repeat]
        laid_out.append((shared if len(own) > 1 else 0, own, again))
    layout = RowLayout.of([(shared, [r.inputs["input_ids"].shape[1] for r in own]) for shared, own, _ in laid_out])
    pieces = {key: [] for key in ("input_ids", "mm_token_type_ids", "positions")}
    images = {"pixel_values": [], "image_grid_thw": []}
    lasts, scored, targets, owners = [], [], [], []  # row positions: each prompt's last, the scored ones
    segments, layout_spans, spans = iter(layout.segments), iter(layout.key_spans), []
    for (_, run), (shared, own, again) in zip(runs, laid_out):
        for n, request in enumerate(run):
            if again[n]:  # the same rows as the request before it
                lasts.append(lasts[-1])
                spans.append(spans[-1])
                continue
            drop = shared if request is not own[0] else 0
            for key in pieces:
                values = request.positions if key == "positions" else request.inputs[key]
                pieces[key].append(values[..., drop:])
            if n == 0:  # the image once for the run
                for key in images:
                    images[key].append(request.inputs[key])
            # The row position of the request's own token i (i >= drop) is start + i - drop.
            start = next(segments)[0]
            spans.append(next(layout_spans))
            lasts.append(start + request.prompt - 1 - drop)
            if request.loss_targets is not None:
                scored.append(request.loss_positions + start - drop)
                targets.append(request.loss_targets)
                owners.append(torch.full_like(request.loss_targets, len(lasts) - 1))
    device = pieces["input_ids"][0].device
    outer = unwrapped(model)
    attention = _attention_inputs(outer, layout, lasts, device)
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
    last_hidden = hidden[torch.tensor(lasts, device=device)]
    firsts = (sampler or Greedy()).first(outer.lm_head(last_hidden), group).tolist()
    losses = _scored_losses(outer, hidden, group, scored, targets, owners)
    # Each request's stretches of the cache, cut at its prompt's end: the answer's keys are not kept.
    prompts = [_cut(request_spans, r.prompt) for request_spans, r in zip(spans, group)]
    shared = [prefix for prefix, run in runs for _ in run]
    return Prefilled(firsts, output_cache(output), prompts, losses, layout.segments[-1][1], shared, last_hidden)


def _attention_inputs(outer, layout: RowLayout, lasts: list[int], device) -> dict:
    """What the prefill's layers take besides its tokens: the row's layout, each image's prefix read
    once where gradients flow back through it (a reward stage's prefill), gathered for each request
    in an evaluation's, without them (vlft.forward.image_groups). A hybrid model's linear-attention
    layers hand each prompt's state on from its last token (`lasts`), so a piece ends there
    (before a scored request's reference answer), and its cache keeps those states."""
    ends = [last + 1 for last in lasts]
    linear = layout.linear_pieces(tuple(ends)) if is_hybrid_model(outer) else None
    inputs = layout.attention_inputs(prefix_once=torch.is_grad_enabled(), linear=linear)
    attention = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    if linear:
        attention[cache_keyword(outer.model)] = prompt_states_cache(
            outer, linear, [linear.piece_ending_at(e) for e in ends]
        )
    return attention


def _scored_losses(outer, hidden, group: list[Request], scored, targets, owners) -> list[tuple[float, int] | None]:
    """Each scored request's (loss sum, answer tokens) from the prefill's hidden states at its
    reference answer's positions (`scored`); None for the others."""
    if not scored:
        return [None] * len(group)
    owners = torch.cat(owners)
    sums = linear_cross_entropy_sums(
        hidden.index_select(0, torch.cat(scored)), outer.lm_head.weight, torch.cat(targets), owners, len(group)
    ).tolist()
    counts = torch.bincount(owners, minlength=len(group)).tolist()
    return [(sums[i], counts[i]) if r.loss_targets is not None else None for i, r in enumerate(group)]


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
    shared = [common_prefix(_distinct_ids(run), min(r.prompt for r in run) - 1) if len(run) > 1 else 0 for run in runs]
    return list(zip(shared, runs))


def _distinct_ids(run: list[Request]) -> list[list[int]]:
    """The token ids of a run's requests, read back once for requests made from the same inputs (a
    reward stage's G answers to a question): a read from the device a request was 72 a rollout."""
    read: dict[int, list[int]] = {}
    for request in run:
        if id(request.inputs) not in read:
            read[id(request.inputs)] = request.inputs["input_ids"][0].tolist()
    return list(read.values())

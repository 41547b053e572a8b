"""A reward stage's decode steps on its adapter folded into a copy of the weights they read.

A rollout's decode step computes one token of each of its rows (some tens of them on the 8B's
GRPO workloads). There, each of a layer's seven adapted projections costs three matmuls: the
base weight's, then the adapter's two small ones (x A^T, then B), the first split over its long
inner dimension with a reduction kernel of its own, so the adapter's small kernels cost about as
much as the base weights' large ones. Folded into the weight, W + scaling * B A, a projection is
one matmul again (the step's time before and after: benchmarks/README.md, "The rollout's decode
steps on the folded adapter"): as in the evaluation job, which merges the adapter
(vlft.generation.evaluate), and as TRL's and ms-swift's rollouts through vLLM run it, the adapter
merged into the engine's weights at each step.

The folded weights are a copy in the model's dtype, kept with the engine that reads them (its
CUDA graph reads them where they lie) and written anew from the adapter at each of its runs
(`refresh`). The model's own weights are never written: a rollout's prefill, the update and the
reference pass compute what they computed without it. Only the decode step reads the copy
(vlft.generation.runner's DecodeStep, while it runs), and only the tokens it draws come of it.

The copy is as large as the adapted layers' weights (most of the language model's, with all seven
projections adapted), so a rollout folds only where that is at most FOLDED_SHARE of the GPU's
memory (the 8B on a 141 GB GPU, not on an 80 GB one, where its GRPO step already needs most of the
memory without it: benchmarks/README.md), and only plain LoRA on linear layers of the model's own dtype (not
DoRA, not a quantized base). In exact arithmetic a folded step is the adapter's; in floating point
each folded weight is rounded once, to the model's dtype (torch.addmm: the product and the sum
are rounded together). tests/generation/test_folded_adapter.py checks the logits and the answers against the
adapter's in float64.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.layer import LoraLayer

from vlft.modeling import language_model, unwrapped

# Of the GPU's memory, the most the folded copy may take.
FOLDED_SHARE = 1 / 8
# Where a rollout folds its adapter: a CPU's decode step runs eagerly, its adapter's matmuls are
# the least of it, and the demo's answers stay the adapter's own.
FOLD_DEVICES = ("cuda",)


def adapted_layers(model) -> list:
    """The language model's layers that carry an adapter (what a decode step runs)."""
    return [m for m in language_model(unwrapped(model)).modules() if isinstance(m, LoraLayer)]


def why_not_folded(model, memory_limit: int | None) -> str | None:
    """Why a rollout's decode steps read the adapter as it is, not folded (None: folded).
    `memory_limit`: the bytes this process may hold on the model's device (None: not a GPU)."""
    layers = adapted_layers(model)
    if not layers:
        return "no adapter"
    device = layers[0].base_layer.weight.device
    if device.type not in FOLD_DEVICES:
        return f"on a {device.type.upper()}, where the adapter's matmuls are the least of a decode step"
    for layer in layers:
        what = _not_plain(layer)
        if what:
            return f"{what} ({type(layer).__name__} at {_name_of(model, layer)})"
    copy = sum(layer.base_layer.weight.nbytes for layer in layers)
    if memory_limit is not None and copy > memory_limit * FOLDED_SHARE:
        return (
            f"the folded copy ({copy / 2**30:.1f} GiB) would take more than {FOLDED_SHARE:.1%} "
            f"of the GPU's {memory_limit / 2**30:.0f} GiB"
        )
    return None


def _not_plain(layer) -> str | None:
    """What keeps a LoRA layer from folding into a copy of its weight, if anything."""
    if type(layer) is not LoraLinear or type(layer.base_layer) is not torch.nn.Linear:
        return "not a LoRA linear layer over a linear layer"
    if not layer.base_layer.weight.dtype.is_floating_point:
        return "a quantized base"
    if len(layer.active_adapters) != 1 or layer.active_adapters[0] not in layer.lora_A:
        return "not one active adapter"
    adapter = layer.active_adapters[0]
    if layer.merged or layer.fan_in_fan_out or layer.lora_variant or layer.lora_bias.get(adapter):
        return "not plain LoRA (merged, transposed, DoRA or with a bias)"
    return None


def _name_of(model, layer) -> str:
    return next((name for name, module in model.named_modules() if module is layer), "?")


class FoldedAdapter:
    """A copy of each adapted layer's weight with its adapter folded in, and the decode step's way
    of reading it (`folded_in`)."""

    def __init__(self, layers: list):
        self.layers = layers
        self.adapters = [layer.active_adapters[0] for layer in layers]
        self.weights = [torch.empty_like(layer.base_layer.weight) for layer in layers]
        # On a GPU the copies are written on a stream of their own, beside the prefill that a run
        # begins with (memory-bound copies beside its matmuls, which on the prefill's own stream
        # would wait for each other); the decode step waits for them (`ready`).
        device = self.weights[0].device if self.weights else torch.device("cpu")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.written = None  # the event of the last writing, on a GPU, until a decode step waits for it

    @classmethod
    def for_rollouts(cls, model, memory_limit: int | None) -> tuple["FoldedAdapter | None", str | None]:
        """The model's adapter folded for a rollout's decode steps where it folds (None and why not elsewhere)."""
        why = why_not_folded(model, memory_limit)
        return (None, why) if why else (cls(adapted_layers(model)), None)

    @staticmethod
    def bytes_for_rollouts(model, memory_limit: int | None) -> int:
        """The bytes `for_rollouts` would allocate (0 where it does not fold), without allocating them."""
        return (
            0 if why_not_folded(model, memory_limit) else sum(l.base_layer.weight.nbytes for l in adapted_layers(model))
        )

    @property
    def bytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    def refresh(self) -> None:
        """Each copy W + scaling * B A from the adapter's weights as they stand, rounded once. On a
        GPU, written after what the caller's stream has queued (the adapter's weights written in
        the model's dtype) and beside what it queues next."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.no_grad(), torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            for layer, adapter, folded in zip(self.layers, self.adapters, self.weights):
                weight = layer.base_layer.weight
                down, up = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
                torch.addmm(
                    weight, up.to(weight.dtype), down.to(weight.dtype), alpha=layer.scaling[adapter], out=folded
                )
            self.written = self.stream.record_event() if self.stream is not None else None

    def ready(self) -> None:
        """The caller's stream waits for the copies' last writing (a GPU's; a CPU's is done)."""
        if self.written is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self.written)
            self.written = None

    @contextmanager
    def folded_in(self):
        """The adapted layers computing from their folded copies alone: each base layer holds its
        copy, and PEFT's forward, finding its adapter marked merged, calls the base layer alone.
        Each base layer's own weight and the marks are put back after."""
        self.ready()
        own = [layer.base_layer.weight.data for layer in self.layers]
        for layer, adapter, folded in zip(self.layers, self.adapters, self.weights):
            layer.base_layer.weight.data = folded
            layer.merged_adapters = [adapter]
        try:
            yield
        finally:
            for layer, data in zip(self.layers, own):
                layer.base_layer.weight.data = data
                layer.merged_adapters = []

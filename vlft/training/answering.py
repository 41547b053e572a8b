"""The model as a rollout answers (no dropout, no gradients, the adapter in the model's dtype), and
what a rollout leaves on the device freed before the update needs it."""

from __future__ import annotations

import gc
from contextlib import contextmanager

import torch

from vlft.training.step_evals import adapter_in_model_dtype


@contextmanager
def answering(model, dtype, into=None, switch_modes=True, trained=None):
    """The model as the evaluation answers: no dropout, no gradients, the adapter (its `trained`
    parameters) in the model's dtype (written `into` the kept engine's tensors, where given).
    Without `switch_modes` (a model whose training mode drops nothing and recomputes nothing) it
    stays in training mode: switching an 8B's PEFT model (some 3,000 modules) there and back took
    tens of ms of the host a step."""
    if switch_modes:
        model.eval()
    try:
        with torch.no_grad(), adapter_in_model_dtype(model, dtype, into, trained):
            yield
    finally:
        if switch_modes:
            model.train()


# What a rollout may leave allocated on the device once its engine is freed (its answers are on the host).
ROLLOUT_LEFT_BYTES = 64 << 20


class RolloutRelease:
    """After a rollout, what it allocated beyond the kept engine freed before the update needs it
    (its prefills' packed caches; the engine itself, its cache and CUDA graph, is kept for the next
    rollout and made before this starts). Those objects may sit in reference cycles; a collection
    runs only where the device still holds more than the rollout found: the young generations
    first (the rollout's own objects), then all (with an engine made a rollout and none, the 8B's
    first update once ran out of the GPU's memory).

    A rollout may also leave memory that is live, not garbage, which no collection frees: on a
    36-question Kvasir-like step of the 8B (prompts computed twice), more than ROLLOUT_LEFT_BYTES,
    and the two collections each rollout freed nothing in a fifth of the step (benchmarks/README.md). What a full
    collection left is noted (the largest of a stage's), and later rollouts collect only past it:
    on the GPU a collection then runs once or twice a stage (after the first rollout, whose step
    captured its graph). `allocated` reads the device's allocated bytes; on a CPU, where there is
    none to read, both generations run after every rollout."""

    def __init__(self, allocated=None):
        if allocated is None and torch.cuda.is_available():
            allocated = torch.cuda.memory_allocated
        self.allocated = allocated
        self.live = 0  # bytes a rollout left that a full collection did not free

    @contextmanager
    def around(self):
        found = self.allocated() if self.allocated else 0
        try:
            yield
        finally:
            for generation in (1, 2):
                if self.allocated and self.allocated() <= found + self.live + ROLLOUT_LEFT_BYTES:
                    break
                gc.collect(generation)
            else:  # both ran: what remains is live
                if self.allocated:
                    self.live = max(self.live, self.allocated() - found)

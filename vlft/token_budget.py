"""`max_batch_tokens: auto`: the largest token budget that fits the GPU a training job got.

Measured at the job's start, on the stage's own model and samples: one forward and backward of a
micro-batch at the longest sample's length and one at twice that give the memory the job holds
whatever the budget (weights, adapter, gradients) and the memory each further token of a
micro-batch takes (activations grow linearly with the tokens of a packed row). The budget is what
fills the GPU's memory (or the process's share of it, torch.cuda.set_per_process_memory_fraction)
to SAFETY of it, with AdamW's two float32 moments of every trained weight added, rounded down to a
multiple of STEP. The probe's gradients are dropped and the random state restored: the steps train
as they would with that budget given by hand. On a CPU there is no memory to fit: micro_batch
samples a micro-batch, as with no budget.
"""

from __future__ import annotations

import torch

SAFETY = 0.9  # of the GPU's memory: the allocator's fragmentation and the kernels' workspaces
STEP = 256  # matmuls over a multiple of 256 tokens stay on the tensor cores' fast kernels


def memory_limit(device: torch.device) -> int:
    """The bytes this process may allocate on `device`."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    return int(total * fraction)


def choose(limit: int, fixed: int, per_token: float, longest: int) -> int | None:
    """The largest multiple of STEP (or the longest sample's length) that fits in SAFETY of `limit`
    bytes, with `fixed` bytes held whatever the budget; None where not even the longest sample fits."""
    tokens = int((limit * SAFETY - fixed) / max(per_token, 1.0))
    if tokens < longest:
        return None
    return max(tokens // STEP * STEP, longest)


def measure(run_micro_batch, lengths: tuple[int, int], device: torch.device) -> tuple[int, float]:
    """(bytes held at no tokens, bytes per token) from the peaks of `run_micro_batch(tokens)` (a
    forward and backward of a micro-batch of at most that many tokens; its tokens returned) at two
    lengths."""
    peaks = []
    for length in lengths:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        tokens = run_micro_batch(length)
        torch.cuda.synchronize(device)
        peaks.append((tokens, torch.cuda.max_memory_allocated(device)))
    (t1, p1), (t2, p2) = peaks
    per_token = max(p2 - p1, 0) / max(t2 - t1, 1)
    return int(p1 - per_token * t1), per_token


def without_side_effects(model, probe):
    """Run `probe` and leave the model's gradients and the random state as they were."""
    states = torch.get_rng_state(), torch.cuda.get_rng_state_all()
    try:
        return probe()
    finally:
        model.zero_grad(set_to_none=True)
        torch.set_rng_state(states[0])
        torch.cuda.set_rng_state_all(states[1])

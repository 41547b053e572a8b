"""`max_batch_tokens: auto`: the largest token budget that fits the GPU a training job got.

Measured at the job's start, on the stage's own model and samples: one forward and backward of a
micro-batch at the longest sample's length and one at twice that give the memory the job holds
whatever the budget (weights, adapter, gradients) and the memory each further token of a
micro-batch takes (activations grow linearly with the tokens of a packed row). The budget is what
fills the GPU's memory (or the process's share of it, torch.cuda.set_per_process_memory_fraction)
to SAFETY of it, with AdamW's two float32 moments of every trained weight added (and a reward
stage's rollout engine, which it keeps beside its steps: vlft.training.grpo), rounded down to a
multiple of STEP. The probe's gradients are dropped and the random state restored: the steps train
as they would with that budget given by hand. On a CPU there is no memory to fit: micro_batch
samples a micro-batch, as with no budget.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from vlft.errors import ConfigError
from vlft.forward.batching import to_device
from vlft.training.host_batches import HostBatcher
from vlft.forward.image_groups import ImageGroup

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


def auto_budget(
    model, samples: list, batcher: HostBatcher, method, optimizer, forward_context, device, dtype, beside: int = 0
) -> dict:
    """`max_batch_tokens: auto`: the budget chosen for this GPU and the measurement it was chosen
    from, for the summary. `samples`: the stage's, in its records' order; `batcher` lays out a
    micro-batch as the stage's steps do, and `method` (vlft.training.methods) computes its loss.
    `beside`: bytes the stage will hold beside its steps that the measurement does not see (a
    reward stage's rollout engine, vlft.training.grpo)."""
    if device.type != "cuda":
        return {"max_batch_tokens": None, "why": "no GPU: micro_batch samples a micro-batch"}
    longest = max(len(s.input_ids) for s in samples)

    def run_micro_batch(length: int) -> int:
        """A forward and backward of the stage's first samples, laid out in a micro-batch of `length` tokens."""
        candidates, total = [], 0
        for sample in samples:
            if total >= 2 * length:
                break
            candidates.append(ImageGroup([sample], 0))
            total += len(sample.input_ids)
        sized = replace(batcher, budget=length)
        row = max(sized.rows(candidates), key=lambda row: sum(len(s.input_ids) for g in row for s in g.samples))
        with forward_context:
            loss_sum = method.loss_sums(model, to_device(sized.lay_out(row), device, dtype))[0]
        loss_sum.backward()
        return sum(len(s.input_ids) for g in row for s in g.samples)

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    moments = 0 if optimizer.state else 2 * 4 * trainable  # AdamW's, made at the first step
    limit = memory_limit(device)
    try:
        fixed, per_token = without_side_effects(model, lambda: measure(run_micro_batch, (longest, 2 * longest), device))
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        raise ConfigError(
            f"max_batch_tokens: auto: this GPU's {limit / 2**30:.1f} GiB cannot train micro-batches of twice the longest "
            f"sample ({2 * longest} tokens); give activation_checkpointing: true or quantization_bit: 4"
        ) from None
    torch.cuda.empty_cache()
    budget = choose(limit, fixed + moments + beside, per_token, longest)
    besides = f"the model{f' and the rollout engine ({beside / 2**30:.1f} GiB)' if beside else ''}"
    if budget is None:
        raise ConfigError(
            f"max_batch_tokens: auto: this GPU's {limit / 2**30:.1f} GiB cannot hold the longest sample ({longest} tokens) "
            f"besides {besides}; give activation_checkpointing: true or quantization_bit: 4"
        )
    return {
        "max_batch_tokens": budget,
        "memory_limit_gib": limit / 2**30,
        "held_gib": (fixed + moments + beside) / 2**30,
        "per_token_kib": per_token / 2**10,
        "longest_sample": longest,
    } | ({"rollout_engine_gib": beside / 2**30} if beside else {})


def choose_beside(chosen: dict, more_bytes: int) -> int | None:
    """The budget `chosen`'s measurement gives with `more_bytes` more held beside the steps (fewer
    where negative)."""
    held = chosen["held_gib"] * 2**30 + more_bytes
    return choose(chosen["memory_limit_gib"] * 2**30, held, chosen["per_token_kib"] * 2**10, chosen["longest_sample"])


def describe(chosen: dict) -> str:
    """The job log's line for the chosen budget."""
    if chosen["max_batch_tokens"] is None:
        return f"max_batch_tokens: auto: {chosen['why']}"
    return (
        f"max_batch_tokens: auto: {chosen['max_batch_tokens']} tokens, to fill {SAFETY:.0%} of "
        f"{chosen['memory_limit_gib']:.1f} GiB at {chosen['per_token_kib']:.0f} KiB a token "
        f"beside {chosen['held_gib']:.1f} GiB held"
        + (
            f", the rollout engine's {chosen['rollout_engine_gib']:.1f} GiB among them"
            if "rollout_engine_gib" in chosen
            else ""
        )
        + " (measured on this stage's samples)"
    )

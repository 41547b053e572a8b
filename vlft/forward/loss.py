"""The training loss without full-vocabulary logits.

Only answer tokens carry labels: a Qwen-VL sample of 1,300 image tokens and a 200-token answer
needs logits at 200 positions, not 1,500. The hidden states of those positions alone go through the
language-model head, fused with the cross-entropy: liger-kernel's Triton kernel where it is
installed and the tensors are on a GPU (logits never materialize), else chunks of rows recomputed
in the backward pass (logits of one chunk at a time). Both return the summed loss, so gradient
accumulation weights every answer token equally.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from vlft.forward.batching import NOT_MODEL_INPUTS
from vlft.modeling import unwrapped


@functools.cache
def fused_loss_class():
    """liger-kernel's fused linear cross-entropy where it is installed (optional: the fallback
    below computes the same sum). Imported on first use on a GPU, not with this module: its import
    asks CUDA which device there is, which a warm process must not do before it forks
    (vlft.jobs.warm_start)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss


# Rows of hidden states whose logits the fallback holds at once (rows x vocabulary x 4 bytes).
CHUNK_ROWS = 1024


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16 and float32 models; float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = hidden @ weight.t()
    return torch.nn.functional.cross_entropy(logits.to(_loss_dtype(logits.dtype)), targets, reduction="sum")


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum(cross_entropy(hidden @ weight.T, targets)) over rows, computed in float32 (or wider)."""
    if hidden.is_cuda and fused_loss_class() is not None:
        return fused_loss_class()(reduction="sum")(weight, hidden, targets)
    total = hidden.new_zeros((), dtype=_loss_dtype(hidden.dtype))
    for start in range(0, hidden.shape[0], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        total = total + checkpoint(_chunk_loss_sum, hidden[rows], weight, targets[rows], use_reentrant=False)
    return total


@torch.no_grad()
def linear_cross_entropy_sums(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, owners: torch.Tensor, count: int
) -> torch.Tensor:
    """The cross-entropy of each row (as linear_cross_entropy_sum computes it) summed by owner:
    `count` sums in float64, row i's loss added to sum owners[i]. For evaluation (no gradients):
    each sample's own sum, the same however its rows were batched with others'."""
    sums = torch.zeros(count, dtype=torch.float64, device=hidden.device)
    for start in range(0, hidden.shape[0], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        logits = hidden[rows] @ weight.t()
        losses = torch.nn.functional.cross_entropy(
            logits.to(_loss_dtype(logits.dtype)), targets[rows], reduction="none"
        )
        sums.index_add_(0, owners[rows], losses.to(torch.float64))
    return sums


def answer_loss_sum(model, batch: dict) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over the answer tokens of a batch (vlft.forward.batching.to_device's
    output), and how many there were.

    `model` is a Qwen-VL ForConditionalGeneration, or a PEFT model around one: its backbone gives the
    hidden states, and its (frozen) head is applied to the answer positions only.
    """
    outer = unwrapped(model)
    loss = linear_cross_entropy_sum(answer_hidden_states(model, batch), outer.lm_head.weight, batch["answer_targets"])
    return loss, batch["answer_targets"].numel()


def answer_hidden_states(model, batch: dict) -> torch.Tensor:
    """The backbone's last hidden states at the batch's answer positions, the rows the head scores."""
    inputs = {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}
    # No KV cache: nothing is generated, and filling one costs memory and time (and torch.compile
    # recompiles on its state).
    hidden = unwrapped(model).model(**inputs, use_cache=False).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch["answer_positions"])


def _chunk_losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = hidden @ weight.t()
    return torch.nn.functional.cross_entropy(logits.to(_loss_dtype(logits.dtype)), targets, reduction="none")


def answer_token_logps(model, batch: dict) -> torch.Tensor:
    """The log-probability of each answer token of the batch (in the order of its answer positions,
    `batch["answer_owners"]` saying whose), with gradients: what a policy-gradient loss weighs. The
    head is applied to answer positions only (`token_logps`)."""
    return token_logps(answer_hidden_states(model, batch), unwrapped(model).lm_head.weight, batch["answer_targets"])


def token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(hidden @ weight.T) at each row's target, a chunk of rows at a time, recomputed in
    the backward pass (liger's fused kernel returns only a total, not one value a token)."""
    chunks = [
        checkpoint(
            _chunk_losses,
            hidden[start : start + CHUNK_ROWS],
            weight,
            targets[start : start + CHUNK_ROWS],
            use_reentrant=False,
        )
        for start in range(0, hidden.shape[0], CHUNK_ROWS)
    ]
    return -torch.cat(chunks) if chunks else hidden.new_zeros(0, dtype=_loss_dtype(hidden.dtype))


def answer_logps(model, batch: dict) -> torch.Tensor:
    """Each sample's log-probability of its answer (the sum over its answer tokens), in the order
    of `batch["sample_ids"]`, with gradients: what a preference loss compares."""
    token_logps = answer_token_logps(model, batch)
    sums = token_logps.new_zeros(len(batch["sample_ids"]))
    return sums.index_add(0, batch["answer_owners"], token_logps)

"""The training methods' objectives as plain functions of tensors, each TRL's own and tested against
it: DPO's loss over pairs (tests/training/test_preferences.py), and GRPO's group advantages, token losses,
loss sum and step weight (tests/data/test_rewards.py, tests/training/test_grpo.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dpo_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each pair's DPO loss (the sigmoid loss of its reward margin; conservative with label
    smoothing) and the implicit rewards of its chosen and rejected answers, from the policy's and
    the reference's log-probabilities of each answer: TRL's `dpo_loss` for `loss_type: sigmoid`
    (tests/training/test_preferences.py checks them equal)."""
    margin = (chosen - rejected) - (ref_chosen - ref_rejected)
    losses = -F.logsigmoid(beta * margin) * (1 - label_smoothing) - F.logsigmoid(-beta * margin) * label_smoothing
    return losses, beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()


def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group") -> torch.Tensor:
    """Each sampled answer's advantage: its reward less its group's mean (a group: one prompt's
    `group_size` answers, consecutive), divided by the group's standard deviation plus 1e-4
    (`group`: GRPO), by the whole batch's (`batch`), or not at all (`none`: Dr. GRPO). TRL's
    GRPOTrainer's own (tests/data/test_rewards.py checks them equal)."""
    grouped = rewards.view(-1, group_size)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale_rewards == "none":
        return advantages
    spread = grouped.std(dim=1).repeat_interleave(group_size) if scale_rewards == "group" else rewards.std()
    return advantages / (spread + 1e-4)


def grpo_token_losses(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    beta: float,
    epsilon_low: float,
    epsilon_high: float,
    sequences: tuple[torch.Tensor, torch.Tensor] | None = None,
    learned: torch.Tensor | None = None,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each answer token's loss (all tensors per token, `advantages` its answer's): PPO's clipped
    objective on the ratio of the policy's probability to the rollout's, plus `beta` times the k3
    estimate of the KL to the reference; and per token, the KL and whether the ratio was clipped
    (low: below 1 - epsilon_low where the advantage is negative; high: above 1 + epsilon_high where
    it is positive). TRL's GRPOTrainer._compute_loss.

    `sequences`: (each token's answer, the number of answers) for GSPO's sequence-level ratio, each
    answer's mean log-ratio over its learned tokens, which all its tokens share (TRL's
    `importance_sampling_level: sequence`); None: each token's own. `learned`: 1 for a token the
    step learns from, 0 for one it does not (a truncated answer's, `mask_truncated_completions`);
    None: all. `importance`: each token's truncated importance-sampling weight, the clipped
    objective's factor before the KL is added (TRL's `importance_sampling_ratio`,
    vlft.training.mismatch); None: none."""
    log_ratio = logps - old_logps
    if sequences is not None:
        owners, answers = sequences
        weight = learned if learned is not None else torch.ones_like(log_ratio)
        tokens = torch.zeros(answers, dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, owners, weight)
        sums = torch.zeros_like(tokens).index_add(0, owners, log_ratio * weight)
        log_ratio = (sums / tokens.clamp(min=1.0))[owners]
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    losses = -torch.min(ratio * advantages, clipped * advantages)
    if importance is not None:
        losses = losses * importance
    kl = torch.zeros_like(logps)
    if beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        losses = losses + beta * kl
    low, high = (ratio < 1 - epsilon_low) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)
    if learned is not None:
        losses, kl, low, high = losses * learned, kl * learned, low & learned.bool(), high & learned.bool()
    flags = {"kl": kl.detach(), "clipped_low": low.detach(), "clipped_high": high.detach()}
    return losses, flags


def grpo_loss_sum(token_losses: torch.Tensor, owners: torch.Tensor, lengths: torch.Tensor, loss_type: str):
    """The step's GRPO loss as a sum that `grpo_step_weight` divides: `grpo`, each answer's mean
    token loss (a mean of answers' means); `bnpo` and `dapo`, the token losses (a mean over the
    step's tokens); `dr_grpo`, the token losses (over answers x max_completion_length).
    `owners`: each token's answer, `lengths`: each answer's tokens."""
    if loss_type == "grpo":
        return (token_losses / lengths.clamp(min=1)[owners].to(token_losses.dtype)).sum()
    return token_losses.sum()


def grpo_step_weight(lengths: list[int], loss_type: str, max_completion_length: int, learned: list[int] | None = None):
    """What a step's GRPO loss sum is divided by (TRL's normalizers, the step as its batch): each
    answer's `lengths`, and `learned`, its tokens the step learns from where some are masked (bnpo
    divides by those; dapo, as TRL's `num_items_in_batch`, by every answer token)."""
    if loss_type == "grpo":
        return len(lengths)
    if loss_type == "dr_grpo":
        return len(lengths) * max_completion_length
    return max(1, sum(learned if loss_type == "bnpo" and learned is not None else lengths))

"""Training methods: what a step's samples are and how a micro-batch's loss is computed.

The training loop (vlft.training.train) knows nothing of which method runs. Checkpoints and resume,
data parallelism, image groups, token budgets, evaluation during training, curves and publishing
are the loop's; a method is asked three things:

- `step_groups(step)`: the step's samples, as image groups (vlft.forward.image_groups), from the
  step plan's groups of record keys (vlft.training.steps). A group's samples share their prompt
  prefix and are computed with it once.
- `step_weight(groups)`: what the step's summed loss is divided by (for supervised fine-tuning, the
  step's answer tokens, whichever process computes them: the loss is a mean per answer token of
  the whole step, however it is cut into micro-batches and processes).
- `loss_sums(model, batch)`: a micro-batch's summed loss, and any metrics the log carries, each a
  sum over the micro-batch (the loop adds them up over micro-batches and processes and divides
  them by the step's weight). `METRICS` names them, "loss" first.
- `step_fields()`: what the step's log line adds beyond the loss sums (a rollout's rewards, for
  grpo), `logged` naming everything the curves draw; `on_policy`: the step's samples come from the
  adapter as it stands, so the loop lays them out at the step, not one step ahead.
- `summary(log)`: what the stage's summary adds from its step log.
- `checkpoint_tensors()` and `restore(tensors)`: what a checkpoint keeps of the method's own state
  for a resumed stage to go on as an uninterrupted one would (grpo's adapter weights a rollout
  learned several steps in a row was drawn with); nothing for sft and dpo.

What a method needs computed once before the first step (DPO's reference log-probabilities,
vlft.training.reference) is computed from the stage's starting weights before it is built, and
kept in the run directory so a resumed stage reuses it (ARCHITECTURE.md, "Training: the recipe and
its methods").
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from vlft.data.stage_data import StageData
from vlft.forward.image_groups import ImageGroup
from vlft.forward.loss import answer_logps, answer_loss_sum
from vlft.training.steps import Step


class TrainingMethod(Protocol):
    name: str
    METRICS: tuple[str, ...]
    logged: tuple[str, ...]  # what the curves draw: METRICS and what step_fields adds
    on_policy: bool  # its step's samples come from the adapter as it stands (laid out at the step)

    def step_fields(self) -> dict: ...

    def step_groups(self, step: Step) -> list[ImageGroup]: ...

    def step_weight(self, groups: list[ImageGroup]) -> int: ...

    def loss_sums(self, model, batch: dict) -> tuple[torch.Tensor, ...]: ...

    def after_last_step(self, model, log) -> None: ...

    def summary(self, log: list[dict]) -> dict: ...

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]: ...

    def restore(self, tensors: dict[str, torch.Tensor]) -> None: ...


class SupervisedFineTuning:
    """`method: sft`: the answers learned token by token (next-token cross-entropy on answer tokens)."""

    name = "sft"
    METRICS = logged = ("loss",)
    on_policy = False

    def __init__(self, data: StageData):
        self.data = data

    def step_groups(self, step: Step) -> list[ImageGroup]:
        return [ImageGroup.of([self.data.samples[key] for key in keys]) for keys in step]

    def step_weight(self, groups: list[ImageGroup]) -> int:
        return sum(len(s.input_ids) - s.prompt_length for g in groups for s in g.samples)

    def loss_sums(self, model, batch: dict) -> tuple[torch.Tensor, ...]:
        loss_sum, _ = answer_loss_sum(model, batch)
        return (loss_sum,)

    def step_fields(self) -> dict:
        return {}

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        pass

    def after_last_step(self, model, log) -> None:
        pass

    def summary(self, log: list[dict]) -> dict:
        return {}


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
    (tests/test_preferences.py checks them equal)."""
    margin = (chosen - rejected) - (ref_chosen - ref_rejected)
    losses = -F.logsigmoid(beta * margin) * (1 - label_smoothing) - F.logsigmoid(-beta * margin) * label_smoothing
    return losses, beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()


class PreferenceOptimization:
    """`method: dpo`: each record's chosen answer (`answer`) made more likely than its rejected one
    relative to the stage's starting weights (Direct Preference Optimization).

    A pair is an image group of two samples, chosen then rejected: its prompt (header, image,
    question) is laid out once and both answers attend to it, each at the positions it has alone,
    so each answer's log-probability and gradients are the ones it gets alone. With image groups
    all pairs on one image share the image. A group is cut to fit a token budget between pairs only.
    The reference log-probabilities (vlft.training.reference) are computed once, before the first
    step. The loss is a mean per pair of the step; `rpo_alpha` adds that times the chosen answers'
    cross-entropy, a mean per chosen token of the step (RPO, as TRL and ms-swift add it). Held-out
    pairs, where the eval split has them, are judged after the last step (vlft.training.held_out_pairs)."""

    name = "dpo"
    METRICS = (
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
    )
    logged = METRICS
    on_policy = False

    def __init__(
        self, data: StageData, settings, reference: dict[str, tuple[float, float]], held_out=None, reference_s=0.0
    ):
        self.data, self.reference, self.held_out = data, reference, held_out
        self.reference_s = reference_s  # seconds the reference took (read back on a resume)
        self.beta, self.label_smoothing, self.rpo_alpha = settings.beta, settings.label_smoothing, settings.rpo_alpha
        self.chosen_token_weight = 0.0
        self.held_out_result: dict = {}

    def step_groups(self, step: Step) -> list[ImageGroup]:
        return [pair_group(self.data, keys) for keys in step]

    def step_weight(self, groups: list[ImageGroup]) -> int:
        pairs = sum(len(g.samples) for g in groups) // 2
        # RPO's term is a mean per chosen token of the whole step; as a sum that the step's pairs
        # divide, each chosen token weighs pairs / chosen tokens.
        chosen_tokens = sum(len(s.input_ids) - s.prompt_length for g in groups for s in g.samples[0::2])
        self.chosen_token_weight = pairs / chosen_tokens
        return pairs

    def loss_sums(self, model, batch: dict) -> tuple[torch.Tensor, ...]:
        logps = answer_logps(model, batch)
        chosen, rejected = logps[0::2], logps[1::2]  # each group's samples are pairs, chosen first
        references = torch.tensor(
            [self.reference[key] for key in batch["sample_ids"][0::2]], dtype=logps.dtype, device=logps.device
        )
        losses, chosen_rewards, rejected_rewards = dpo_losses(
            chosen, rejected, references[:, 0], references[:, 1], self.beta, self.label_smoothing
        )
        loss = losses.sum()
        if self.rpo_alpha:
            loss = loss - self.rpo_alpha * self.chosen_token_weight * chosen.sum()
        return (
            loss,
            chosen_rewards.sum(),
            rejected_rewards.sum(),
            (chosen_rewards - rejected_rewards).sum(),
            (chosen_rewards > rejected_rewards).sum().to(logps.dtype),
            chosen.detach().sum(),
            rejected.detach().sum(),
        )

    def step_fields(self) -> dict:
        return {}

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {}  # its reference is kept in the run directory (vlft.training.reference)

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        pass

    def after_last_step(self, model, log) -> None:
        """The held-out pairs judged by the trained weights, in the job's log and the curves."""
        if self.held_out is None:
            log.note("held-out pairs: the stage's eval split has none (records with a rejected answer)", {})
            return
        self.held_out_result = self.held_out.judge(model, self.beta, self.label_smoothing)
        result = self.held_out_result
        log.note(
            f"held-out pairs ({result['held_out_pairs']} of {self.held_out.split}): preference accuracy"
            f" {result['held_out_preference_accuracy']:.4f}, reward margin {result['held_out_reward_margin']:.4f},"
            f" loss {result['held_out_loss']:.4f}"
            + (
                f"; left out, without a rejected answer: {self.held_out.left_out} records"
                if self.held_out.left_out
                else ""
            ),
            {
                "eval/rewards/accuracies": result["held_out_preference_accuracy"],
                "eval/rewards/margins": result["held_out_reward_margin"],
                "eval/dpo_loss": result["held_out_loss"],
            },
        )

    def summary(self, log: list[dict]) -> dict:
        """For the summary and the report: the share of pairs preferred, and the reward margin,
        over the first and the last tenth of the stage's steps; on held-out pairs after the last."""
        tenth = max(1, len(log) // 10)

        def mean(rows, field):
            return sum(r[field] for r in rows) / len(rows)

        return {
            "preference_accuracy_start": mean(log[:tenth], "rewards/accuracies"),
            "preference_accuracy_end": mean(log[-tenth:], "rewards/accuracies"),
            "reward_margin_end": mean(log[-tenth:], "rewards/margins"),
            "reference_s": round(self.reference_s, 3),
            **self.held_out_result,
        }


def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group") -> torch.Tensor:
    """Each sampled answer's advantage: its reward less its group's mean (a group: one prompt's
    `group_size` answers, consecutive), divided by the group's standard deviation plus 1e-4
    (`group`: GRPO), by the whole batch's (`batch`), or not at all (`none`: Dr. GRPO). TRL's
    GRPOTrainer's own (tests/test_rewards.py checks them equal)."""
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each answer token's loss (all tensors per token, `advantages` its answer's): PPO's clipped
    objective on the ratio of the policy's probability to the rollout's, plus `beta` times the k3
    estimate of the KL to the reference; and per token, the KL and whether the ratio was clipped
    (low: below 1 - epsilon_low where the advantage is negative; high: above 1 + epsilon_high where
    it is positive). TRL's GRPOTrainer._compute_loss, token-level importance sampling."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    losses = -torch.min(ratio * advantages, clipped * advantages)
    kl = torch.zeros_like(logps)
    if beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        losses = losses + beta * kl
    flags = {
        "kl": kl.detach(),
        "clipped_low": ((ratio < 1 - epsilon_low) & (advantages < 0)).detach(),
        "clipped_high": ((ratio > 1 + epsilon_high) & (advantages > 0)).detach(),
    }
    return losses, flags


def grpo_loss_sum(token_losses: torch.Tensor, owners: torch.Tensor, lengths: torch.Tensor, loss_type: str):
    """The step's GRPO loss as a sum that `grpo_step_weight` divides: `grpo`, each answer's mean
    token loss (a mean of answers' means); `bnpo` and `dapo`, the token losses (a mean over the
    step's tokens); `dr_grpo`, the token losses (over answers x max_completion_length).
    `owners`: each token's answer, `lengths`: each answer's tokens."""
    if loss_type == "grpo":
        return (token_losses / lengths.clamp(min=1)[owners].to(token_losses.dtype)).sum()
    return token_losses.sum()


def grpo_step_weight(lengths: list[int], loss_type: str, max_completion_length: int) -> int:
    """What a step's GRPO loss sum is divided by (TRL's normalizers, the step as its batch)."""
    if loss_type == "grpo":
        return len(lengths)
    if loss_type == "dr_grpo":
        return len(lengths) * max_completion_length
    return max(1, sum(lengths))


def pair_group(data: StageData, keys: list[str]) -> ImageGroup:
    """The preference pairs of `keys` (the records of one image group, or one record) as one image
    group: chosen, rejected, chosen, rejected, ..."""
    return ImageGroup.of([s for key in keys for s in (data.samples[key], data.rejected[key])], unit=2)

"""A reward stage's rollout as a value (`Rollout`): a step's answers, rewarded, laid out as the
update learns them, with what the update needs of each; what names an answer (`answer_id`) and
seeds its draw (`answer_seed`); and the fields a rollout adds to the step's log line. Drawn by
vlft.training.rollouts, learned by vlft.training.grpo."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from vlft.data.prompts import Sample
from vlft.forward.image_groups import ImageGroup
from vlft.training.shared_prompts import PromptPass
from vlft.training.steps import Step


def answer_seed(stage_seed: int, rollout: int, key: str, number: int) -> int:
    """The seed of a sampled answer: the same for the same stage, rollout, record and answer, in any
    process, order or attempt (a hash, not a generator's state)."""
    digest = hashlib.sha256(f"{stage_seed}:{rollout}:{key}:{number}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


# The seconds a step spends drawing its answers and in its passes without gradients (verl's names);
# the rest of its time is its update. The host's seconds: the passes are launched, not waited for,
# so what the device still has of them when the host moves on counts in the update's.
TIMING = ("timing_s/gen", "timing_s/ref", "timing_s/old_log_prob")


# What a step's rollout adds to its log line, besides each reward's mean and spread (TRL's names).
ROLLOUT_FIELDS = (
    "reward",
    "reward_std",
    "advantage_std",
    "completions/mean_length",
    "completions/max_length",
    "completions/clipped_ratio",
)


@dataclass
class KeptPrompts:
    """A rollout's answers (this process's share) whose prompts' forward its prefill kept, and their
    ids: the one micro-batch of a step that learns them from it (vlft.training.shared_prompts)."""

    answers: list[tuple[int, list[int]]]
    ids: list[str]
    prompt_pass: PromptPass

    def logps(self) -> torch.Tensor:
        """The answers' token log-probabilities, with gradients through the prompts' kept forward."""
        return self.prompt_pass.answer_logps(self.answers)


@dataclass
class Rollout:
    """A step's answers, rewarded, as the update learns them: their image groups, each answer's
    advantage, its log-probabilities under the starting weights (for the KL, where `beta` is above
    0) and at the rollout (where a rollout is learned more than once), by answer id; the prompts'
    forward where the rollout kept it; what the step's log line says of it (TRL's names); and the
    answers cut off at max_completion_length, before their end (`truncated`, by answer id); and each
    answer token's log-probability as the sampler drew it (`sampled`, by answer id: float64, on the
    host), which the update's are measured against (vlft.training.mismatch)."""

    groups: list[ImageGroup]
    advantages: dict[str, float]
    references: dict[str, torch.Tensor]
    drawn: dict[str, torch.Tensor]
    kept: KeptPrompts | None
    fields: dict
    truncated: frozenset[str] = frozenset()
    sampled: dict[str, torch.Tensor] = field(default_factory=dict)
    rewards: dict[str, float] = field(default_factory=dict)  # each answer's total reward, by answer id


def answer_id(key: str, number: int) -> str:
    """A sampled answer's sample id: its record's key and its number among the question's answers."""
    return f"{key}#{number}"


def answer_groups(step: Step, samples: dict[str, list[Sample]]) -> list[ImageGroup]:
    """One group a step group: a question's answers, or with image groups all answers to the
    questions on one image, which then share the image too."""
    return [ImageGroup.of([s for key in keys for s in samples[key]]) for keys in step]


def keys_of(step: Step) -> tuple[str, ...]:
    """A step's records, group after group: the order its rollout asks them in."""
    return tuple(key for group in step for key in group)

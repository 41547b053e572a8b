"""Training methods: what a step's samples are and how a micro-batch's loss is computed.

The training loop (vlft.training.train) knows nothing of which method runs. Checkpoints and resume,
data parallelism, image groups, token budgets, evaluation during training, curves and publishing
are the loop's; a method is asked three things:

- `step_groups(step)`: the step's samples, as image groups (vlft.training.image_groups), from the
  step plan's groups of record keys (vlft.training.steps). A group's samples share their prompt
  prefix and are computed with it once.
- `step_weight(groups)`: what the step's summed loss is divided by (for supervised fine-tuning, the
  step's answer tokens, whichever process computes them: the loss is a mean per answer token of
  the whole step, however it is cut into micro-batches and processes).
- `loss_sums(model, batch)`: a micro-batch's summed loss, and any metrics the log carries, each a
  sum over the micro-batch (the loop adds them up over micro-batches and processes and divides
  them by the step's weight). `METRICS` names them, "loss" first.

A method that needs something computed once before the first step (DPO's reference
log-probabilities) does it when it is built, from the stage's starting weights and its data, and
keeps it in the run directory so a resumed stage reuses it (docs/ARCHITECTURE.md, "A second method").
"""

from __future__ import annotations

from typing import Protocol

import torch

from vlft.data.stage_data import StageData
from vlft.training.image_groups import ImageGroup
from vlft.training.loss import answer_loss_sum
from vlft.training.steps import Step


class TrainingMethod(Protocol):
    name: str
    METRICS: tuple[str, ...]

    def step_groups(self, step: Step) -> list[ImageGroup]: ...

    def step_weight(self, groups: list[ImageGroup]) -> int: ...

    def loss_sums(self, model, batch: dict) -> tuple[torch.Tensor, ...]: ...


class SupervisedFineTuning:
    """`method: sft`: the answers learned token by token (next-token cross-entropy on answer tokens)."""

    name = "sft"
    METRICS = ("loss",)

    def __init__(self, data: StageData):
        self.data = data

    def step_groups(self, step: Step) -> list[ImageGroup]:
        return [ImageGroup.of([self.data.samples[key] for key in keys]) for keys in step]

    def step_weight(self, groups: list[ImageGroup]) -> int:
        return sum(len(s.input_ids) - s.prompt_length for g in groups for s in g.samples)

    def loss_sums(self, model, batch: dict) -> tuple[torch.Tensor, ...]:
        loss_sum, _ = answer_loss_sum(model, batch)
        return (loss_sum,)

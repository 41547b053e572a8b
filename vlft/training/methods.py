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
kept in the run directory so a resumed stage reuses it (docs/design.md, "Training: the recipe and
its methods").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from vlft.data.stage_data import StageData
from vlft.forward.image_groups import ImageGroup
from vlft.forward.loss import answer_loss_sum
from vlft.training.steps import Step


@dataclass(frozen=True)
class MethodInputs:
    """What a method builds itself from (`build`): the stage's settings and inputs, its data, the
    model it trains and where, and the host batcher of any records without a token budget
    (`batcher_of`, for what a method computes once before the first step)."""

    settings: object  # vlft.job_settings.StageSettings
    inputs: object  # vlft.training.runs.StageInputs
    data: StageData
    model: torch.nn.Module
    tokenizer: object
    builder: object
    run: object  # vlft.training.runs.RunDirectory
    device: torch.device
    dtype: torch.dtype
    group: object  # vlft.jobs.distributed.Group
    batcher_of: Callable
    steps: list = field(default_factory=list)  # the stage's plan of steps (vlft.training.steps)


class TrainingMethod(Protocol):
    """Everything the loop (vlft.training.train) asks of a method; `Method` gives what most leave as is."""

    name: str
    METRICS: tuple[str, ...]
    logged: tuple[str, ...]  # what the curves draw: METRICS and what step_fields adds
    on_policy: bool  # its step's samples come from the adapter as it stands (laid out at the step)
    pairs: bool  # its records hold a rejected answer beside the chosen one (vlft.data.stage_data)

    @classmethod
    def build(cls, made: MethodInputs) -> "TrainingMethod": ...

    def step_fields(self) -> dict: ...

    def step_groups(self, step: Step) -> list[ImageGroup]: ...

    # An on-policy method's: the step's groups and micro-batches, laid out at the step.
    def step_batches(self, step: Step, index: int, batcher, upcoming: Step | None) -> tuple[list, list]: ...

    def step_weight(self, groups: list[ImageGroup]) -> int: ...

    def loss_sums(self, model, batch) -> tuple[torch.Tensor, ...]: ...

    def after_last_step(self, model, log) -> None: ...

    def summary(self, log: list[dict]) -> dict: ...

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]: ...

    def restore(self, tensors: dict[str, torch.Tensor]) -> None: ...

    # What `max_batch_tokens: auto` measures a token of the update with, what the method holds
    # beside the update on the GPU (bytes), and the budget it then takes of what was chosen.
    def measured_as(self) -> "TrainingMethod": ...

    def bytes_beside(self, steps: list[Step]) -> int: ...

    def budget_chosen(self, chosen: dict, steps: list[Step]) -> dict: ...

    # What it holds beside the update, in the words of a step that ran out of memory ("" for nothing).
    def held_beside(self) -> str: ...


class Method:
    """What a method does where it has nothing of its own to do."""

    on_policy = False
    pairs = False

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

    def measured_as(self) -> TrainingMethod:
        return self

    def bytes_beside(self, steps: list[Step]) -> int:
        return 0

    def budget_chosen(self, chosen: dict, steps: list[Step]) -> dict:
        return chosen

    def held_beside(self) -> str:
        return ""


class SupervisedFineTuning(Method):
    """`method: sft`: the answers learned token by token (next-token cross-entropy on answer tokens)."""

    name = "sft"
    METRICS = logged = ("loss",)

    def __init__(self, data: StageData):
        self.data = data

    @classmethod
    def build(cls, made: MethodInputs) -> "SupervisedFineTuning":
        return cls(made.data)

    def step_groups(self, step: Step) -> list[ImageGroup]:
        return [ImageGroup.of([self.data.samples[key] for key in keys]) for keys in step]

    def step_weight(self, groups: list[ImageGroup]) -> int:
        return sum(len(s.input_ids) - s.prompt_length for g in groups for s in g.samples)

    def loss_sums(self, model, batch: dict) -> tuple[torch.Tensor, ...]:
        loss_sum, _ = answer_loss_sum(model, batch)
        return (loss_sum,)

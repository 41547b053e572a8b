"""`method: dpo`: Direct Preference Optimization, as TRL's DPOTrainer computes it (`loss_type: sigmoid`),
each pair's prompt laid out once for both of its answers."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from vlft.data.stage_data import StageData
from vlft.forward.image_groups import ImageGroup, pair_group
from vlft.forward.loss import answer_logps
from vlft.modeling import adapter_autocast
from vlft.training.held_out_pairs import HeldOutPairs
from vlft.training.methods import Method, MethodInputs
from vlft.training.objectives import dpo_losses
from vlft.training.reference import REFERENCE_FILE, reference_logps
from vlft.training.steps import Step


class PreferenceOptimization(Method):
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
    pairs = True

    def __init__(
        self, data: StageData, settings, reference: dict[str, tuple[float, float]], held_out=None, reference_s=0.0
    ):
        self.data, self.reference, self.held_out = data, reference, held_out
        self.reference_s = reference_s  # seconds the reference took (read back on a resume)
        self.beta, self.label_smoothing, self.rpo_alpha = settings.beta, settings.label_smoothing, settings.rpo_alpha
        self.chosen_token_weight = 0.0
        self.held_out_result: dict = {}

    @classmethod
    def build(cls, made: MethodInputs) -> "PreferenceOptimization":
        """With what it computes once before the first step, from the starting weights, and keeps in
        the run directory (not in checkpoints): the reference log-probabilities of the training pairs
        (vlft.training.reference) and of the eval split's held-out pairs (vlft.training.held_out_pairs)."""
        settings, model = made.settings, made.model

        def batcher_of(pairs: StageData):
            return replace(made.batcher_of(pairs), budget=settings.max_batch_tokens)

        forward = (adapter_autocast(model, made.device, made.dtype), made.device, made.dtype, made.group)
        path, started = Path(made.run.path) / REFERENCE_FILE, time.perf_counter()
        reference = reference_logps(model, made.data, settings.image_groups, batcher_of(made.data), path, *forward)
        reference_s = time.perf_counter() - started
        held_out = HeldOutPairs.of_split(
            made.inputs.eval_prepared,
            made.inputs.eval_cache,
            settings,
            made.builder,
            model,
            batcher_of,
            forward,
            made.run.path,
        )
        return cls(made.data, settings, reference, held_out, reference_s)

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

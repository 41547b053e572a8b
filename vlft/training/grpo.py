"""`method: grpo`: Group Relative Policy Optimization, as TRL's GRPOTrainer computes it, with each
question's prompt and image computed once for its answers.

At every step, before its update, the adapter as it stands answers the step's questions and the
answers are rewarded (vlft.training.rollouts: a `Rollout`, drawn by the stage's `Rollouts`); the
step learns them under PPO's clipped objective (vlft.training.objectives: `grpo_token_losses`,
`grpo_loss_sum`, `grpo_step_weight`, each tested against TRL's). With one update per rollout (as
TRL's `num_iterations: 1`) the rollout's log-probabilities are the update's own, detached: no pass
computes them, and where the rollout kept its prompts' forward, the update computes only the
answers' tokens after it (`KeptPrompts`). With `num_iterations` above 1 a rollout is learned that
many steps in a row (the step plan repeats its step, vlft.training.steps), clipped against its
log-probabilities at the rollout, which one pass without gradients computes (as TRL's do); a
checkpoint within a rollout's steps keeps the adapter's weights the rollout was drawn with (a few
MB), so a resumed stage draws the same rollout again and goes on as an uninterrupted one would. With
`beta` above 0 the KL is to the stage's starting weights: the starting adapter's weights are kept (a
copy of the adapter, not of the model) and swapped in for a pass over the rollout's answers without
gradients. `importance_sampling_level: sequence` clips each answer's ratio (GSPO) rather than each
token's, and `mask_truncated_completions` learns nothing of the answers the rollout cut off
(overlong filtering), both as TRL computes them. Every step logs how far the update's
log-probabilities of the drawn tokens at the rollout lie from the sampler's, and with
`tis_imp_ratio_cap` weights each token's loss by their capped ratio (vlft.training.mismatch).
With `filter_groups` a step learns only from questions whose answers' rewards differ, refilled
from further questions (vlft.training.dynamic_sampling).
"""

from __future__ import annotations

import statistics
from contextlib import nullcontext
from dataclasses import replace

import torch

from vlft.data.rewards import Rewards
from vlft.data.stage_data import StageData
from vlft.forward.batching import host_to_device
from vlft.forward.image_groups import ImageGroup
from vlft.forward.loss import answer_token_logps
from vlft.jobs import distributed
from vlft.training import dynamic_sampling
from vlft.training.methods import Method, MethodInputs, SupervisedFineTuning
from vlft.training.mismatch import FIELDS as MISMATCH_FIELDS, Mismatch, importance_ratios
from vlft.training.objectives import grpo_loss_sum, grpo_step_weight, grpo_token_losses
from vlft.training.rollout import ROLLOUT_FIELDS, TIMING, KeptPrompts, Rollout
from vlft.training.rollouts import Rollouts
from vlft.training.shared_prompts import prompts_once_unless
from vlft.training.step_evals import swapped_data
from vlft.training.steps import Step


class GroupRelativePolicyOptimization(Method):
    """The method: its settings, its rewards' names in the log, the rollout it learns (`rollout`),
    and the weights that rollout was drawn with where it is learned more than once."""

    name = "grpo"
    METRICS = ("loss", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean")
    on_policy = True

    def __init__(
        self,
        data: StageData,
        settings,
        rewards: Rewards,
        builder,
        tokenizer,
        model,
        device,
        dtype,
        prompts_once=False,
        group: distributed.Group = distributed.Group(),
        plan: list[Step] | None = None,
    ):
        self.data, self.settings, self.device, self.group = data, settings, device, group
        self.rollouts = Rollouts(data, settings, rewards, builder, tokenizer, model, device, dtype, prompts_once, group)
        self.generations, self.iterations = settings.num_generations, settings.num_iterations
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        # The starting weights, for the KL: the adapter's own tensors, a few MB (beta 0: not needed).
        self.start = [p.detach().clone() for p in self.trainable] if settings.beta else None
        each_reward = tuple(f"rewards/{name}/{part}" for name in rewards.weights for part in ("mean", "std"))
        self.plan = plan or []  # the stage's steps, whose questions refill a step's with filter_groups
        filtering = dynamic_sampling.FIELDS if settings.filter_groups else ()
        self.logged = self.METRICS + ROLLOUT_FIELDS + each_reward + MISMATCH_FIELDS + filtering
        self.mismatch = Mismatch()  # the step's, over its micro-batches
        self.rollout: Rollout | None = None  # the one the steps learn now
        self.fields: dict = {}  # the step's log line's, beside the loss sums
        self.token_weight = self.answer_weight = 0.0
        # With several updates a rollout: the adapter's weights it was drawn with, until its last update.
        self.drawn_with: list[torch.Tensor] | None = None
        self.next_index = 0  # the step after the last one laid out
        # The update's rows of a step's groups (the batcher's, from step_batches; called without
        # one, the step's groups in one row): the passes without gradients lay their answers out alike.
        self.rows = lambda groups: [groups]

    @classmethod
    def build(cls, made: MethodInputs) -> "GroupRelativePolicyOptimization":
        settings = made.settings
        rewards = Rewards(settings.rewards, settings.answer_format)
        twice = prompts_once_unless(made.model, settings)
        if made.group.is_main:
            print(f"grpo: each prompt computed {f'twice a step ({twice})' if twice else 'once a step'}", flush=True)
        return cls(
            made.data,
            settings,
            rewards,
            made.builder,
            made.tokenizer,
            made.model,
            made.device,
            made.dtype,
            prompts_once=twice is None,
            group=made.group,
            plan=made.steps,
        )

    def measured_as(self) -> SupervisedFineTuning:
        """A token of the update costs what an SFT token does (a forward and backward of a packed
        row, the loss's own work aside): `max_batch_tokens: auto` measures it on the records' answers."""
        return SupervisedFineTuning(self.data)

    def bytes_beside(self, steps: list[Step]) -> int:
        """On a GPU, the rollouts' kept engine held beside the update (vlft.training.rollouts)."""
        return self.rollouts.rollout_bytes(steps) if self.device.type == "cuda" else 0

    def budget_chosen(self, chosen: dict, steps: list[Step]) -> dict:
        return self.rollouts.prompts_once_or_folded(chosen, steps)

    def held_beside(self) -> str:
        engine = self.rollouts.engine
        if engine is None:
            return ""
        return f" beside the rollout engine's {engine.bytes / 2**30:.1f} GiB (its KV cache and folded adapter)"

    # The loop asks for a step's groups lazily, after the step before has updated the adapter.
    def step_batches(self, step: Step, index: int, batcher, upcoming: Step | None = None) -> tuple[list, list]:
        """The step's groups (`step_groups`) and its micro-batches: where the rollout kept its
        prompts' forward, the one that learns the answers from it (`KeptPrompts`); else the
        batcher's. The `upcoming` step's prompts are read meanwhile, where it draws anew."""
        self.rows = batcher.rows
        keep = self.rollouts.keeps_prompts(step, index, batcher.budget)
        self.rollouts.read_next(step, upcoming if (index + 1) % self.iterations == 0 else None)
        groups = self.step_groups(step, index, keep)
        if self.rollouts.prompt_pass is not None:  # in the step's log: whether its prompts were computed once
            self.fields["prompts_once"] = float(keep)
        kept = self.rollout.kept
        if kept is None:
            return groups, batcher(groups)
        return groups, [kept] if kept.answers else []  # none: this process drew nothing

    def step_groups(self, step: Step, index: int, keep_prompts: bool = False) -> list[ImageGroup]:
        """The step's questions answered by the adapter as it stands (`index`: the step's number),
        or, at a rollout's later updates, the rollout's answers again."""
        iteration, self.next_index = index % self.iterations, index + 1
        if iteration and self.rollout is not None:
            self.fields |= dict.fromkeys(TIMING, 0.0)  # nothing drawn or passed over for this step
            return self.rollout.groups
        if not iteration and self.iterations > 1:
            self.drawn_with = [p.detach().clone() for p in self.trainable]
        # Resumed within a rollout's updates: drawn again with the weights it was drawn with.
        with swapped_data(self.trainable, self.drawn_with) if iteration else nullcontext():
            rollout = index // self.iterations

            def draw(questions: Step) -> Rollout:
                return self.rollouts.draw(questions, rollout, keep_prompts, self.start, self.iterations > 1, self.rows)

            if self.settings.filter_groups:
                self.rollout = dynamic_sampling.filtered(draw, step, self.plan, index, self.settings)
            else:
                self.rollout = draw(step)
        self.fields = dict(self.rollout.fields)
        return self.rollout.groups

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Within a rollout's updates, the weights it was drawn with; else nothing."""
        if self.drawn_with is None or self.next_index % self.iterations == 0:
            return {}
        return {f"drawn_with.{i}": t for i, t in enumerate(self.drawn_with)}

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        if tensors:
            self.drawn_with = [tensors[f"drawn_with.{i}"].to(p.device) for i, p in enumerate(self.trainable)]

    def step_fields(self) -> dict:
        return self.fields | self.mismatch.fields(self.group)

    def step_weight(self, groups: list[ImageGroup]) -> int:
        samples = [s for g in groups for s in g.samples]
        lengths = [len(s.input_ids) - s.prompt_length for s in samples]
        learned = [n * self._learned(s.record_id) for s, n in zip(samples, lengths)]
        weight = grpo_step_weight(lengths, self.settings.loss_type, self.settings.max_completion_length, learned)
        # The KL and clip fractions are logged as TRL logs them: means per learned answer token of
        # the step; with GSPO's ratio, the clip fractions per answer.
        self.token_weight = weight / max(1, sum(learned))
        self.answer_weight = weight / max(1, len(lengths))
        self.mismatch = Mismatch()
        return weight

    def _learned(self, answer: str) -> int:
        """1 where the step learns from the answer, 0 where it is masked (truncated, with mask_truncated_completions)."""
        return int(not (self.settings.mask_truncated_completions and answer in self.rollout.truncated))

    def loss_sums(self, model, batch) -> tuple[torch.Tensor, ...]:
        rollout = self.rollout
        if isinstance(batch, KeptPrompts):  # the rollout's answers after the prompts its prefill kept
            self.rollout = replace(rollout, kept=None)  # learned once
            logps = batch.logps()
            # Laid out on the host (the device may still be on the rollout's passes without gradients).
            lengths = torch.tensor([len(tokens) for _, tokens in batch.answers])
            owners = host_to_device(torch.repeat_interleave(torch.arange(len(batch.answers)), lengths), logps.device)
            lengths = host_to_device(lengths, logps.device)
            ids = batch.ids
        else:
            logps = answer_token_logps(model, batch)
            owners = batch["answer_owners"]
            lengths = torch.bincount(owners, minlength=len(batch["sample_ids"]))
            ids = batch["sample_ids"]
        advantages = host_to_device(torch.tensor([rollout.advantages[i] for i in ids], dtype=logps.dtype), logps.device)
        reference = None
        if self.start is not None:
            reference = torch.cat([rollout.references[i] for i in ids]).to(logps.device, logps.dtype)
        epsilon_high = self.settings.epsilon_high or self.settings.epsilon
        # One update a rollout: the rollout's log-probabilities are these, detached (ratio 1).
        drawn = logps.detach()
        if self.iterations > 1:
            drawn = torch.cat([rollout.drawn[i] for i in ids]).to(logps.device, logps.dtype)
        learned = None
        if self.settings.mask_truncated_completions:
            learned = torch.tensor([self._learned(i) for i in ids], dtype=logps.dtype)
            learned = host_to_device(learned, logps.device)[owners]
        # The sampler's log-probabilities of the drawn tokens against the update's at the rollout.
        sampled = host_to_device(torch.cat([rollout.sampled[i] for i in ids]), logps.device).to(logps.dtype)
        ratios = importance_ratios(drawn, sampled, self.settings.tis_imp_ratio_cap)
        self.mismatch.add(drawn, sampled, ratios, learned)
        by_answer = self.settings.importance_sampling_level == "sequence"
        losses, flags = grpo_token_losses(
            logps,
            drawn,
            reference,
            advantages[owners],
            self.settings.beta,
            self.settings.epsilon,
            epsilon_high,
            sequences=(owners, len(ids)) if by_answer else None,
            learned=learned,
            importance=ratios if self.settings.tis_imp_ratio_cap is not None else None,
        )
        loss = grpo_loss_sum(losses, owners, lengths, self.settings.loss_type)
        # A clip fraction per learned answer token, or per answer (GSPO: an answer's tokens share its ratio).
        per_token = self.token_weight
        if by_answer:
            per_token = self.answer_weight / lengths.clamp(min=1)[owners].to(logps.dtype)
        return (
            loss,
            flags["kl"].sum() * self.token_weight,
            (flags["clipped_low"].to(logps.dtype) * per_token).sum(),
            (flags["clipped_high"].to(logps.dtype) * per_token).sum(),
        )

    def after_last_step(self, model, log) -> None:
        self.rollouts.close()

    def summary(self, log: list[dict]) -> dict:
        """The mean reward over the first and the last tenth of the stage's steps; where its prompts
        could be computed once a step, how many steps computed them twice (too long for the budget)."""
        tenth = max(1, len(log) // 10)
        summary = {
            "reward_start": statistics.fmean(r["reward"] for r in log[:tenth]),
            "reward_end": statistics.fmean(r["reward"] for r in log[-tenth:]),
        }
        if any("prompts_once" in r for r in log):
            summary["steps_prompts_twice"] = sum(r.get("prompts_once") == 0 for r in log)
        return summary

"""A preference stage's held-out pairs: the records of its eval split that carry a rejected answer,
judged as TRL judges a DPO eval set (its eval rewards/accuracies, rewards/margins and loss).

Their reference log-probabilities are computed with the training pairs' before the first step and
kept beside them in the run directory; after the last step the trained weights' log-probabilities
of the same pairs give the share of pairs whose chosen answer gains more than the rejected one
(the preference accuracy), the mean reward margin and the DPO loss. A split without pairs (a VQA
split) has nothing to judge: the stage's log says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vlft.data.stage_data import StageData, load_stage_data
from vlft.files import read_jsonl
from vlft.training.objectives import dpo_losses
from vlft.training.reference import pair_logps, reference_logps

HELD_OUT_REFERENCE_FILE = "reference_logps_held_out.json"


@dataclass
class HeldOutPairs:
    split: str
    data: StageData
    reference: dict[str, tuple[float, float]]
    image_groups: bool
    batcher: object
    forward: tuple  # (forward_context, device, dtype, group) as pair_logps takes them
    left_out: int = 0  # the split's records without a rejected answer: not pairs, named in the log

    @classmethod
    def of_split(
        cls, prepared: str | None, cache: str | None, settings, builder, model, make_batcher, forward, run_dir
    ):
        """The held-out pairs of the eval split `prepared`, their reference computed or read; None
        where the stage has no eval split or the split no pair."""
        records = read_jsonl(prepared) if prepared else []
        pairs = sum("rejected" in r for r in records)
        if not pairs:
            return None
        data = load_stage_data(
            [prepared], [cache], builder, {}, settings.answer_format, settings.max_seq_len, pairs=True, only_pairs=True
        )
        batcher = make_batcher(data)
        path = Path(run_dir) / HELD_OUT_REFERENCE_FILE
        reference = reference_logps(model, data, settings.image_groups, batcher, path, *forward)
        return cls(prepared, data, reference, settings.image_groups, batcher, forward, len(records) - pairs)

    def judge(self, model, beta: float, label_smoothing: float) -> dict:
        """The trained weights on the held-out pairs: their count, preference accuracy, reward margin, loss."""
        policy = pair_logps(model, self.data, self.image_groups, self.batcher, *self.forward)
        keys = sorted(policy)
        chosen, rejected, ref_chosen, ref_rejected = (
            torch.tensor([pairs[key][i] for key in keys], dtype=torch.float64)
            for pairs, i in ((policy, 0), (policy, 1), (self.reference, 0), (self.reference, 1))
        )
        losses, chosen_rewards, rejected_rewards = dpo_losses(
            chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing
        )
        return {
            "held_out_pairs": len(keys),
            "held_out_preference_accuracy": (chosen_rewards > rejected_rewards).double().mean().item(),
            "held_out_reward_margin": (chosen_rewards - rejected_rewards).mean().item(),
            "held_out_loss": losses.mean().item(),
        }

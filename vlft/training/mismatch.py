"""The rollout/update mismatch: how far the log-probabilities the update computes of a rollout's
drawn tokens lie from the sampler's (vlft.generation.sampling's `drawn_logps`), logged every step
under TRL's and verl's names, and the truncated importance-sampling weights (TIS) that correct the
update for it where a stage asks (`tis_imp_ratio_cap`, verl's key).

A rollout's answers are drawn in this process on the weights being trained, so the two agree but
for rounding: the decode step's logits come from a forward of one token at a time, on a GPU in
bf16 and where it folds, on the folded copy of the adapter's weights
(vlft.generation.folded_adapter); the update's come from a packed forward of the whole answer.
TRL (with vLLM, `vllm_importance_sampling_correction`) and verl (`tis_imp_ratio_cap`) weight each
token's loss by min(pi_update / pi_sampler, cap), its ratio at the rollout, detached.
"""

from __future__ import annotations

import torch

from vlft.jobs import distributed

FIELDS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_max",
)


def importance_ratios(old_logps: torch.Tensor, sampled_logps: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Each token's ratio of its probability at the rollout under the update's forward to the
    sampler's, at most `cap` (None: uncapped): TRL's `importance_sampling_ratio`."""
    ratios = torch.exp(old_logps - sampled_logps)
    return ratios.clamp(max=cap) if cap is not None else ratios


class Mismatch:
    """A step's mismatch over the tokens its update learns from: each micro-batch's part added on
    the device (`add`: no wait), read once the step is done (`fields`), over every process."""

    # Each part's numbers, and how parts combine: token count, |delta logp| sum and max, |delta p|
    # sum and max, ratio sum, min and max.
    COMBINE = (sum, sum, max, sum, max, sum, min, max)

    def __init__(self):
        self.parts: list[torch.Tensor] = []

    def add(self, old_logps, sampled_logps, ratios, learned: torch.Tensor | None) -> None:
        keep = learned.bool() if learned is not None else torch.ones_like(old_logps, dtype=torch.bool)
        logps = (old_logps - sampled_logps).abs()[keep]
        probs = (old_logps.exp() - sampled_logps.exp()).abs()[keep]
        ratios = ratios[keep]
        zero, inf = logps.new_zeros(1), logps.new_full((1,), float("inf"))
        count = keep.sum().to(logps.dtype)[None]
        self.parts.append(
            torch.cat(
                [
                    count,
                    logps.sum()[None],
                    torch.cat([logps, zero]).max()[None],
                    probs.sum()[None],
                    torch.cat([probs, zero]).max()[None],
                    ratios.sum()[None],
                    torch.cat([ratios, inf]).min()[None],
                    torch.cat([ratios, zero]).max()[None],
                ]
            )
        )

    def fields(self, group: distributed.Group) -> dict[str, float]:
        """The step's fields (FIELDS); all 0.0 where no token was learned (as TRL logs them)."""
        parts = [p.tolist() for p in self.parts]
        if group.size > 1:
            parts = [p for ranks in distributed.gathered(parts) for p in ranks]
        if not parts or not (count := sum(p[0] for p in parts)):
            return dict.fromkeys(FIELDS, 0.0)
        total = [combine(p[i] for p in parts) for i, combine in enumerate(self.COMBINE)]
        _, logps, logps_max, probs, probs_max, ratios, ratios_min, ratios_max = total
        values = (logps / count, logps_max, ratios_min, ratios / count, ratios_max, probs / count, probs_max)
        return dict(zip(FIELDS, values))

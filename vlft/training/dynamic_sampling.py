"""Dynamic sampling (DAPO; verl's `filter_groups`): a step learns only from the questions whose
answers' rewards differ, and where too few of its own do, from further questions drawn for it.

A question whose answers all score alike has advantages of 0: it adds nothing to the step's
gradient but still counts in its mean (a step of them learns nothing at all). verl drops such
groups and generates further batches until the step holds its batch of questions that do teach
something, up to `max_num_gen_batches` batches. Here a further batch is the questions of the next
step of the stage's plan (cycling past its end), drawn at this step's rollout with the adapter as
it stands: the plan's steps stay as they are (each step still draws its own questions at its own
rollout), and a refill depends on the step alone, so a resumed stage draws what an uninterrupted one
does. The kept questions' advantages are computed again over the step they make up (as verl's
are, after filtering: `scale_rewards: batch` divides by their spread). Where every batch leaves
fewer questions than the step holds, the step learns from those (and where none at all, from its own
questions, whose advantages are then all 0: what a step without filtering would learn).
"""

from __future__ import annotations

from typing import Iterator

import torch

from vlft.training.objectives import group_advantages
from vlft.training.rollout import TIMING, Rollout, answer_groups, answer_id, keys_of
from vlft.training.steps import Step

# What a filtered step's log line adds: the batches drawn for it (verl's name), and the share of
# the step's questions learned from whose answers' rewards differ.
FIELDS = ("train/num_gen_batches", "dynamic_sampling/kept_ratio")


def refills(plan: list[Step], index: int, iterations: int) -> Iterator[Step]:
    """The steps whose questions refill step `index`'s rollout, in order: the plan's next rollouts'
    steps (each rollout's step once, where it is learned `iterations` times), cycling past the end."""
    rollouts = plan[::iterations]
    start = index // iterations
    for offset in range(1, len(rollouts)):
        yield rollouts[(start + offset) % len(rollouts)]


def informative(rollout: Rollout, step: Step, generations: int) -> Step:
    """The step's groups with only their questions whose answers' rewards differ (empty groups dropped)."""
    kept = []
    for keys in step:
        differ = [key for key in keys if _rewards_differ(rollout.rewards, key, generations)]
        if differ:
            kept.append(differ)
    return kept


def _rewards_differ(rewards: dict[str, float], key: str, generations: int) -> bool:
    """Whether the answers to question `key` score otherwise than alike."""
    return len({rewards[answer_id(key, n)] for n in range(generations)}) > 1


def filtered(draw, step: Step, plan: list[Step], index: int, settings) -> Rollout:
    """Step `index`'s rollout with dynamic sampling: `draw(step)` draws a step's questions' answers
    (a Rollout); the informative questions of the step's own and its refills', until they number
    the step's, at most max_num_gen_batches draws."""
    generations, needed = settings.num_generations, len(keys_of(step))
    drawn = [(step, draw(step))]
    kept = informative(drawn[0][1], step, generations)
    seen = set(keys_of(step))
    for extra in refills(plan, index, settings.num_iterations):
        if len(keys_of(kept)) >= needed or len(drawn) >= settings.max_num_gen_batches:
            break
        extra = [[key for key in keys if key not in seen] for keys in extra]
        extra = [keys for keys in extra if keys]
        if not extra:
            continue
        seen.update(keys_of(extra))
        drawn.append((extra, draw(extra)))
        kept += informative(drawn[-1][1], extra, generations)
    kept = _first(kept, needed) or step
    return _merged(drawn, kept, needed, settings)


def _first(step: Step, questions: int) -> Step:
    """The step's first `questions` questions, in its groups (the last group cut where it must)."""
    first, left = [], questions
    for keys in step:
        if left <= 0:
            break
        first.append(keys[:left])
        left -= len(first[-1])
    return first


def _merged(drawn: list[tuple[Step, Rollout]], kept: Step, needed: int, settings) -> Rollout:
    """One rollout of the `kept` questions out of the `drawn` ones: their answers laid out as
    the update learns them, their advantages computed over the kept step."""
    generations = settings.num_generations
    samples, merged = {}, {"advantages": {}, "references": {}, "drawn": {}, "rewards": {}, "sampled": {}}
    truncated = set()
    for step, rollout in drawn:
        for keys, group in zip(step, rollout.groups):
            for n, key in enumerate(keys):
                samples[key] = group.samples[n * generations : (n + 1) * generations]
        for name, values in merged.items():
            values |= getattr(rollout, name)
        truncated |= rollout.truncated
    ids = [answer_id(key, n) for key in keys_of(kept) for n in range(generations)]
    rewards = torch.tensor([merged["rewards"][i] for i in ids], dtype=torch.float64)
    advantages = group_advantages(rewards, generations, settings.scale_rewards)
    fields = dict(drawn[0][1].fields)  # the step's own questions' rewards, as a step without filtering logs them
    for name in TIMING:
        fields[name] = sum(rollout.fields[name] for _, rollout in drawn)
    fields["train/num_gen_batches"] = len(drawn)
    informative = sum(_rewards_differ(merged["rewards"], key, generations) for key in keys_of(kept))
    fields["dynamic_sampling/kept_ratio"] = informative / max(1, needed)
    return Rollout(
        answer_groups(kept, samples),
        dict(zip(ids, advantages.tolist())),
        merged["references"],
        merged["drawn"],
        None,
        fields,
        frozenset(truncated & set(ids)),
        merged["sampled"],
        merged["rewards"],
    )

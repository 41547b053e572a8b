"""The step plan: every optimizer step of a stage, as the groups of record keys it trains on, in order.

One planner for every stage. A group is the records that share a prompt prefix and are laid out
with it once (vlft.forward.image_groups): with `image_groups` all of a stage's questions on one
image, otherwise each record alone (a group of one). Each epoch takes the groups in the stage's
order: shuffled with the seed (`random`), or where their first record falls in the records' own
order (`given`, or sorted `by_field`: a group goes where its easiest question would). A step takes
whole groups until it holds at least micro_batch x grad_accum records; an epoch's last step may
hold fewer. `max_steps` cuts the steps short, or runs further epochs; otherwise `epochs` epochs.
"""

from __future__ import annotations

import random
from typing import Callable

from vlft.data.records import order_records
from vlft.job_settings import StageSettings

Step = list[list[str]]  # a step's groups, each the keys of its records


def plan_steps(
    records: list[dict], settings: StageSettings, group_of: Callable[[dict], str] | None = None
) -> list[Step]:
    """Every optimizer step of the stage. `group_of`: what a record's group is known by (its image,
    with image groups); None: each record is a group of its own."""
    group_of = group_of or (lambda record: record["key"])
    # A grpo stage learns each rollout num_iterations steps in a row: each step of its questions repeated.
    repeats = settings.num_iterations if settings.method == "grpo" else 1
    step_size = settings.micro_batch * settings.grad_accum
    groups = groups_in_order(records, group_of)
    max_steps = settings.max_steps
    steps: list[Step] = []
    epoch = 0
    while (len(steps) < max_steps) if max_steps else epoch < settings.epochs:
        if settings.order == "random":
            # Groups of one shuffle as vlft.data.records.order_records shuffles records: the same draws.
            ordered = list(groups)
            random.Random(settings.seed * 100_003 + epoch).shuffle(ordered)
        else:
            in_order = order_records(
                records,
                settings.order,
                settings.order_field,
                settings.order_descending,
                settings.seed,
                epoch,
            )
            ordered = groups_in_order(in_order, group_of)
        current: Step = []
        for group in ordered:
            current.append([r["key"] for r in group])
            if sum(map(len, current)) >= step_size:
                steps.extend([current] * repeats)
                current = []
        if current:
            steps.extend([current] * repeats)
        epoch += 1
    return steps[:max_steps] if max_steps else steps


def groups_in_order(records: list[dict], group_of: Callable[[dict], str]) -> list[list[dict]]:
    """Records grouped by `group_of`, in order of each group's first record."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(group_of(record), []).append(record)
    return list(groups.values())


def image_of(images: dict) -> Callable[[dict], str]:
    """A record's image, for image groups (`images`: record key -> (cache, image id); the id is the
    sha256 of the image's bytes, the same in every split's cache)."""
    return lambda record: images[record["key"]][1]

"""A step's micro-batches on the host: its groups shared out among data-parallel processes, cut into
rows, and each row laid out (packed, or padded) with its images read from the cache.

One batcher for every stage and method: a method says what a step's groups are (vlft.training.methods;
a stage without image groups has groups of one), this says how they become model input. Rows:

- packing with a token budget: groups cut to fit the budget, then first fit by decreasing length;
- packing without one: at most micro_batch samples a row: groups of one `micro_batch` at a time
  in the step's order (what micro_batch has always meant), image groups first fit by decreasing
  length;
- padding (packing off; image groups need packing): samples of similar length under the budget
  (vlft.forward.batching.token_budget_batches), or micro_batch of them at a time.

Whole groups go to a process and to a row, cut only where one exceeds the budget (each part keeps
the prefix): an image's questions are computed with their image once wherever they land.

Where the processes share the frozen base (`even`, vlft.training.sharding), each must compute as many
micro-batches as the busiest: a share with fewer is padded with fillers, a micro-batch of the step's
marked FILLER, whose results its consumers leave out (the update weighs its loss 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from vlft.jobs import distributed
from vlft.data.prompts import PromptBuilder
from vlft.forward.batching import FILLER, collate, token_budget_batches
from vlft.forward.image_groups import ImageGroup, group_rows, share_groups
from vlft.forward.packing import pack_groups


@dataclass
class HostBatcher:
    images: dict  # record key -> (cache, image id)
    builder: PromptBuilder
    rope_index: Callable
    pad_id: int
    packing: bool
    micro_batch: int
    budget: int | None  # tokens a micro-batch, or None: micro_batch samples
    group: distributed.Group
    pin: bool = False
    even: bool = False  # as many micro-batches on every process, fillers where a share has fewer

    def __call__(self, groups: list[ImageGroup]) -> list[dict]:
        """This process's micro-batches of a step's groups."""
        return list(self.each(groups))

    def each(self, groups: list[ImageGroup]) -> Iterator[dict]:
        """This process's micro-batches of the groups, each laid out when asked for: a pass over a
        whole split (a preference stage's reference) holds one micro-batch's images at a time."""
        if self.group.size == 1:
            return (self.lay_out(row) for row in self.rows(groups))
        shares = share_groups(groups, self.group.size)  # this process's share of the step, balanced by tokens
        rows = self.rows(shares[self.group.rank])
        fillers = 0
        if self.even:
            most = max(len(self.rows(share)) for share in shares)
            fillers = most - len(rows)
            # A filler: the process's own first row, or where its share is empty the step's first.
            rows += [rows[0] if rows else self.rows(next(share for share in shares if share))[0]] * fillers
        return (self.lay_out(row) | ({FILLER: True} if n >= len(rows) - fillers else {}) for n, row in enumerate(rows))

    def work_spread(self, groups: list[ImageGroup]) -> dict:
        """For the step's log line: each process's tokens in the step (the busiest sets its time)."""
        if self.group.size == 1:
            return {}
        return {"rank_tokens": [sum(g.tokens for g in share) for share in share_groups(groups, self.group.size)]}

    def rows(self, groups: list[ImageGroup]) -> list[list[ImageGroup]]:
        alone = all(len(g.samples) == 1 for g in groups)
        if not self.packing:
            if not alone:
                raise ValueError("image groups need packing: a padded micro-batch has no shared prefix")
            samples = [g.samples[0] for g in groups]
            batches = token_budget_batches(samples, self.budget) if self.budget else self.in_order(samples)
            return [[ImageGroup([s], 0) for s in batch] for batch in batches]
        if self.budget:
            return group_rows(groups, self.budget, None)
        return self.in_order(groups) if alone else group_rows(groups, None, self.micro_batch)

    def in_order(self, items: list) -> list[list]:
        return [items[i : i + self.micro_batch] for i in range(0, len(items), self.micro_batch)]

    def lay_out(self, row: list[ImageGroup]) -> dict:
        if self.packing:
            return pack_groups(row, self.images, self.builder, self.rope_index, pin=self.pin)
        samples = [g.samples[0] for g in row]
        return collate(samples, self.images, self.builder, self.pad_id, rope_index=self.rope_index, pin=self.pin)

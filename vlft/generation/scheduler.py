"""The generation engine's scheduler: which request each row of the KV cache answers, which prompts
are prefilled together, and when rows refill or move down.

Requests are read as rows free up, so that their inputs need not all be on the device at once. The
requests on one image go into one prefill whole, with the image once: where they do not fit the
free rows, they wait for rows to free up while others still answer (a few decode steps, cheap beside
computing the image again). Once no prompt is left, the rows still answering move down to the
lowest ones, so that steps compute on fewer rows as answers end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

from vlft.generation.requests import Request, asks_again
from vlft.generation.shared_prefixes import seat_plan


@dataclass
class Row:
    """A row of the KV cache while it answers one request."""

    request: Request
    answer: list[int] = field(default_factory=list)  # the tokens so far
    written: int = 0  # its length in the cache, as the cache's write_at holds it on the device
    logps: list[float] | None = None  # each token's log-probability as the sampler drew it, where kept

    def finished(self, end_id: int) -> bool:
        """Ended by the model (its end of turn) or at the request's token limit."""
        return self.answer[-1] == end_id or len(self.answer) >= self.request.max_new_tokens


class Scheduler:
    def __init__(self, requests: Iterator[Request], slots: int, prefill_tokens: int):
        self.requests, self.slots, self.prefill_tokens = requests, slots, prefill_tokens
        self.rows: list[Row | None] = [None] * slots
        self.queue: deque[Request] = deque()  # read ahead, not yet prefilled
        self.exhausted = False  # every request has been read

    def free(self) -> list[int]:
        return [slot for slot in range(self.slots) if self.rows[slot] is None]

    def answering(self) -> list[int]:
        return [slot for slot in range(self.slots) if self.rows[slot] is not None]

    @property
    def drained(self) -> bool:
        """No prompt is left to fill a free row."""
        return self.exhausted and not self.queue

    def next_group(self, most: int, prefixes: tuple[int, int] | None = None) -> list[Request]:
        """Requests for `most` free rows, at most `prefill_tokens` tokens computed in their prefill
        (one prompt at least; a prompt after one on its image counts its own tokens); with shared
        prefixes, (free prefix slots, seats a slot), no more prefixes than there are free slots."""
        group, tokens = [], 0
        if prefixes is not None and not prefixes[0]:
            return group
        answering = any(row is not None for row in self.rows)
        while len(group) < most and (self.queue or self._read_one()):
            request = self.queue[0]
            if not group or request.image is None or group[-1].image != request.image:
                run = self._run_length()
                if run > most - len(group) and (group or (answering and run <= self.slots)):
                    break
            # The tokens it adds to the prefill: after a prompt on its image, its own tokens alone;
            # none where it asks that prompt again.
            length = request.inputs["input_ids"].shape[1]
            if group and asks_again(request, group[-1]):
                length = 0
            elif group and request.image is not None and group[-1].image == request.image:
                length -= request.image_tokens
            if group and tokens + length > self.prefill_tokens:
                break
            if prefixes is not None and seat_plan(group + [request], prefixes[1])[-1] >= prefixes[0]:
                break
            group.append(self.queue.popleft())
            tokens += length
        return group

    def moves_down(self) -> list[tuple[int, int]]:
        """(source, target) rows: each row still answering, from the top, into the lowest free row
        below it; applied in order, the answering rows end up the lowest."""
        free, moves = self.free(), []
        for source in reversed(range(self.slots)):
            if self.rows[source] is not None and free and free[0] < source:
                target = free.pop(0)
                moves.append((source, target))
                self.rows[target], self.rows[source] = self.rows[source], None
                free.append(source)
                free.sort()
        return moves

    def _read_one(self) -> bool:
        request = next(self.requests, None)
        if request is None:
            self.exhausted = True
            return False
        self.queue.append(request)
        return True

    def _run_length(self) -> int:
        """How many requests at the head of the queue ask about one image (read ahead up to `slots`)."""
        n = 1
        while n < self.slots and (len(self.queue) > n or self._read_one()):
            if self.queue[n].image is None or self.queue[n].image != self.queue[0].image:
                break
            n += 1
        return n

"""Generation, greedy for evaluation or sampled: continuous batching over a KV cache allocated once.

`model.generate` pads a batch to its longest prompt, grows its KV cache by concatenation at every
step, and keeps the batch together until its longest answer ends, so that short answers wait for
long ones. Here instead:

- the KV cache has `slots` rows, each as long as the longest prompt plus answer, allocated once;
- prompts are prefilled packed end to end, without padding, by the model's own forward (vision
  tower and all, through vlft.forward.packing's attention), consecutive prompts on one image with its
  prefix once (vlft.forward.image_groups), and each one's keys and values are copied into a free row;
- each decode step runs the language model's own layers on one token of every row, each row
  attending to its own length and at its own text position (past the image's M-RoPE positions);
  on a GPU it is compiled and replayed as a CUDA graph, its attention a flex_attention kernel
  that reads each row's cache only to its length;
- a row whose answer ends (end of turn, or its sample's token limit) takes the next prompt before
  the next step.

The model's layers do all the arithmetic; the engine owns only the cache, the mask and the
schedule, so that the answers are the ones `generate` gives, token for token (on a CPU in float32,
where the step runs transformers' own attention; tests/generation/test_generation.py). Its parts:

- vlft.generation.requests: a request, one prompt as model inputs;
- vlft.generation.scheduler: each row's state (`Row`) and the scheduler (which requests are read,
  prefilled together, given rows, moved down);
- vlft.generation.runner: the model runner (the packed prefill, the decode step and its graphs);
- vlft.generation.kv_cache: the cache allocated once, its windows and live blocks;
- vlft.generation.sampling: how a next token is chosen (greedy, or drawn with each prompt's seed);
- this module: `answer_requests`, the entry point, and `Generation`, the loop that applies the
  scheduler's choices to the device's state one step at a time.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Iterable

import torch

from vlft.generation.kv_cache import SlotCache
from vlft.generation.requests import Request
from vlft.generation.runner import PACKED_ROW_TOKENS, DecodeStep, layer_calls, prefill
from vlft.generation.sampling import Sampling, sampler_for
from vlft.generation.scheduler import Row, Scheduler
from vlft.modeling import language_model
from vlft.generation.shared_prefixes import Cascade, SharedPrefixes, own_length, seat_plan
from vlft.forward.packing import packed_attention_while


def answer_requests(
    model,
    requests: Iterable[Request],
    slots: int,
    end_id: int,
    max_length: int,
    on_answer: Callable[[int, list[int]], None],
    prefill_tokens: int = PACKED_ROW_TOKENS,
    stats: dict | None = None,
    on_loss: Callable[[int, float, int], None] | None = None,
    sampling: Sampling | None = None,
    cascade: Cascade | None = None,
) -> None:
    """Answer every request, greedily (`sampling` None) or drawn with its seed, `slots` at a time; `on_answer(key, token_ids)` as each ends
    (its ids end with `end_id` where the model said it, else at the request's token limit), and
    `on_loss(key, loss sum, answer tokens)` for each scored request, from its prefill.

    `max_length` bounds a request's prompt plus answer. Free rows are filled by packed prefills of
    up to `prefill_tokens` tokens computed (one prompt at least; a prompt after one on its image
    counts its own tokens). Requests are read as rows free up, so that their inputs need not all be
    on the device at once. `stats`, where given, gets the
    seconds of each phase (setting up, reading prompts, prefills, choosing rows, steps, their
    bookkeeping, handing answers over; the step's compile and capture apart), the steps, and the
    rows busy over all steps (synchronizing the device around each, which a benchmark can
    afford). `cascade`, where given, keeps the prefix that rows share once and reads it once a
    step for all of them (vlft.generation.shared_prefixes). An engine made for this call alone:
    its memory is freed as it returns."""
    timer = _Timer(language_model(model).embed_tokens.weight.device, stats)
    timer.start()
    engine = Engine(model, slots, max_length, sampling, cascade)
    timer.stop("setup_s")
    try:
        engine.answer(requests, end_id, on_answer, prefill_tokens, stats, on_loss, timer)
    finally:
        engine.release()


class Engine:
    """The engine's device state: the KV cache (and shared prefixes), the decode step, its sampler
    and, on a GPU, its compiled layer and CUDA graph. Kept between runs (`answer`), a reward
    stage's rollouts, one a step, capture the step's graph once, not once a rollout (a capture costs a
    rollout a few percent: benchmarks/README.md); the graph reads the model's weights where they lie, so a caller that
    changes them between runs writes the new values into the same tensors
    (vlft.training.step_evals.adapter_in_model_dtype's `into`). `folded`, where given, is the
    adapter folded into a copy of the weights for the decode steps (vlft.generation.folded_adapter),
    written anew from the adapter at each run. `release` frees its memory."""

    def __init__(self, model, slots: int, max_length: int, sampling: Sampling | None = None, cascade=None, folded=None):
        text = language_model(model)
        weight = text.embed_tokens.weight
        self.model, self.slots, self.cascade = model, slots, cascade
        self.max_length, row_length = _lengths(max_length, cascade)
        self.cache = SlotCache(model, slots, row_length)
        if cascade:
            self.cache.prefixes = SharedPrefixes(model, cascade, self.max_length, slots)
        # Compiled on a GPU (once a process), where it halves a step (benchmarks/README.md).
        self.step = DecodeStep(model, self.cache, compile=weight.device.type == "cuda", folded=folded)
        self.step.sampler = sampler_for(sampling, slots, self.step.positions)

    @staticmethod
    def cache_bytes(model, slots: int, max_length: int, cascade: Cascade | None) -> int:
        """The bytes of the KV cache (its rows, their linear-attention states, and its prefix slots) that an engine of these
        arguments allocates: what a reward stage's kept engine holds beside its update."""
        padded, row_length = _lengths(max_length, cascade)
        tokens = slots * row_length + (cascade.prefixes * padded if cascade else 0)
        return tokens * SlotCache.bytes_per_token(model) + slots * SlotCache.bytes_per_row(model)

    @property
    def bytes(self) -> int:
        """What it holds on the device: its KV cache (rows and prefix slots) and its folded adapter."""
        prefixes = self.cache.prefixes
        tensors = self.cache.tensors + (prefixes.keys + prefixes.values if prefixes else [])
        return sum(t.nbytes for t in tensors) + (self.step.folded.bytes if self.step.folded else 0)

    def fits(self, slots: int, max_length: int, cascade: Cascade | None) -> bool:
        """Whether a run of `slots` rows of up to `max_length` positions, its shared prefixes laid
        out as `cascade`, fits this engine (its rows, their length and its prefix slots as large or larger)."""
        if slots > self.slots or max_length > self.max_length or (cascade is None) != (self.cascade is None):
            return False
        if cascade is None:
            return True
        kept = self.cascade
        return (
            cascade.seats <= kept.seats
            and cascade.prefixes <= kept.prefixes
            and own_length(cascade, max_length) <= own_length(kept, self.max_length)
        )

    def answer(
        self,
        requests: Iterable[Request],
        end_id: int,
        on_answer: Callable[[int, list[int]], None],
        prefill_tokens: int = PACKED_ROW_TOKENS,
        stats: dict | None = None,
        on_loss: Callable[[int, float, int], None] | None = None,
        timer: "_Timer | None" = None,
        prefill_with: Callable | None = None,
        on_logps: Callable[[int, list[float]], None] | None = None,
    ) -> None:
        """Answer every request (as answer_requests does); every row is free again as it returns.
        `prefill_with`: what computes a packed prefill, in place of vlft.generation.runner.prefill
        (its arguments and result); a reward stage's keeps the prompts' forward for its update
        (vlft.training.shared_prompts). `on_logps(key, logps)`, where given (sampled answers),
        before `on_answer`: each answer token's log-probability as the sampler drew it."""
        text = language_model(self.model)
        timer = timer or _Timer(text.embed_tokens.weight.device, stats)
        timer.start()
        if self.step.folded:  # the adapter as the caller left it for this run
            self.step.folded.refresh()
        captured = self.step.capture_s
        with packed_attention_while(self.model):
            # Evaluating during training, the stage's layers are compiled for its steps: here they run
            # eagerly, as in an evaluate job, so that the prefills compute what the job's would.
            # Compiled, each layer's prefill through the KV cache was traced apart (on the GPU, dynamo
            # gave up at its limit of 8 recompiles in a stage's first evaluation).
            with layer_calls(text.layers, [None] * len(text.layers)):
                timer.stop("setup_s")  # seconds the first time a process compiles (torch's compiler loads), then little
                timer.add("max_length", self.max_length)
                scheduler = Scheduler(iter(requests), self.slots, prefill_tokens)
                Generation(
                    self.model,
                    self.cache,
                    self.step,
                    scheduler,
                    end_id,
                    on_answer,
                    on_loss,
                    timer,
                    prefill_with,
                    on_logps,
                ).run()
            # A first step compiled and captured the step's graph: apart.
            timer.add("compile_s", self.step.capture_s - captured)
            timer.add("step_s", captured - self.step.capture_s)
            timer.add("graphs", len(self.step.graphs or {}))
        timer.stop("setup_s")  # once a run, before the first prompt and after the last answer

    def release(self) -> None:
        """Its KV cache and CUDA graph freed now."""
        self.step.release()
        self.cache.release()


def _lengths(max_length: int, cascade: Cascade | None) -> tuple[int, int]:
    """An engine's longest prompt and answer, and what each of its rows holds (with shared
    prefixes, its own part): a multiple of 256, since matmuls over an odd length (1724, say) leave
    the tensor cores' fast kernels."""
    padded = -(-max_length // 256) * 256
    return padded, own_length(cascade, padded) if cascade else padded


class Generation:
    """One run of the engine over its requests: the scheduler's choices applied to the device's
    state (the cache, each row's latest token, text position and whether it answers), one decode
    step at a time."""

    def __init__(
        self,
        model,
        cache: SlotCache,
        step: DecodeStep,
        scheduler: Scheduler,
        end_id,
        on_answer,
        on_loss,
        timer,
        prefill_with: Callable | None = None,
        on_logps: Callable | None = None,
    ):
        self.model, self.cache, self.step, self.scheduler = model, cache, step, scheduler
        self.end_id, self.on_answer, self.on_loss, self.timer = end_id, on_answer, on_loss, timer
        if on_logps is not None and step.sampler.logps is None:
            raise ValueError("a greedy run keeps no sampled log-probabilities")
        self.on_logps = on_logps
        slots = scheduler.slots
        self.active = torch.zeros(slots, dtype=torch.long, device=cache.rows.device)  # 1 where a row answers
        # With flex_attention's live blocks a step reads each row only to its own length, so it
        # computes on the whole cache (one shape, one CUDA graph); otherwise on the rows and length in use.
        self.whole = step.live is not None
        self.prefixes = cache.prefixes
        self.prefill = prefill_with or prefill

    def run(self) -> None:
        while True:
            free = self.scheduler.free()
            while free and (group := self.scheduler.next_group(len(free), self._free_prefixes())):
                self.timer.stop("read_s")
                self.start(group, free)
            self.timer.stop("read_s")
            if self.scheduler.drained and not self.whole:
                for source, target in self.scheduler.moves_down():
                    self.move(source, target)
            if not self.scheduler.answering():
                return
            self.decode()

    def _free_prefixes(self) -> tuple[int, int] | None:
        return None if self.prefixes is None else (len(self.prefixes.free), self.prefixes.seats)

    def start(self, group: list[Request], free: list[int]) -> None:
        """Prefill `group` and give each prompt a free row, unless its first token answered it."""
        prefilled = self.prefill(self.model, group, self.step.sampler)
        rows, slots_of = self.scheduler.rows, []  # each prompt's row, None where its first token answered it
        started = []  # (slot, its first token, its next text position) of each row given a prompt
        firsts_logps = self.step.sampler.first_logps.tolist() if self.on_logps else [None] * len(group)
        for request, first, loss, logp in zip(group, prefilled.firsts, prefilled.losses, firsts_logps):
            if loss is not None and self.on_loss is not None:
                self.on_loss(request.key, *loss)
            row = Row(request, [first], logps=[logp] if self.on_logps else None)
            if row.finished(self.end_id):  # its row stays free
                self._answered(row)
                slots_of.append(None)
                continue
            slot = free.pop(0)
            rows[slot] = row
            slots_of.append(slot)
            started.append((slot, first, int(request.positions[..., : request.prompt].max()) + 1))
        if started:
            self._set_rows_state(started, [rows[slot].request for slot, _, _ in started])
        skip = None
        if self.prefixes is not None:  # each prefix once, in its slot; each row holds what follows it
            plan = seat_plan(group, self.prefixes.seats)
            at_prefix = Counter(plan)
            # A prompt alone at its slot puts all of itself there; prompts that share one, the prefix
            # they share (a template and an image lead every prompt on one image: never none).
            skip = [
                shared if at_prefix[prefix] > 1 else request.prompt
                for shared, request, prefix in zip(prefilled.shared, group, plan)
            ]
            self.prefixes.fill(prefilled, plan, skip, slots_of)
        for slot, length in zip([s for s in slots_of if s is not None], self.cache.fill(slots_of, prefilled, skip)):
            rows[slot].written = length
            if length + rows[slot].request.max_new_tokens > self.cache.length:
                raise ValueError(
                    f"a prompt's {length} tokens past its shared prefix and its {rows[slot].request.max_new_tokens}"
                    f" answer tokens do not fit the {self.cache.length} a row holds (Cascade.own_length)"
                )
        self.timer.add("prefill_tokens", prefilled.tokens)  # shared prefixes once
        del prefilled
        self.timer.stop("prefill_s")
        self.timer.add("prefills", 1)

    def _set_rows_state(self, started: list[tuple[int, int, int]], requests: list[Request]) -> None:
        """The device's state of the rows just given prompts (their latest token, next position, the
        sampler's and whether they answer), a copy each for all of them: a write a row and a state
        held the host for milliseconds at each prefill, the device idle."""
        device = self.active.device
        slots, firsts, positions = (torch.tensor(column, device=device) for column in zip(*started))
        self.step.tokens[slots] = firsts
        self.step.positions[slots] = positions
        self.step.sampler.start(slots, requests, positions)
        self.active[slots] = 1

    def decode(self) -> None:
        """One token of each row up to the last that answers, over the cache up to the longest;
        idle rows among them compute on what they hold, and nothing reads it."""
        answering, rows = self.scheduler.answering(), self.scheduler.rows
        count, length = self.scheduler.slots, self.cache.length
        if not self.whole:
            count, length = answering[-1] + 1, max(rows[slot].written for slot in answering) + 1
        self.timer.stop("schedule_s")
        chosen = self.step(count, length)
        self.timer.stop("step_s")
        self.step.tokens[:count].copy_(chosen[:count])
        self.cache.write_at += self.active
        self.step.positions += self.active
        chosen = chosen[:count].tolist()
        logps = self.step.sampler.logps[:count].tolist() if self.on_logps else None  # read after the tokens: no wait
        self.timer.stop("bookkeeping_s")
        self.timer.add("decode_steps", 1)
        self.timer.add("busy_rows", len(answering))
        self.timer.add("computed_rows", count)
        finished = []
        for slot in answering:
            row = rows[slot]
            row.answer.append(chosen[slot])
            if logps is not None:
                row.logps.append(logps[slot])
            row.written += 1
            if row.finished(self.end_id):
                self._answered(row)
                rows[slot] = None
                finished.append(slot)
        if finished:  # a write a state for them all (at a rollout's end, every row at once)
            done = torch.tensor(finished, device=self.active.device)
            self.active[done] = 0
            self.cache.write_at[done] = 0
            if self.prefixes is not None:
                self.prefixes.leave(finished)
        self.timer.stop("answers_s")

    def _answered(self, row: Row) -> None:
        if self.on_logps is not None:
            self.on_logps(row.request.key, row.logps)
        self.on_answer(row.request.key, row.answer)

    def move(self, source: int, target: int) -> None:
        """Row `source`'s device state into row `target` (the scheduler has moved its Row)."""
        self.cache.move(source, target)
        for state in (self.step.tokens, self.step.positions, self.active):
            state[target] = state[source]
        self.step.sampler.move(source, target)
        self.active[source], self.cache.write_at[source] = 0, 0


class _Timer:
    """Seconds between start and stop, summed by name into `totals` (the device synchronized at
    each); nothing at all where `totals` is None."""

    def __init__(self, device, totals: dict | None):
        self.device, self.totals, self.began = device, totals, 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        if self.totals is not None:
            self.began = self._now()

    def stop(self, name: str) -> None:
        """The seconds since the last start or stop, to `name`."""
        if self.totals is not None:
            now = self._now()
            self.add(name, now - self.began)
            self.began = now

    def add(self, name: str, amount) -> None:
        if self.totals is not None:
            self.totals[name] = self.totals.get(name, 0) + amount

"""A reward stage's rollouts: each step's questions answered by the adapter as it stands, rewarded,
and laid out as the update learns them (`Rollout`, a value), by one object that owns what the
rollouts keep from one to the next (`Rollouts`: the engine, the folded adapter, the prompts read a
step ahead, the prompts' forward kept for the update).

`num_generations` answers to each of a step's questions are drawn by the generation engine
(vlft.generation.engine with vlft.generation.sampling's seeded draws: a question's answers share its
prompt's prefill), scored by the stage's rewards (vlft.data.rewards), and each answer's advantage is
its reward against its group's (vlft.training.objectives.group_advantages). A question's answers
are one image group: its prompt laid out once, each answer at the positions it has alone. Where the
stage allows it (vlft.training.shared_prompts.prompts_once_unless), the rollout's prefill is the
update's forward over the prompts (`KeptPrompts`): each prompt computed once a step, not twice. On a
GPU with room for it, the decode steps read the adapter folded into a copy of the weights
(vlft.generation.folded_adapter): one matmul a projection.

An answer's seed is a hash of (the stage's seed, the rollout's number, the record (its split's file
name and id), the answer's number): a resumed stage draws at each step what an uninterrupted one
would, and a study whose results were moved draws what it drew. With several processes (a stage's
`gpus`), each process draws the answers to its share of a step's questions (`_shares`: the
batcher's token-balanced sharing of the step), as TRL's processes each generate for their own
prompts; all of them gather every answer, so that each scores the whole step alike, and each learns
its share, from the prompts' forward its own rollout kept.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from vlft.data.prompts import Sample
from vlft.data.rewards import Answer, Rewards
from vlft.data.stage_data import StageData
from vlft.forward.batching import to_device
from vlft.forward.image_groups import ImageGroup, common_prefix, share_groups
from vlft.forward.loss import answer_token_logps
from vlft.forward.packing import pack_groups
from vlft.generation.engine import Engine
from vlft.generation.evaluate import prompt_inputs, prompt_request
from vlft.generation.folded_adapter import FoldedAdapter
from vlft.generation.sampling import Sampling, image_markers
from vlft.generation.shared_prefixes import cascade_for, prefixes_shareable
from vlft.jobs import distributed
from vlft.modeling import adapter_autocast, rope_index, unwrapped
from vlft.training import token_budget
from vlft.training.answering import RolloutRelease, answering
from vlft.training.objectives import group_advantages
from vlft.training.rollout import TIMING, KeptPrompts, Rollout, answer_groups, answer_id, answer_seed, keys_of
from vlft.training.reference import has_dropout
from vlft.training.shared_prompts import PromptPass
from vlft.training.step_evals import swapped_data
from vlft.training.steps import Step

# Where a question's prompt is kept once in the rollout's KV cache for its answers and read once a
# decode step (vlft.generation.shared_prefixes); a CPU answers as `generate` does (a test adds it).
SHARED_PROMPT_DEVICES = ("cuda",)


class Rollouts:
    """A reward stage's rollouts, one a step (`draw`), and what they keep from one to the next."""

    def __init__(
        self, data: StageData, settings, rewards: Rewards, builder, tokenizer, model, device, dtype, prompts_once, group
    ):
        self.data, self.settings, self.rewards, self.group = data, settings, rewards, group
        self.builder, self.tokenizer, self.model, self.device, self.dtype = builder, tokenizer, model, device, dtype
        self.generations = settings.num_generations
        self.records = {r["key"]: r for r in data.records}
        # What an answer's seed names its record by: its split's file name and its id, not where the
        # results lie (a key holds the prepared split's path), so moved results draw the same.
        self._seed_names = {r["key"]: f"{Path(r['source_split']).name}#{r['id']}" for r in data.records}
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        # Whether the rollout's eval mode computes other than training mode: dropout to turn off,
        # or activation checkpointing (a decode step must not run through it).
        self.switch_modes = has_dropout(model) or unwrapped(model).is_gradient_checkpointing
        # The rollouts' engine, kept from one to the next (its KV cache, and on a GPU its decode
        # step's CUDA graph, captured once a stage, not once a rollout), and the adapter's weights
        # in the model's dtype where that graph reads them.
        self.engine: Engine | None = None
        self.answer_weights = None
        self.longest: int | None = None  # the stage's longest prompt and answer
        # Why the rollouts decode on the adapter as it is where it would fold (`prompts_once_or_folded`).
        self.not_folded: str | None = None
        self.share_prompts = device.type in SHARED_PROMPT_DEVICES and prefixes_shareable(model)
        # `prompts_once` (vlft.training.shared_prompts.prompts_once_unless): a step whose prompts
        # fit its token budget computes them once, in the rollout's prefill, for its update too.
        compiled = settings.compile and device.type == "cuda"
        self.prompt_pass = PromptPass(model, device, dtype, compiled) if prompts_once else None
        # The rollout's answers where it kept its prompts' forward (this process's share), and their ids.
        self.kept_answers: list[tuple[int, list[int]]] | None = None
        self.kept_ids: list[str] = []
        self.shares: dict[tuple[str, ...], list[list[tuple[str, ...]]]] = {}  # the last steps' (`_shares`)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else builder.end_of_turn
        self.reader = ThreadPoolExecutor(max_workers=1)  # the next step's prompts, read while this one's prefill runs
        # A rollout's images as it read them and as it put them on the device, by their source
        # (data.images' (cache, image)), until its passes without gradients have been queued (`_logps`).
        self.images_placed: dict = {}
        self.release = RolloutRelease()
        self.told_budget = False  # a step whose prompts did not fit max_batch_tokens told of (once a stage)
        self.read_ahead: dict[tuple[str, ...], Future] = {}  # by the keys read

    def read_next(self, step: Step, upcoming: Step | None) -> None:
        """The `upcoming` step's prompts read from the host's caches in a thread meanwhile (None:
        the next step draws nothing new); what was read for other steps than `step` let go. A
        rollout's reading is a share of a step worth hiding (benchmarks/README.md): read from the
        rollout's start, the thread
        reads while the prefill holds the device and the host waits on it. Started after the
        rollout, it read while the update launched its short answers' layers, whose host's work the
        device waits on, and took the interpreter from them."""
        this_step = keys_of(self._shares(step)[self.group.rank])
        self.read_ahead = {keys: read for keys, read in self.read_ahead.items() if keys == this_step}  # others: stale
        if upcoming is not None:
            keys = keys_of(self._shares(upcoming)[self.group.rank])
            self.read_ahead[keys] = self.reader.submit(self._read_prompts, keys)

    def keeps_prompts(self, step: Step, index: int, budget: int | None) -> bool:
        """Whether step `index`'s rollout keeps its prompts' forward for the update: where the stage
        computes them once and they fit the budget. Every process keeps it, or none does: a process
        that did not would learn the batcher's share of the step, which is not the share the others
        draw and learn."""
        return self.prompt_pass is not None and self._prompts_fit(self._shares(step), index, budget)

    def _shares(self, step: Step) -> list[list[tuple[str, ...]]]:
        """Each process's questions of the step, in rank order (one share for one process): the
        step's groups as its update lays them out, each answer at its longest, shared out as the
        batcher shares a step (vlft.forward.image_groups.share_groups: balanced by tokens, a group
        longer than a fair share cut between its questions, never between a question's answers). A
        process draws its share's answers, and where its rollout keeps the prompts' forward, learns
        them; the same on every process (it depends on the step alone)."""
        if self.group.size == 1:
            return [[tuple(keys) for keys in step]]
        known = keys_of(step)
        if known not in self.shares:
            room, groups = self.settings.max_completion_length, []
            for keys in step:
                samples = []
                for key in keys:
                    prompt = self.data.samples[key]
                    ids = prompt.input_ids[: prompt.prompt_length] + [self.pad_id] * room
                    samples += [Sample(key, ids, ids, prompt.prompt_length)] * self.generations
                groups.append(ImageGroup.of(samples, unit=self.generations))
            while len(self.shares) > 2:  # a step's shares are asked for a step ahead, then at the step
                self.shares.pop(next(iter(self.shares)))
            self.shares[known] = [
                [tuple(p.samples[i].record_id for i in range(0, len(p.samples), self.generations)) for p in share]
                for share in share_groups(groups, self.group.size)
            ]
        return self.shares[known]

    def _read_prompts(self, keys: list[str]) -> dict[str, dict]:
        """The host inputs of each record's prompt (its image read, its positions computed), in pinned
        memory for a GPU: from pageable memory, putting a step's screenshots on the device holds the
        host and the device alike; from pinned memory, a fraction of the device's time alone
        (benchmarks/README.md).

        Each image is read and pinned once, for all the questions on it: pinned memory is new memory
        where the host allocator has no free block of the size (cudaHostAlloc, milliseconds for a
        screenshot, which hold up every CUDA call of the thread that runs the device meanwhile), and 9 questions on one image had pinned 9 copies of it a step.
        """
        model, pin, data = unwrapped(self.model), self.device.type == "cuda", self.data
        inputs, images = {}, {}
        for key in keys:
            sample = data.samples[key]
            source = data.images[sample.record_id]  # (its cache, the image's id)
            read = prompt_inputs(
                sample, data, self.builder, self.pad_id, model, pin=pin, read_image=source not in images
            )
            read["images"] = images.setdefault(source, read["images"])
            inputs[key] = read
        return inputs

    def _prompts_fit(self, shares: list[Step], index: int, budget: int | None) -> bool:
        """Whether each process's share of step `index`, its prompts as a prefill lays them out (an
        image's prefix once) with every answer at its longest, fits the token budget that one
        micro-batch holds. The first step that does not is told once a stage, with the budget that
        would hold it: its prompts are computed twice (the cost of a step either way:
        benchmarks/README.md, GRPO)."""
        if budget is None:
            return True
        needs = max(self._prompt_tokens(share) for share in shares)
        if needs <= budget:
            return True
        if not self.told_budget and self.group.is_main:
            print(
                f"grpo: step {index + 1}'s prompts with every answer at max_completion_length take {needs} tokens"
                f"{' (the largest process share)' if len(shares) > 1 else ''}, more than max_batch_tokens {budget}:"
                f" such steps compute each prompt twice (max_batch_tokens: {needs} or more computes them once)",
                flush=True,
            )
            self.told_budget = True
        return False

    def _prompt_tokens(self, step: Step) -> int:
        """The step's prompts as a prefill lays them out, with every answer at its longest: the tokens
        the update's micro-batch holds where the rollout keeps them."""
        tokens, answer = 0, self.settings.max_completion_length
        for keys in step:
            prompts = [self.data.samples[key].input_ids[: self.data.samples[key].prompt_length] for key in keys]
            shared = common_prefix(prompts, min(len(p) for p in prompts) - 1)
            tokens += shared + sum(self.generations * (len(p) - shared + answer) for p in prompts)
        return tokens

    def draw(
        self, step: Step, rollout: int, keep_prompts: bool, start: list[torch.Tensor] | None, twice: bool, rows
    ) -> Rollout:
        """Rollout number `rollout`: the step's questions answered by the adapter as it stands,
        rewarded; each answer's advantage, and its log-probabilities under the `start` weights (for
        the KL; None: none) and, where the rollout is learned `twice` or more, at the rollout, each
        from a pass without gradients laid out in the update's `rows`; with `keep_prompts`, its
        prompts' forward (vlft.training.shared_prompts). With several processes each draws its
        share of the questions (`_shares`) and passes over its answers (the reference's and the
        rollout's log-probabilities), and all of them gather every answer and pass."""
        share = self._shares(step)[self.group.rank]
        keys, own = list(keys_of(step)), list(keys_of(share))
        began = time.perf_counter()
        self.kept_answers = [] if keep_prompts else None
        # Each answer's tokens and their log-probabilities as the sampler drew them, read back to the host.
        answers, sampled = self._sample(own, rollout, keep_prompts) if own else ({}, {})
        if self.group.size > 1:  # every process's answers: the rewards and advantages are the whole step's
            parts = distributed.gathered((answers, sampled))
            answers = {key: drawn for part, _ in parts for key, drawn in part.items()}
            sampled = {key: logps for _, part in parts for key, logps in part.items()}
        timing = dict.fromkeys(TIMING, 0.0) | {"timing_s/gen": time.perf_counter() - began}
        samples = {key: [self._answer_sample(key, n, ids) for n, ids in enumerate(answers[key])] for key in keys}
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for key in keys for ids in answers[key]]
        asked = [key for key in keys for _ in range(self.generations)]  # each answer's record, in order
        judged = [Answer(self.records[key], text, self.data.frames.get(key)) for key, text in zip(asked, texts)]
        scored = self.rewards.score(judged)
        total = torch.tensor(scored["total"], dtype=torch.float64)
        advantages = group_advantages(total, self.generations, self.settings.scale_rewards)
        ids = [s.record_id for key in keys for s in samples[key]]
        began = time.perf_counter()
        references = self._logps(samples, share, start, rows) if start is not None else {}
        timing["timing_s/ref"], began = time.perf_counter() - began, time.perf_counter()
        drawn = self._logps(samples, share, None, rows) if twice else {}
        timing["timing_s/old_log_prob"] = time.perf_counter() - began
        self.images_placed = {}  # the passes are queued: their images' copies go with them
        if self.group.size > 1 and (start is not None or twice):  # each passed over its share
            references, drawn = ({i: logps.cpu() for i, logps in part.items()} for part in (references, drawn))
            passed = distributed.gathered((references, drawn))
            references = {i: logps for part, _ in passed for i, logps in part.items()}
            drawn = {i: logps for _, part in passed for i, logps in part.items()}
        lengths = [len(a) for key in keys for a in answers[key]]
        end = [self.builder.end_of_turn]
        truncated = frozenset(answer_id(key, n) for key in keys for n, a in enumerate(answers[key]) if a[-1:] != end)
        fields = {
            "reward": float(total.mean()),
            "reward_std": float(total.view(-1, self.generations).std(dim=1).mean()),
            "advantage_std": float(advantages.std()),
            "completions/mean_length": sum(lengths) / len(lengths),
            "completions/max_length": max(lengths),
            "completions/clipped_ratio": len(truncated) / len(lengths),
        }
        for name in self.rewards.weights:
            values = [v for v in scored[name] if v == v]  # NaN: the reward does not apply
            fields[f"rewards/{name}/mean"] = statistics.fmean(values) if values else float("nan")
            fields[f"rewards/{name}/std"] = statistics.pstdev(values) if len(values) > 1 else 0.0
        fields |= timing  # seconds of the step's rollout and passes (verl's names), apart from its update
        if self.group.size > 1 and self.kept_answers is not None:  # each process learns the share it drew
            shares = self._shares(step)
            fields["rank_tokens"] = [
                sum(ImageGroup.of([s for key in keys for s in samples[key]]).tokens for keys in share)
                for share in shares
            ]
        kept = (
            KeptPrompts(self.kept_answers, self.kept_ids, self.prompt_pass) if self.kept_answers is not None else None
        )
        self.kept_answers = None
        advantages_of = dict(zip(ids, advantages.tolist()))
        sampled_logps = {
            answer_id(key, n): torch.tensor(logps, dtype=torch.float64)
            for key in keys
            for n, logps in enumerate(sampled[key])
        }
        groups = answer_groups(step, samples)
        rewards = dict(zip(ids, total.tolist()))
        return Rollout(groups, advantages_of, references, drawn, kept, fields, truncated, sampled_logps, rewards)

    def _sample(self, keys: list[str], rollout: int, keep_prompts: bool = False) -> tuple[dict, dict]:
        """`num_generations` answers to each record's question, each drawn with its own seed (the
        rollout's number: the step's, with one update a rollout), and each answer token's
        log-probability as the sampler drew it, by record. `keep_prompts`: prefilled by the prompt
        pass, which keeps their forward for the update (`kept_answers`, in the order asked)."""
        settings, data = self.settings, self.data
        asked = [(key, n) for key in keys for n in range(self.generations)]
        answers: dict[str, list] = {key: [None] * self.generations for key in keys}
        sampled: dict[str, list] = {key: [None] * self.generations for key in keys}
        # Read a step ahead where it could be; put on the device here, by the thread that runs the
        # device (a copy from another thread would meet a CUDA graph's capture).
        read = self.read_ahead.pop(tuple(keys), None)
        ready = read.result() if read is not None else self._read_prompts(keys)
        placed: dict = {}  # each image put on the device once, for all the questions on it

        def requests():
            for index, (key, n) in enumerate(asked):
                if n == 0:  # a question's inputs read and put on the device once for its answers
                    prompt = prompt_request(
                        None,
                        data.samples[key],
                        data,
                        self.builder,
                        self.pad_id,
                        unwrapped(self.model),
                        self.device,
                        self.dtype,
                        settings.max_completion_length,
                        inputs=ready[key],
                        placed=placed,
                    )
                seed = answer_seed(settings.seed, rollout, self._seed_names[key], n)
                yield replace(prompt, key=index, seed=seed)

        def answered(index: int, ids: list[int]) -> None:
            key, n = asked[index]
            answers[key][n] = list(ids)

        def drawn_logps(index: int, logps: list[float]) -> None:
            key, n = asked[index]
            sampled[key][n] = logps

        engine = self._engine(asked)
        if engine.step.graphs == {}:
            # Its decode step's CUDA graph is captured in this run, and a capture forbids the CUDA
            # calls of every other thread (pinning memory among them): the reads finish first (the
            # reader takes its work in order, so all are done once a last one is).
            self.reader.submit(lambda: None).result()
        self.kept_answers = None
        if keep_prompts:  # the prefills' forward kept for the update: nothing of theirs to free
            with (
                self.prompt_pass.rollout(),
                answering(self.model, self.dtype, self.answer_weights, self.switch_modes, self.trainable),
            ):
                prefill = self.prompt_pass.prefill
                engine.answer(
                    requests(),
                    end_id=self.builder.end_of_turn,
                    on_answer=answered,
                    prefill_with=prefill,
                    on_logps=drawn_logps,
                )
            self.kept_answers = [(index, answers[key][n]) for index, (key, n) in enumerate(asked)]
            self.kept_ids = [answer_id(key, n) for key, n in asked]
            # The images it read and put on the device, by their source, for its passes without
            # gradients (where a rollout frees what it made, they go with it).
            self.images_placed = {
                data.images[data.samples[key].record_id]: (host, placed[id(host)])
                for key in keys
                if ready[key]["images"]
                for host in [ready[key]["images"][0][1]]
            }
            return answers, sampled
        with (
            answering(self.model, self.dtype, self.answer_weights, self.switch_modes, self.trainable),
            self.release.around(),
        ):
            engine.answer(requests(), end_id=self.builder.end_of_turn, on_answer=answered, on_logps=drawn_logps)
        return answers, sampled

    def prompts_once_or_folded(self, chosen: dict, steps: list[Step]) -> dict:
        """`max_batch_tokens: auto`'s choice (vlft.training.token_budget, `chosen`, measured with the
        folded adapter held beside the update), or where the folded copy is what keeps some step's
        prompts and longest answers from fitting the budget once, and the budget without it holds
        every step's, that budget, the rollouts decoding on the adapter as it is. Folding saves
        a share of each decode step; a step whose prompts do not fit computes them twice, which
        costs far more (both measured in benchmarks/README.md)."""
        folded = self._folded_bytes()
        budget = chosen["max_batch_tokens"]
        if self.prompt_pass is None or not folded or budget is None:
            return chosen
        needs = max(self._prompt_tokens(share) for step in steps for share in self._shares(step))
        unfolded = token_budget.choose_beside(chosen, -folded)
        if budget >= needs or unfolded is None or unfolded < needs:
            return chosen
        self.not_folded = (
            f"so that every step's prompts and longest answers ({needs} tokens at most) fit max_batch_tokens: auto"
            f" once: {unfolded} tokens beside the engine, {budget} beside its folded copy too ({folded / 2**30:.1f} GiB)"
        )
        held, engine = chosen["held_gib"] - folded / 2**30, chosen["rollout_engine_gib"] - folded / 2**30
        return chosen | {"max_batch_tokens": unfolded, "held_gib": held, "rollout_engine_gib": engine}

    def _engine(self, asked: list[tuple[str, int]]) -> Engine:
        """The kept engine, made anew only where this rollout's rows or their shared prompts do not
        fit it. Its rows are as long as the stage's longest prompt and answer, so that one decode
        step, compiled and captured once, serves every rollout (a step's own longest gave each
        rollout a shape of its own, and each a recompile)."""
        settings, cascade = self.settings, self._cascade(asked)
        if self.engine is None or not self.engine.fits(len(asked), self._longest(), cascade):
            if self.engine is not None:
                self.engine.release()
            sampling = Sampling(settings.temperature, settings.top_p, settings.top_k, image_markers(self.model.config))
            folded, why_not = (
                (None, self.not_folded) if self.not_folded else FoldedAdapter.for_rollouts(self.model, self._limit())
            )
            if self.engine is None:  # said once a stage
                said = f"folded into a copy of its weights ({folded.bytes / 2**30:.1f} GiB)" if folded else why_not
                print(
                    f"grpo: the rollout's decode steps read the adapter {'' if folded else 'as it is, '}{said}",
                    flush=True,
                )
            self.engine = Engine(unwrapped(self.model), len(asked), self._longest(), sampling, cascade, folded)
            if self.dtype not in (torch.float32, torch.float64):
                self.answer_weights = [torch.empty_like(p, dtype=self.dtype) for p in self.trainable]
        return self.engine

    def _longest(self) -> int:
        """The stage's longest prompt and answer: every rollout's rows are as long."""
        if self.longest is None:
            prompts = max(s.prompt_length for s in self.data.samples.values())
            self.longest = prompts + self.settings.max_completion_length
        return self.longest

    def _cascade(self, asked: list[tuple[str, int]]):
        """How a rollout of `asked` keeps its shared prompts in the engine's cache (None: each row its own)."""
        if not self.share_prompts:
            return None
        samples = [self.data.samples[key] for key, _ in asked]
        prompts = [(self.data.images[s.record_id][1], s.input_ids[: s.prompt_length]) for s in samples]
        cascade = cascade_for(prompts, len(asked), self.settings.max_completion_length)
        if cascade is None:
            return None
        # A prefix slot a question: its answers' seats. With image groups a slot holds the prefix
        # its image's questions share, and each row its question past it; seats for all of an
        # image's answers (72 at 9 questions of 8) are past what flex_attention's decoding kernel
        # compiles for.
        return replace(cascade, seats=self.generations, prefixes=len(asked) // self.generations)

    def rollout_bytes(self, steps: list[Step]) -> int:
        """What the rollouts' kept engine holds on the device beside the update, at the stage's
        largest rollout (this process's share): its KV cache and, where the adapter folds, the
        folded copy. A budget measured for an SFT step leaves no room for them: a budget that
        left them out ran the 8B's first update out of the GPU's memory."""
        model, cache = unwrapped(self.model), 0
        for step in steps:
            asked = [(key, n) for key in keys_of(self._shares(step)[self.group.rank]) for n in range(self.generations)]
            if asked:
                cache = max(cache, Engine.cache_bytes(model, len(asked), self._longest(), self._cascade(asked)))
        return cache + self._folded_bytes()

    def _limit(self) -> int | None:
        """The bytes this process may hold on its GPU (None: not on a GPU)."""
        return token_budget.memory_limit(self.device) if self.device.type == "cuda" else None

    def _folded_bytes(self) -> int:
        """The folded adapter's copy of the weights that the rollouts would hold beside the update (0: none)."""
        return FoldedAdapter.bytes_for_rollouts(self.model, self._limit())

    def _answer_sample(self, key: str, number: int, answer: list[int]) -> Sample:
        """A sampled answer after its record's prompt, as a training sample of its own id; its
        image is its record's."""
        prompt = self.data.samples[key]
        ids = prompt.input_ids[: prompt.prompt_length]
        sample_id = answer_id(key, number)
        self.data.images.setdefault(sample_id, self.data.images[key])
        return Sample(sample_id, ids + answer, [-100] * len(ids) + answer, len(ids))

    def _logps(self, samples: dict, share: Step, weights: list[torch.Tensor] | None, rows) -> dict[str, torch.Tensor]:
        """Each answer's token log-probabilities under `weights` (the starting weights, for the KL)
        or the adapter as it stands (None), without gradients: the answers to this process's
        `share` of the step laid out in the update's `rows` (each group's prompt, with image groups
        its image, once for all of its answers), a forward a row. A forward a question had taken
        most of a step (benchmarks/README.md, GRPO).

        The values stay on the device, nothing read back: the host goes on to the update while the
        device computes them (the update's answers' forward after it is mostly the host's
        work). Its seconds in the step's log (`timing_s/ref`) are then the host's."""
        groups = answer_groups(share, samples)
        logps_of = {}
        forward = adapter_autocast(self.model, self.device, self.dtype)
        swapped = swapped_data(self.trainable, weights) if weights is not None else nullcontext()
        # The images the rollout read and put on the device (prompts kept), neither read nor copied
        # again: a step's screenshots' cached vision features, copied from pageable memory, would
        # hold the device and the host, the device idle after the rollout.
        held = {source: host for source, (host, _) in self.images_placed.items()}
        on_device = {id(host): tensor for host, tensor in self.images_placed.values()}
        with swapped, torch.no_grad(), forward:
            for row in rows(groups):
                batch = pack_groups(row, self.data.images, self.builder, rope_index(self.model), held=held)
                # A row's own copy of what is on the device: an image it copies is its own (its host
                # tensor's id may be another's once that tensor is gone).
                logps = answer_token_logps(self.model, to_device(batch, self.device, self.dtype, dict(on_device)))
                # An answer's tokens are consecutive, in the order of the row's samples (the host's
                # batch says how many each has).
                lengths = torch.bincount(batch["answer_owners"], minlength=len(batch["sample_ids"]))
                logps_of.update(zip(batch["sample_ids"], logps.split(lengths.tolist())))
        return logps_of

    def close(self) -> None:
        """The reader stopped and the engine's memory freed, after the stage's last step."""
        self.reader.shutdown()
        if self.engine is not None:
            self.engine.release()
            self.engine = None

"""A GRPO step against an image-grouped SFT step over the same images with G answers each.

The training benchmark's workload (benchmarks/train_speed.py: JPEGs of six sizes, 720x576 to
1920x1080, the 8B with random weights) with short answers (1-16 tokens, as a click or a Kvasir
answer is): GRPO on P questions a step (--questions-per-image on each image; with more than one,
image groups: an image's questions' answers share it), G answers sampled to each (at most
--max-completion-length tokens, temperature 1.0), rewarded by the `format` reward; SFT on the same
images with G answers for each of those questions and `image_groups` (each image's prompt once for
all its answers). Both from the vision cache, packed under one token budget, compiled. A GRPO step
is its rollout (the engine's sampled answers), its rewards, a reference pass where --beta is above
0, and its update; with random weights every answer runs to the length limit, so the rollout is at
its longest. The step time of each comes from its step log; the first --warmup steps are left out.
GRPO's parts come from its log's `timing_s/*` fields (the update is the rest), the engine's phases
from its own timer (answer_requests' `stats`, the device synchronized around each phase). A
process's first GRPO run pays one-time costs inside its measured steps (a step of 0.45-0.55 s more,
the sixth on an H200, with no recompile; likely the pinned memory growing for the largest step's
prompts); `--grpo-runs N` runs it again in the same process, and the later runs' mean is the
steady state (`grpo_over_sft_step_matched_steady`).

    python benchmarks/grpo_speed.py --arch qwen3-vl-8b --prompts 16 --generations 8 --out benchmarks/results/grpo
    python benchmarks/grpo_speed.py --arch qwen3-vl-8b --prompts 18 --questions-per-image 9 --out ...

`--also-dynamic` runs GRPO twice more under `half_informative` (a reward under which half the
questions' answers all score alike): as it is, and with GSPO and dynamic sampling (filter_groups),
whose steps draw further questions for the half they drop. Every GRPO run reports the mismatch of
the sampler's log-probabilities and the update's (vlft.training.mismatch), over its measured steps.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import random
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from train_speed import (
    build_caches,
    build_model,
    commit_of,
    image_processor_for,
    make_tokenizer,
    WORDS,
    make_workload,
    our_settings,
    run_ours,
)
from peers import qwen_numbered_tokenizer, save_full_processor
from vlft.data.records import prepare_split
import vlft.generation.engine
import vlft.generation.folded_adapter
import vlft.generation.runner
import vlft.training.answering
import vlft.training.grpo
import vlft.training.rollouts
import vlft.training.train
from vlft.files import read_jsonl, write_jsonl
from vlft.training.rollout import TIMING


def questions(
    work: Path, images: int, per_image: int, generations: int, tokenizer, answer_tokens: int
) -> tuple[Path, Path, Path]:
    """The same images three ways: `per_image` questions each (GRPO's prompts); each of those
    questions G times with G answers of 1-16 tokens (SFT's image groups: the answers GRPO samples
    and learns, as records); and the same with every answer `answer_tokens` long, as long as the
    sampled answers (with random weights each runs to its limit): that SFT step lays out the
    tokens of the GRPO update. Before 2026-11-28 the SFT records asked G different questions."""
    each = per_image * generations
    rows = read_jsonl(make_workload(work, images * each, tokenizer, 0, each, short_answers=True))
    asked = rows[::generations]
    answers = [dict(r, question=asked[n // generations]["question"]) for n, r in enumerate(rows)]
    matched = [dict(r, answer=answer_of_length(tokenizer, answer_tokens, n)) for n, r in enumerate(answers)]
    for name, records in (("prompts", asked), ("answers", answers), ("answers-matched", matched)):
        (work / name).mkdir(parents=True, exist_ok=True)
        write_jsonl(work / name / "raw.jsonl", records)
        prepare_split(work / name / "raw.jsonl", work / "images", work / name / "prepared.jsonl")
    return work / "prompts", work / "answers", work / "answers-matched"


def answer_of_length(tokenizer, tokens: int, seed: int) -> str:
    """An answer of exactly `tokens` tokens with its end of turn, as a stage learns it whole (words,
    then `Final answer: three`): a word that would pass the length is left for a shorter one."""
    words, text, end = random.Random(seed), [], ". Final answer: three"

    def length(parts: list[str]) -> int:
        return len(tokenizer(" ".join(parts) + end, add_special_tokens=False)["input_ids"])

    for _ in range(100 * tokens):
        if length(text) >= tokens - 1:
            break
        word = words.choice(WORDS)
        if length(text + [word]) <= tokens - 1:
            text.append(word)
    if length(text) != tokens - 1:
        raise ValueError(f"no answer of {tokens} tokens from the benchmark's words")
    return " ".join(text) + end


ENGINE_CALLS: list[dict] = []  # each rollout's engine phases (answer_requests' stats), with --phases
ENGINE_PHASES = False


# Each rollout's collections: (generation, seconds, device bytes allocated before it, after it).
COLLECTIONS: list[tuple[int, float, int, int]] = []


# With --phases: each step's seconds in each phase, the device synchronized around each call.
STEP_PHASES: list[dict[str, float]] = [{}]
HOST_ALLOCATIONS = [0, 0.0]  # the host allocator's count and seconds of allocations, after the step before


def timed_phase(name: str, function):
    """`function`, each call's seconds (the device synchronized before and after) added to this step's `name`."""

    def timed(*args, **kwargs):
        torch.cuda.synchronize()
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            phases = STEP_PHASES[-1]
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - started

    return timed


def phase_patches() -> list[tuple[object, str, str]]:
    """Where a GRPO step's phases begin and end: what its rollout reads, prefills, decodes and
    scores, and its update's forward, backward, clipping and optimizer step."""
    import vlft.generation.runner
    import vlft.data.rewards
    import vlft.training.shared_prompts

    return [
        (vlft.training.grpo, "prompt_request", "reading prompts (the rest: a step ahead)"),
        (vlft.generation.engine, "prefill", "prefill without gradients"),
        (vlft.training.shared_prompts.PromptPass, "prefill", "prefill with gradients"),
        (vlft.generation.runner.DecodeStep, "__call__", "decode steps"),
        (vlft.data.rewards.Rewards, "score", "rewards"),
        (vlft.training.shared_prompts.PromptPass, "answer_logps", "answers' forward after kept prompts"),
        (vlft.training.grpo, "pack_groups", "rows laid out for a pass without gradients"),
        (vlft.training.grpo, "to_device", "rows put on the device for a pass without gradients"),
        (vlft.training.grpo, "answer_token_logps", "forward over prompts and answers"),
        (torch.Tensor, "backward", "backward"),
        (torch.nn.utils, "clip_grad_norm_", "clipping"),
        (torch.optim.AdamW, "step", "optimizer step"),
    ]


def profile_patches() -> list[tuple[object, str, str]]:
    """(--profile) The host's work around the phases, labelled too, so that the device's idle
    stretches fall to what the host did then (the innermost label at each one's start)."""
    import vlft.training.shared_prompts
    import vlft.training.step_log

    grpo, rollouts = vlft.training.grpo.GroupRelativePolicyOptimization, vlft.training.rollouts.Rollouts
    return [
        (grpo, "step_batches", "the step's rollout: its setting up"),
        (rollouts, "draw", "the rollout: its answers judged"),
        (rollouts, "_logps", "a pass without gradients: its setting up"),
        (vlft.generation.engine.Engine, "answer", "the engine's run: its setting up"),
        (vlft.generation.engine.Generation, "start", "a prefill: its rows set up"),
        (vlft.generation.engine.Generation, "decode", "a decode step: its bookkeeping"),
        (vlft.training.shared_prompts.PromptPass, "_answer_hidden", "answers' forward: its layers"),
        (vlft.training.step_log.StepLog, "step", "the step's log line"),
    ]


def time_phases() -> None:
    """The GRPO step's phases timed (--phases); a step ends with Trainer.step."""
    for owner, attribute, name in phase_patches():
        setattr(owner, attribute, timed_phase(name, getattr(owner, attribute)))
    step = vlft.training.train.Trainer.step

    def step_then_next(*args, **kwargs):
        result = step(*args, **kwargs)
        # Pinned host memory allocated anew during the step (cudaHostAlloc holds up every thread's CUDA calls).
        host = torch.cuda.host_memory_stats()
        STEP_PHASES[-1]["host allocations (count)"] = host.get("num_host_alloc", 0) - HOST_ALLOCATIONS[0]
        STEP_PHASES[-1]["host allocations (s)"] = host.get("host_alloc_time.total", 0) / 1e6 - HOST_ALLOCATIONS[1]
        HOST_ALLOCATIONS[:] = [host.get("num_host_alloc", 0), host.get("host_alloc_time.total", 0) / 1e6]
        STEP_PHASES.append({})
        return result

    vlft.training.train.Trainer.step = step_then_next


def profile_a_step(directory: Path, step_to_profile: int) -> None:
    """(--profile) Step `step_to_profile` of each run under torch.profiler, each phase a labelled
    range (no synchronizing): its Chrome trace, gzipped, what `profile_summary` reads from it, and
    the main thread's Python (cProfile) written to `directory`, one file each per run, numbered."""
    import cProfile
    import gzip
    import pstats
    import shutil

    from torch.profiler import ProfilerActivity, profile, record_function

    def labelled(name, function):
        def call(*args, **kwargs):
            with record_function(f"phase: {name}"):
                return function(*args, **kwargs)

        return call

    for owner, attribute, name in phase_patches() + profile_patches():
        setattr(owner, attribute, labelled(name, getattr(owner, attribute)))
    step, state = vlft.training.train.Trainer.step, {"steps": 0, "profiler": None, "runs": 0}

    def step_profiled(*args, **kwargs):
        result = step(*args, **kwargs)
        state["steps"] += 1
        if state["profiler"] is not None:
            torch.cuda.synchronize()
            state["profiler"].stop()
            state["python"].disable()  # before the trace is written and read
            trace = directory / f"run{state['runs']}.trace.json"
            state["profiler"].export_chrome_trace(str(trace))
            (directory / f"run{state['runs']}.summary.json").write_text(json.dumps(profile_summary(trace), indent=1))
            with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
                shutil.copyfileobj(raw, packed)
            trace.unlink()
            with (directory / f"run{state['runs']}.python.txt").open("w") as out:
                pstats.Stats(state["python"], stream=out).sort_stats("cumulative").print_stats(80)
            state["python"].dump_stats(directory / f"run{state['runs']}.pstats")  # its callers, read anywhere
            state["profiler"], state["runs"] = None, state["runs"] + 1
        elif state["steps"] == step_to_profile:
            torch.cuda.synchronize()
            state["profiler"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            state["profiler"].start()
            state["python"] = cProfile.Profile()  # the main thread's Python, where the device waits on the host
            state["python"].enable()
        return result

    def run_begins(*args, **kwargs):
        state["steps"] = 0
        return RUN_OURS(*args, **kwargs)

    directory.mkdir(parents=True, exist_ok=True)
    vlft.training.train.Trainer.step = step_profiled
    globals()["run_ours"] = run_begins


def profile_answers_host(directory: Path) -> None:
    """(--answers-host) Each GRPO run's answers' forwards (the update's pass over a step's sampled
    answers after their kept prompts) seen from the host: each layer's call timed on the host, and
    the process's fifth (past the warm-up's first compiles) under torch.profiler's CPU activity
    alone (no CUDA tracing, whose per-kernel cost misleads where launches are the question): its
    ops by their own host time."""
    from torch.profiler import ProfilerActivity, profile

    from vlft.training import shared_prompts

    apart, after = shared_prompts._numbered_apart, shared_prompts.PromptPass._answer_hidden
    state = {"forwards": 0}
    directory.mkdir(parents=True, exist_ok=True)

    def answer_hidden(self, *args, **kwargs):
        layer_call, calls = self.after, []

        def timed_layer(*layer_args, **layer_kwargs):
            started = time.perf_counter()
            output = layer_call(*layer_args, **layer_kwargs)
            calls.append(time.perf_counter() - started)
            return output

        self.after = timed_layer
        try:
            started = time.perf_counter()
            hidden = after(self, *args, **kwargs)
            host = time.perf_counter() - started
            torch.cuda.synchronize()
            whole = time.perf_counter() - started
        finally:
            self.after = layer_call
        state["forwards"] += 1
        line = {
            "forward": state["forwards"],
            "host_s": host,
            "until_done_s": whole,
            "layer_calls_ms": [round(c * 1e3, 3) for c in calls],
        }
        with (directory / "answers_layers.jsonl").open("a") as out:
            out.write(json.dumps(line) + "\n")
        return hidden

    def numbered_apart(forward, device):
        if state["forwards"] != 4:
            return apart(forward, device)

        def profiled():  # in the answers' thread: the profiler sees the ops of the thread it starts in
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                result = forward()
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=90)
            (directory / f"answers_host_{state['forwards']}.txt").write_text(table)
            return result

        return apart(profiled, device)

    shared_prompts.PromptPass._answer_hidden = answer_hidden
    shared_prompts._numbered_apart = numbered_apart


def profile_summary(trace: Path) -> dict:
    """From a profiled step's Chrome trace: the step's span, the device's busy time (kernels and
    copies, overlaps counted once), each phase's span on the host and on the device with the
    kernel time within it, and the kernels that took the most time, by name."""
    events = json.loads(trace.read_text())["traceEvents"]
    device = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )

    def busy(start: float, end: float) -> float:
        total, reached = 0.0, start
        for a, b, _ in device:
            a, b = max(a, reached), min(b, end)
            if b > a:
                total, reached = total + b - a, b
        return total / 1e6

    phases: dict[str, dict] = {}
    for e in events:
        if e.get("name", "").startswith("phase: ") and e.get("cat") in ("user_annotation", "gpu_user_annotation"):
            side = "device" if e["cat"] == "gpu_user_annotation" else "host"
            entry = phases.setdefault(e["name"][7:], {"host_s": 0.0, "device_span_s": 0.0, "device_busy_s": 0.0})
            if side == "host":
                entry["host_s"] += e["dur"] / 1e6
            else:
                entry["device_span_s"] += e["dur"] / 1e6
                entry["device_busy_s"] += busy(e["ts"], e["ts"] + e["dur"])
    kernels: dict[str, list] = {}
    for a, b, name in device:
        entry = kernels.setdefault(name[:120], [0, 0.0])
        entry[0], entry[1] = entry[0] + 1, entry[1] + (b - a) / 1e6
    start = min(e["ts"] for e in events if "dur" in e and e.get("ph") == "X")
    end = max(e["ts"] + e["dur"] for e in events if "dur" in e and e.get("ph") == "X")
    return {
        "span_s": (end - start) / 1e6,
        "device_busy_s": busy(start, end),
        "phases": phases,
        "kernels_by_time": sorted(([n, c, round(t, 5)] for n, (c, t) in kernels.items()), key=lambda k: -k[2])[:60],
        "device_idle": device_idle(events, device, start, end),
    }


def device_idle(events: list[dict], device: list[tuple], start: float, end: float, least_us: float = 100) -> dict:
    """Where the device waits on the host: its idle stretches of at least `least_us`, summed by the
    host's phase at each one's start, and the host's ops and runtime calls that overlap them (an
    op's own time and its callers' alike: read it as where the host was, not as a sum)."""
    gaps, reached = [], start
    for a, b, _ in device:
        if a - reached >= least_us:
            gaps.append((reached, a))
        reached = max(reached, b)
    if end - reached >= least_us:
        gaps.append((reached, end))
    phases = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][7:])
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("phase: ")
    )
    by_phase: dict[str, float] = {}
    for a, b in gaps:
        covering = [name for x, y, name in phases if x <= a < y]
        name = covering[-1] if covering else "between phases"
        by_phase[name] = by_phase.get(name, 0.0) + (b - a) / 1e6
    starts = [a for a, _ in gaps]
    by_op: dict[str, float] = {}
    for e in events:
        if e.get("cat") not in ("cpu_op", "cuda_runtime", "cuda_driver") or "dur" not in e:
            continue
        x, y = e["ts"], e["ts"] + e["dur"]
        i = max(0, bisect.bisect_right(starts, x) - 1)
        while i < len(gaps) and gaps[i][0] < y:
            overlap = min(y, gaps[i][1]) - max(x, gaps[i][0])
            if overlap > 0:
                by_op[e["name"][:80]] = by_op.get(e["name"][:80], 0.0) + overlap / 1e6
            i += 1
    return {
        "stretches": len(gaps),
        "idle_s": sum(b - a for a, b in gaps) / 1e6,
        "by_host_phase": {k: round(v, 4) for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])},
        "host_ops_meanwhile": [[k, round(v, 4)] for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:25]],
    }


def stage_settings(args) -> tuple[dict, dict]:
    """The SFT runs' stage settings and the GRPO run's. The SFT runs learn each answer whole (`cot`),
    so that the matched run's answers are as long as the answers GRPO samples and learns: with
    `final`, as every run had it before 2026-11-28, an SFT stage learns the final answer alone
    (`three` and its end of turn), and the matched SFT step held 11,074 tokens where the GRPO update
    over the same images held 15,464 (36 Kvasir-like questions a step). GRPO's own setting does not
    change its answers' lengths (max_completion_length does); its `format` reward parses `final`."""
    base = dict(our_settings(args.steps), answer_format="cot", max_batch_tokens=args.max_batch_tokens)
    if args.learning_rate is not None:
        base["learning_rate"] = args.learning_rate
    sft = dict(base, image_groups=True, micro_batch=args.prompts * args.generations)
    grpo = dict(
        base,
        answer_format="final",
        method="grpo",
        beta=args.beta,
        # With several questions an image, its questions' answers one group: the image once for them all.
        image_groups=args.questions_per_image > 1,
        micro_batch=args.prompts,
        num_generations=args.generations,
        max_completion_length=args.max_completion_length,
        rewards={"format": 1.0},
    )
    return sft, grpo


def half_informative(records, answers):
    """A reward under which half the questions' answers all score alike and the others' differ:
    by a hash of the record's id (every record asks the same question, and the ids are multiples of
    G), then of each answer with its place (a random model's answers may repeat one text). A random
    model's answers all score 0 under `format`, which dynamic sampling would drop every question of."""
    return [
        1.0 if zlib.crc32(str(r["id"]).encode()) % 2 else float(zlib.crc32(f"{n}:{a}".encode()) % 2)
        for n, (r, a) in enumerate(zip(records, answers))
    ]


def dynamic_runs(grpo: dict) -> dict[str, dict]:
    """--also-dynamic's two runs' settings: GRPO under `half_informative`, plain and with GSPO and dynamic sampling."""
    half = dict(grpo, rewards={"grpo_speed:half_informative": 1.0})
    return {
        "grpo, half the questions informative": half,
        "grpo, GSPO and dynamic sampling, half the questions informative": dict(
            half, importance_sampling_level="sequence", filter_groups=True
        ),
    }


def mismatch_of(log: list[dict]) -> dict:
    """The sampler/update mismatch over a run's measured steps: each field's mean, and its extreme."""
    fields = [k for k in log[0] if k.startswith(("sampling/", "training/rollout_probs"))] if log else []
    result = {k: statistics.fmean(r[k] for r in log) for k in fields}
    for k in fields:
        extreme = min if k.endswith("min") else max
        result[f"{k} (extreme)"] = extreme(r[k] for r in log)
    for k in ("train/num_gen_batches", "dynamic_sampling/kept_ratio"):
        if log and k in log[0]:
            result[k] = statistics.fmean(r[k] for r in log)
    return result


def allocator_counts() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


class TimedGc:
    """The gc module as vlft.training.grpo sees it, each collection timed (the benchmark's own)."""

    def __getattr__(self, name):
        return getattr(gc, name)

    @classmethod
    def collect(cls, generation: int = 2) -> int:
        before, started = torch.cuda.memory_allocated(), time.perf_counter()
        found = gc.collect(generation)
        COLLECTIONS.append((generation, time.perf_counter() - started, before, torch.cuda.memory_allocated()))
        return found


RUN_OURS = run_ours
ANSWER = vlft.generation.engine.Engine.answer
FITS = vlft.generation.engine.Engine.fits
FRESH = "grpo, a fresh engine each rollout, each answer its own copy of the prompt"
KEPT_UNSHARED = "grpo, the kept engine, each answer its own copy of the prompt"
TWICE = "grpo, each prompt computed twice a step (the rollout's prefill, then the update's forward)"
REPEATED = "grpo, each answer's prompt prefilled for it (as before 2026-11-28)"
UNFOLDED = "grpo, the decode steps on the adapter as it is (as before the folded adapter)"
ASKS_AGAIN = vlft.generation.runner.asks_again
PROMPTS_ONCE_UNLESS = vlft.training.grpo.prompts_once_unless
ROLLOUTS: list[dict[int, list[int]]] = []  # each rollout's answers by request key, as drawn


def answer_timed(self, *args, **kwargs):
    # The engine's phases (--phases): its timer synchronizes the device at each, which a run
    # without the timer does not.
    stats: dict | None = {} if ENGINE_PHASES else None
    drawn: dict[int, list[int]] = {}
    on_answer = kwargs.pop("on_answer")

    def kept_and_handed_on(key: int, ids: list[int]) -> None:
        drawn[key] = list(ids)
        on_answer(key, ids)

    ANSWER(self, *args, stats=stats, on_answer=kept_and_handed_on, **kwargs)
    ENGINE_CALLS.append(stats or {})
    ROLLOUTS.append(drawn)


def agreement(ours: list[dict], theirs: list[dict]) -> dict:
    """How alike two runs' sampled answers are, rollout by rollout (each rollout's answers come
    from the weights the rollouts before them trained, so a difference carries on)."""
    same, tokens, total = [], [], 0
    for a, b in zip(ours, theirs):
        for key in a:
            x, y = a[key], b.get(key, [])
            common = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            same.append(x == y)
            tokens.append(common)
            total += 1
    first = [a[k] == b.get(k) for a, b in zip(ours[:1], theirs[:1]) for k in a]
    return {
        "answers": total,
        "identical": sum(same) / max(total, 1),
        "identical_first_rollout": sum(first) / max(len(first), 1),
        "mean_tokens_before_they_part": sum(tokens) / max(total, 1),
    }


def run_trl(args, model_dir: Path, prompts: Path) -> dict:
    """benchmarks/grpo_trl.py in a process of its own, TRL's site first on PYTHONPATH; its answers a
    second over the steps after --warmup, or the error's last lines where it failed."""
    import os
    import subprocess

    result = args.work / "trl.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, str(REPO / "benchmarks/grpo_trl.py"), "--model", str(model_dir)]
    command += ["--questions", str(prompts / "raw.jsonl"), "--images", str(args.work / "images")]
    command += ["--prompts", str(args.prompts), "--generations", str(args.generations)]
    command += ["--max-completion-length", str(args.max_completion_length), "--steps", str(args.steps)]
    command += ["--result", str(result)]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([args.trl_site, os.environ.get("PYTHONPATH", "")])}
    started = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    (args.out / "trl.log").parent.mkdir(parents=True, exist_ok=True)
    (args.out / "trl.log").write_text((done.stdout + done.stderr)[-20000:])
    if done.returncode != 0 or not result.exists():
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-3:], "job_s": time.time() - started}
    run = json.loads(result.read_text())
    measured = run["step_s"][args.warmup :]
    return {
        "trl": run["trl"],
        "transformers": run["transformers"],
        "s_per_step": sum(measured) / len(measured),
        "answers_per_s": run["completions_per_step"] * len(measured) / sum(measured),
        "peak_gib": run["peak_gib"],
        "steps_measured": len(measured),
        "job_s": time.time() - started,
    }


def run_swift(args, model_dir: Path, prompts: Path, tokenizer) -> dict:
    """ms-swift's `swift rlhf --rlhf_type grpo` with its own engine (no vLLM) through peer_timer.py,
    on the same questions: its documented multimodal rows, P questions a step (per-device batch G,
    gradient accumulation P), G answers of at most --max-completion-length tokens, its `format`
    reward, β 0, LoRA r=16 on all linear layers of the language model (vision tower and aligner
    frozen), gradient checkpointing (as TRL needed for the 8B). Its answers a second over the steps
    after --warmup, or the error's last lines."""
    import os
    import subprocess

    work = args.work / "swift"
    work.mkdir(parents=True, exist_ok=True)
    rows = read_jsonl(prompts / "raw.jsonl")
    data = work / "grpo.jsonl"
    write_jsonl(
        data,
        [
            {
                "messages": [{"role": "user", "content": "<image>" + r["question"]}],
                "images": [str(args.work / "images" / r["image"])],
            }
            for r in rows
        ],
    )
    from peers import swift_model_and_lora

    settings = {
        "rlhf_type": "grpo",
        **swift_model_and_lora(model_dir, data),
        "gradient_checkpointing": "true",
        "num_generations": args.generations,
        "max_completion_length": args.max_completion_length,
        "per_device_train_batch_size": args.generations,
        "gradient_accumulation_steps": args.prompts,
        "reward_funcs": "format",
        "beta": 0,
        "temperature": 1.0,
        "use_vllm": "false",
        "learning_rate": 1e-4,
        "lr_scheduler_type": "constant",
        "warmup_ratio": 0,
        "weight_decay": 0,
        "dataset_shuffle": "false",
        "train_dataloader_shuffle": "false",
        "max_steps": args.steps,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "seed": 0,
        "output_dir": work / "out",
    }
    argv = [word for key, value in settings.items() for word in (f"--{key}", str(value))]
    result = work / "timer.json"
    result.unlink(missing_ok=True)
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([args.swift_site, os.environ.get("PYTHONPATH", "")]),
        "PEER_VISION_START_ID": str(tokenizer.convert_tokens_to_ids("<|vision_start|>")),
        "PEER_PAD_ID": str(tokenizer.pad_token_id),
        "HF_HUB_OFFLINE": "1",
        "MODELSCOPE_OFFLINE": "1",
    }
    started = time.time()
    command = [sys.executable, str(REPO / "benchmarks/peer_timer.py"), str(result), "swift-rlhf", *argv]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=work)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "swift.log").write_text((done.stdout + done.stderr)[-20000:])
    if done.returncode != 0 or not result.exists():
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-3:], "job_s": time.time() - started}
    measured = [s["s"] for s in json.loads(result.read_text())["steps"][args.warmup :]]
    return {
        "s_per_step": sum(measured) / len(measured),
        "answers_per_s": args.prompts * args.generations * len(measured) / sum(measured),
        "peak_gib": json.loads(result.read_text())["peak_gib"],
        "steps_measured": len(measured),
        "job_s": time.time() - started,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlft-grpo-bench"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=16, help="questions a step")
    parser.add_argument("--questions-per-image", type=int, default=1, help="9: Kvasir-like (with image groups)")
    parser.add_argument("--beta", type=float, default=0.0, help="above 0: a reference pass a rollout")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=20)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-batch-tokens", type=int, default=12288)
    parser.add_argument("--commit")
    parser.add_argument(
        "--grpo-runs", type=int, default=1, help="GRPO's run this many times in the process, one after the other"
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help="0: the weights never move, so every rollout of two runs should draw the same answers (an agreement check)",
    )
    parser.add_argument(
        "--also-fresh-engines",
        action="store_true",
        help="GRPO again as it ran before its engine was kept: a fresh engine each rollout, no shared prompts",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="each GRPO step's phases timed, the device synchronized around each (a little slower overall)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="a folder: the first step after the warm-up of each run profiled (torch.profiler), its trace and summary there",
    )
    parser.add_argument(
        "--answers-host",
        type=Path,
        help="a folder: the answers' forwards' layer calls timed on the host, one profiled (CPU activity only)",
    )
    parser.add_argument(
        "--also-prompts-repeated",
        action="store_true",
        help="GRPO again as it ran before a question's answers shared its prefill: its prompt computed once an answer",
    )
    parser.add_argument(
        "--also-unfolded",
        action="store_true",
        help="GRPO again as it ran before the rollout folded its adapter (its decode steps computing the adapter's "
        "matmuls), between the first and the second of --grpo-runs",
    )
    parser.add_argument(
        "--also-prompts-twice",
        action="store_true",
        help="GRPO again as it ran before the rollout's prefill served the update: each prompt computed twice a step",
    )
    parser.add_argument(
        "--trl-site", help="a folder with TRL and its pinned packages: TRL's GRPOTrainer on the same workload too"
    )
    parser.add_argument("--swift-site", help="a folder with ms-swift and its pins: `swift rlhf --rlhf_type grpo` too")
    parser.add_argument("--also-dynamic", action="store_true", help="GRPO under half_informative, plain and GSPO+DAPO")
    return parser.parse_args()


def set_up_instruments(args: argparse.Namespace) -> None:
    """The benchmark's own timing of the engine and collections, and what --phases, --profile and
    --answers-host ask for."""
    vlft.generation.engine.Engine.answer = answer_timed  # the benchmark's own timing of the engine
    vlft.training.answering.gc = TimedGc()
    if args.phases:
        time_phases()
        globals()["ENGINE_PHASES"] = True
    if args.profile:
        profile_a_step(args.profile, args.warmup)
    if args.answers_host:
        profile_answers_host(args.answers_host)


def prepare(args: argparse.Namespace):
    """The tokenizer, the model saved as a checkpoint, and the three workloads' caches: the questions
    (GRPO's), their answers as SFT records, and answers as long as GRPO samples (SFT matched)."""
    # ms-swift's Qwen3-VL template writes the image by Qwen's own special-token ids: for it, the
    # benchmark's tokenizer with its special tokens at those ids (peers.py does the same).
    tokenizer = qwen_numbered_tokenizer() if args.swift_site else make_tokenizer()
    per_image = args.questions_per_image
    images = args.prompts * args.steps // per_image
    prompts, answers, matched = questions(
        args.work, images, per_image, args.generations, tokenizer, args.max_completion_length
    )
    model = build_model(args.arch, tokenizer, "cuda")
    image_processor = image_processor_for(model)
    model_dir = args.work / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    image_processor.save_pretrained(model_dir)
    if args.trl_site or args.swift_site:  # the processor files a published checkpoint has
        save_full_processor(model, tokenizer, image_processor, model_dir)
    for directory in (prompts, answers, matched):
        (directory / "images").unlink(missing_ok=True)  # a --work left by an earlier run
        (directory / "images").symlink_to(args.work / "images", target_is_directory=True)
        build_caches(directory, image_processor, model)
    del model
    torch.cuda.empty_cache()
    return tokenizer, model_dir, prompts, answers, matched


def planned_runs(args: argparse.Namespace, prompts: Path, answers: Path, matched: Path) -> tuple[dict, str]:
    """Each run by name: its workload and settings, in the order they run; and the name of GRPO's own."""
    sft, grpo = stage_settings(args)
    runs = {
        f"sft, image groups, {args.generations} answers an image": (
            answers,
            sft,
        ),
        f"sft, image groups, {args.generations} answers an image of {args.max_completion_length} tokens": (
            matched,
            sft,
        ),
    }
    if args.also_fresh_engines:  # before the kept one: neither runs on what the other left
        runs[FRESH] = (prompts, grpo)
        runs[KEPT_UNSHARED] = (prompts, grpo)
    if args.also_prompts_twice:
        runs[TWICE] = (prompts, grpo)
    if args.also_prompts_repeated:
        runs[REPEATED] = (prompts, grpo)
    ours = f"grpo, {args.generations} sampled answers a question"
    runs[ours] = (prompts, grpo)
    if args.also_unfolded:  # after a first GRPO run, which pays the process's one-time costs
        runs[UNFOLDED] = (prompts, grpo)
    for repeat in range(2, args.grpo_runs + 1):  # the host's speed drifts between runs: the same run again
        runs[f"{ours}, run {repeat}"] = (prompts, grpo)
    if args.also_dynamic:
        runs |= {name: (prompts, settings) for name, settings in dynamic_runs(grpo).items()}
    return runs, ours


def measure_run(
    args: argparse.Namespace, model_dir: Path, name: str, directory: Path, settings: dict, index: int
) -> tuple[dict, list]:
    """One run of the benchmark's: its steps' speed, memory and parts, and the answers it drew. The
    runs that stand for earlier code (FRESH, KEPT_UNSHARED, TWICE, REPEATED, UNFOLDED) patch the
    parts that code lacked."""
    started = time.time()
    ENGINE_CALLS.clear()
    COLLECTIONS.clear()
    # As before the engine was kept: a fresh one each rollout, each answer with its own copy of its prompt.
    fresh = name == FRESH
    vlft.generation.engine.Engine.fits = (lambda self, *a: False) if fresh else FITS
    vlft.training.rollouts.SHARED_PROMPT_DEVICES = () if name in (FRESH, KEPT_UNSHARED) else ("cuda",)
    twice = name in (FRESH, KEPT_UNSHARED, TWICE)  # as GRPO ran before its prompts were computed once
    vlft.training.grpo.prompts_once_unless = (lambda *a: "the benchmark's") if twice else PROMPTS_ONCE_UNLESS
    vlft.generation.runner.asks_again = (lambda *a: False) if name == REPEATED else ASKS_AGAIN
    vlft.generation.folded_adapter.FOLD_DEVICES = () if name == UNFOLDED else ("cuda",)
    ROLLOUTS.clear()
    STEP_PHASES[:] = [{}]
    allocator = allocator_counts()
    run = run_ours(
        model_dir,
        directory / "prepared.jsonl",
        directory / "vision",
        args.steps,
        args.warmup,
        settings,
        args.work / f"run{index}",
    )
    drawn = list(ROLLOUTS)
    seconds = sum(run["step_s"])
    result = {
        "s_per_step": seconds / len(run["step_s"]),
        "answers_per_s": sum(run["samples"]) / seconds,
        "peak_gib": run["peak_gib"],
        "steps_measured": len(run["step_s"]),
        "step_s": [round(t, 4) for t in run["step_s"]],
        # The tokens of the samples a step learns, each counted whole (its prompt too): the
        # matched SFT run's and GRPO's are the same where their answers are as long.
        "sample_tokens_a_step": statistics.fmean(run["tokens"]),
        "job_s": time.time() - started,
        # The caching allocator's cudaMalloc and cudaFree calls and its retries (a free of its
        # cached blocks, then the allocation again) over the run: an allocator short of memory.
        "allocator": {k: v - allocator[k] for k, v in allocator_counts().items()},
    }
    if settings.get("method") == "grpo":
        # Each part's seconds a step (its own log's timing_s fields; the update is the rest),
        # and the engine's phases a rollout (the device synchronized around each phase).
        parts = {k: sum(r[k] for r in run["log"]) / len(run["log"]) for k in TIMING}
        parts["update"] = result["s_per_step"] - sum(parts.values())
        result["parts_s"] = parts
        result["mismatch"] = mismatch_of(run["log"])
        # Over all the run's rollouts (one a step), the first's included.
        result["collections"] = {
            "full_ones": sum(g == 2 for g, *_ in COLLECTIONS),
            "young_ones": sum(g != 2 for g, *_ in COLLECTIONS),
            "s_a_rollout": sum(t for _, t, *_ in COLLECTIONS) / args.steps,
            "mib_before_freed": [[round(b / 2**20), round((b - a) / 2**20)] for _, _, b, a in COLLECTIONS],
        }
        if args.phases:  # each phase's mean seconds a step, over the steps after the warm-up
            measured = STEP_PHASES[args.warmup : args.steps]
            names = sorted({k for phases in measured for k in phases})
            result["phases_s"] = {k: sum(p.get(k, 0.0) for p in measured) / len(measured) for k in names}
            result["phases_s_each_step"] = [{k: round(v, 4) for k, v in p.items()} for p in STEP_PHASES]
            result["engine_s_each_rollout"] = [
                {k: round(v, 4) for k, v in c.items() if "_s" in k} for c in ENGINE_CALLS
            ]
        result["engine_s"] = {
            k: sum(c.get(k, 0) for c in ENGINE_CALLS[args.warmup :]) / len(ENGINE_CALLS[args.warmup :])
            for k in sorted({k for c in ENGINE_CALLS for k in c})
        }
    # The run's model and optimizer may sit in reference cycles (compiled layers, PEFT): free
    # them before the next run loads its own.
    del run
    gc.collect()
    torch.cuda.empty_cache()
    print(name, json.dumps(result), flush=True)
    return result, drawn


def compare_draws(args: argparse.Namespace, results: dict, drawn: dict, ours: str) -> None:
    """How many of GRPO's answers each earlier way of computing them drew alike."""
    if args.also_fresh_engines:  # the same draws? (the kept graph: exactly; shared prompts: bf16's own order of sums)
        for name in (KEPT_UNSHARED, ours):
            results[name]["answers_against_fresh_engines"] = agreement(drawn[name], drawn[FRESH])
    if args.also_prompts_twice:  # the prefill under the training's autocast (float32 adapter) against the bf16 one
        results[ours]["answers_against_prompts_twice"] = agreement(drawn[ours], drawn[TWICE])
    if args.also_prompts_repeated:  # the same prompts computed once or once an answer: bf16's own order of sums
        results[ours]["answers_against_prompts_repeated"] = agreement(drawn[ours], drawn[REPEATED])
    if args.also_unfolded:  # the adapter's matmuls or its folded copies: bf16's own rounding
        results[ours]["answers_against_unfolded"] = agreement(drawn[ours], drawn[UNFOLDED])


def against_peers(args: argparse.Namespace, results: dict, grpo_run: dict, model_dir: Path, prompts: Path, tokenizer):
    """TRL's and ms-swift's GRPO on the same workload, where their sites are given, and ours against them."""
    if args.trl_site:
        results["trl"] = run_trl(args, model_dir, prompts)
        ours_rate = grpo_run["answers_per_s"]
        results["trl"]["ours_over_trl"] = (
            ours_rate / results["trl"]["answers_per_s"] if results["trl"].get("answers_per_s") else None
        )
        print("trl", json.dumps(results["trl"]), flush=True)
    if args.swift_site:
        results["ms-swift"] = run_swift(args, model_dir, prompts, tokenizer)
        if results["ms-swift"].get("answers_per_s"):
            results["ms-swift"]["ours_over_swift"] = grpo_run["answers_per_s"] / results["ms-swift"]["answers_per_s"]
        print("ms-swift", json.dumps(results["ms-swift"]), flush=True)


def summary(args: argparse.Namespace, results: dict, runs: dict) -> dict:
    """The result file: every run, and GRPO's step against the SFT steps over the same images."""
    sft, sft_matched, grpo_run = [
        results[name] for name in runs if name not in (FRESH, KEPT_UNSHARED, TWICE, REPEATED, UNFOLDED)
    ][:3]
    for name, run in results.items():
        if name.startswith("grpo"):
            run["over_sft_step"] = run["s_per_step"] / sft["s_per_step"]
            run["over_sft_step_matched"] = run["s_per_step"] / sft_matched["s_per_step"]
    report = {
        "arch": args.arch,
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit_of(args.commit),
        "command": " ".join(sys.argv),
        "prompts": args.prompts,
        "questions_per_image": args.questions_per_image,
        "beta": args.beta,
        "generations": args.generations,
        "max_completion_length": args.max_completion_length,
        "runs": results,
        "grpo_over_sft_step": grpo_run["s_per_step"] / sft["s_per_step"],
        # Against SFT on answers as long as the ones GRPO sampled and learned (the same tokens in its update).
        "grpo_over_sft_step_matched": grpo_run["s_per_step"] / sft_matched["s_per_step"],
        "rollout_s_estimate": grpo_run["s_per_step"] - sft["s_per_step"],
    }
    repeats = [results[name] for name in runs if ", run " in name]
    if repeats:  # the process's first run pays its one-time costs; the later ones are its steady state
        steady = statistics.fmean(run["s_per_step"] for run in repeats)
        report["grpo_s_per_step_steady"] = steady
        report["grpo_over_sft_step_matched_steady"] = steady / sft_matched["s_per_step"]
    return report


def main() -> None:
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    set_up_instruments(args)
    tokenizer, model_dir, prompts, answers, matched = prepare(args)
    runs, ours = planned_runs(args, prompts, answers, matched)
    results, drawn = {}, {}
    for index, (name, (directory, settings)) in enumerate(runs.items()):
        results[name], drawn[name] = measure_run(args, model_dir, name, directory, settings, index)
    compare_draws(args, results, drawn, ours)
    grpo_run = results[ours]
    against_peers(args, results, grpo_run, model_dir, prompts, tokenizer)
    report = summary(args, results, runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"grpo_speed_{args.arch}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

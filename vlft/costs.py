"""What each training and evaluation job will cost, before it runs.

A job's work is counted from its data (`count_split`): its records, the image tokens each image
becomes at the stage's pixel range (`image_tokens`, the Qwen-VL processors' resize), and the
question and answer tokens the checkpoint's tokenizer makes of them. What the stage does with them
(epochs or max_steps, image groups, its method, the evaluation's answer room) decides what the job
computes (`train_seconds`, `eval_seconds`). Its time is that work at the throughputs our benchmarks
measured, per device and model (vlft/throughputs.csv, each coefficient with its source), scaled by
the language model's parameters from the nearest measured model, plus the job's fixed cost (load,
compile). Once a study's own jobs have run, the ratio of their measured times to their predictions
refines the rest of the study's (`Refinement`).

Counting reads a split's records and its images' headers once per content of the split and keeps the
counts under .snakemake/vlft/counts/: a dry run that finds them reads nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vlft.data.records import raw_objects, selected_by
from vlft.devices import Throughputs
from vlft.parallelism import Layout
from vlft.files import atomic_path
from vlft.stage_params import trains_vision

# The chat template's tokens around a question and its answer (Qwen-VL's: the turns' markers, the
# image's start and end): the same for every sample, too few to count one by one.
TEMPLATE_TOKENS = 20
# Counted without a tokenizer on disk (a model not fetched yet): characters a token, English text.
CHARACTERS_A_TOKEN = 4
# A tower that trains (vision_lora, train_merger) runs its forward, then a backward to its inputs
# and its LoRA's weights, and the mergers' in full: on the 8B about three times a frozen tower's
# forward (benchmarks/README.md, "Training the vision tower").
TRAINED_TOWER_WORK = 3
COUNTS_VERSION = 1


def image_tokens(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> int:
    """The language model's tokens of one image: transformers' Qwen2-VL `smart_resize` (the size each
    side is rounded to a multiple of `factor`, the area brought into [min_pixels, max_pixels]), over
    factor². Written here because importing its module brings torch and transformers, seconds of
    every dry run; tests/workflow/test_costs.py holds it equal to transformers' on many sizes."""
    resized_h = max(factor, round(height / factor) * factor)
    resized_w = max(factor, round(width / factor) * factor)
    if resized_h * resized_w > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        resized_h = max(factor, math.floor(height / beta / factor) * factor)
        resized_w = max(factor, math.floor(width / beta / factor) * factor)
    elif resized_h * resized_w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        resized_h = math.ceil(height * beta / factor) * factor
        resized_w = math.ceil(width * beta / factor) * factor
    return (resized_h // factor) * (resized_w // factor)


@dataclass
class SplitCounts:
    """What one split holds, under one filter, in tokens."""

    records: int = 0
    images: int = 0
    image_tokens: int = 0  # each record's image, summed over records
    distinct_image_tokens: int = 0  # each image once
    question_tokens: int = 0
    rejected_tokens: int = 0
    answer_lengths: dict[int, int] = field(default_factory=dict)  # answer tokens -> records
    tokens_estimated: bool = False  # from characters: no tokenizer on disk

    def answer_tokens(self, cap: int | None = None) -> int:
        return sum(min(n, cap or n) * count for n, count in self.answer_lengths.items())

    def longest_answer(self, cap: int | None = None) -> int:
        return min(max(self.answer_lengths, default=0), cap or math.inf)

    def __add__(self, other: "SplitCounts") -> "SplitCounts":
        lengths = dict(self.answer_lengths)
        for n, count in other.answer_lengths.items():
            lengths[n] = lengths.get(n, 0) + count
        summed = {k: getattr(self, k) + getattr(other, k) for k in asdict(self) if k != "answer_lengths"}
        summed["tokens_estimated"] = self.tokens_estimated or other.tokens_estimated
        return SplitCounts(**summed, answer_lengths=lengths)


@dataclass(frozen=True)
class ModelShape:
    """What a checkpoint's size and image layout are, from its config files alone."""

    compute_params: float  # the language model's weights a token goes through (its layers and head)
    factor: int  # pixels a side of one image token: patch size x merge size
    tokenizer: Path | None
    layer_params: float = 0.0  # its decoder layers' weights alone: what a sharded stage all-gathers

    @classmethod
    def of(cls, model_dir: str | Path) -> "ModelShape":
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        text = config.get("text_config", config)
        d, layers, inner = text["hidden_size"], text["num_hidden_layers"], text["intermediate_size"]
        heads = text["num_attention_heads"]
        head_dim = text.get("head_dim") or d // heads
        kv = text.get("num_key_value_heads", heads) * head_dim
        per_layer = 2 * d * heads * head_dim + 2 * d * kv + 3 * d * inner
        processor = json.loads((model_dir / "preprocessor_config.json").read_text())
        tokenizer = model_dir / "tokenizer.json"
        return cls(
            layers * per_layer + text["vocab_size"] * d,
            processor["patch_size"] * processor["merge_size"],
            tokenizer if tokenizer.is_file() else None,
            layers * per_layer,
        )


def _token_counts(texts: list[str], tokenizer: Path | None) -> list[int]:
    """Each text's tokens; each distinct text tokenized once (Kvasir-VQA asks some twenty questions,
    and many answers repeat)."""
    distinct = list(dict.fromkeys(texts))
    if tokenizer is None:
        lengths = [math.ceil(len(t) / CHARACTERS_A_TOKEN) for t in distinct]
    else:
        from tokenizers import Tokenizer  # the Rust library alone: no torch, no transformers

        lengths = [
            len(e.ids) for e in Tokenizer.from_file(str(tokenizer)).encode_batch(distinct, add_special_tokens=False)
        ]
    length_of = dict(zip(distinct, lengths))
    return [length_of[t] for t in texts]


@dataclass
class RecordTable:
    """Each record of a raw split, in its order: its image, and its tokens."""

    images: list[str] = field(default_factory=list)
    image_tokens: list[int] = field(default_factory=list)
    questions: list[int] = field(default_factory=list)
    answers: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    tokens_estimated: bool = False


def record_table(
    records: str | Path, image_root: str | Path, shape: ModelShape, pixels: tuple[int, int]
) -> RecordTable:
    """Read every record of a raw split and each distinct image's header (its size, not its
    pixels), and tokenize the questions and answers. An image that cannot be read counts nothing:
    prepare_split names it."""
    from PIL import Image

    sizes: dict[str, int] = {}
    table = RecordTable(tokens_estimated=shape.tokenizer is None)
    questions, answers, rejected = [], [], []
    for record in raw_objects([records]):
        image = str(record.get("image", ""))
        if image not in sizes:
            try:
                with Image.open(Path(image_root) / image) as opened:
                    width, height = opened.size
                sizes[image] = image_tokens(height, width, shape.factor, *pixels)
            except (OSError, ValueError, Image.DecompressionBombError):  # prepare_split names it
                sizes[image] = 0
        table.images.append(image)
        table.image_tokens.append(sizes[image])
        questions.append(str(record.get("question", "")))
        answers.append(str(record.get("answer", "")))
        rejected.append(str(record.get("rejected") or ""))
    table.questions = _token_counts(questions, shape.tokenizer)
    table.answers = _token_counts(answers, shape.tokenizer)
    table.rejected = _token_counts(rejected, shape.tokenizer)
    return table


def selection(records: str | Path, filters: dict) -> list[bool]:
    """Which of a raw split's records (in raw_objects' order, as record_table reads them) a filter selects."""
    return [selected_by(record, filters) for record in raw_objects([records])]


def counts_of(table: RecordTable, selected: list[bool] | None = None) -> SplitCounts:
    """The split's counts over the records selected (all without a selection)."""
    counts = SplitCounts(tokens_estimated=table.tokens_estimated)
    seen = set()
    for i, image in enumerate(table.images):
        if selected is not None and not selected[i]:
            continue
        counts.records += 1
        counts.image_tokens += table.image_tokens[i]
        if image not in seen:
            seen.add(image)
            counts.distinct_image_tokens += table.image_tokens[i]
        counts.question_tokens += table.questions[i]
        counts.rejected_tokens += table.rejected[i]
        counts.answer_lengths[table.answers[i]] = counts.answer_lengths.get(table.answers[i], 0) + 1
    counts.images = len(seen)
    return counts


def count_split(
    records: str | Path, image_root: str | Path, shape: ModelShape, pixels: tuple[int, int], filters: dict
) -> SplitCounts:
    """Count one raw split's records that `filters` selects."""
    table = record_table(records, image_root, shape, pixels)
    return counts_of(table, selection(records, filters) if filters else None)


class CountsMemo:
    """Counts kept between plans: a split's record table once per (split content, tokenizer, pixel
    range), read again only for a filter not counted before; each filter's counts apart."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.known: dict[str, object] = {}

    def _kept(self, key: list, make, load):
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        if name in self.known:
            return self.known[name]
        path = self.directory / f"{name}.json"
        try:
            value = load(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            value = make()
            try:
                with atomic_path(path) as tmp:
                    tmp.write_text(json.dumps(asdict(value)))
            except OSError:
                pass  # counted again next time
        self.known[name] = value
        return value

    def counts(self, split_digest: str, records, image_root, shape: ModelShape, pixels, filters) -> SplitCounts:
        tokenizer = hashlib.sha256(shape.tokenizer.read_bytes()).hexdigest() if shape.tokenizer else None
        table_key = [COUNTS_VERSION, split_digest, tokenizer, shape.factor, list(pixels)]

        def table():
            return self._kept(
                table_key, lambda: record_table(records, image_root, shape, pixels), lambda d: RecordTable(**d)
            )

        def count():
            return counts_of(table(), selection(records, filters) if filters else None)

        def load(stored):
            stored["answer_lengths"] = {int(n): c for n, c in stored["answer_lengths"].items()}
            return SplitCounts(**stored)

        return self._kept(table_key + [filters], count, load)


@dataclass(frozen=True)
class Prediction:
    """A job's predicted seconds: its fixed cost (load, compile) and the rest, its work."""

    fixed_s: float
    work_s: float
    what: str  # the counted work, in words
    # An evaluation's decode-step shape (its split and pixels): the first job of each shape in a study
    # compiles the step for it (the rest load it from torch's cache), a cost the plan counts once a shape.
    compiles: tuple | None = None

    @property
    def seconds(self) -> float:
        return self.fixed_s + self.work_s

    def refined(self, ratio: float) -> "Prediction":
        # The whole job scaled: a host's per-job costs (its CPU and disk: the load, the compile from
        # cache) differ from the table's as much as its throughput does (benchmarks/README.md, forecast).
        return dataclasses.replace(self, fixed_s=self.fixed_s * ratio, work_s=self.work_s * ratio)


def tokens(count: float) -> str:
    return f"{count / 1e6:,.1f}M" if count >= 1e6 else f"{count / 1e3:,.0f}k" if count >= 1e3 else f"{count:.0f}"


def _decode_s(tokens: float, rows: int, rate: Throughputs, kind: str = "") -> float:
    """Generating `tokens` answer tokens with `rows` answered at once: each step reads the weights
    once for all its rows, and each row's own part. `kind` "rollout_": a reward stage's rollout's
    steps, at their own rates where the table has them (its rows share their prompts' keys, read
    once a prompt, where an evaluation's each read their own), the evaluation's elsewhere."""
    if f"{kind}decode_step_s" not in rate.values:
        kind = ""
    return tokens * (rate[f"{kind}decode_step_s"] / rows + rate[f"{kind}decode_row_s"])


def train_seconds(
    settings: dict,
    counts: SplitCounts,
    rate: Throughputs,
    adapter_dropout: float | None = None,
    layout: Layout = Layout(),
) -> Prediction:
    """A training stage's time: each step's forward and backward over the tokens it computes (an
    image's once a group with image groups, once a sample otherwise), the vision tower where it
    trains from pixels, and a method's own passes (dpo: the reference, once; grpo: its rollouts and
    their passes without gradients). `adapter_dropout`: the LoRA dropout of the adapter the stage
    trains (where it starts from another stage's, that adapter's; None: the stage's own)."""
    records = max(counts.records, 1)
    step_size = settings["micro_batch"] * settings["grad_accum"]
    # A grpo stage learns each rollout num_iterations steps in a row (vlft.training.steps.plan_steps):
    # max_steps counts those repeats, epochs do not.
    repeats = settings["num_iterations"] if settings["method"] == "grpo" else 1
    samples = (
        settings["max_steps"] * step_size if settings["max_steps"] else counts.records * settings["epochs"] * repeats
    )
    passes = samples / records  # times each record is trained on
    image = counts.distinct_image_tokens if settings["image_groups"] else counts.image_tokens
    text = counts.records * TEMPLATE_TOKENS + counts.question_tokens
    method = settings["method"]
    tower = TRAINED_TOWER_WORK if trains_vision(settings) else 1
    extra_s = 0.0
    if method == "grpo":
        generations = settings["num_generations"]
        completion = counts.answer_tokens(settings["max_completion_length"]) / records
        image = counts.distinct_image_tokens  # a question's answers share its prompt: an image group
        text += generations * completion * counts.records
        # The rollouts: each step's prompts prefilled once, then decoded in rows of all their answers.
        prompts = counts.distinct_image_tokens + counts.records * TEMPLATE_TOKENS + counts.question_tokens
        rows = generations * step_size
        longest = counts.longest_answer(settings["max_completion_length"])
        rollouts = samples / step_size / repeats  # one for its num_iterations steps
        extra_s = _decode_s(longest * rollouts * rows, rows, rate, "rollout_")
        dropout = settings["lora_dropout"] if adapter_dropout is None else adapter_dropout
        # Where the rollout keeps its prompts' forward for the update, its prefill is the update's
        # forward over them, in the step's tokens already; elsewhere a pass of its own.
        # (A step's prompts with every answer at max_completion_length, as the runtime checks them.)
        step_tokens = prompts / records * step_size + rows * settings["max_completion_length"]
        if not _prompts_once(settings, dropout, step_tokens):
            extra_s += prompts * passes / repeats / rate["prefill_tokens_per_s"]
    else:
        text += counts.answer_tokens() + (counts.rejected_tokens if method == "dpo" else 0)
    step_s = passes * (
        counts.records * rate["train_s_per_sample"]
        + (image + text) / rate["train_tokens_per_s"]
        + (0 if settings["vision_cache"] else counts.distinct_image_tokens * rate["vision_s_per_image_token"] * tower)
    )
    if method == "dpo":  # the reference's log-probabilities: one pass without gradients, a third of a step's work
        extra_s = (image + text) / rate["train_tokens_per_s"] / 3
    if method == "grpo":
        # A rollout's passes without gradients over its answers, laid out as the update lays them
        # out, each a third of a step's work: the reference's with beta above 0, the rollout's own
        # log-probabilities with num_iterations above 1 (vlft.training.grpo): a forward of the update's
        # tokens, a third of the SFT step over them (benchmarks/README.md, GRPO).
        without_gradients = (settings["beta"] > 0) + (repeats > 1)
        extra_s += without_gradients * passes / repeats * (image + text) / rate["train_tokens_per_s"] / 3
        # What the token counts leave out: the host's launches of a step's passes through the compiled
        # layers, which outlast their kernels at a few thousand tokens a pass (benchmarks/README.md,
        # "What CUDA graphs would take out of the update"), a step and a pass without gradients.
        extra_s += (
            samples / step_size * rate["grpo_step_host_s"] + without_gradients * rollouts * rate["grpo_pass_host_s"]
        )
    what = f"{samples:,.0f} samples, {tokens(passes * (image + text))} tokens"
    seconds = step_s + extra_s
    if layout.processes > 1:
        steps = max(samples / step_size, 1)
        budget = settings["max_batch_tokens"]
        if isinstance(budget, int) and budget:  # each process's micro-batches a step
            rows = math.ceil(passes * (image + text) / steps / layout.processes / budget)
        else:
            rows = math.ceil(step_size / layout.processes / settings["micro_batch"])
        seconds, said = layout.priced(seconds, steps, rows)
        what += said
    return Prediction(rate["train_fixed_s"], seconds, what)


def _prompts_once(settings: dict, dropout: float, step_tokens: float) -> bool:
    """Whether a grpo stage's rollouts keep their prompts' forward for the update, as far as the plan
    can tell (vlft.training.shared_prompts.prompts_once_unless): one update a rollout, no LoRA
    dropout, no activation checkpointing, and an average step's prompts with every answer at its
    longest (`step_tokens`) within a numeric max_batch_tokens (auto fits what it can)."""
    budget = settings["max_batch_tokens"]
    fits = budget is None or budget == "auto" or step_tokens <= budget
    return settings["num_iterations"] == 1 and dropout == 0 and not settings["activation_checkpointing"] and fits


def eval_seconds(evaluation: dict, counts: SplitCounts, rate: Throughputs, shape: tuple | None = None) -> Prediction:
    """An evaluation's time: each image once and every question with its reference answer in the
    prefill (which gives the loss too), then the answers decoded at `batch_size` rows, each as long as
    its reference answer, at most max_new_tokens."""
    prefill = (
        counts.distinct_image_tokens
        + counts.records * TEMPLATE_TOKENS
        + counts.question_tokens
        + counts.answer_tokens()
    )
    answers = counts.answer_tokens(evaluation["max_new_tokens"])
    rows = evaluation["batch_size"]
    work = (
        prefill / rate["prefill_tokens_per_s"]
        + _decode_s(answers, rows, rate)
        + counts.distinct_image_tokens * rate["vision_s_per_image_token"]
    )
    what = f"{counts.records:,} answers, {tokens(prefill)} tokens prefilled, {tokens(answers)} generated"
    return Prediction(rate["eval_fixed_s"], work, what, compiles=shape)


def vision_cache_seconds(counts: SplitCounts, rate: Throughputs) -> Prediction:
    """A vision cache's time: the frozen tower over each image once (writing the shards is not counted)."""
    work = counts.distinct_image_tokens * rate["vision_s_per_image_token"]
    return Prediction(
        rate["eval_fixed_s"], work, f"{counts.images:,} images, {tokens(counts.distinct_image_tokens)} tokens"
    )


@dataclass
class Refinement:
    """The ratio of a study's measured job times to their predictions, per kind of job (train,
    evaluate): the median over the jobs that ran on the device predicted for, applied to the rest's
    predictions. 1 until one has run."""

    measured: dict[str, list[float]] = field(default_factory=dict)

    def add(self, kind: str, prediction: Prediction, measured_s: float) -> None:
        if prediction.seconds > 0 and measured_s > 0:  # the job's whole time against its whole prediction
            self.measured.setdefault(kind, []).append(measured_s / prediction.seconds)

    def ratio(self, kind: str) -> float:
        return statistics.median(self.measured[kind]) if self.measured.get(kind) else 1.0

    def jobs(self, kind: str) -> int:
        return len(self.measured.get(kind, []))


def runtime_minutes(seconds: float, margin: float, floor: int) -> int:
    """The time limit a job asks for from its prediction: the prediction times the margin, at least
    the floor, in whole minutes."""
    return max(floor, math.ceil(seconds * margin / 60))


def attempts_needed(seconds: float, margin: float, ceiling: int) -> int:
    """Attempts a stage takes where each may run at most `ceiling` minutes: it stops before its limit
    and the next resumes (vlft.jobs.stopping)."""
    return max(1, math.ceil(seconds * margin / 60 / ceiling))


def duration(seconds: float) -> str:
    """A time as the forecast says it: seconds, minutes or hours."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def wall_seconds(durations: dict, needs: dict, gpus: dict, capacity: float) -> float:
    """The plan's wall time: jobs started as soon as what they need is done and enough GPUs are free
    (`capacity`, unbounded with math.inf), earliest-ready first."""
    import heapq

    finish: dict = {}
    running: list[tuple[float, int, object]] = []  # (finish time, order, job)
    free, now, order = capacity, 0.0, 0
    waiting = list(durations)
    while waiting or running:
        ready = [j for j in waiting if all(n in finish for n in needs.get(j, ()) if n in durations)]
        started = False
        for job in ready:
            want = min(gpus.get(job, 0), capacity)
            if want <= free:
                free -= want
                order += 1
                heapq.heappush(running, (now + durations[job], order, job))
                waiting.remove(job)
                started = True
        if not started:
            now, _, job = heapq.heappop(running)
            finish[job] = now
            free += min(gpus.get(job, 0), capacity)
    return max(finish.values(), default=0.0)

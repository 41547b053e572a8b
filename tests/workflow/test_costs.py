"""Each job's time before it runs (vlft.costs, vlft.study_costs): counted from the data, timed by
the measured throughputs, refined by the study's own jobs; the dry run's table and SLURM limits."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import yaml
from PIL import Image

from tests.helpers import snakemake
from vlft.costs import (
    CountsMemo,
    ModelShape,
    Prediction,
    TEMPLATE_TOKENS,
    TRAINED_TOWER_WORK,
    Refinement,
    SplitCounts,
    attempts_needed,
    count_split,
    eval_seconds,
    image_tokens,
    runtime_minutes,
    train_seconds,
    wall_seconds,
)
from vlft.devices import Throughputs, throughputs

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_image_tokens_equal_the_qwen_processors_resize():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    for factor, low, high in ((28, 3136, 1003520), (32, 4096, 16384), (32, 65536, 1336320), (28, 200704, 1003520)):
        for height in (40, 97, 333, 1036, 1288, 1920, 2555):
            for width in (40, 150, 777, 1080, 1288, 2560):
                resized_h, resized_w = smart_resize(height, width, factor, low, high)
                assert image_tokens(height, width, factor, low, high) == (resized_h // factor) * (resized_w // factor)


def word_tokenizer(path, words):
    """A real tokenizer.json (the tokenizers library's, as checkpoints ship it): one token a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


@pytest.fixture
def small_split(tmp_path):
    """Five records on three images of three sizes; two categories."""
    images = tmp_path / "images"
    images.mkdir()
    for name, size in (("a.png", (64, 64)), ("b.png", (128, 64)), ("c.png", (96, 96))):
        Image.new("RGB", size).save(images / name)
    rows = [
        ("a.png", "what color", "red", "color"),
        ("a.png", "how many shapes here", "two shapes so 2", "count"),
        ("b.png", "what color", "blue", "color"),
        ("b.png", "is it round", "yes", "yes/no"),
        ("c.png", "what color", "it is green so green", "color"),
    ]
    records = tmp_path / "train.jsonl"
    records.write_text(
        "".join(
            json.dumps({"id": str(i), "image": im, "question": q, "answer": a, "category": c}) + "\n"
            for i, (im, q, a, c) in enumerate(rows)
        )
    )
    words = sorted({w for _, q, a, _ in rows for w in (q + " " + a).split()})
    return records, images, word_tokenizer(tmp_path / "tokenizer.json", words)


def test_a_split_is_counted_from_its_records_image_sizes_and_tokenizer(small_split, tmp_path):
    records, images, tokenizer = small_split
    shape = ModelShape(compute_params=1e9, factor=32, tokenizer=tokenizer)
    counts = count_split(records, images, shape, (1024, 16384), {})
    per_image = {
        n: image_tokens(h, w, 32, 1024, 16384) for n, (w, h) in {"a": (64, 64), "b": (128, 64), "c": (96, 96)}.items()
    }
    assert (per_image["a"], per_image["b"], per_image["c"]) == (4, 8, 9)
    assert counts.records == 5 and counts.images == 3
    assert counts.image_tokens == 2 * 4 + 2 * 8 + 9
    assert counts.distinct_image_tokens == 4 + 8 + 9
    assert counts.question_tokens == 2 + 4 + 2 + 3 + 2
    assert counts.answer_lengths == {1: 3, 4: 1, 5: 1}
    assert counts.answer_tokens(cap=2) == 3 + 2 + 2
    # A filter counts the records it selects, and their images only.
    colors = count_split(records, images, shape, (1024, 16384), {"category": "color"})
    assert (colors.records, colors.images, colors.distinct_image_tokens) == (3, 3, 21)
    assert (colors.question_tokens, colors.answer_tokens()) == (6, 1 + 1 + 5)
    # Without a tokenizer on disk: characters over four, said.
    estimated = count_split(records, images, ModelShape(1e9, 32, None), (1024, 16384), {})
    assert estimated.tokens_estimated and estimated.question_tokens == sum(
        math.ceil(len(q) / 4) for q in ("what color", "how many shapes here", "what color", "is it round", "what color")
    )


def test_counts_are_kept_and_read_back_without_the_records(small_split, tmp_path):
    records, images, tokenizer = small_split
    shape = ModelShape(1e9, 32, tokenizer)
    first = CountsMemo(tmp_path / "counts").counts("digest-1", records, images, shape, (1024, 16384), {})
    records.write_text("")  # a new memo finds the stored counts of that content: it reads no record
    again = CountsMemo(tmp_path / "counts").counts("digest-1", records, images, shape, (1024, 16384), {})
    assert again == first and again.records == 5
    # Another content (digest) is counted anew.
    assert CountsMemo(tmp_path / "counts").counts("digest-2", records, images, shape, (1024, 16384), {}).records == 0


def kvasir_like(answer_tokens: int, records=288, images=32) -> SplitCounts:
    """The training benchmark's Kvasir-like workload: 1,303 image tokens an image, 9 questions on
    each, about 15 question tokens (with the template's 20: the 45 text tokens the fit took with
    short answers)."""
    return SplitCounts(
        records=records,
        images=images,
        image_tokens=records * 1303,
        distinct_image_tokens=images * 1303,
        question_tokens=records * 15,
        answer_lengths={answer_tokens: records},
    )


# Every decode rate a table may give zeroed: an evaluation's and a rollout's.
NO_DECODE = {"decode_step_s": 0, "decode_row_s": 0, "rollout_decode_step_s": 0, "rollout_decode_row_s": 0}
# A reward stage's host's costs beyond its tokens' work zeroed.
NO_HOST = {"grpo_step_host_s": 0, "grpo_pass_host_s": 0}

STAGE = dict(
    micro_batch=16, grad_accum=1, max_steps=None, epochs=1, image_groups=False, method="sft", vision_cache=True
) | dict(vision_lora=False, train_merger=False)
# A reward stage whose rollouts keep their prompts' forward (one update a rollout, no LoRA dropout).
GRPO_STAGE = dict(
    STAGE,
    method="grpo",
    num_generations=8,
    max_completion_length=20,
    beta=0.0,
    lora_dropout=0.0,
    num_iterations=1,
    activation_checkpointing=False,
    max_batch_tokens=None,
)


@pytest.mark.parametrize(
    "device, groups, answers, measured",
    [
        ("H200", False, 10, 14.33),
        ("H200", True, 10, 69.65),
        ("H200", False, 210, 11.97),
        ("H200", True, 210, 38.85),
        ("H100", False, 10, 13.32),
        ("H100", True, 10, 67.36),
    ],
)
def test_the_table_gives_back_the_benchmarks_it_was_fitted_on(device, groups, answers, measured):
    """The training rows of vlft/throughputs.csv against the runs they were fitted on (benchmarks/
    README.md, "Image groups"): a two-coefficient least-squares fit through four runs, each run
    within 5% of it (the table's source says so), and the text tokens taken as 45 + the answer's
    length against the benchmark's own (short answers 1-16, long 20-400: means 8.5 and 210); 7%
    holds both."""
    rate = throughputs(device, 7.57e9)
    settings = dict(STAGE, image_groups=groups)
    predicted = train_seconds(settings, kvasir_like(answers), rate)
    samples_per_s = 288 / predicted.work_s
    assert samples_per_s == pytest.approx(measured, rel=0.07)


def test_a_prediction_follows_what_the_stage_computes():
    rate = throughputs("H100", 7.57e9)
    counts = kvasir_like(10)
    plain = train_seconds(STAGE, counts, rate)
    assert train_seconds(dict(STAGE, epochs=2), counts, rate).work_s == pytest.approx(2 * plain.work_s)
    # max_steps decides the samples: 36 steps of 16 are two epochs of 288.
    assert train_seconds(dict(STAGE, max_steps=36), counts, rate).work_s == pytest.approx(2 * plain.work_s)
    # An image group computes each image once: 8 of its 9 questions' image tokens left out.
    grouped = train_seconds(dict(STAGE, image_groups=True), counts, rate)
    saved = (counts.image_tokens - counts.distinct_image_tokens) / rate["train_tokens_per_s"]
    assert plain.work_s - grouped.work_s == pytest.approx(saved)
    # From pixels, the tower runs over each image.
    pixels = train_seconds(dict(STAGE, vision_cache=False), counts, rate)
    assert pixels.work_s - plain.work_s == pytest.approx(
        counts.distinct_image_tokens * rate["vision_s_per_image_token"]
    )
    # A tower that trains runs its backward too: TRAINED_TOWER_WORK times a frozen tower's forward,
    # whichever part trains.
    for trained in (dict(vision_lora=True), dict(train_merger=True)):
        tower = train_seconds(dict(STAGE, vision_cache=False, **trained), counts, rate)
        assert tower.work_s - plain.work_s == pytest.approx(TRAINED_TOWER_WORK * (pixels.work_s - plain.work_s))
    # A twice larger model takes twice the time a token; its fixed cost is the same.
    larger = train_seconds(STAGE, counts, throughputs("H100", 2 * 7.57e9))
    assert larger.work_s == pytest.approx(2 * plain.work_s) and larger.fixed_s == plain.fixed_s
    # A grpo stage: num_iterations steps learn each rollout, drawn once: twice the updates, the same
    # rollouts (with rollouts taking no time, exactly twice the time).
    grpo = dict(GRPO_STAGE, lora_dropout=0.05)  # its rollouts' prompts computed twice (below: once)
    no_rollouts = Throughputs(
        rate.device,
        rate.model,
        rate.values | {"prefill_tokens_per_s": math.inf} | NO_DECODE,
        1.0,
    )
    once, twice = (train_seconds(dict(grpo, num_iterations=n), counts, rate) for n in (1, 2))
    updates_once, updates_twice = (train_seconds(dict(grpo, num_iterations=n), counts, no_rollouts) for n in (1, 2))
    assert once.work_s > updates_once.work_s
    # ... and, with num_iterations above 1, a pass without gradients a rollout for its
    # log-probabilities; with beta above 0, one for the reference's: each a forward over the
    # update's tokens, a third of their forward and backward (with no time a sample besides the
    # tokens, exactly a third of the update).
    tokens_only = Throughputs(rate.device, rate.model, no_rollouts.values | {"train_s_per_sample": 0} | NO_HOST, 1.0)
    update = train_seconds(dict(grpo, num_iterations=1), counts, tokens_only).work_s
    assert train_seconds(dict(grpo, num_iterations=2), counts, tokens_only).work_s == pytest.approx(
        update * (2 + 1 / 3)
    )
    assert train_seconds(dict(grpo, num_iterations=1, beta=0.04), counts, tokens_only).work_s == pytest.approx(
        update * (1 + 1 / 3)
    )
    assert train_seconds(dict(grpo, num_iterations=2, beta=0.04), counts, tokens_only).work_s == pytest.approx(
        update * (2 + 2 / 3)
    )
    assert twice.work_s - once.work_s == pytest.approx(updates_twice.work_s - updates_once.work_s)
    # Beyond the tokens' work, the host's launches: a cost each step (288 questions in steps of 16,
    # num_iterations steps a rollout) and each pass without gradients (one a rollout each).
    host = Throughputs(
        rate.device, rate.model, tokens_only.values | {"grpo_step_host_s": 1, "grpo_pass_host_s": 10}, 1.0
    )
    for iterations, beta, passes_a_rollout in [(1, 0.0, 0), (2, 0.0, 1), (1, 0.04, 1), (2, 0.04, 2)]:
        settings = dict(grpo, num_iterations=iterations, beta=beta)
        added = train_seconds(settings, counts, host).work_s - train_seconds(settings, counts, tokens_only).work_s
        steps = 288 / 16 * iterations
        assert added == pytest.approx(steps * 1 + passes_a_rollout * 288 / 16 * 10)
    # Where the rollout keeps its prompts' forward for the update (vlft.training.shared_prompts), its
    # prefill is the update's forward over them: nothing is added for it. Elsewhere (dropout on the
    # adapter, the stage's own or the one it starts from; activation checkpointing; a step longer than
    # max_batch_tokens) each rollout prefills its prompts once more, at the prefill's rate.
    no_decode = Throughputs(rate.device, rate.model, rate.values | NO_DECODE, 1.0)
    kept = dict(grpo, num_iterations=1, lora_dropout=0.0)
    update = train_seconds(kept, counts, no_rollouts).work_s
    assert train_seconds(kept, counts, no_decode).work_s == update
    assert train_seconds(dict(kept, max_batch_tokens="auto"), counts, no_decode).work_s == update
    prompts = counts.distinct_image_tokens + counts.records * TEMPLATE_TOKENS + counts.question_tokens
    prefill = prompts / rate["prefill_tokens_per_s"]  # each record's prompt once: one epoch
    step_tokens = prompts / counts.records * 16 + 16 * 8 * 20  # 16 questions, 8 answers of at most 20 tokens each
    for twice_settings, dropout in [
        (dict(kept, lora_dropout=0.05), None),
        (kept, 0.05),
        (dict(kept, activation_checkpointing=True), None),
        (dict(kept, max_batch_tokens=int(step_tokens) - 1), None),
    ]:
        assert train_seconds(twice_settings, counts, no_decode, dropout).work_s == pytest.approx(update + prefill)
    assert train_seconds(dict(kept, max_batch_tokens=int(step_tokens) + 1), counts, no_decode).work_s == update
    # Evaluation: answers capped at max_new_tokens, decoded in rows of batch_size.
    long = kvasir_like(300)
    capped = eval_seconds({"max_new_tokens": 100, "batch_size": 128}, long, rate)
    uncapped = eval_seconds({"max_new_tokens": 512, "batch_size": 128}, long, rate)
    per_token = rate["decode_step_s"] / 128 + rate["decode_row_s"]
    assert uncapped.work_s - capped.work_s == pytest.approx(288 * 200 * per_token)


@pytest.mark.parametrize("rows, measured_ms", [(72, 8.26), (144, 10.39), (288, 14.76)])
def test_the_h200s_rollout_rates_give_the_decode_steps_measured(rows, measured_ms):
    """The table's rollout rates against the three Kvasir-like steps they were fitted to (their
    source: grpo_speed --phases, H200), each within 0.1 ms; the evaluation's rates would say
    9.8, 15.5 and 27.0 ms."""
    rate = throughputs("H200", 7.57e9)
    assert (rate["rollout_decode_step_s"] + rows * rate["rollout_decode_row_s"]) * 1e3 == pytest.approx(
        measured_ms, abs=0.1
    )


def test_a_rollouts_decode_steps_are_timed_at_the_rollouts_rates_where_the_table_has_them():
    """A reward stage's decode steps: each rollout's longest answer's steps over all its rows (8
    answers to each of a step's 16 questions), at the rollout's rates on the H200 and, where a table
    has none (the H100's), at its evaluation's."""
    counts = kvasir_like(10)
    grpo = GRPO_STAGE
    rows, rollouts = 8 * 16, counts.records / 16
    steps = counts.longest_answer(20) * rollouts
    for device, kind in (("H200", "rollout_"), ("H100", "")):
        rate = throughputs(device, 7.57e9)
        assert ("rollout_decode_step_s" in rate.values) == (kind == "rollout_")
        zeroed = {f"{kind}decode_step_s": 0, f"{kind}decode_row_s": 0}
        without = Throughputs(rate.device, rate.model, rate.values | zeroed, 1.0)
        decode_s = train_seconds(grpo, counts, rate).work_s - train_seconds(grpo, counts, without).work_s
        assert decode_s == pytest.approx(steps * (rate[f"{kind}decode_step_s"] + rows * rate[f"{kind}decode_row_s"]))
    # The evaluation's rates are left to evaluations.
    rate = throughputs("H200", 7.57e9)
    rollout_rates_gone = {"rollout_decode_step_s": 0, "rollout_decode_row_s": 0}
    evaluation_rates_gone = {"decode_step_s": 0, "decode_row_s": 0}
    for gone in (rollout_rates_gone, evaluation_rates_gone):
        changed = Throughputs(rate.device, rate.model, rate.values | gone, 1.0)
        assert (train_seconds(grpo, counts, changed).work_s < train_seconds(grpo, counts, rate).work_s) == (
            gone is rollout_rates_gone
        )


def screenshots(count: int) -> SplitCounts:
    """benchmarks/grpo_speed.py's screenshots (benchmarks/train_speed.py's SIZES under its MIN_PIXELS
    and MAX_PIXELS), one question each, taken in turn."""
    import train_speed  # benchmarks/ is on the tests' path (pyproject.toml)

    sizes = train_speed.SIZES
    tokens = [image_tokens(h, w, 32, train_speed.MIN_PIXELS, train_speed.MAX_PIXELS) for w, h in sizes]
    taken = sum(tokens[i % len(sizes)] for i in range(count))
    return SplitCounts(
        records=count,
        images=count,
        image_tokens=taken,
        distinct_image_tokens=taken,
        question_tokens=count * 15,
        answer_lengths={20: count},
    )


@pytest.mark.parametrize(
    "workload, questions, beta, measured",
    [
        ("kvasir", 9, 0.0, 0.585),
        ("kvasir", 18, 0.0, 0.860),
        ("kvasir", 36, 0.0, 1.251),
        ("kvasir", 18, 0.04, 1.056),
        ("screenshots", 8, 0.0, 0.815),
        ("screenshots", 8, 0.04, 1.115),
    ],
)
def test_a_reward_stages_predicted_step_is_the_step_measured_on_the_h200(workload, questions, beta, measured):
    """GRPO steps of the 8B as benchmarks/grpo_speed.py measured them on an H200 (the steady runs the
    table's grpo_step_host_s names; every answer at its 20 tokens): the prediction of one step from
    the table's rates. The host's two costs were fitted to these six steps, each within 6%."""
    counts = (
        kvasir_like(20, records=questions, images=questions // 9) if workload == "kvasir" else screenshots(questions)
    )
    settings = dict(GRPO_STAGE, micro_batch=questions, image_groups=workload == "kvasir", beta=beta)
    assert train_seconds(settings, counts, throughputs("H200", 7.57e9)).work_s == pytest.approx(measured, rel=0.06)


def test_the_plans_wall_time_waits_for_what_a_job_needs_and_for_free_gpus():
    durations = {"a": 10.0, "b": 20.0, "c": 15.0}
    needs = {"b": ["a", "outside the plan"]}
    gpus = {"a": 1, "b": 1, "c": 1}
    assert wall_seconds(durations, needs, gpus, math.inf) == 30
    assert wall_seconds(durations, needs, gpus, 2) == 30
    assert wall_seconds(durations, needs, gpus, 1) == 45
    # A job asking for more GPUs than there are runs alone on all of them.
    assert wall_seconds({"a": 5.0, "d": 7.0}, {}, {"a": 1, "d": 4}, 2) == 12


def test_time_limits_and_attempts_follow_the_prediction():
    assert runtime_minutes(600, 1.5, 15) == 15  # 15 min predicted with the margin: the floor
    assert runtime_minutes(3600, 1.5, 15) == 90
    assert attempts_needed(3600 * 9, 1.5, 480) == 2  # 13.5 h with the margin, 8 h a job
    assert attempts_needed(60, 1.5, 480) == 1


def test_the_study_own_jobs_refine_the_rest():
    """A finished job's whole time against its whole prediction: on a small study a job is mostly its
    fixed cost (15 of a training job's 19 s on the 8B), and a host's differs from the table's."""
    refinement = Refinement()
    assert refinement.ratio("train") == 1.0
    for fixed, work, measured in ((15, 5, 24), (15, 45, 78), (15, 35, 55)):
        refinement.add("train", Prediction(fixed, work, ""), measured)
    assert refinement.ratio("train") == pytest.approx(1.2) and refinement.jobs("train") == 3
    refined = Prediction(10.0, 100.0, "", compiles=("d", "val", 1, 2)).refined(1.2)
    assert refined.seconds == pytest.approx(132.0) and refined.compiles == ("d", "val", 1, 2)


def test_a_finished_jobs_whole_time_is_read_from_its_logs_last_line(tmp_path):
    """The refinement compares a job's time launch to exit, as predicted, which only its log holds."""
    from vlft.jobs.cli import took_line, took_seconds

    log = tmp_path / "job.log"
    log.write_text("train.py: host h; started ...\n" + "x" * 1000 + "\n{}\n" + took_line(25, 21.4) + "\n")
    assert took_seconds(log) == 21
    log.write_text("train.py: host h; started ...\nerror: stopped\n")
    assert took_seconds(log) is None and took_seconds(tmp_path / "missing.log") is None


def test_a_dry_run_prints_each_jobs_predicted_time_the_total_and_what_a_partition_splits(
    demo_workdir, tmp_path, monkeypatch
):
    """The README's dry run on the finished demo with every stage and evaluation forced: a line a
    job with its predicted time, refined by the jobs that ran; the plan's total at the GPUs given; a
    stage longer than max_runtime named with its attempts; each train job's runtime its prediction."""
    # Each training and evaluation log ends with what the job took, its launch to its exit: at least
    # the time its own summary measured from its start to its outputs.
    for log, summary in (
        ("train/exp1/main.log", "train/exp1/main/summary.json"),
        ("evaluate/exp1/main/val.log", "eval/exp1/main/val/metrics.json"),
    ):
        last = (demo_workdir / "results/logs" / log).read_text().strip().splitlines()[-1]
        took = re.fullmatch(
            r"took (\d+) s(, predicted \d+ s \(\d+\.\d\d of the prediction\)| \(not predicted: .*\))", last
        )
        assert took, (log, last)
        inner = json.loads((demo_workdir / "results" / summary).read_text())["wall_time_s"]
        assert int(took.group(1)) >= round(inner), (log, last, inner)
    workdir = tmp_path / "demo"
    shutil.copytree(demo_workdir, workdir, symlinks=True)
    forced = ("-n", "--forcerun", "train", "evaluate", "--resources", "gpu=2")
    # On the CPU the demo ran on: its own jobs refine the predictions.
    run = snakemake(workdir, *forced)
    out = run.stdout + run.stderr
    assert re.search(r"train: refined by \d+ of this study's finished jobs", out), out[-3000:]
    # On an H100 with an 8-hour... here a one-minute partition, the runtimes left to the prediction.
    config_file = workdir / "config/config.yaml"
    config = yaml.safe_load(config_file.read_text())
    del config["defaults"]["resources"]["runtime"], config["evaluation"]["resources"]["runtime"]
    config |= {"max_runtime": 1, "planning": {"device": "H100", "margin": 4}}
    config_file.write_text(yaml.safe_dump(config))
    run = snakemake(workdir, *forced)
    out = run.stdout + run.stderr
    assert (
        "Predicted time of the jobs that would run, on H100 (planning.device; throughputs measured on qwen3-vl-8b)"
        in out
    )
    table = out[out.index("Predicted time of the jobs") :]
    for job in ("train exp1/main", "train click_grpo/grpo", "evaluate exp1/main on val", "evaluate base/base on test"):
        assert re.search(rf"^  {re.escape(job)} +\d+(\.\d)? (s|min|h)  ", table, re.M), (job, table)
    assert re.search(r"total: \d+\.\d\d GPU-hours; wall time .* at gpu=2", table), table
    # Each split at each pixel range its evaluations use compiles the decode step once: 9 s on an H100.
    from vlft.config import resolve_config
    from vlft.plan import build_plan

    monkeypatch.chdir(workdir)  # the config's paths are the workflow's
    plan = build_plan(resolve_config(config))
    shapes = set()
    for experiment, stage, split in plan.evaluations():
        settings = plan.eval_settings(experiment, stage, config["evaluation"])
        shapes.add((settings["dataset"], split, settings["min_pixels"], settings["max_pixels"]))
    assert f"its decode step's compile: {len(shapes)} x 9 s" in table and len(shapes) > 1, table
    # A training job's 15 s of fixed cost alone, times the margin of 4, is more than max_runtime's minute.
    line = r"train exp1/main needs more than the 1 min a job may run: it runs as [2-9] attempts, .*: raise it"
    assert re.search(line, table), table
    # Without a ceiling, each job asks for its prediction times the margin, in whole minutes, at
    # least the floor (the job's `predicted_s` is the prediction rounded to a second).
    config |= {"max_runtime": None, "planning": {"device": "H100", "margin": 4, "floor_minutes": 1}}
    config_file.write_text(yaml.safe_dump(config))
    out = snakemake(workdir, *forced).stdout
    asked = re.findall(r"resources: .*?runtime=(\d+),.*?predicted_s=(\d+)", out)
    assert len(asked) == out.count("rule train:") + out.count("rule evaluate:"), out[:3000]
    for runtime, predicted in asked:
        bounds = {max(1, math.ceil((int(predicted) + d) * 4 / 60)) for d in (-0.5, 0.5)}
        assert int(runtime) in bounds, (runtime, predicted)
    assert {int(r) for r, _ in asked} != {1}  # some job's prediction is past the floor


@pytest.mark.parametrize("device,nearest", [("A100", "H100"), ("L40S", "H100"), ("B200", "H200"), ("MI300X", "H200")])
def test_a_gpu_without_measurements_is_timed_from_the_nearest_measured_one_by_its_published_figures(device, nearest):
    """A GPU vlft/devices.csv knows but the table has no row of: the nearest measured GPU's
    coefficients, per-token work scaled by the two devices' bf16 throughputs, decode steps by their
    memory bandwidths, a job's own fixed costs as measured; and the plan says so."""
    from vlft.devices import device_specs

    rate, measured = throughputs(device, 7.57e9), throughputs(nearest, 7.57e9)
    specs = device_specs()
    compute = float(specs[device]["bf16_tflops"]) / float(specs[nearest]["bf16_tflops"])
    bandwidth = float(specs[device]["memory_tb_s"]) / float(specs[nearest]["memory_tb_s"])
    assert rate.derived.startswith(f"no measurements on {device}: {nearest}'s, scaled by published bf16 throughput")
    assert rate["train_tokens_per_s"] == pytest.approx(measured["train_tokens_per_s"] * compute)
    assert rate["vision_s_per_image_token"] == pytest.approx(measured["vision_s_per_image_token"] / compute)
    assert rate["decode_step_s"] == pytest.approx(measured["decode_step_s"] / bandwidth)
    assert rate["train_fixed_s"] == measured["train_fixed_s"] and rate["eval_once_s"] == measured["eval_once_s"]
    assert throughputs("TPU", 7.57e9) is None


def test_several_processes_share_a_stages_work_and_a_sharded_base_pays_its_all_gathers():
    """Replicated, each of N processes takes 1/N of the work. Sharded, each micro-batch also
    all-gathers the decoder layers twice (forward, backward), (N-1)/N of them from the others, at
    the link's bandwidth (vlft/devices.csv; across nodes an InfiniBand adapter's), overlapped with
    the computation: the slower of the two sets the time."""
    from vlft.parallelism import INTER_NODE_GB_S, Layout

    rate = throughputs("H100", 7.57e9)
    counts = kvasir_like(10)
    stage = dict(STAGE, max_batch_tokens=None)  # 18 steps of 16 samples, micro-batches of 16
    one = train_seconds(stage, counts, rate)
    replicated = train_seconds(stage, counts, rate, layout=Layout(processes=4))
    assert replicated.work_s == pytest.approx(one.work_s / 4) and "not yet measured on GPUs" in replicated.what
    # A 32B's decoder layers: 62 GB of bf16 weights; 4 processes a step of 16 take one micro-batch each.
    layers = 62e9
    sharded = train_seconds(stage, counts, rate, layout=Layout(4, 1, True, layers, 450))
    gathered = 2 * 1 * 18 * layers * 3 / 4
    assert sharded.work_s == pytest.approx(max(one.work_s / 4, gathered / 450e9))
    assert f"{gathered / 1e9:,.0f} GB all-gathered at 450 GB/s a GPU" in sharded.what
    across = train_seconds(stage, counts, rate, layout=Layout(8, 2, True, layers, 450))
    gathered = 2 * 1 * 18 * layers * 7 / 8  # micro_batch 16 over 8 processes: still one each
    assert across.work_s == pytest.approx(max(one.work_s / 8, gathered / (INTER_NODE_GB_S * 1e9)))
    assert "8 processes on 2 nodes" in across.what
    # Under a token budget, each process's micro-batches a step follow its share of the step's tokens.
    budgeted = dict(stage, max_batch_tokens=4096)
    step_tokens = counts.image_tokens + counts.records * TEMPLATE_TOKENS + counts.question_tokens
    step_tokens = (step_tokens + counts.answer_tokens()) / 18
    rows = math.ceil(step_tokens / 2 / 4096)
    two = train_seconds(budgeted, counts, rate, layout=Layout(2, 1, True, layers, 450))
    alone = train_seconds(budgeted, counts, rate)
    assert two.work_s == pytest.approx(max(alone.work_s / 2, 2 * rows * 18 * layers / 2 / 450e9))


@pytest.mark.parametrize(
    "weights_gb, gpu_gb, processes, setting, method, expected",
    [
        (67, 141, 2, "auto", "sft", "replicate"),  # a 32B on H200s: under half of one
        (67, 80, 2, "auto", "sft", "shard"),  # on H100s: over half
        (17, 24, 4, "auto", "sft", "shard"),  # an 8B on 24 GB cards
        (17, 80, 4, "auto", "sft", "replicate"),
        (67, 80, 1, "auto", "sft", "replicate"),  # one process has nothing to shard with
        (67, 80, 2, "auto", "grpo", "replicate"),  # a path sharding does not support: auto replicates
        (67, None, 2, "auto", "sft", "replicate"),  # no GPU (CPU processes)
        (1, 141, 2, "shard", "sft", "shard"),  # asked for
        (67, 80, 2, "replicate", "sft", "replicate"),
    ],
)
def test_auto_shards_where_the_weights_would_take_over_half_a_gpu(
    weights_gb, gpu_gb, processes, setting, method, expected
):
    from vlft.config import stage_defaults
    from vlft.parallelism import chosen

    settings = stage_defaults() | {"method": method}
    gpu = gpu_gb and gpu_gb * 1e9
    assert chosen(setting, settings, processes, weights_gb * 1e9, gpu) == expected

"""Reward stages (`method: grpo`) on the CPU with a tiny real Qwen3-VL: a stage samples answers with
the adapter as it stands, scores them and learns them; each step's loss and LoRA gradients equal
TRL's GRPO loss computed over the same answers as separate sequences; a stage stopped and resumed
draws and trains what an uninterrupted one does."""

from __future__ import annotations

import gc
from dataclasses import replace
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from vlft.data import clicks
from vlft.data.prompts import PromptBuilder
from vlft.data.stage_data import load_stage_data
from vlft.demo.screens import make_dataset
from vlft.errors import ConfigError
from vlft.files import read_jsonl
from vlft.job_settings import StageSettings
from vlft.modeling import load_base_model, load_tokenizer, with_new_adapter
from vlft.training import token_budget
from vlft.forward.batching import to_device
import vlft.training.answering as answering_module
import vlft.training.grpo as grpo_module
import vlft.training.rollouts as rollouts_module
from vlft.generation import folded_adapter
from vlft.generation.engine import Engine
from vlft.training.grpo import GroupRelativePolicyOptimization
from vlft.training.objectives import group_advantages
from vlft.training.rollout import answer_seed, keys_of
from vlft.forward.loss import answer_token_logps
from vlft.forward.packing import pack, pack_groups, use_packed_attention
from vlft.modeling import rope_index
from vlft.data.rewards import Rewards
from vlft.training.runs import StageInputs
from vlft.training.train import Preempted, _out_of_memory_said
from tests.helpers import (
    FLOAT64_RTOL,
    REPO,
    image_groups_rtol,
    StopAfter,
    plan_of_stages,
    tiny_family_data,
    tiny_stage_settings,
    train_float64,
)
from vlft.demo.shapes import questions_on_shared_images
from tests.forward.test_fast_path import LORA
from tests.training.test_preferences import SHARED_BY_EIGHT_RTOL
from vlft.training.census import part_of

CPU, FLOAT64 = torch.device("cpu"), torch.float64
GRPO = dict(
    method="grpo",
    answer_format="click",
    num_generations=4,
    max_completion_length=12,
    # A random tiny model's answers rarely give a point: the length reward tells them apart, so
    # that a step has a signal to learn; the click rewards are logged as a click stage's are.
    rewards={"click_in_box": 1.0, "format": 0.1, "tests.training.test_grpo:answer_length_reward": 1.0},
    micro_batch=2,
    max_steps=3,
    learning_rate=5e-3,
    lora_dropout=0.0,
    temperature=1.0,
    beta=0.0,
    loss_type="dapo",
)


def answer_length_reward(records, answers):
    """A reward of one's own (`module:function`): one that tells a random tiny model's answers apart."""
    assert len(records) == len(answers) and all("question" in r for r in records)
    return [float(len(answer) % 5) for answer in answers]


@pytest.fixture(scope="module")
def screens(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    make_dataset({"train": root / "raw.jsonl"}, root / "images", {"train": 6}, seed=2)
    return tiny_family_data(root, "qwen3_vl", root / "raw.jsonl")


def same_adapter(a, b) -> bool:
    """Whether two runs' adapters are bit for bit the same."""
    a, b = (load_file(run / "adapter/adapter_model.safetensors") for run in (a, b))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def train(root, out, stop=None, **overrides):
    inputs = StageInputs(str(root / "model"), [str(root / "prepared.jsonl")], [str(root / "pixels")], None)
    train_float64(inputs, tiny_stage_settings(**(GRPO | overrides)), out, stop)
    return read_jsonl(out / "log.jsonl")


def test_a_grpo_stage_samples_scores_and_learns_its_answers_and_logs_what_researchers_watch(screens, tmp_path):
    log = train(screens, tmp_path / "run")
    assert [row["step"] for row in log] == [1, 2, 3]
    for row in log:
        for name in ("reward", "reward_std", "advantage_std", "completions/mean_length", "kl"):
            assert name in row and row[name] == row[name]  # present, not NaN
        assert 0 <= row["rewards/click_in_box/mean"] <= 1 and 0 <= row["rewards/format/mean"] <= 1
        assert 1 <= row["completions/mean_length"] <= GRPO["max_completion_length"]
        assert row["samples"] == GRPO["micro_batch"] * GRPO["num_generations"]
        assert row["kl"] == 0.0  # beta 0: no KL computed
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert "reward_start" in summary and "reward_end" in summary
    # The adapter moved.
    adapter = load_file(tmp_path / "run/adapter/adapter_model.safetensors")
    assert any(float(t.abs().max()) > 0 for k, t in adapter.items() if "lora_B" in k)


def test_a_resumed_grpo_stage_draws_and_trains_what_an_uninterrupted_one_does(screens, tmp_path):
    """Stopped after step 2 and run again, or run on the same data moved elsewhere: the same draws,
    losses and adapter as one uninterrupted run."""
    whole = train(screens, tmp_path / "whole", beta=0.04)
    moved = train(shutil.copytree(screens, tmp_path / "moved"), tmp_path / "moved-run", beta=0.04)
    assert [r["reward"] for r in moved] == [r["reward"] for r in whole]
    with pytest.raises(Preempted, match="after step 2"):
        train(screens, tmp_path / "cut", stop=StopAfter(2), beta=0.04)
    resumed = train(screens, tmp_path / "cut", beta=0.04)
    assert [r["reward"] for r in resumed] == [r["reward"] for r in whole]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
    assert whole[-1]["kl"] > 0  # beta above 0: the KL to the starting weights, after it has moved
    assert same_adapter(tmp_path / "whole", tmp_path / "cut")


def train_in_a_process_of_its_own(root, out, stop_after: int | None = None, dtype: str = "float32") -> str:
    """A stage trained as a job trains it: in a new process (stopped after step `stop_after`, as by
    SIGTERM), in `dtype`."""
    code = (
        "import torch\n"
        "from pathlib import Path\n"
        "from tests.helpers import StopAfter, tiny_stage_settings\n"
        "from tests.training.test_grpo import GRPO\n"
        "from vlft.training.runs import StageInputs\n"
        "from vlft.training.train import Preempted, train_stage\n"
        f"root, out, stop = Path({str(root)!r}), Path({str(out)!r}), {stop_after!r}\n"
        "inputs = StageInputs(str(root / 'model'), [str(root / 'prepared.jsonl')], [str(root / 'pixels')], None)\n"
        "settings = tiny_stage_settings(**(GRPO | {'beta': 0.04, 'max_steps': 4}))\n"
        "try:\n"
        "    train_stage(inputs, settings, out / 'adapter', out / 'log.jsonl', out / 'summary.json', out / 'ckpt', 1000,\n"
        f"                stop=StopAfter(stop) if stop else None, dtype=torch.{dtype})\n"
        "except Preempted:\n"
        "    pass\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True, timeout=600
    ).stdout


def test_a_grpo_stage_resumed_in_a_new_process_trains_to_an_uninterrupted_ones_adapter_bit_for_bit(screens, tmp_path):
    """As a job stopped by SIGTERM, SIGINT or SIGKILL and run again resumes it: in a process of its
    own, in float32, where a different order of adding up a gradient's parts shows in the last bits.
    The prompts' forward is numbered above the answers' however young the process
    (vlft.training.shared_prompts._numbered_apart): a stage resumed after step 2 had an adapter
    up to a few float32 roundings off an uninterrupted one's."""
    train_in_a_process_of_its_own(screens, tmp_path / "whole")
    train_in_a_process_of_its_own(screens, tmp_path / "cut", stop_after=2)
    assert "resuming from step 2 " in train_in_a_process_of_its_own(screens, tmp_path / "cut")
    whole, resumed = (read_jsonl(tmp_path / run / "log.jsonl") for run in ("whole", "cut"))
    assert [(r["loss"], r["kl"], r["grad_norm"]) for r in resumed] == [
        (r["loss"], r["kl"], r["grad_norm"]) for r in whole
    ]
    assert whole[-1]["grad_norm"] > 0 and whole[-1]["prompts_once"] == 1.0  # it learned, each prompt once a step
    a, b = (load_file(tmp_path / run / "adapter/adapter_model.safetensors") for run in ("whole", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_stage_learning_each_rollout_twice_resumed_within_a_rollout_trains_what_an_uninterrupted_one_does(
    screens, tmp_path
):
    """`num_iterations: 2`: steps 1-2 learn one rollout, 3-4 the next (their rewards are the
    rollout's); stopped after step 1, within a rollout, the rerun draws that rollout again with the
    weights it was drawn with and ends with the uninterrupted run's adapter, bit for bit. Its first
    update is the one `num_iterations: 1` takes (the rollout's log-probabilities, from their own
    pass, equal the update's)."""
    lengths = {"tests.training.test_grpo:answer_length_reward": 1.0}  # rewards that differ within a group: a signal
    twice = dict(num_iterations=2, max_steps=4, beta=0.04, rewards=lengths, warmup_ratio=0.0)
    whole = train(screens, tmp_path / "whole", **twice)
    assert [r["step"] for r in whole] == [1, 2, 3, 4]
    assert whole[0]["reward"] == whole[1]["reward"] and whole[2]["reward"] == whole[3]["reward"]
    assert whole[1]["loss"] != whole[0]["loss"]  # the same answers, learned by moved weights
    once = train(screens, tmp_path / "once", **(twice | {"num_iterations": 1, "max_steps": 1}))
    assert once[0]["reward"] == whole[0]["reward"]  # rollout 0 is step 0's draws
    assert once[0]["loss"] == pytest.approx(whole[0]["loss"], rel=FLOAT64_RTOL, abs=1e-15)
    with pytest.raises(Preempted, match="after step 1"):
        train(screens, tmp_path / "cut", stop=StopAfter(1), **twice)
    resumed = train(screens, tmp_path / "cut", **twice)
    assert [(r["reward"], r["loss"]) for r in resumed] == [(r["reward"], r["loss"]) for r in whole]
    assert same_adapter(tmp_path / "whole", tmp_path / "cut")


def test_rollouts_through_one_kept_engine_with_each_prompt_once_draw_and_train_what_fresh_engines_do(
    screens, tmp_path, monkeypatch
):
    """A stage's rollouts share one engine (its cache and, on a GPU, its decode step's graph), and on
    a GPU each question's prompt is kept once for its answers: the same draws, losses and adapter
    as a fresh engine a rollout holding each answer's own copy of its prompt, bit for bit (float64)."""
    made = []
    monkeypatch.setattr(rollouts_module, "Engine", lambda *args: made.append(Engine(*args)) or made[-1])
    kept = train(screens, tmp_path / "kept")
    assert len(made) == 1 and made[0].cascade is None  # one engine for the 3 rollouts
    monkeypatch.setattr(rollouts_module, "SHARED_PROMPT_DEVICES", ("cuda", "cpu"))
    shared = train(screens, tmp_path / "shared")
    assert len(made) == 2 and made[1].cascade.seats == GRPO["num_generations"]
    monkeypatch.setattr(Engine, "fits", lambda self, *args: False)
    fresh = train(screens, tmp_path / "fresh")
    assert len(made) == 2 + len(fresh)  # an engine a rollout
    assert fresh[0]["reward"] != fresh[-1]["reward"] or fresh[0]["loss"] != fresh[-1]["loss"]
    for run in (kept, shared):
        assert [(r["reward"], r["loss"]) for r in run] == [(r["reward"], r["loss"]) for r in fresh]
    adapters = [
        load_file(tmp_path / name / "adapter/adapter_model.safetensors") for name in ("kept", "shared", "fresh")
    ]
    assert all(torch.equal(a[k], adapters[2][k]) for a in adapters[:2] for k in adapters[2])


def test_a_stage_whose_decode_steps_read_its_folded_adapter_draws_and_trains_what_the_adapter_does(
    screens, tmp_path, monkeypatch, capsys
):
    """A GPU's rollouts decode on the adapter folded into a copy of the weights
    (vlft.generation.folded_adapter), written anew at each rollout from the adapter the steps before
    updated. Folding on the CPU too, in float64, a stage draws the same answers as one decoding on
    the adapter itself, and since only the draws come of the decode steps, logs the same losses and
    trains to the same adapter, bit for bit."""
    from vlft.generation import folded_adapter

    adapter_run = train(screens, tmp_path / "adapter")
    assert "grpo: the rollout's decode steps read the adapter as it is, on a CPU" in capsys.readouterr().out
    monkeypatch.setattr(folded_adapter, "FOLD_DEVICES", ("cuda", "cpu"))
    folded_run = train(screens, tmp_path / "folded")
    assert "grpo: the rollout's decode steps read the adapter folded into a copy of its weights (" in (
        capsys.readouterr().out
    )
    watched = ("reward", "loss", "completions/mean_length", "rewards/format/mean")
    assert [[r[k] for k in watched] for r in folded_run] == [[r[k] for k in watched] for r in adapter_run]
    assert adapter_run[0]["loss"] != adapter_run[-1]["loss"]  # the adapter the rollouts folded moved
    a, b = (load_file(tmp_path / run / "adapter/adapter_model.safetensors") for run in ("adapter", "folded"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_stage_computing_each_prompt_once_a_step_draws_what_two_passes_draw_and_trains_to_their_adapter(
    screens, shared_images, tmp_path, monkeypatch, capsys
):
    """The rollout's prefill, run with gradients, serves the update too (vlft.training.shared_prompts):
    the same draws (bit for bit: float64, the same prefill) and, step after step, the losses of a
    stage that computes each prompt again in its update, within float64's reassociation bound (each
    step's loss is computed by the adapter the steps before trained); with image groups (two
    questions on each image) too. A step whose prompts exceed the token budget computes them twice,
    as before. Each step's gradients are the next test's."""

    grouped = dict(
        answer_format="final", rewards={"tests.training.test_grpo:answer_length_reward": 1.0}, image_groups=True
    )
    runs = {}
    for name, root, settings in [
        ("alone", screens, {}),
        ("grouped", shared_images, grouped),
        ("over budget", screens, {"max_batch_tokens": 64}),
    ]:
        once = train(root, tmp_path / name / "once", **settings)
        out = capsys.readouterr().out
        assert "grpo: each prompt computed once a step" in out
        # Each step's log says whether its prompts were computed once; a step over the budget is
        # told of once, with the budget that would hold it, and the summary counts such steps.
        over = name == "over budget"
        assert [r["prompts_once"] for r in once] == [0.0 if over else 1.0] * len(once)
        told = re.findall(r"grpo: step 1's prompts .* take (\d+) tokens, more than max_batch_tokens 64", out)
        assert len(told) == (1 if over else 0) and out.count("such steps compute each prompt twice") == len(told)
        if over:
            assert f"(max_batch_tokens: {told[0]} or more computes them once)" in out and int(told[0]) > 64
        summary = json.loads((tmp_path / name / "once/summary.json").read_text())
        assert summary["steps_prompts_twice"] == (len(once) if over else 0)
        with monkeypatch.context() as patched:
            patched.setattr(grpo_module, "prompts_once_unless", lambda *args: "as before")
            twice = train(root, tmp_path / name / "twice", **settings)
        assert "computed twice a step (as before)" in capsys.readouterr().out
        assert all("prompts_once" not in r for r in twice)  # the stage never could
        runs[name] = once, twice
        assert [r["reward"] for r in once] == [r["reward"] for r in twice]
        assert [r["completions/mean_length"] for r in once] == [r["completions/mean_length"] for r in twice]
        losses = torch.tensor([[r["loss"] for r in run] for run in (once, twice)])
        assert torch.allclose(losses[0], losses[1], rtol=SHARED_BY_EIGHT_RTOL, atol=1e-15)
    # Over the budget the stage computed its prompts twice, whichever it was set to do: bit for bit.
    once, twice = runs["over budget"]
    assert [r["loss"] for r in once] == [r["loss"] for r in twice]
    a, b = (
        load_file(tmp_path / "over budget" / run / "adapter/adapter_model.safetensors") for run in ("once", "twice")
    )
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_stage_says_why_it_computes_its_prompts_twice_where_once_would_not_be_the_same(screens):
    """One update a rollout, no LoRA dropout, no activation checkpointing: once a step (with any
    number of processes: each learns the share it drew, tests/training/test_distributed.py). Each other case
    names what would make the rollout's prefill and the update's forward differ."""
    from vlft.modeling import use_activation_checkpointing
    from vlft.training.shared_prompts import prompts_once_unless

    def model(lora_dropout: float):
        return with_new_adapter(load_base_model(screens / "model", CPU, FLOAT64), LORA | {"lora_dropout": lora_dropout})

    settings = StageSettings.resolve(tiny_stage_settings(**GRPO))
    assert "LoRA dropout 0.05" in prompts_once_unless(model(0.05), settings)
    model = model(0.0)
    assert prompts_once_unless(model, settings) is None
    twice = StageSettings.resolve(tiny_stage_settings(**(GRPO | {"num_iterations": 2})))
    assert "num_iterations 2" in prompts_once_unless(model, twice)
    use_activation_checkpointing(model)
    assert "activation checkpointing" in prompts_once_unless(model, settings)


def test_answer_seeds_depend_on_stage_step_record_and_answer_alone():
    seeds = {answer_seed(s, step, key, n) for s in (0, 1) for step in (0, 1) for key in ("a", "b") for n in (0, 1)}
    assert len(seeds) == 16 and all(0 <= seed < 2**63 for seed in seeds)
    assert answer_seed(0, 3, "train#7", 2) == answer_seed(0, 3, "train#7", 2)


@pytest.fixture(scope="module")
def shared_images(tmp_path_factory):
    """Two images with two questions each (answers in words)."""
    root = tmp_path_factory.mktemp("grpo-shared")
    return tiny_family_data(root, "qwen3_vl", questions_on_shared_images(root, images=2, per_image=2))


def test_a_rollouts_questions_on_one_image_read_it_and_put_it_on_the_device_once(shared_images):
    """Two questions on each of two images: each image is read once for its questions, on the host
    (where a GPU's pinned copy is new memory, 25-30 ms a screenshot that holds up the device's
    thread) and on the device, whether the reader read it a step ahead or the rollout reads it."""
    on = MethodOn(shared_images, "final", loss_type="dapo")
    keys = [r["key"] for r in on.data.records[:4]]
    read = on.method.rollouts._read_prompts(keys)
    host = [read[key]["images"][0][1] for key in keys]
    assert host[0] is host[1] and host[2] is host[3] and host[0] is not host[2]
    assert not torch.equal(host[0], host[2])
    images = []
    engine = on.method.rollouts._engine([(key, n) for key in keys for n in range(on.method.generations)])
    answer = engine.answer

    def answer_noted(requests, *args, **kwargs):
        requests = list(requests)
        images.append([request.inputs["pixel_values"] for request in requests])
        return answer(iter(requests), *args, **kwargs)

    engine.answer = answer_noted
    for read_ahead in ({tuple(keys): on.method.rollouts.reader.submit(lambda: read)}, {}):
        on.method.rollouts.read_ahead = read_ahead
        on.method.rollouts._sample(keys, 0)
    for pixels in images:  # a question's 4 answers, then the next question's
        first, second = pixels[0], pixels[8]
        assert all(p is first for p in pixels[:8]) and all(p is second for p in pixels[8:])
        assert first is not second
    assert torch.equal(images[0][0], images[1][0]) and torch.equal(images[0][8], images[1][8])


@pytest.mark.parametrize("kept", [False, True], ids=["update's own forward", "prompts kept from the rollout"])
@pytest.mark.parametrize(
    "loss_type, layout",
    [
        ("grpo", "a question an image"),
        ("dapo", "a question an image"),
        ("dr_grpo", "a question an image"),
        ("dapo", "two questions an image, image groups"),
    ],
)
def test_a_grpo_step_with_each_questions_prompt_once_equals_trls_loss_over_separate_sequences(
    screens, shared_images, loss_type, layout, kept
):
    """Family (b) and (a): the loss and LoRA gradients of a step whose answers share their
    question's prompt in one packed row (with image groups, the answers to all questions on one
    image sharing the image) equal TRL's GRPO loss (its formulas, as tests/data/test_rewards.py checks
    them against TRL's own code) over each answer computed as a sequence of its own. `kept`: the
    prompts computed once a step, by the rollout's prefill with gradients, the update computing
    the answers' tokens alone (vlft.training.shared_prompts)."""
    grouped = layout.endswith("image groups")
    root, answer_format = (shared_images, "final") if grouped else (screens, "click")
    on = MethodOn(root, answer_format, loss_type=loss_type, prompts_once=kept)
    keys = [r["key"] for r in on.data.records[: 4 if grouped else 2]]
    step = [keys[:2], keys[2:]] if grouped else [[k] for k in keys]
    groups = on.method.step_groups(step, 0, keep_prompts=kept)
    # Each group's answers share their prompt (with image groups: the header and the image).
    assert [len(g.samples) for g in groups] == [8, 8] if grouped else [4, 4]
    assert all(g.shared > 0 for g in groups)
    # TRL's _compute_loss with old = current (num_iterations 1) and beta 0.
    advantages = on.step_equals_trls(groups, loss_type, old=None, kept=kept)
    assert (on.method.rollouts.prompt_pass is not None) == kept
    # Each question's advantages are its answers' rewards against their group's mean: they sum to 0.
    assert torch.allclose(advantages.view(-1, 4).sum(1), torch.zeros(len(keys), dtype=FLOAT64), atol=1e-9)


@pytest.mark.parametrize("kept", [False, True], ids=["update's own forward", "prompts kept from the rollout"])
def test_a_grpo_step_training_the_tower_equals_trls_loss_over_separate_sequences(shared_images, kept):
    """vision_lora and train_merger: the tower's LoRA and the mergers learn from a step whose
    answers share their image (image groups), the prompts computed by the update or kept from the
    rollout's prefill, as TRL's loss over each answer alone would teach them. Tolerance: an
    image's prefix serves 8 answers, its gradient crossing the tower's float32 rotary embedding
    (tests.helpers.image_groups_rtol)."""
    on = MethodOn(shared_images, "final", loss_type="dapo", prompts_once=kept, tower=True)
    keys = [r["key"] for r in on.data.records[:4]]
    groups = on.method.step_groups([keys[:2], keys[2:]], 0, keep_prompts=kept)
    assert {part_of(n) for n, p in on.model.named_parameters() if p.requires_grad} == {
        "LoRA adapter",
        "vision LoRA adapter",
        "merger",
    }
    rtol = max(SHARED_BY_EIGHT_RTOL, image_groups_rtol("qwen3_vl", 8, tower_trains=True))
    on.step_equals_trls(groups, "dapo", old=None, kept=kept, rtol=rtol)
    # Every tensor of the image's path learns (the mergers' originals, kept for the adapter off, do not train).
    tower = {n: g for n, g in on.gradients.items() if part_of(n) in ("vision LoRA adapter", "merger")}
    assert tower and all(g.abs().sum() > 0 for g in tower.values()), [n for n, g in tower.items() if not g.abs().sum()]


@pytest.fixture(scope="module")
def hybrid_shared_images(tmp_path_factory):
    """shared_images' questions on a tiny Qwen3.5 (Gated DeltaNet layers beside attention)."""
    root = tmp_path_factory.mktemp("grpo-hybrid")
    return tiny_family_data(root, "qwen3_5", questions_on_shared_images(root, images=2, per_image=2))


def test_a_grpo_step_on_a_hybrid_model_equals_trls_loss_over_separate_sequences(hybrid_shared_images):
    """On a Qwen3.5, a step's answers to two questions on each of two images, sampled by the
    engine (each row's DeltaNet states beside the attention layers' keys) and learned in one packed
    row each image's prefix and each question's prompt once (each answer's DeltaNet layers starting
    from its prompt's state), equal TRL's GRPO loss over each answer alone, in loss and LoRA
    gradients. The prompts are computed twice a step there (`prompts_once_unless` says why), and a
    GPU's rollout keeps each row's prompt whole (`prefixes_shareable`). Tolerance: a prefix's state
    serves 8 answers (tests.helpers.image_groups_rtol)."""
    from vlft.generation.shared_prefixes import prefixes_shareable
    from vlft.training.shared_prompts import prompts_once_unless

    on = MethodOn(hybrid_shared_images, "final", loss_type="dapo")
    assert "linear-attention layers" in prompts_once_unless(on.model, on.method.settings)
    assert not prefixes_shareable(on.model)
    keys = [r["key"] for r in on.data.records[:4]]
    groups = on.method.step_groups([keys[:2], keys[2:]], 0, keep_prompts=False)
    assert [len(g.samples) for g in groups] == [8, 8] and all(g.shared > 0 for g in groups)
    on.step_equals_trls(groups, "dapo", old=None, rtol=max(SHARED_BY_EIGHT_RTOL, image_groups_rtol("qwen3_5", 8)))


def test_the_backward_pass_takes_each_prompt_layer_right_after_its_answers_layer(screens):
    """With each prompt computed once a step, the backward pass goes down the layers taking each
    one's answers (a few tokens: their host's work outweighs their kernels), then the same layer's
    prompts (many tokens), so the device works on a prompt layer while the host launches the next
    answers' layer; not every answers' layer first (vlft.training.shared_prompts._numbered_apart)."""
    on = MethodOn(screens, "click", loss_type="dapo", prompts_once=True)
    groups = on.method.step_groups([[r["key"]] for r in on.data.records[:2]], 0, keep_prompts=True)
    assert groups and on.method.rollouts.prompt_pass.prefills
    order = []

    class Noted(torch.autograd.Function):
        """The identity, noting when the backward pass reaches an answers' layer's output."""

        @staticmethod
        def forward(ctx, hidden, index):
            ctx.index = index
            return hidden.clone()

        @staticmethod
        def backward(ctx, grad):
            order.append(("answers", ctx.index))
            return grad, None

    def noted(index):
        def hook(module, args, kwargs, output):
            return Noted.apply(output, index) if "packed_prompt_keys" in kwargs else output

        return hook

    layers = on.model.base_model.model.model.language_model.layers
    hooks = [layer.register_forward_hook(noted(i), with_kwargs=True) for i, layer in enumerate(layers)]
    # A prompt layer's backward begins where its kept keys' gradient is taken in.
    for prefilled in on.method.rollouts.prompt_pass.prefills:
        for i, kept in enumerate(prefilled.cache.layers):
            kept.keys.register_hook(lambda grad, i=i: order.append(("prompts", i)))
    try:
        on.method.loss_sums(on.model, on.method.rollout.kept)[0].backward()
    finally:
        for hook in hooks:
            hook.remove()
    down = range(len(layers) - 1, -1, -1)
    assert order == [(part, i) for i in down for part in ("answers", "prompts")]


def test_a_rollout_learned_twice_is_clipped_against_its_log_probabilities_at_the_rollout(screens):
    """`num_iterations: 2`: the second update learns the same answers, its ratio against their
    log-probabilities at the rollout (TRL's old_per_token_logps), as TRL's loss over separate
    sequences computes it; the clipping bites."""
    on = MethodOn(screens, "click", loss_type="dapo", num_iterations=2)
    step = [[r["key"]] for r in on.data.records[:2]]
    groups = on.method.step_groups(step, 0)
    old = on.separate_logps([s for g in groups for s in g.samples])
    with torch.no_grad():  # an update's worth of change, larger than the clipping range
        for name, param in on.model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * 0.05)
    assert on.method.step_groups(step, 1) is groups  # the same rollout, not drawn again
    on.step_equals_trls(groups, "dapo", old=old, clipped=True)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_a_gspo_step_masking_its_truncated_answers_equals_trls_loss_over_separate_sequences(shared_images, loss_type):
    """`importance_sampling_level: sequence` (GSPO) and `mask_truncated_completions` in a step of
    two questions on each of two images, image groups, learned twice a rollout: the loss and LoRA
    gradients equal TRL's over each answer alone, each answer's ratio the mean of its tokens', the
    answers cut off at max_completion_length learned from by no token. A random tiny model's answers
    never reach their end (checked): the test then takes every third answer as one that did, so
    that the mask keeps some answers and drops others."""
    on = MethodOn(
        shared_images,
        "final",
        loss_type=loss_type,
        num_iterations=2,
        importance_sampling_level="sequence",
        mask_truncated_completions=True,
    )
    keys = [r["key"] for r in on.data.records[:4]]
    step = [keys[:2], keys[2:]]
    groups = on.method.step_groups(step, 0)
    answers = [s for g in groups for s in g.samples]
    end = on.builder.end_of_turn
    assert all(s.input_ids[-1] != end for s in answers) and on.method.rollout.truncated == {
        s.record_id for s in answers
    }
    on.method.rollout = replace(on.method.rollout, truncated=frozenset(s.record_id for s in answers[1::3]))
    old = on.separate_logps(answers)
    with torch.no_grad():  # an update's worth of change: the answers' ratios move off 1
        for name, param in on.model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * 0.05)
    assert on.method.step_groups(step, 1) is groups
    on.step_equals_trls(groups, loss_type, old=old)


def test_a_rollouts_passes_without_gradients_go_a_row_at_a_time_in_the_updates_rows(shared_images, monkeypatch):
    """The reference's and the rollout's log-probabilities (`beta` above 0, `num_iterations` above
    1) are computed in the rows the update lays the step out in, a forward a row, each image's
    prefix once for the answers to all its questions; they had taken a forward a question (1.25 s
    of a 2.0 s step of 18 Kvasir-like questions on the 8B). Each answer's token log-probabilities
    equal those of the answer computed as a sequence of its own (float64)."""
    on = MethodOn(shared_images, "final", loss_type="dapo", num_iterations=2, beta=0.04)
    on.method.rows = lambda groups: [[group] for group in groups]  # a row an image, as a token budget may cut them
    rows = []

    def noted(model, batch):
        rows.append(sorted(batch["sample_ids"]))
        return answer_token_logps(model, batch)

    monkeypatch.setattr(rollouts_module, "answer_token_logps", noted)
    keys = [r["key"] for r in on.data.records[:4]]
    groups = on.method.step_groups([keys[:2], keys[2:]], 0)
    images = [sorted(s.record_id for s in group.samples) for group in groups]
    assert [len(ids) for ids in images] == [8, 8] and rows == images + images  # the reference's pass, the rollout's
    samples = [s for g in groups for s in g.samples]
    for sample, alone in zip(samples, on.separate_logps(samples)):
        # The starting weights are the current ones.
        reference, drawn = on.method.rollout.references[sample.record_id], on.method.rollout.drawn[sample.record_id]
        assert torch.allclose(reference, alone, rtol=FLOAT64_RTOL, atol=0), sample.record_id
        assert torch.allclose(drawn, alone, rtol=FLOAT64_RTOL, atol=0), sample.record_id


class MethodOn:
    """A grpo method over a tiny float64 model (of the family `root` holds) with a random adapter,
    and TRL's loss beside it."""

    def __init__(self, root, answer_format: str, prompts_once: bool = False, tower: bool = False, **overrides):
        tokenizer = load_tokenizer(root / "model")
        lora = LORA | {"vision_lora": tower, "train_merger": tower}  # `tower`: the image's path trained too
        self.model = model = with_new_adapter(load_base_model(root / "model", CPU, FLOAT64), lora)
        use_packed_attention(model)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.02)
        self.builder = PromptBuilder(tokenizer, model.config.image_token_id)
        self.data = load_stage_data(
            [str(root / "prepared.jsonl")],
            [str(root / "pixels")],
            self.builder,
            filters={},
            answer_format=answer_format,
            max_seq_len=4096,
            convention=clicks.convention_for(answer_format, model.config),
        )
        rewards = overrides.pop("rewards", {"tests.training.test_grpo:answer_length_reward": 1.0})
        overrides |= {"rewards": rewards, "answer_format": answer_format}
        settings = StageSettings.resolve(tiny_stage_settings(**(GRPO | overrides)))
        self.method = GroupRelativePolicyOptimization(
            self.data,
            settings,
            Rewards(rewards, answer_format),
            self.builder,
            tokenizer,
            model,
            CPU,
            FLOAT64,
            prompts_once=prompts_once,
        )

    def separate_logps(self, samples) -> list[torch.Tensor]:
        """Each answer's token log-probabilities, computed as a sequence of its own."""
        return [
            answer_token_logps(
                self.model, to_device(pack([s], self.data.images, self.builder, rope_index(self.model)), CPU, FLOAT64)
            )
            for s in samples
        ]

    def step_equals_trls(
        self, groups, loss_type: str, old, clipped: bool = False, kept: bool = False, rtol: float = SHARED_BY_EIGHT_RTOL
    ) -> torch.Tensor:
        """Our step's loss and LoRA gradients (each prompt once for its answers; `kept`: from the
        rollout's prefill) against TRL's GRPO loss over every answer as a padded sequence of its own
        (`old`: the rollout's token log-probabilities, None: the current ones, detached), within
        `rtol` of the gradient's parts; the step's advantages. The method's
        importance_sampling_level and mask_truncated_completions apply to both."""
        method, model = self.method, self.model
        weight = method.step_weight(groups)
        batch = method.rollout.kept
        if not kept:
            batch = to_device(pack_groups(groups, self.data.images, self.builder, rope_index(model)), CPU, FLOAT64)
        loss = method.loss_sums(model, batch)[0] / weight
        trainable = [p for p in model.parameters() if p.requires_grad]
        shared = torch.autograd.grad(loss, trainable)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.gradients = dict(zip(names, shared))  # the step's, for a test to look into

        samples = [s for g in groups for s in g.samples]
        token_logps = self.separate_logps(samples)
        width = max(len(t) for t in token_logps)
        per_token, mask, per_token_old = (torch.zeros(len(samples), width, dtype=FLOAT64) for _ in range(3))
        for i, logps in enumerate(token_logps):
            per_token[i, : len(logps)], mask[i, : len(logps)] = logps, 1
            per_token_old[i, : len(logps)] = (old[i] if old is not None else logps).detach()
        advantages = torch.tensor([method.rollout.advantages[s.record_id] for s in samples], dtype=FLOAT64)
        if method.settings.mask_truncated_completions:  # TRL's completion mask without the truncated answers
            mask = mask * torch.tensor([s.record_id not in method.rollout.truncated for s in samples])[:, None]

        def trl_loss(advantages):
            log_ratio = per_token - per_token_old
            if method.settings.importance_sampling_level == "sequence":
                log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]
            ratio = torch.exp(log_ratio)
            clipped = torch.clamp(ratio, 0.8, 1.2)
            token_loss = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])
            if loss_type == "grpo":
                return ((token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
            if loss_type == "dr_grpo":
                return (token_loss * mask).sum() / (len(samples) * GRPO["max_completion_length"])
            if loss_type == "dapo":  # TRL's num_items_in_batch: every answer token, masked or not
                return (token_loss * mask).sum() / sum(len(t) for t in token_logps)
            return (token_loss * mask).sum() / mask.sum().clamp(min=1)

        expected = trl_loss(advantages)
        separate = torch.autograd.grad(expected, trainable, retain_graph=True)
        # The gradient is a difference: what the answers above their group's mean pull, less what the
        # ones below push (advantages sum to 0 in a group). Its rounding is relative to those parts.
        pulled = torch.autograd.grad(trl_loss(advantages.clamp(min=0)), trainable, retain_graph=True)
        pushed = torch.autograd.grad(trl_loss(advantages.clamp(max=0)), trainable)
        assert torch.allclose(loss, expected, rtol=max(FLOAT64_RTOL, rtol), atol=1e-15)
        assert any(float(g.abs().max()) > 0 for g in separate)  # some answers' rewards differ: a real gradient
        for a, b, up, down in zip(shared, separate, pulled, pushed):
            # A question's prompt serves its answers in one copy: tests/training/test_preferences.py's bound for a
            # prefix shared by up to 8 answers (measured here: 4.0e-8 of the parts, with 4 answers).
            assert (a - b).norm() <= rtol * (up.norm() + down.norm())
        if method.settings.importance_sampling_level == "token":
            ratio = torch.exp(per_token - per_token_old)[mask.bool()]
            assert bool(((ratio < 0.8) | (ratio > 1.2)).any()) == clipped
        return advantages


@pytest.mark.parametrize(
    "stage, said",
    [
        ({"method": "grpo", "answer_format": "click"}, "rewards: a reward stage needs at least one reward"),
        ({"method": "grpo", "answer_format": "final", "rewards": {"click_in_box": 1}}, "judges clicks"),
        ({"method": "grpo", "rewards": {"format": 1}, "loss_type": "sigmoid"}, "'sigmoid' is not a grpo loss"),
        ({"method": "grpo", "rewards": {"format": 1}, "packing": False}, "grpo needs packing: true"),
        ({"method": "grpo", "rewards": {"no_such_module_here:f": 1}, "answer_format": "final"}, "cannot be imported"),
        ({"method": "dpo", "beta": 0}, "dpo's β must be above 0"),
    ],
)
def test_a_grpo_stage_that_cannot_train_is_one_sentence_before_any_job(tmp_path, stage, said):
    make_dataset({"train": tmp_path / "train.jsonl"}, tmp_path / "images", {"train": 3}, seed=0)
    with pytest.raises(ConfigError, match=said):
        plan_of_stages(tmp_path, tmp_path / "train.jsonl", [{"name": "s", **stage}])


def test_method_settings_are_in_a_stages_params_only_where_it_uses_the_method(tmp_path):
    """Adding grpo's settings reruns no sft or dpo stage: each method's keys are left out of other
    stages' params, and a dpo stage's resolved beta and loss_type are what they were (0.1, sigmoid)."""
    from vlft.demo.shapes import make_dataset as make_shapes  # records with a rejected answer too

    make_shapes({"train": tmp_path / "train.jsonl"}, tmp_path / "images", {"train": 3}, seed=0)
    stages = [
        {"name": "sft"},
        {"name": "dpo", "method": "dpo"},
        {"name": "grpo", "method": "grpo", "rewards": {"answer_match": 1.0}},
    ]
    plan = plan_of_stages(tmp_path, tmp_path / "train.jsonl", stages)
    sft, dpo, grpo = (plan.stages[f"e/{name}"].train_params() for name in ("sft", "dpo", "grpo"))
    assert not {"beta", "loss_type", "num_generations", "rewards", "temperature"} & set(sft)
    assert dpo["beta"] == 0.1 and dpo["loss_type"] == "sigmoid" and "num_generations" not in dpo
    assert grpo["beta"] == 0.0 and grpo["loss_type"] == "dapo" and grpo["num_generations"] == 8
    assert "rpo_alpha" not in grpo and grpo["rewards"] == {"answer_match": 1.0}
    # grpo's options added since, left out while off (and max_num_gen_batches with filter_groups):
    # a grpo stage trained before them reruns not.
    added = {"importance_sampling_level", "mask_truncated_completions", "tis_imp_ratio_cap", "filter_groups"}
    assert not (added | {"max_num_gen_batches"}) & set(grpo)
    stages[2] |= {"importance_sampling_level": "sequence", "filter_groups": True, "tis_imp_ratio_cap": 2.0}
    on = plan_of_stages(tmp_path, tmp_path / "train.jsonl", stages).stages["e/grpo"].train_params()
    assert on["importance_sampling_level"] == "sequence" and on["filter_groups"] and on["max_num_gen_batches"] == 4
    assert on["tis_imp_ratio_cap"] == 2.0 and "mask_truncated_completions" not in on


def test_a_forward_numbered_apart_runs_under_the_callers_grad_mode_and_autocast_and_raises_its_errors():
    """A forward in a thread of its own, as its caller would run it; one that makes more autograd
    nodes than it may is said."""
    from vlft.training.shared_prompts import _numbered_apart

    def state():
        return torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")

    with torch.no_grad():
        assert _numbered_apart(state, CPU) == (False, False, torch.get_autocast_dtype("cpu"))
    with torch.autocast("cpu", torch.bfloat16):
        assert _numbered_apart(state, CPU) == (True, True, torch.bfloat16)
        assert _numbered_apart(lambda: torch.ones(2, 2) @ torch.ones(2, 2), CPU).dtype == torch.bfloat16

    def fails():
        raise ValueError("a bad answer")

    with pytest.raises(ValueError, match="a bad answer"):
        _numbered_apart(fails, CPU)

    # More nodes than the prompts are numbered above: an error, not a backward pass in another order.
    weight = torch.ones(2, requires_grad=True)
    assert _numbered_apart(lambda: (weight * 2).sum(), CPU, below=2).requires_grad
    with pytest.raises(RuntimeError, match="the answers' forward made 3 autograd nodes, more than the 2 the prompts'"):
        _numbered_apart(lambda: (weight * 2).exp().sum(), CPU, below=2)


def test_a_rollout_whose_engine_is_yet_to_capture_its_graph_lets_the_reads_in_flight_finish_first(screens):
    """A CUDA graph's capture forbids every other thread's CUDA calls, and the reader thread pins the
    next step's prompts: a rollout whose engine captures its decode step's graph (a GPU's, at its
    first run) starts only once no read is in flight. (On a CPU nothing is captured: the engine
    here is made to look like a GPU's until its run begins.)"""
    import threading

    on = MethodOn(screens, "click", loss_type="dapo")
    keys = [r["key"] for r in on.data.records[:2]]
    asked = [(key, n) for key in keys for n in range(on.method.generations)]
    engine = on.method.rollouts._engine(asked)
    seen = []
    answer = engine.answer

    def answer_checked(*args, **kwargs):
        seen.append(all(read.done() for read in on.method.rollouts.read_ahead.values()))
        released.set()  # a read that waits for the run to begin ends now
        engine.step.graphs = None  # a CPU's engine again: nothing to capture
        return answer(*args, **kwargs)

    engine.answer = answer_checked
    for graphs, read_s in (({}, 0.2), (None, 60)):  # yet to capture, then none to capture
        released = threading.Event()
        engine.step.graphs = graphs
        on.method.rollouts.read_ahead = {("another step",): on.method.rollouts.reader.submit(released.wait, read_s)}
        on.method.rollouts._sample(keys, 0)
    assert seen == [True, False]


def test_a_rollout_collects_where_it_left_garbage_and_not_again_for_memory_a_collection_left_live():
    """After a rollout the release collects while the device holds more than the rollout found;
    memory that both collections left is live, and later rollouts collect only past it."""
    allocated, collected = [0], []
    garbage = {"bytes": 0}  # what a collection frees, as the device's reading sees it

    def collections(phase, info):
        if phase == "stop":
            collected.append(info["generation"])
            allocated[0] -= garbage["bytes"]
            garbage["bytes"] = 0

    release = answering_module.RolloutRelease(allocated=lambda: allocated[0])
    mib = 1 << 20
    automatic = gc.isenabled()
    gc.disable()  # only the release's own collections
    gc.callbacks.append(collections)
    try:

        def roll_out(live: int, left: int) -> list[int]:
            """A rollout that leaves `live` bytes in use and `left` bytes of garbage; its collections."""
            collected.clear()
            with release.around():
                allocated[0] += live + left
                garbage["bytes"] = left
            allocated[0] -= live  # the update lets the live memory go
            return list(collected)

        assert roll_out(0, 10 * mib) == []  # within ROLLOUT_LEFT_BYTES: nothing to collect
        assert roll_out(0, 500 * mib) == [1]  # garbage: the young generations free it
        assert roll_out(300 * mib, 0) == [1, 2]  # live: neither frees it, and it is noted
        assert release.live == 300 * mib
        assert roll_out(300 * mib, 0) == []  # no longer collected for
        assert roll_out(300 * mib, 500 * mib) == [1]  # garbage past it still is
        assert roll_out(350 * mib, 0) == []  # within ROLLOUT_LEFT_BYTES past it
        assert roll_out(600 * mib, 0) == [1, 2] and release.live == 600 * mib
    finally:
        gc.callbacks.remove(collections)
        if automatic:
            gc.enable()

    cpu = answering_module.RolloutRelease(allocated=None) if not torch.cuda.is_available() else None
    if cpu is not None:  # nothing to read: both generations every rollout
        gc.callbacks.append(collections)
        try:
            collected.clear()
            with cpu.around():
                pass
            assert collected == [1, 2]
        finally:
            gc.callbacks.remove(collections)


@pytest.mark.parametrize("shared", [False, True], ids=["each row its own prompt", "prompts kept once a question"])
def test_the_rollout_engine_is_counted_before_it_is_made_as_it_then_holds(shared_images, monkeypatch, shared):
    """`max_batch_tokens: auto` counts the rollouts' kept engine beside a reward stage's update (at an
    SFT step's budget, 16 screenshots a step of the 8B on one H200 ran out of memory beside it). What
    is counted before any rollout is what the engine then holds at the stage's largest rollout, its
    KV cache and its folded adapter, byte for byte; a smaller rollout's engine holds less."""
    monkeypatch.setattr(folded_adapter, "FOLD_DEVICES", ("cuda", "cpu"))
    if shared:
        monkeypatch.setattr(rollouts_module, "SHARED_PROMPT_DEVICES", ("cuda", "cpu"))
    on = MethodOn(shared_images, "final", loss_type="dapo")
    keys = [r["key"] for r in on.data.records[:4]]
    small, large = [[keys[0]]], [keys[:2], keys[2:4]]  # a question; two images' two questions each
    counted = on.method.rollouts.rollout_bytes([small, large, small])
    held = []
    for step in (small, large):  # the engine made for the small rollout is made anew for the large
        engine = on.method.rollouts._engine([(k, n) for k in keys_of(step) for n in range(GRPO["num_generations"])])
        assert (engine.cache.prefixes is not None) == shared and engine.step.folded is not None
        held.append(engine.bytes)
    assert held[1] == counted > held[0]
    weights = sum(p.nbytes for n, p in on.model.named_parameters() if "base_layer.weight" in n)
    assert engine.step.folded.bytes == weights and counted > weights


@pytest.mark.parametrize(
    "budget, chosen, said",
    [
        (
            24576,
            None,
            r"with max_batch_tokens: 24576 beside the rollout engine's 0\.0 GiB \(its KV cache and folded "
            r"adapter\): give max_batch_tokens: auto, which measures this GPU, or a smaller number",
        ),
        (
            9984,
            {"max_batch_tokens": 9984},
            r"with max_batch_tokens: 9984 \(chosen by auto\) beside .*: give a smaller number",
        ),
    ],
)
def test_a_step_out_of_memory_is_one_sentence_naming_the_budget_and_the_engine_beside_it(
    shared_images, budget, chosen, said
):
    on = MethodOn(shared_images, "final", loss_type="dapo")
    on.method.rollouts._engine([(r["key"], n) for r in on.data.records[:2] for n in range(GRPO["num_generations"])])
    with pytest.raises(ConfigError, match="^this stage's step 6 ran out of the memory " + said):
        with _out_of_memory_said(budget, chosen, on.method, CPU, 5):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 372.00 MiB.")


@pytest.mark.parametrize(
    "room, folds",
    [
        (-30, False),  # 30 tokens short of the longest step beside the folded copy, 70 over without it
        (0, True),  # every step fits beside the folded copy too
        (-150, True),  # without the folded copy some step still would not fit (50 short): it folds
    ],
    ids=["the folded copy keeps prompts twice", "room for both", "prompts twice either way"],
)
def test_auto_leaves_the_adapter_unfolded_where_that_is_what_holds_every_steps_prompts_once(
    shared_images, monkeypatch, capsys, room, folds
):
    """`max_batch_tokens: auto` for a reward stage is measured with the folded adapter held beside
    the update. Where that copy is what keeps some step's prompts and longest answers from fitting
    the budget once, and the budget without it holds every step's, the stage takes that budget and
    its rollouts decode on the adapter as it is (a few ms a decode step, against a second forward
    over a step's prompts); elsewhere the choice stands. The measurement here is made up: a token
    costs a hundredth of the folded copy, so leaving it out adds 100 tokens (budgets to the token)."""
    monkeypatch.setattr(folded_adapter, "FOLD_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(token_budget, "STEP", 1)
    on = MethodOn(shared_images, "final", prompts_once=True)
    keys = [r["key"] for r in on.data.records[:4]]
    steps = [[keys[:2]], [keys[2:4]], [keys[:1]]]
    needs = max(on.method.rollouts._prompt_tokens(step) for step in steps)
    folded = folded_adapter.FoldedAdapter.bytes_for_rollouts(on.model, None)
    per_token, limit = folded / 100, 2**30
    held = limit * token_budget.SAFETY - (needs + room) * per_token
    chosen = {
        "max_batch_tokens": token_budget.choose(limit, held, per_token, 1),
        "memory_limit_gib": limit / 2**30,
        "held_gib": held / 2**30,
        "per_token_kib": per_token / 2**10,
        "longest_sample": 1,
        "rollout_engine_gib": folded / 2**30,
    }
    assert (chosen["max_batch_tokens"] >= needs) == (room == 0)
    taken = on.method.rollouts.prompts_once_or_folded(chosen, steps)
    engine = on.method.rollouts._engine([(k, n) for k in keys[:2] for n in range(GRPO["num_generations"])])
    assert (engine.step.folded is not None) == folds
    if folds:
        assert taken == chosen
        return
    assert taken["max_batch_tokens"] == token_budget.choose(limit, held - folded, per_token, 1) >= needs
    assert taken["rollout_engine_gib"] == pytest.approx(0, abs=1e-12) and taken["held_gib"] < chosen["held_gib"]
    said = capsys.readouterr().out
    assert f"decode steps read the adapter as it is, so that every step's prompts and longest answers ({needs}" in said


def test_the_reference_pass_reads_the_images_the_rollout_put_on_the_device_and_gets_the_same_values(
    shared_images, monkeypatch
):
    """A rollout that keeps its prompts has read each image and put it on the device once: its
    reference pass (beta above 0) neither reads it from its cache again nor copies it again (on the
    8B, 8 screenshots' vision features are 0.5 GB a step, 34 ms of the device and the host to copy),
    and its log-probabilities are those of the pass that reads and copies them, bit for bit (two
    images with two questions each, image groups)."""
    on = MethodOn(shared_images, "final", prompts_once=True, beta=0.04)
    keys = [r["key"] for r in on.data.records[:4]]
    step = [keys[:2], keys[2:]]
    copied, read = [], []  # per row of a pass: the images it found on the device already; images read
    to_device = rollouts_module.to_device

    def to_device_noted(batch, device, dtype, placed=None):
        copied.append(len(placed or {}))
        return to_device(batch, device, dtype, placed)

    monkeypatch.setattr(rollouts_module, "to_device", to_device_noted)
    cache = on.data.images[keys[0]][0]
    tensor = type(cache).tensor

    def tensor_noted(self, image_id):
        read.append(image_id)
        return tensor(self, image_id)

    monkeypatch.setattr(type(cache), "tensor", tensor_noted)
    groups = on.method.step_groups(step, 0, keep_prompts=True)
    reused = dict(on.method.rollout.references)
    assert copied == [2] and on.method.rollouts.images_placed == {}  # one row, its two images; let go after
    assert len(read) == 2  # each image read once, by the rollout; the reference pass read none again
    samples = {key: [s for g in groups for s in g.samples if s.record_id.startswith(f"{key}#")] for key in keys}
    again = on.method.rollouts._logps(
        samples, step, on.method.start, on.method.rows
    )  # nothing placed now: each image read and copied
    assert copied == [2, 0] and len(read) == 4 and again.keys() == reused.keys()
    assert all(torch.equal(again[i], reused[i]) for i in reused)


def test_every_step_logs_how_far_the_samplers_log_probabilities_lie_from_the_updates(screens, tmp_path, monkeypatch):
    """Each step logs the mismatch between the sampler's log-probabilities of the drawn tokens and
    the update's (TRL's and verl's names), on the adapter as it is and folded into a copy of the
    weights. In float64 both are the model's own softmax of the same token, one from the decode
    step's forward of a token at a time, the other from the update's packed forward: they differ by
    rounding alone (FLOAT64_RTOL of a log-probability, under 16 in magnitude at the tiny model's
    vocabulary and logits). With `tis_imp_ratio_cap` the ratios are then 1 and the stage learns
    what one without it does."""
    runs = {}
    for folded in (False, True):
        if folded:
            monkeypatch.setattr(folded_adapter, "FOLD_DEVICES", ("cuda", "cpu"))
        for cap in (None, 2.0):
            runs[folded, cap] = train(screens, tmp_path / f"{folded}-{cap}", tis_imp_ratio_cap=cap, temperature=0.7)
    for log in runs.values():
        assert len(log) == GRPO["max_steps"]
        for record in log:
            assert 0 <= record["sampling/sampling_logp_difference/max"] <= 16 * FLOAT64_RTOL
            assert record["sampling/sampling_logp_difference/mean"] <= record["sampling/sampling_logp_difference/max"]
            assert 0 <= record["training/rollout_probs_diff_max"] <= 16 * FLOAT64_RTOL
            ratios = [record[f"sampling/importance_sampling_ratio/{part}"] for part in ("min", "mean", "max")]
            assert all(abs(r - 1) <= 16 * FLOAT64_RTOL for r in ratios) and ratios[0] <= ratios[1] <= ratios[2]
    watched = ("reward", "completions/mean_length")
    plain = load_file(tmp_path / "False-None/adapter/adapter_model.safetensors")
    for (folded, cap), log in runs.items():
        assert [[r[k] for k in watched] for r in log] == [[r[k] for k in watched] for r in runs[False, None]]
        adapter = load_file(tmp_path / f"{folded}-{cap}/adapter/adapter_model.safetensors")
        assert all(torch.allclose(adapter[k], plain[k], rtol=FLOAT64_RTOL, atol=1e-12) for k in plain), (folded, cap)


def reward_on_some_questions(records, answers):
    """A reward under which the answers to every other question (by its record's id) all score
    alike: those questions teach a step nothing."""
    return [1.0 if int(r["id"].split("-")[-1]) % 2 else float(len(a) % 5) for r, a in zip(records, answers)]


DYNAMIC = dict(
    filter_groups=True,
    max_num_gen_batches=3,
    rewards={"tests.training.test_grpo:reward_on_some_questions": 1.0},
    num_generations=6,
)


def test_dynamic_sampling_learns_from_the_questions_whose_rewards_differ_refilled_from_the_next_steps(screens):
    """`filter_groups` (verl's dynamic sampling): a step's questions whose answers all score alike
    are dropped, and the questions of the plan's next steps are drawn for it at its rollout until
    it holds its own number of informative ones; their advantages are computed over the step they
    make up; the step's log line keeps its own questions' rewards."""
    on = MethodOn(screens, "click", **DYNAMIC)
    keys = [r["key"] for r in on.data.records]
    plan = [[[keys[0]], [keys[1]]], [[keys[2]], [keys[3]]], [[keys[4]], [keys[5]]]]
    on.method.plan = plan
    ids = {r["key"]: int(r["id"].split("-")[-1]) for r in on.data.records}
    assert sorted(ids[k] % 2 for k in keys) == [0, 0, 0, 1, 1, 1]  # half the questions teach nothing
    groups = on.method.step_groups(plan[0], 0)
    rollout = on.method.rollout
    learned = [s.record_id.rsplit("#", 1)[0] for g in groups for s in g.samples[:: DYNAMIC["num_generations"]]]
    informative = [k for step in plan for group in step for k in group if ids[k] % 2 == 0]
    assert learned == informative[:2]  # in the plan's order, the step's own first
    generations = DYNAMIC["num_generations"]
    for key in learned:
        assert len({rollout.rewards[f"{key}#{n}"] for n in range(generations)}) > 1
    answers = [f"{k}#{n}" for k in learned for n in range(generations)]
    expected = group_advantages(torch.tensor([rollout.rewards[i] for i in answers], dtype=FLOAT64), generations)
    assert [rollout.advantages[i] for i in answers] == expected.tolist()
    # The step's own questions (one informative), then the next step's (whose first is).
    assert rollout.fields["train/num_gen_batches"] == 2 and rollout.fields["dynamic_sampling/kept_ratio"] == 1
    own = [r for k in keys[:2] for r in [rollout.rewards[f"{k}#{n}"] for n in range(generations)]]
    assert rollout.fields["reward"] == pytest.approx(sum(own) / len(own), rel=FLOAT64_RTOL)


def test_a_resumed_stage_with_dynamic_sampling_draws_and_trains_what_an_uninterrupted_one_does(screens, tmp_path):
    """A step's refills depend on the step alone: stopped after step 2 and run again, the same
    draws, losses and adapter as one uninterrupted run."""
    whole = train(screens, tmp_path / "whole", **DYNAMIC)
    assert {r["dynamic_sampling/kept_ratio"] for r in whole} == {1.0} and max(
        r["train/num_gen_batches"] for r in whole
    ) > 1
    with pytest.raises(Preempted, match="after step 2"):
        train(screens, tmp_path / "cut", stop=StopAfter(2), **DYNAMIC)
    resumed = train(screens, tmp_path / "cut", **DYNAMIC)
    assert [(r["reward"], r["loss"]) for r in resumed] == [(r["reward"], r["loss"]) for r in whole]
    assert same_adapter(tmp_path / "whole", tmp_path / "cut")

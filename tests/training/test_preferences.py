"""Preference stages (`method: dpo`): pairs validated as answers are, the loss TRL's, a pair's prompt
computed once with the loss and gradients of separate sequences, the reference the starting
weights' own log-probabilities, computed once and kept for a resumed stage, held-out pairs judged
after the last step."""

from __future__ import annotations

import json
import types
from dataclasses import replace

import pytest
import torch

from vlft.data import clicks
from vlft.data.prompts import PromptBuilder
from vlft.data.stage_data import load_stage_data
from vlft.demo.shapes import make_dataset
from vlft.demo.tiny_model import FAMILIES
from vlft.errors import ConfigError, InputError
from vlft.files import read_jsonl, write_jsonl
from vlft.job_settings import StageSettings
from vlft.modeling import load_base_model, load_tokenizer, rope_index, with_adapter, with_new_adapter
from vlft.forward.batching import collate, to_device
from vlft.forward.image_groups import group_rows
from vlft.training.dpo import PreferenceOptimization
from vlft.training.objectives import dpo_losses
from vlft.forward.packing import pack_groups, use_packed_attention
from vlft.training.reference import REFERENCE_FILE, without_dropout, has_dropout
from vlft.training.runs import StageInputs
from vlft.training.steps import groups_in_order, image_of
from vlft.caches.vision_cache import VisionCache, build_vision_cache, use_vision_cache
from vlft.training.train import Preempted
from tests.helpers import FLOAT64_RTOL, StopAfter, plan_of_stages, tiny_family_data, tiny_stage_settings
from tests.forward.test_fast_path import LORA, lora_model

FLOAT64 = torch.float64
CPU = torch.device("cpu")
# FLOAT64_RTOL bounds sums of up to 10^4 terms reassociated. Here one image's prefix serves up to 8
# answers (4 pairs): their gradients meet in one copy of it rather than in 8 copies' weight
# gradients, sums of 8 times the terms before they meet; a wrong pairing or position shows at 1e-4.
SHARED_BY_EIGHT_RTOL = 8 * FLOAT64_RTOL
# Which earlier record's image each of 10 records asks about: images of 4, 3, 2 and 1 pairs.
IMAGE_OF_RECORD = [0, 0, 0, 0, 4, 4, 4, 7, 7, 9]


def trl_dpo_loss():
    """TRL's DPO loss function (trl 0.24's DPOTrainer.dpo_loss), called on a stand-in for the trainer
    that holds the settings it reads. trl 0.24 reads transformers 5's package checks, which return
    (found, version), as found whatever they say: its own flags are set to the first element first."""
    import importlib

    flags = importlib.import_module("trl.import_utils")
    for name, value in list(vars(flags).items()):
        if name.endswith("_available") and isinstance(value, tuple):
            setattr(flags, name, value[0])
    from trl.trainer.dpo_config import FDivergenceType
    from trl.trainer.dpo_trainer import DPOTrainer

    def loss(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing):
        trainer = types.SimpleNamespace(
            accelerator=types.SimpleNamespace(device=chosen.device),
            reference_free=False,
            f_divergence_type=FDivergenceType.REVERSE_KL,
            f_divergence_params=None,
            beta=beta,
            label_smoothing=label_smoothing,
        )
        return DPOTrainer.dpo_loss(trainer, chosen, rejected, ref_chosen, ref_rejected, loss_type="sigmoid")

    return loss


@pytest.mark.parametrize("beta, label_smoothing", [(0.1, 0.0), (0.5, 0.2), (2.0, 0.0)])
def test_the_dpo_loss_and_rewards_are_trls(beta, label_smoothing):
    generator = torch.Generator().manual_seed(0)
    logps = [-20 * torch.rand(64, generator=generator, dtype=FLOAT64) for _ in range(4)]
    ours = dpo_losses(*logps, beta, label_smoothing)
    theirs = trl_dpo_loss()(*logps, beta, label_smoothing)
    for mine, trls in zip(ours, theirs):
        assert torch.allclose(mine, trls, rtol=FLOAT64_RTOL, atol=0)


def with_pairs(raw, out, images_of=None):
    """The records of `raw` as preference pairs (the rejected answer another record's, so that it
    is an answer of the same kind and differs), optionally asking about earlier records' images."""
    records = read_jsonl(raw)
    for index, record in enumerate(records):
        record["rejected"] = next(
            r["answer"] for r in records[index + 1 :] + records if r["answer"] != record["answer"]
        )
        if images_of:
            record["image"] = records[images_of[index]]["image"]
    write_jsonl(out, records)
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def pairs_setup(request, tmp_path_factory):
    """A tiny model of one family and 10 preference pairs on 4 images, prepared and pixel-cached."""
    root = tmp_path_factory.mktemp(f"pairs-{request.param}")
    make_dataset({"train": root / "raw.jsonl"}, root / "images", {"train": 10}, seed=4)
    return tiny_family_data(root, request.param, with_pairs(root / "raw.jsonl", root / "train.jsonl", IMAGE_OF_RECORD))


def stage_data(root, answer_format="cot", split=None):
    """The pairs of root's prepared split (or of `split`, a directory with its prepared.jsonl and
    pixels made with root's model)."""
    tokenizer = load_tokenizer(root / "model")
    config = load_base_model(root / "model", CPU, torch.float32).config
    builder = PromptBuilder(tokenizer, config.image_token_id)
    split = split or root
    data = load_stage_data(
        [str(split / "prepared.jsonl")],
        [str(split / "pixels")],
        builder,
        {},
        answer_format,
        1024,
        clicks.convention_for(answer_format, config),
        pairs=True,
        only_pairs=True,
    )
    return data, builder, tokenizer


def plain_logps(model, samples, images, builder, pad_id):
    """Each sample's answer log-probability on the plain path: a padded batch with its attention
    mask, each sample in a row of its own, full-vocabulary logits."""
    batch = to_device(collate(samples, images, builder, pad_id), CPU, FLOAT64)
    inputs = {
        k: v
        for k, v in batch.items()
        if k not in ("labels", "answer_positions", "answer_targets", "answer_owners", "sample_ids")
    }
    logits = model(**inputs).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return -losses.sum(dim=1)


@pytest.mark.parametrize("source", ["pixels", "vision cache"])
def test_pairs_computed_with_their_prompt_and_image_once_give_the_loss_and_gradients_of_separate_sequences(
    pairs_setup, source
):
    """A DPO step over 10 pairs on 4 images: each image's pairs one group (the image once, each
    answer after it), cut between pairs by the token budget into packed rows, the fused path's
    per-answer sums; against every answer computed separately on the plain path, in float64 with
    lora_dropout 0, with label smoothing and RPO's term on."""
    root = pairs_setup
    data, builder, tokenizer = stage_data(root)
    settings = StageSettings.resolve(tiny_stage_settings(method="dpo", beta=0.3, label_smoothing=0.1, rpo_alpha=0.5))
    model = lora_model(root / "model")
    keys = [r["key"] for r in data.records]
    # A reference away from the policy, so that every margin and reward is non-trivial.
    reference = {key: (-30.0 - i, -28.0 + 0.5 * i) for i, key in enumerate(keys)}

    # Plain: chosen and rejected as separate sequences, TRL's loss on their sums.
    model.zero_grad()
    chosen = plain_logps(model, [data.samples[k] for k in keys], data.images, builder, tokenizer.pad_token_id)
    rejected = plain_logps(model, [data.rejected[k] for k in keys], data.images, builder, tokenizer.pad_token_id)
    refs = torch.tensor([reference[k] for k in keys], dtype=FLOAT64)
    losses, _, _ = trl_dpo_loss()(chosen, rejected, refs[:, 0], refs[:, 1], 0.3, 0.1)
    chosen_tokens = sum(len(data.samples[k].input_ids) - data.samples[k].prompt_length for k in keys)
    plain = losses.mean() + 0.5 * (-chosen.sum() / chosen_tokens)
    # DPO's gradient is a difference: what the chosen answers pull, less what the rejected push,
    # nearly equal where two answers differ in a word. Its rounding is relative to those two parts,
    # not to their difference: each part is bounded as every float64 comparison here is.
    trainable = [p for p in model.parameters() if p.requires_grad]
    by_chosen, by_rejected = torch.autograd.grad(plain, [chosen, rejected], retain_graph=True)
    pulled = torch.autograd.grad((by_chosen * chosen).sum(), trainable, retain_graph=True)
    pushed = torch.autograd.grad((by_rejected * rejected).sum(), trainable)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    plain_grads = {n: (c + r, c.norm() + r.norm()) for n, c, r in zip(names, pulled, pushed)}

    # Ours: the pairs of each image in one group, laid out in packed rows under a budget; from the
    # pixels, or from the frozen vision tower's cached outputs.
    shared_model = lora_model(root / "model")
    if source == "vision cache":
        build_vision_cache(root / "pixels", model.get_base_model(), root / "vision", max_gb=1, device=CPU)
        vision = VisionCache(root / "vision")
        use_vision_cache(shared_model)
        data.images = {key: (vision, image_id) for key, (_, image_id) in data.images.items()}
    use_packed_attention(shared_model)
    shared_model.zero_grad()
    method = PreferenceOptimization(data, settings, reference)
    step = [[r["key"] for r in g] for g in groups_in_order(data.records, image_of(data.images))]
    groups = method.step_groups(step)
    assert [len(g.samples) for g in groups] == [8, 6, 4, 2]
    assert all(g.shared > 0 for g in groups)  # the header and the image, laid out once a group
    weight = method.step_weight(groups)
    assert weight == 10
    rows = group_rows(groups, groups[0].tokens - 1, None)  # the 4-pair group cannot stay whole
    assert len(rows) > 1 and all(len(g.samples) % 2 == 0 for row in rows for g in row)
    totals = None
    for row in rows:
        host = pack_groups(row, data.images, builder, rope_index(shared_model))
        sums = method.loss_sums(shared_model, to_device(host, CPU, FLOAT64))
        (sums[0] / weight).backward()
        totals = [s.detach() for s in sums] if totals is None else [t + s.detach() for t, s in zip(totals, sums)]
    assert (totals[0] / weight).item() == pytest.approx(plain.item(), rel=FLOAT64_RTOL)
    assert (totals[5] / weight).item() == pytest.approx(chosen.mean().item(), rel=FLOAT64_RTOL)
    assert (totals[6] / weight).item() == pytest.approx(rejected.mean().item(), rel=FLOAT64_RTOL)
    for name, (grad, parts) in plain_grads.items():
        error = (dict(shared_model.named_parameters())[name].grad - grad).norm()
        assert (
            error <= SHARED_BY_EIGHT_RTOL * parts
        ), f"{name}: error {error:.2e} > {SHARED_BY_EIGHT_RTOL:.0e} x {parts:.2e}"


def sft_then_dpo(root, out, stop=None, held_out=None, **dpo):
    """An SFT stage on the pairs' chosen answers, then a DPO stage from its adapter (float64),
    judging the pairs of the `held_out` split directory where given."""
    from vlft.training.train import train_stage

    inputs = StageInputs(str(root / "model"), [str(root / "prepared.jsonl")], [str(root / "pixels")], None)
    sft = out / "sft"
    if not (sft / "adapter").exists():
        settings = tiny_stage_settings(answer_format="cot", micro_batch=4, lora_dropout=0.0, learning_rate=1e-2)
        train_stage(
            inputs,
            settings,
            sft / "adapter",
            sft / "log.jsonl",
            sft / "summary.json",
            sft / "ckpt",
            1000,
            dtype=FLOAT64,
        )
    dpo_inputs = StageInputs(inputs.model_dir, inputs.prepared, inputs.caches, str(sft / "adapter"))
    if held_out:
        dpo_inputs = replace(
            dpo_inputs, eval_prepared=str(held_out / "prepared.jsonl"), eval_cache=str(held_out / "pixels")
        )
    settings = tiny_stage_settings(
        answer_format="cot", micro_batch=4, lora_dropout=0.0, method="dpo", epochs=2, learning_rate=1e-2, **dpo
    )
    stage = out / "dpo"
    train_stage(
        dpo_inputs,
        settings,
        stage / "adapter",
        stage / "log.jsonl",
        stage / "summary.json",
        stage / "ckpt",
        2,
        stop=stop,
        dtype=FLOAT64,
    )
    return sft, stage


@pytest.fixture(scope="module")
def trained_pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo-stage")
    make_dataset({"train": root / "raw.jsonl"}, root / "images", {"train": 10}, seed=5)
    return tiny_family_data(root, "qwen3_vl", with_pairs(root / "raw.jsonl", root / "train.jsonl", IMAGE_OF_RECORD))


def test_the_kept_reference_is_the_starting_weights_and_a_resumed_stage_reads_it(trained_pairs, tmp_path):
    """The reference a DPO stage keeps in its run directory equals a fresh forward of its starting
    weights (the base with the SFT stage's adapter); stopped after its second step and run again,
    the stage resumes with the reference it kept, not a second computation; its log carries the
    DPO metrics each step."""
    root = trained_pairs
    with pytest.raises(Preempted, match="after step 2"):
        sft_then_dpo(root, tmp_path, stop=StopAfter(2), image_groups=True)
    [run_dir] = (tmp_path / "dpo/ckpt").iterdir()
    kept = run_dir / REFERENCE_FILE
    first = kept.read_text()
    stamp = kept.stat().st_mtime_ns

    data, builder, tokenizer = stage_data(root)
    model = with_adapter(load_base_model(root / "model", CPU, FLOAT64), tmp_path / "sft/adapter", trainable=False)
    keys = [r["key"] for r in data.records]
    chosen = plain_logps(model, [data.samples[k] for k in keys], data.images, builder, tokenizer.pad_token_id)
    rejected = plain_logps(model, [data.rejected[k] for k in keys], data.images, builder, tokenizer.pad_token_id)
    reference = json.loads(first)["logps"]
    assert sorted(reference) == sorted(keys)
    got = torch.tensor([reference[k] for k in keys], dtype=FLOAT64)
    assert torch.allclose(got[:, 0], chosen.detach(), rtol=FLOAT64_RTOL, atol=0)
    assert torch.allclose(got[:, 1], rejected.detach(), rtol=FLOAT64_RTOL, atol=0)

    sft_then_dpo(root, tmp_path, image_groups=True)
    assert kept.read_text() == first and kept.stat().st_mtime_ns == stamp
    log = read_jsonl(tmp_path / "dpo/log.jsonl")
    summary = json.loads((tmp_path / "dpo/summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and [row["step"] for row in log] == list(range(1, summary["steps"] + 1))
    for row in log:
        assert row["rewards/margins"] == pytest.approx(row["rewards/chosen"] - row["rewards/rejected"], abs=1e-12)
        assert 0 <= row["rewards/accuracies"] <= 1
    # The first step starts at the reference itself: every reward 0, the loss log 2.
    assert log[0]["rewards/chosen"] == pytest.approx(0, abs=1e-9) and log[0]["loss"] == pytest.approx(
        0.6931471805599453
    )
    # Trained on its own pairs, the policy prefers the chosen answers by its last step.
    assert log[-1]["rewards/margins"] > 0 and log[-1]["rewards/accuracies"] > 0.5
    assert "held_out_pairs" not in summary  # no eval split given: nothing held out to judge


@pytest.mark.parametrize("damage", ["a value edited", "cut short"])
def test_a_kept_reference_that_was_altered_is_said_and_computed_again(trained_pairs, tmp_path, capsys, damage):
    """The kept reference edited (a value changed, the file still valid JSON) or cut short: one line
    naming it, and the stage computes it again, to the values it had, rather than train on it."""
    root = trained_pairs
    with pytest.raises(Preempted, match="after step 2"):
        sft_then_dpo(root, tmp_path, stop=StopAfter(2), image_groups=True)
    [kept] = (tmp_path / "dpo/ckpt").glob(f"*/{REFERENCE_FILE}")
    first = json.loads(kept.read_text())
    if damage == "a value edited":
        altered = json.loads(kept.read_text())
        key = next(iter(altered["logps"]))
        altered["logps"][key][0] += 1.0
        kept.write_text(json.dumps(altered))
        problem = "its values differ from the checksum written with them"
    else:
        kept.write_text(kept.read_text()[:40])
        problem = "cannot be read whole"
    capsys.readouterr()
    sft_then_dpo(root, tmp_path, image_groups=True)
    assert f"{kept}: {problem}" in capsys.readouterr().out
    again = json.loads(kept.read_text())
    assert sorted(again["logps"]) == sorted(first["logps"])
    for key, pair in first["logps"].items():
        assert again["logps"][key] == pytest.approx(pair, rel=FLOAT64_RTOL), key


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_reference_pass_runswithout_dropout_and_in_trainings_own_modes_where_there_is_none(trained_pairs, dropout):
    """With no dropout anywhere, the reference pass keeps training's module and grad modes (so a
    compiled layer is not compiled a second time); with LoRA dropout it runs in eval mode without
    gradients, and training's mode comes back after."""
    base = load_base_model(trained_pairs / "model", CPU, FLOAT64)
    model = with_new_adapter(base, dict(LORA, lora_dropout=dropout))
    model.train()
    assert has_dropout(model) == (dropout > 0)
    with without_dropout(model):
        assert model.training == torch.is_grad_enabled() == (dropout == 0)
    assert model.training and torch.is_grad_enabled()


def test_held_out_pairs_are_judged_by_the_trained_weights_against_the_starting_weights(trained_pairs, tmp_path, capfd):
    """A split of 6 pairs and a record without a rejected answer, held out: after the last step the
    stage's summary, log and curves carry TRL's eval figures for the 6 pairs, equal to the DPO loss
    of fresh forwards of the trained adapter against the starting weights (the SFT adapter)."""
    from vlft.caches.image_cache import PixelSettings, build_image_cache
    from vlft.data.records import prepare_split
    from vlft.modeling import load_image_processor

    root, held = trained_pairs, tmp_path / "held"
    make_dataset({"val": held / "raw.jsonl"}, held / "images", {"val": 7}, seed=11)
    records = read_jsonl(with_pairs(held / "raw.jsonl", held / "pairs.jsonl"))
    del records[-1]["rejected"]
    write_jsonl(held / "val.jsonl", records)
    prepare_split(held / "val.jsonl", held / "images", held / "prepared.jsonl")
    pixels = PixelSettings.from_processor(load_image_processor(root / "model"), 4096, 16384)
    build_image_cache(held / "prepared.jsonl", held / "images", held / "pixels", pixels)

    sft, stage = sft_then_dpo(root, tmp_path, held_out=held, image_groups=True, beta=0.1)
    summary = json.loads((stage / "summary.json").read_text())

    data, builder, tokenizer = stage_data(root, split=held)
    keys = [r["key"] for r in data.records]
    assert len(keys) == 6

    def logps(adapter):
        model = with_adapter(load_base_model(root / "model", CPU, FLOAT64), adapter, trainable=False)
        return [
            plain_logps(model, [answers[k] for k in keys], data.images, builder, tokenizer.pad_token_id).detach()
            for answers in (data.samples, data.rejected)
        ]

    losses, chosen_rewards, rejected_rewards = dpo_losses(*logps(stage / "adapter"), *logps(sft / "adapter"), 0.1)
    assert summary["held_out_pairs"] == 6
    assert summary["held_out_preference_accuracy"] == (chosen_rewards > rejected_rewards).double().mean().item()
    margin = (chosen_rewards - rejected_rewards).mean().item()
    assert summary["held_out_reward_margin"] == pytest.approx(margin, rel=FLOAT64_RTOL)
    assert summary["held_out_loss"] == pytest.approx(losses.mean().item(), rel=FLOAT64_RTOL)
    assert abs(summary["held_out_loss"] - 0.6931471805599453) > 1e-3  # moved off the start's log 2
    said = capfd.readouterr().err
    assert f"held-out pairs (6 of {held / 'prepared.jsonl'}): preference accuracy" in said
    assert "; left out, without a rejected answer: 1 records" in said


def test_a_preference_pair_is_validated_like_any_answer(tmp_path):
    from vlft.data.records import prepare_split

    make_dataset({"train": tmp_path / "raw.jsonl"}, tmp_path / "images", {"train": 3}, seed=0)
    records = read_jsonl(tmp_path / "raw.jsonl")
    for bad, said in (
        (" ", "must be non-empty text: the answer not preferred"),
        (records[1]["answer"], "the same as the answer"),
    ):
        records[1]["rejected"] = bad
        write_jsonl(tmp_path / "train.jsonl", records)
        with pytest.raises(InputError) as found:
            prepare_split(tmp_path / "train.jsonl", tmp_path / "images", tmp_path / "prepared.jsonl")
        assert str(found.value).startswith(f"{tmp_path / 'train.jsonl'}:2: field 'rejected': {said}")
        assert not (tmp_path / "prepared.jsonl").exists()


@pytest.mark.parametrize(
    "stage, said",
    [
        ({"method": "dpo", "packing": False}, "method: dpo needs packing: true"),
        ({"method": "dpo", "max_batch_tokens": "auto"}, "max_batch_tokens: auto is measured on single answers"),
        ({"method": "dpo", "answer_format": "click"}, "method: dpo learns from answers in words"),
        ({"method": "dpo"}, "method: a dpo stage learns from preference pairs, and no record of"),
    ],
)
def test_a_dpo_stage_that_cannot_train_is_one_sentence_before_any_job(tmp_path, stage, said):
    make_dataset({"train": tmp_path / "train.jsonl"}, tmp_path / "images", {"train": 3}, seed=0)
    answers_alone = [{k: v for k, v in r.items() if k != "rejected"} for r in read_jsonl(tmp_path / "train.jsonl")]
    write_jsonl(tmp_path / "train.jsonl", answers_alone)
    with pytest.raises(ConfigError, match=said):
        plan_of_stages(tmp_path, tmp_path / "train.jsonl", [{"name": "s", **stage}])

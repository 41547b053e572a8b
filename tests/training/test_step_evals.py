"""Evaluation during training (`eval_every`) and `keep: best` (vlft.training.step_evals), on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import REPO, tiny_stage_settings
from vlft.errors import ConfigError
from vlft.generation.evaluate import evaluate_split
from vlft.files import read_jsonl
from vlft.caches.image_cache import PixelSettings, build_image_cache
from vlft.modeling import load_image_processor
from vlft.plan import build_plan
from vlft.data.records import prepare_split
from vlft.training.train import Preempted, StageInputs, train_stage

EVALUATION = {"answer_format": "final", "max_seq_len": 4096, "max_new_tokens": 12, "batch_size": 5}


class StopAfter:
    def __init__(self, step: int):
        self.step, self.seen = step, 0

    def reason(self):
        self.seen += 1
        return "SIGTERM received" if self.seen == self.step else None


@pytest.fixture(scope="module")
def splits(tmp_path_factory, tiny_model_dir) -> Path:
    """A train split of 48 records and a val split of 20, prepared and pixel-cached."""
    from vlft.demo.shapes import make_dataset

    root = tmp_path_factory.mktemp("step-evals")
    raw = {"train": root / "train.jsonl", "val": root / "val.jsonl"}
    make_dataset(raw, root / "images", {"train": 48, "val": 20}, seed=1)
    pixels = PixelSettings.from_processor(load_image_processor(tiny_model_dir), 4096, 16384)
    for split, path in raw.items():
        prepare_split(path, root / "images", root / f"{split}.prepared.jsonl")
        build_image_cache(root / f"{split}.prepared.jsonl", root / "images", root / f"{split}.cache", pixels)
    return root


def stage(tiny_model_dir, splits, evaluating: bool) -> StageInputs:
    extra = {"eval_prepared": str(splits / "val.prepared.jsonl"), "eval_cache": str(splits / "val.cache")}
    return StageInputs(
        str(tiny_model_dir),
        [str(splits / "train.prepared.jsonl")],
        [str(splits / "train.cache")],
        None,
        **(extra if evaluating else {}),
    )


def settings(**evaluation) -> dict:
    base = tiny_stage_settings(max_steps=6, micro_batch=8, lora_dropout=0.1, learning_rate=2e-3, warmup_ratio=0)
    if evaluation:
        base |= {"eval_samples": 8, "eval_split": None, "keep": "last", "best_metric": "accuracy"} | evaluation
    return base


def train(inputs, stage_settings, out: Path, dtype=torch.float64, stop=None, checkpoint_every=1000) -> dict:
    return train_stage(
        inputs,
        stage_settings,
        out / "adapter",
        out / "log.jsonl",
        out / "summary.json",
        out / "ckpt",
        checkpoint_every,
        stop,
        dtype=dtype,
        curves_dir=out / "tb",
        evaluation=EVALUATION if stage_settings.get("eval_every") else None,
    )


def trained_steps(out: Path) -> list[dict]:
    """What each step of the log computed (not how fast)."""
    return [
        {k: row[k] for k in ("step", "loss", "lr", "grad_norm", "samples")} for row in read_jsonl(out / "log.jsonl")
    ]


def adapter(out: Path) -> dict:
    return load_file(out / "adapter/adapter_model.safetensors")


def test_evaluating_during_training_changes_nothing_it_trains_and_records_each_evaluation(
    tmp_path, tiny_model_dir, splits
):
    plain = train(stage(tiny_model_dir, splits, False), settings(), tmp_path / "plain")
    evaluated = train(stage(tiny_model_dir, splits, True), settings(eval_every=4), tmp_path / "evaluated")

    # The same computation: the very same adapter, bit for bit, and the same losses.
    a, b = adapter(tmp_path / "plain"), adapter(tmp_path / "evaluated")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert trained_steps(tmp_path / "plain") == trained_steps(tmp_path / "evaluated")
    # Stages that trained the same thing say so, however one of them was watched.
    assert evaluated["data_and_settings"] == plain["data_and_settings"]
    assert "evaluations_during_training" not in plain

    # Before the first step, every 4 steps, and after the last; 8 records each time.
    evals = evaluated["evaluations_during_training"]
    assert [r["step"] for r in evals] == [0, 4, 6]
    assert all(r["n"] == 8 and 0 <= r["accuracy"] <= 1 and r["loss"] > 0 for r in evals)
    assert set(evals[-1]["accuracy_by_category"]) <= {r["category"] for r in read_jsonl(splits / "val.jsonl")}
    assert 0 < evaluated["eval_share"] < 1 and evaluated["eval_s"] == pytest.approx(sum(r["seconds"] for r in evals))
    assert evals[0]["loss"] > evals[-1]["loss"]  # it learns, as the evaluation sees it
    # The curves: TensorBoard's own reader finds each evaluation once.
    events = EventAccumulator(str(tmp_path / "evaluated/tb")).Reload()
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 4, 6]
    assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx([r["loss"] for r in evals])


def test_the_last_evaluation_during_training_is_the_evaluation_jobs_on_those_records(tmp_path, tiny_model_dir, splits):
    """In the dtype the evaluation job runs (float32 on the CPU): the answers it gives and their
    loss are the evaluation job's on the same records with the stage's adapter (merged there)."""
    summary = train(stage(tiny_model_dir, splits, True), settings(eval_every=3, eval_samples=20), tmp_path, None)
    last = summary["evaluations_during_training"][-1]
    assert last["step"] == 6 and last["n"] == 20
    metrics = evaluate_split(
        str(tiny_model_dir),
        str(tmp_path / "adapter"),
        str(splits / "val.prepared.jsonl"),
        str(splits / "val.cache"),
        EVALUATION,
        tmp_path / "predictions.jsonl",
        tmp_path / "metrics.json",
    )
    assert metrics["accuracy"] == last["accuracy"]
    assert metrics["accuracy_by_category"] == last["accuracy_by_category"]
    # Merged weights against base + adapter in float32: each logit's rounding is some 1e-7 of its
    # size, through a two-layer model and a mean of log-probabilities: far under 1e-4.
    assert metrics["loss"] == pytest.approx(last["loss"], rel=1e-4)


def test_keep_best_publishes_the_adapter_of_the_best_evaluation_and_survives_a_stop(tmp_path, tiny_model_dir, splits):
    inputs = stage(tiny_model_dir, splits, True)
    # A rate at which the loss goes up and down, so that the best is not the last step.
    best = settings(eval_every=1, keep="best", best_metric="loss", learning_rate=5e-2, lr_schedule="constant")
    whole = train(inputs, best, tmp_path / "whole")
    evals = whole["evaluations_during_training"]
    assert [r["step"] for r in evals] == [0, 1, 2, 3, 4, 5, 6]
    after_steps = [r for r in evals if r["step"] > 0]
    lowest = min(after_steps, key=lambda r: r["loss"])
    assert lowest["step"] < 6 and lowest["loss"] < evals[-1]["loss"]
    kept = {"step": lowest["step"], "best_metric": "loss", "accuracy": lowest["accuracy"], "loss": lowest["loss"]}
    assert whole["kept"] == kept
    # What was published is that adapter: evaluated again, the same loss (float64: to rounding).
    again = train_stage(
        StageInputs(
            str(tiny_model_dir),
            [str(splits / "train.prepared.jsonl")],
            [str(splits / "train.cache")],
            str(tmp_path / "whole/adapter"),
            eval_prepared=inputs.eval_prepared,
            eval_cache=inputs.eval_cache,
        ),
        best | {"max_steps": 1, "learning_rate": 1e-30},  # a step that moves nothing
        tmp_path / "again/adapter",
        tmp_path / "again/log.jsonl",
        tmp_path / "again/summary.json",
        tmp_path / "again/ckpt",
        1000,
        dtype=torch.float64,
        evaluation=EVALUATION,
    )
    assert again["evaluations_during_training"][0]["loss"] == pytest.approx(lowest["loss"], rel=1e-9)
    # A curriculum stage's curves go on after the steps of the stage it started from.
    assert again["steps_before"] == 6
    # Its mark of the best adapter is gone with the checkpoints: only the finished run is kept.
    assert sorted(p.name for p in (tmp_path / "whole/ckpt").glob("*/*")) == [".vlft-run-directory", "finished"]

    # Stopped after step 3 (a checkpoint at 2 and one at the stop), then resumed: the same
    # evaluations once each, the same kept step, the same adapter.
    with pytest.raises(Preempted, match="after step 3"):
        train(inputs, best, tmp_path / "split", stop=StopAfter(3), checkpoint_every=2)
    resumed = train(inputs, best, tmp_path / "split", checkpoint_every=2)
    assert resumed["resumed_from_step"] == 3
    assert [r["step"] for r in resumed["evaluations_during_training"]] == [0, 1, 2, 3, 4, 5, 6]
    assert resumed["kept"]["step"] == whole["kept"]["step"]
    a, b = adapter(tmp_path / "whole"), adapter(tmp_path / "split")
    assert all(torch.allclose(a[k], b[k], rtol=1e-9, atol=0) for k in a)
    events = EventAccumulator(str(tmp_path / "split/tb")).Reload()
    assert [e.step for e in events.Scalars("eval/loss")] == [0, 1, 2, 3, 4, 5, 6]


def demo_config(**stage_keys) -> dict:
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["experiments"] = {"exp": {"stages": [{"name": "main", **stage_keys}]}}
    return config


def test_the_config_is_checked_and_the_options_rerun_nothing_while_off():
    with pytest.raises(ConfigError, match=r"experiments\.exp\.stages\[0\]\.keep: 'best' .*set eval_every"):
        build_plan(demo_config(keep="best"))
    with pytest.raises(ConfigError, match=r"stages\[0\]\.eval_split: unknown split 'dev' of dataset 'shapes'"):
        build_plan(demo_config(eval_every=5, eval_split="dev"))
    with pytest.raises(ConfigError, match=r"stages\[0\]\.eval_every: .* needs eval_split"):
        build_plan(demo_config(eval_every=5, eval_splits=[]))
    # Off, none of the new keys is a parameter of the training job: nothing trained before reruns.
    off = build_plan(demo_config(eval_samples=10, keep="last")).stage("exp", "main")
    assert not {"eval_every", "eval_samples", "eval_split", "keep", "best_metric"} & set(off.train_params())
    assert off.eval_split is None
    on = build_plan(demo_config(eval_every=5)).stage("exp", "main")
    assert on.train_params()["eval_every"] == 5 and on.eval_split == "val"  # the first of eval_splits

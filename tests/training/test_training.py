"""The training loop: the logged learning rate, schedules that cannot train, filters over splits, step times, curves."""

from pathlib import Path

import pytest

from tests.helpers import KilledAfter
from vlft.training.curves import SCALARS
from vlft.errors import ConfigError, InputError
from vlft.files import read_jsonl, write_jsonl


def test_the_logged_learning_rate_is_the_one_the_step_used(small_stage, tmp_path):
    """Cosine with 2 warmup steps of 4: the steps use 0, 1/2, 1 and 1/2 of the rate (HF's schedule);
    the log said 1/2, 1, 1/2, 0, the rate of the step after."""
    from vlft.training.train import train_stage

    inputs, settings = small_stage
    settings = settings | {"max_steps": 4, "warmup_ratio": 0.5, "micro_batch": 4, "learning_rate": 1e-3}
    train_stage(inputs, settings, tmp_path / "a", tmp_path / "log.jsonl", tmp_path / "s.json", tmp_path / "c", 100)
    logged = [row["lr"] for row in read_jsonl(tmp_path / "log.jsonl")]
    assert logged == pytest.approx([0.0, 0.5e-3, 1e-3, 0.5e-3], rel=1e-12, abs=1e-18)


def test_a_stage_whose_records_make_too_few_steps_for_its_warmup_is_refused_before_it_trains(small_stage, tmp_path):
    """Epochs over few records: the step count is known only in the job, which refuses at once."""
    from vlft.training.train import train_stage

    inputs, settings = small_stage
    settings = settings | {"epochs": 1, "max_steps": None, "micro_batch": 16, "warmup_ratio": 0.05}
    with pytest.raises(ConfigError) as refused:
        train_stage(inputs, settings, tmp_path / "a", tmp_path / "log.jsonl", tmp_path / "s.json", tmp_path / "c", 100)
    assert str(refused.value).startswith("this stage's 16 records make 1 step(s): all 1 of its steps are warmup")
    assert not (tmp_path / "a").exists() and not (tmp_path / "log.jsonl").exists()


def test_a_training_job_takes_a_filter_on_its_splits_as_a_whole(small_stage, tmp_path):
    """Where the raw splits did not exist when the workflow started (the demo's), the job checks."""
    from vlft.modeling import load_tokenizer
    from vlft.data.prompts import PromptBuilder
    from vlft.data.stage_data import load_stage_data
    from transformers import AutoConfig

    inputs, _ = small_stage
    records = read_jsonl(inputs.prepared[0])
    for name, category in (("a", "color"), ("b", "count")):
        write_jsonl(tmp_path / f"{name}.jsonl", [r for r in records if r["category"] == category])
    splits, caches = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], inputs.caches * 2
    image_token = AutoConfig.from_pretrained(inputs.model_dir).image_token_id
    builder = PromptBuilder(load_tokenizer(inputs.model_dir), image_token)

    def load(filters):
        return load_stage_data(splits, caches, builder, filters, "cot", 512)

    counts = [r for r in records if r["category"] == "count"]
    assert counts and [r["id"] for r in load({"category": "count"}).records] == [r["id"] for r in counts]
    with pytest.raises(InputError) as refused:
        load({"category": "size"})
    assert (
        str(refused.value)
        == f"{splits[0]}, {splits[1]}: the stage's filter {{'category': 'size'}} selects no record of its splits"
    )


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a TensorBoard run, as TensorBoard itself reads it: (step, value) in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_stage_writes_its_curves_to_tensorboard_and_a_resumed_one_continues_them_without_duplicates(
    small_stage, tmp_path
):
    """Killed after step 5 with its last checkpoint at 4: the rerun trains steps 5 and 6 again, and
    TensorBoard shows steps 1 to 6 once each, with the values of the stage's final log."""
    from vlft.training.train import train_stage

    inputs, settings = small_stage
    settings = settings | {"max_steps": 6, "micro_batch": 4}
    stage, board = tmp_path / "train/exp/stage", tmp_path / "tensorboard/exp/stage"

    def run(stop=None):
        out = (stage / "adapter", stage / "log.jsonl", stage / "summary.json")
        return train_stage(inputs, settings, *out, tmp_path / "ckpt", 2, stop, curves_dir=board)

    with pytest.raises(KeyboardInterrupt):
        run(KilledAfter(5))
    assert [step for step, _ in tensorboard_scalars(board)["train/loss"]] == [1, 2, 3, 4, 5]
    assert run()["resumed_from_step"] == 4
    log = read_jsonl(stage / "log.jsonl")
    scalars = tensorboard_scalars(board)
    assert sorted(scalars) == [f"train/{name}" for name in sorted(SCALARS)]
    for name in SCALARS:
        assert [step for step, _ in scalars[f"train/{name}"]] == [1, 2, 3, 4, 5, 6], name
        # TensorBoard keeps float32: equal to the log's float64 within float32's rounding.
        expected = [row[name] for row in log]
        assert [value for _, value in scalars[f"train/{name}"]] == pytest.approx(expected, rel=2**-23, abs=1e-30), name
    # A run of other settings (or a forced one) starts from step 0, and its curves afresh.
    train_stage(
        inputs,
        settings | {"seed": 1},
        *(stage / n for n in ("adapter", "log.jsonl", "summary.json")),
        tmp_path / "ckpt",
        2,
        curves_dir=board,
    )
    assert [step for step, _ in tensorboard_scalars(board)["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert len(list(board.glob("events.out.tfevents.*"))) == 1


def test_each_logged_steps_time_is_its_own(small_stage, tmp_path):
    """A step's samples/s in the log is over that step's time alone (from the end of the step before):
    from the second step on, the steps' times (samples / samples_per_s) add up to the time between
    their log lines, less the first's. The slack is for the log lines' own writing, well under a
    millisecond each, with room for a busy machine's scheduler."""
    from vlft.training.train import train_stage

    inputs, settings = small_stage
    out = [tmp_path / name for name in ("adapter", "log.jsonl", "summary.json")]
    train_stage(inputs, settings | {"max_steps": 4, "micro_batch": 4}, *out, tmp_path / "ckpt", 100)
    log = read_jsonl(tmp_path / "log.jsonl")
    steps = [row["samples"] / row["samples_per_s"] for row in log]
    assert len(steps) == 4 and all(step > 0 for step in steps)
    assert sum(steps[1:]) <= log[-1]["time"] - log[0]["time"] + 0.05, (steps, [row["time"] for row in log])

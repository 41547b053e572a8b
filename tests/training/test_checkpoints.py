"""Training checkpoints: nothing pickled, written or loaded; a checkpoint of the older (pickled)
format is never loaded, and says so; a damaged one is set aside and the one before it serves."""

import pickle
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import KilledAfter, StopAfter

from vlft.errors import TrainingError

from vlft.files import read_jsonl
from vlft.training import checkpoints
from vlft.training.train import Preempted, train_stage


def train(small_stage, out: Path, stop=None, checkpoint_every: int = 1) -> dict:
    inputs, settings = small_stage
    paths = [out / name for name in ("adapter", "log.jsonl", "summary.json")]
    return train_stage(
        inputs, settings | {"max_steps": 4, "micro_batch": 4}, *paths, out / "ckpt", checkpoint_every, stop
    )


def run_dir(out: Path) -> Path:
    (directory,) = (out / "ckpt").iterdir()
    return directory


def test_checkpoints_hold_no_pickle_and_a_resumed_stage_unpickles_nothing(small_stage, tmp_path, monkeypatch):
    with pytest.raises(KeyboardInterrupt):
        train(small_stage, tmp_path, KilledAfter(3))
    saved = checkpoints.complete(run_dir(tmp_path))
    assert [checkpoint.name for checkpoint in saved] == ["step-00000001", "step-00000002"]  # killed in step 3
    for checkpoint in saved:
        assert sorted(p.name for p in checkpoint.iterdir()) == [
            "adapter.safetensors",
            "state.json",
            "state.safetensors",
        ]

    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    assert train(small_stage, tmp_path)["resumed_from_step"] == 2


def test_a_checkpoint_of_the_pickled_format_is_one_sentence_and_never_loaded(small_stage, tmp_path, capsys):
    """A replaced state.pt would run its code when unpickled (here: it would create a file)."""
    with pytest.raises(Preempted):
        train(small_stage, tmp_path, StopAfter(2))
    directory = run_dir(tmp_path)
    for checkpoint in checkpoints.complete(directory):  # as an earlier version left them
        (checkpoint / checkpoints.COMPLETE).unlink()
    ran = tmp_path / "ran"
    older = directory / "step-00000002" / checkpoints.OLDER_FORMAT
    older.write_bytes(pickle.dumps(RunsCode(str(ran))))
    summary = train(small_stage, tmp_path)
    assert summary["resumed_from_step"] == 0 and not ran.exists()
    said = capsys.readouterr().out
    assert (
        f"{older.parent}: a checkpoint of an earlier version, saved with pickle, which this version does not load"
        in said
    )
    assert [row["step"] for row in read_jsonl(tmp_path / "log.jsonl")] == [1, 2, 3, 4]


@pytest.mark.parametrize("damage", ["cut short", "emptied"])
def test_a_damaged_checkpoint_is_one_sentence_set_aside_and_the_one_before_serves(
    small_stage, tmp_path, capsys, damage
):
    with pytest.raises(KeyboardInterrupt):
        train(small_stage, tmp_path, KilledAfter(3))
    newest = checkpoints.latest(run_dir(tmp_path))
    damaged = newest / ("state.safetensors" if damage == "cut short" else checkpoints.COMPLETE)
    data = damaged.read_bytes()
    damaged.write_bytes(data[: len(data) // 2] if damage == "cut short" else b"")
    summary = train(small_stage, tmp_path)
    assert newest.name == "step-00000002" and summary["resumed_from_step"] == 1
    assert f"{newest}: damaged (" in capsys.readouterr().out
    assert [row["step"] for row in read_jsonl(tmp_path / "log.jsonl")] == [1, 2, 3, 4]


class RunsCode:
    """What a hostile pickle does when loaded: here, create a file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_checkpoint_altered_in_place_is_one_sentence_set_aside_and_the_one_before_serves(
    small_stage, tmp_path, capsys
):
    """The newest checkpoint's adapter weights rewritten, same size, still a valid safetensors file:
    its recorded checksum tells it apart, and the stage resumes from the one before."""
    with pytest.raises(KeyboardInterrupt):
        train(small_stage, tmp_path, KilledAfter(3))
    newest = checkpoints.latest(run_dir(tmp_path))
    adapter = newest / checkpoints.ADAPTER
    weights = load_file(adapter)
    size = adapter.stat().st_size
    save_file({name: torch.full_like(t, float("nan")) for name, t in weights.items()}, adapter)
    assert adapter.stat().st_size == size
    summary = train(small_stage, tmp_path)
    assert summary["resumed_from_step"] == 1
    said = capsys.readouterr().out
    assert f"{newest}: damaged (adapter.safetensors: its content differs from the checksum in state.json)" in said
    assert [row["step"] for row in read_jsonl(tmp_path / "log.jsonl")] == [1, 2, 3, 4]


def test_a_loss_that_is_not_a_finite_number_stops_the_stage_in_one_sentence_naming_the_step(small_stage, tmp_path):
    """A learning rate so large that the first update overflows: the next step's loss is not finite.
    The stage stops there, and no adapter is written to be evaluated (or win the report)."""
    inputs, settings = small_stage
    paths = [tmp_path / name for name in ("adapter", "log.jsonl", "summary.json")]
    with pytest.raises(TrainingError) as stopped:
        train_stage(
            inputs, settings | {"max_steps": 4, "micro_batch": 4, "learning_rate": 1e30}, *paths, tmp_path / "ckpt", 1
        )
    said = str(stopped.value)
    assert re.fullmatch(
        r"step [234] of 4: the loss is (nan|inf|-inf) and the gradient norm \S+, not finite numbers: the stage "
        r"stops here with no adapter \(a lower learning_rate or max_grad_norm, or rewards that stay finite, may avoid it\)",
        said,
    ), said
    assert not any(path.exists() for path in paths)

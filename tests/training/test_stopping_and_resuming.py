"""Stopping at a step boundary (a signal, the time limit) and resuming where a stage stopped."""

import json
import os
import shutil
import signal
import pytest
import torch
from safetensors.torch import load_file
from tests.helpers import FLOAT64_RTOL, StopAfter, assert_close_normwise, seven_step_stage
from vlft.jobs.stopping import RESERVE_S, StopRequest, slurm_end_time
from vlft.training.train import Preempted, train_stage


@pytest.fixture
def stop_request():
    """A StopRequest whose signal handlers are pytest's again afterwards."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    yield StopRequest
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def test_a_signal_stops_training_at_the_next_step_boundary(stop_request):
    stop = stop_request()
    assert stop.reason() is None
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.reason() == "SIGUSR1 received"
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the same stop, not a KeyboardInterrupt mid-step
    assert stop.reason() == "SIGINT received"


def test_the_time_limit_stops_training_while_two_slowest_steps_and_the_save_still_fit(stop_request):
    now = [1000.0]
    stop = stop_request(end_time=now[0] + RESERVE_S + 3.0, clock=lambda: now[0])
    assert stop.reason() is None  # no step measured yet: the reserve alone fits, 3 s to spare
    now[0] += 0.5
    assert stop.reason() is None  # reserve + 2 x 0.5 s fits in the 2.5 s left
    now[0] += 1.0
    assert stop.reason() == f"the job's time limit is {round(RESERVE_S + 1.5)} s away"  # reserve + 2 x 1 s does not fit


def test_the_job_end_time_comes_from_slurm_and_is_none_elsewhere(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    assert slurm_end_time() is None
    monkeypatch.setenv("SLURM_JOB_END_TIME", "1795336463")
    assert slurm_end_time() == 1795336463.0


def test_a_stopped_stage_resumes_from_its_checkpoint_and_ends_where_an_uninterrupted_one_does(tmp_path, tiny_model_dir):
    from vlft.demo.shapes import make_dataset

    make_dataset({"train": tmp_path / "train.jsonl"}, tmp_path / "images", {"train": 48}, seed=0)
    inputs, settings = seven_step_stage(
        tmp_path, tmp_path / "train.jsonl", tiny_model_dir, max_steps=6, lora_dropout=0.1
    )

    def run(name, stop=None, retry=False):
        out = tmp_path / name
        return (
            train_stage(
                inputs,
                settings,
                out / "adapter",
                out / "log.jsonl",
                out / "summary.json",
                out / "ckpt",
                2,
                stop,
                dtype=torch.float64,
                reuse_finished=retry,
            ),
            out,
        )

    _, whole = run("whole")
    with pytest.raises(Preempted, match="after step 3"):
        run("split", StopAfter(3))
    assert not (tmp_path / "split/adapter").exists()
    summary, split = run("split")
    assert summary["resumed_from_step"] == 3
    log = [json.loads(line) for line in (split / "log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == [1, 2, 3, 4, 5, 6]
    a = load_file(whole / "adapter/adapter_model.safetensors")
    b = load_file(split / "adapter/adapter_model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert_close_normwise(a[key], b[key], FLOAT64_RTOL, key)

    # A retry of a job that finished its steps but was stopped as it wrote its outputs (a late
    # time limit; Snakemake then deletes them) restores them from the kept result: nothing trains.
    # Only the finished result is kept; the checkpoints have served.
    assert sorted(p.name for p in (split / "ckpt").glob("*/*")) == [".vlft-run-directory", "finished"]
    before = {
        name: (split / name).read_bytes() for name in ("log.jsonl", "summary.json", "adapter/adapter_model.safetensors")
    }
    shutil.rmtree(split / "adapter")
    for name in ("log.jsonl", "summary.json"):
        (split / name).unlink()
    restored, _ = run("split", retry=True)
    assert restored == summary and {name: (split / name).read_bytes() for name in before} == before
    # A first attempt (a new run, or one forced with -f or -R) trains again.
    retrained, _ = run("split")
    assert retrained["resumed_from_step"] == 0 and retrained["wall_time_s"] != summary["wall_time_s"]

"""Training curves to W&B and MLflow beside TensorBoard (the config's `report_to`,
vlft.training.trackers), in their offline modes: the same numbers the stage's log holds, at its steps,
with the stage's settings as the run's config."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from vlft.files import read_jsonl


def wandb_records(path):
    """The records of an offline W&B run file (`run-<id>.wandb`): a 7-byte header (":W&B", magic,
    version), then LevelDB's log format: 32 KiB blocks of records each with a 7-byte header (crc32c,
    length, type: 1 full, 2 first, 3 middle, 4 last), every record one protobuf `Record`. wandb 0.31
    reads these files in its Go core only, so the test reads them here."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, pending = path.read_bytes(), 32768, 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def without_mlflow_variables(monkeypatch):
    for name in [name for name in os.environ if name.startswith("MLFLOW_")]:
        monkeypatch.delenv(name)


def test_a_stage_reports_its_curves_to_wandb_and_mlflow_offline_as_its_log_has_them(small_stage, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from vlft.training.train import train_stage

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # MLflow with no variable set, as a user first runs it: its default store in the study's directory.
    without_mlflow_variables(monkeypatch)
    monkeypatch.chdir(tmp_path)
    inputs, settings = small_stage
    settings = settings | {"max_steps": 4, "micro_batch": 4}
    results = tmp_path / "my-study"
    stage, board = results / "train/exp/stage", results / "tensorboard/exp/stage"
    out = (stage / "adapter", stage / "log.jsonl", stage / "summary.json")
    train_stage(inputs, settings, *out, tmp_path / "ckpt", 2, curves_dir=board, report_to=("wandb", "mlflow"))
    log = read_jsonl(stage / "log.jsonl")
    assert [row["step"] for row in log] == [1, 2, 3, 4]
    assert not board.exists()  # TensorBoard was not asked for

    # MLflow: an experiment named for the study, a run named for the stage, every step's loss, in
    # MLflow's default store, which `mlflow ui` run in the study's directory reads.
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("my-study").experiment_id])
    assert run.info.run_name == "exp/stage" and run.data.params["learning_rate"] == str(settings["learning_rate"])
    history = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(row["step"], pytest.approx(row["loss"], rel=1e-15)) for row in log]

    # W&B: the offline run under the study's results (wandb/), named for the stage, every step's
    # loss at its step, the stage's settings as its config.
    [run_file] = (results / "wandb").glob("wandb/offline-run-*/run-my-study-exp-stage.wandb")
    records = list(wandb_records(run_file))
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "exp/stage" and run.project == "my-study"
    steps = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            steps.append((items["_step"], items["train/loss"]))
    assert steps == [(row["step"], pytest.approx(row["loss"], rel=1e-15)) for row in log]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["learning_rate"] == settings["learning_rate"] and config["lora_r"] == settings["lora_r"]


OPEN_A_RUN = """
import sys
from vlft.training.trackers import MlflowRun
run = MlflowRun("my-study", sys.argv[1], {"learning_rate": 1e-4})
run.log({"train/loss": 1.5}, step=1)
run.close()
"""


def test_stages_starting_at_once_share_mlflow_s_default_store(tmp_path, monkeypatch):
    """Parallel stages of one study open MLflow's default SQLite store at the same moment; the first
    opening creates and migrates its tables, which two jobs doing at once break for both."""
    from mlflow.tracking import MlflowClient

    without_mlflow_variables(monkeypatch)
    names = [f"exp{i}/stage" for i in range(4)]
    jobs = [
        subprocess.Popen([sys.executable, "-c", OPEN_A_RUN, name], cwd=tmp_path, stderr=subprocess.PIPE)
        for name in names
    ]
    for job in jobs:
        assert job.wait(timeout=300) == 0, job.stderr.read().decode()[-2000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("my-study").experiment_id])
    assert sorted(run.info.run_name for run in runs) == names

"""Experiment trackers beside TensorBoard: the config's `report_to` (transformers' and LLaMA-Factory's
name), any of tensorboard, wandb and mlflow. Each is the library's own client, configured the way its
users configure it everywhere else, by its environment variables: W&B's WANDB_PROJECT (default: the
study's results directory's name), WANDB_MODE=offline, WANDB_DIR; MLflow's MLFLOW_TRACKING_URI
(default: MLflow's own, the SQLite file ./mlflow.db in the study's directory, which `mlflow ui` run there
reads), MLFLOW_EXPERIMENT_NAME (default: as W&B's project).

One run a stage, named <experiment>/<stage>, with the stage's settings as its config/params; every
scalar the TensorBoard run gets goes to each tracker at the same step (vlft.training.curves). A stage
resumed from a checkpoint goes on in the same W&B run (its id is the stage's); MLflow starts a run
per attempt, as its runs cannot be reopened across processes without the id, named the same.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path

from filelock import FileLock

TRACKERS = ("tensorboard", "wandb", "mlflow")
# What each tracker imports; MLflow's default SQLite store migrates its tables with alembic.
PACKAGES = {"wandb": ("wandb",), "mlflow": ("mlflow", "alembic", "sqlalchemy")}


def missing_packages(report_to: list[str]) -> list[str]:
    """The trackers named whose package is not installed here (checked as a study is planned)."""
    return [
        name
        for name in report_to
        if any(importlib.util.find_spec(package) is None for package in PACKAGES.get(name, ()))
    ]


def flat(settings: dict, prefix: str = "") -> dict:
    """Nested settings as one level of `a.b` keys (MLflow's params are flat)."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


class WandbRun:
    def __init__(self, study: str, run: str, settings: dict, directory: Path):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", study),
            name=run,
            # The stage's own id: a resumed attempt goes on in the same run.
            id=f"{study}-{run}".replace("/", "-"),
            resume="allow",
            config=settings,
            dir=os.environ.get("WANDB_DIR", str(directory)),
        )

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def creating_the_store(tracking_uri: str):
    """A lock beside a SQLite store while a job opens it: the first opening creates and migrates its
    tables, and two jobs doing that at once (parallel stages of one study) break each other's
    migration. Other stores need none."""
    if not tracking_uri.startswith("sqlite:///"):
        return contextlib.nullcontext()
    return FileLock(tracking_uri.removeprefix("sqlite:///") + ".lock")


class MlflowRun:
    def __init__(self, study: str, run: str, settings: dict):
        import mlflow

        self.mlflow = mlflow
        with creating_the_store(mlflow.get_tracking_uri()):
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", study))
        self.run = mlflow.start_run(run_name=run)
        mlflow.log_params({k: str(v)[:6000] for k, v in flat(settings).items()})

    def log(self, scalars: dict, step: int) -> None:
        self.mlflow.log_metrics({name: float(value) for name, value in scalars.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def open_trackers(report_to: list[str], log_dir: Path, settings: dict) -> list:
    """The trackers other than TensorBoard (vlft.training.curves writes that one), for the stage whose
    TensorBoard run is `log_dir` (<results>/tensorboard/<experiment>/<stage>)."""
    results, run = log_dir.parents[2], f"{log_dir.parent.name}/{log_dir.name}"
    opened = []
    if "wandb" in report_to:
        opened.append(WandbRun(results.resolve().name, run, settings, results / "wandb"))
    if "mlflow" in report_to:
        opened.append(MlflowRun(results.resolve().name, run, settings))
    return opened

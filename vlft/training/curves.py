"""Live training curves in TensorBoard: one run a stage, under results/tensorboard/<experiment>/<stage>,
so that `tensorboard --logdir results/tensorboard` shows every stage of a study side by side while
they train; the same scalars to W&B and MLflow where the config's `report_to` names them
(vlft.training.trackers).

The per-step log (log.jsonl) stays the record the report reads; these are the same numbers, written
as they come. A stage resumed from a checkpoint continues its curves: TensorBoard's purge step drops
what the stopped attempt wrote past the checkpoint, the steps now trained again. A stage that starts
from step 0 (new settings, or a forced rerun) starts its curves afresh.
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from vlft.files import remove_inside
from vlft.training.trackers import open_trackers

# The per-step log's fields drawn, each as train/<name>, besides the training method's own metrics
# (vlft.training.methods: DPO's rewards, say).
SCALARS = ("loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "memory_gb")
FLUSH_S = 30  # how stale a curve may be while a stage trains
EVENTS = "events.out.tfevents."  # how SummaryWriter names the files it writes


class Curves:
    def __init__(
        self,
        log_dir: str | Path,
        first_step: int,
        steps_before: int = 0,
        metrics: tuple[str, ...] = (),
        report_to: tuple[str, ...] = ("tensorboard",),
        settings: dict | None = None,
    ):
        """`first_step`: the steps already done, restored from a checkpoint (0 for none);
        `steps_before`: those of the stages this one starts from, after which its curves go on;
        `metrics`: the training method's, drawn too; `report_to`: where to (`settings`: the stage's,
        each tracker's record of the run)."""
        self.names = SCALARS + tuple(m for m in metrics if m not in SCALARS)
        log_dir = Path(log_dir)
        self.offset = steps_before
        self.writer = None
        if "tensorboard" in report_to:
            if first_step == 0:  # the stage's earlier curves: TensorBoard's event files, nothing else there
                for events in log_dir.glob(f"{EVENTS}*"):
                    remove_inside(events, log_dir)
            # Steps are counted from 1 in the log: the purge drops what the stopped attempt wrote after first_step.
            purge = steps_before + first_step + 1 if first_step else None
            self.writer = SummaryWriter(log_dir, purge_step=purge, flush_secs=FLUSH_S)
        self.trackers = open_trackers(report_to, log_dir, settings or {})

    def add(self, record: dict) -> None:
        """One line of the per-step log."""
        self.add_scalars({f"train/{name}": record[name] for name in self.names}, record["step"])

    def add_scalars(self, scalars: dict, step: int) -> None:
        for name, value in scalars.items():
            if self.writer is not None:
                self.writer.add_scalar(name, value, self.offset + step)
        for tracker in self.trackers:
            tracker.log(scalars, self.offset + step)

    def add_evaluation(self, record: dict) -> None:
        """An evaluation during training (vlft.training.step_evals): accuracy, by category, validation loss."""
        scalars = {"eval/accuracy": record["accuracy"], "eval/loss": record["loss"]}
        scalars |= {f"eval/accuracy/{category}": v for category, v in record["accuracy_by_category"].items()}
        self.add_scalars(scalars, record["step"])

    def __enter__(self) -> "Curves":
        return self

    def __exit__(self, *exc) -> None:
        if self.writer is not None:
            self.writer.close()
        for tracker in self.trackers:
            tracker.close()

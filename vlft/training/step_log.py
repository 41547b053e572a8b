"""What a stage says as it trains: the per-step log (log.jsonl), its live curves (vlft.training.curves)
and the progress bar, kept together so the loop reports a step or an evaluation in one call."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from vlft.jobs.progress import progress_line

from vlft.files import storage_error
from vlft.training.curves import Curves
from vlft.training.step_evals import describe


class StepLog:
    """The main process writes; the others' calls are no-ops. Use as a context manager: the bar is
    closed (its line ended) however the loop ends, so an error's line starts a line of its own."""

    def __init__(
        self,
        path: Path,
        total_steps: int,
        first_step: int,
        name: str,
        curves: Curves | None,
        device: torch.device,
        is_main: bool,
    ):
        """`curves`: the main process's live curves, closed with the log (None: none)."""
        self.path, self.device, self.is_main = path, device, is_main
        self.progress = progress_line(total_steps, name, initial=first_step, shown=is_main)
        self.curves = curves
        self.clock = time.time()  # a step's time runs from the end of the one before: waits included

    def __enter__(self) -> "StepLog":
        self._stack = ExitStack()
        self._stack.enter_context(self.progress)
        if self.curves:
            self._stack.enter_context(self.curves)
        self.file = self._stack.enter_context(open(self.path if self.is_main else os.devnull, "a"))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def step(self, step: int, fields: dict, lr: float, grad_norm: float, samples: list) -> None:
        """One optimizer step done: its line in the log and the curves, the bar moved on."""
        elapsed, self.clock = time.time() - self.clock, time.time()
        record = {
            "step": step,
            **fields,
            "lr": lr,  # the scheduled learning rate the step used
            "grad_norm": grad_norm,
            "samples": len(samples),
            "samples_per_s": len(samples) / elapsed,
            "tokens_per_s": sum(len(s.input_ids) for s in samples) / elapsed,
            "memory_gb": memory_gb(self.device),
            "time": time.time(),
        }
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as err:
            raise storage_error(err, self.path) or err
        if self.curves:
            self.curves.add(record)
        # Redrawn by update() at most every `mininterval` seconds, so SLURM logs stay small.
        self.progress.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)
        self.progress.update(1)

    def evaluation(self, record: dict) -> None:
        """An evaluation during training, above the progress bar (stderr): in a job's log, a line of its own."""
        self.progress.write(describe(record), file=sys.stderr)
        if self.curves:
            self.curves.add_evaluation(record)

    def note(self, line: str, scalars: dict, step: int | None = None) -> None:
        """A measurement beside the steps (a preference stage's held-out pairs): its line above the
        bar, its curves at `step` (default: the last step logged)."""
        self.progress.write(line, file=sys.stderr)
        if self.curves:
            self.curves.add_scalars(scalars, self.progress.n if step is None else step)

    def restart_clock(self) -> None:
        """The next step's time starts now: what came between (an evaluation, a checkpoint) is left out."""
        self.clock = time.time()


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def throughput(rows: list[dict]) -> dict:
    """The stage's speed and memory, from its per-step log."""
    return {
        "samples_per_s": sum(r["samples_per_s"] for r in rows) / len(rows),
        "tokens_per_s": sum(r["tokens_per_s"] for r in rows) / len(rows),
        "peak_memory_gb": max(r["memory_gb"] for r in rows),
        "final_loss": rows[-1]["loss"],
    }

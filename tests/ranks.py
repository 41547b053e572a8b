"""Processes that stand in for a data-parallel job's ranks in the tests that train in several
processes over gloo, kept from one test to the next: `spawn(target, args, nprocs)` runs
`target(rank, *args)` in ranks 0 to nprocs - 1, as torch.multiprocessing.spawn does, without each
test starting fresh processes. A fresh process imports torch, transformers, peft and the test's
module before it does anything, seconds of CPU each, which over the suite's data-parallel tests
came to minutes of CI's 2 cores.

A rank keeps nothing of one test for the next but its imports: every target sets the environment
torchrun would set, joins a process group and leaves it, as the test process itself trains stage
after stage (tests/helpers.py's train_float64). What a rank prints during a task comes back to the
test's own output (where capfd reads it), as a spawned process's inherited output would; a rank
that raises fails the call with its traceback, and the other ranks, which may wait on it in a
collective, are ended and started afresh for the next test."""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
import tempfile
import time
import traceback

TASK_TIMEOUT_S = 900  # a test's few steps take seconds; a loaded 2-core machine, many times that


def _serve(rank: int, tasks, results) -> None:
    """A rank's loop: each task's output into a file of its own, then (its traceback or None, the file)."""
    while (task := tasks.get()) is not None:
        target, args = task
        with tempfile.NamedTemporaryFile(delete=False, prefix=f"rank{rank}-") as said:
            kept = _output_to(said.fileno())
            try:
                target(rank, *args)
                failure = None
            except BaseException:  # a rank reports whatever ended its task
                failure = traceback.format_exc()
            finally:
                for fd in (*_output_to(*kept), *kept):
                    os.close(fd)
        results.put((failure, said.name))


def _output_to(out: int, err: int | None = None) -> tuple[int, int]:
    """Points this process's standard output and error at `out` (and `err`); returns copies of the
    ones they replace."""
    sys.stdout.flush()
    sys.stderr.flush()
    kept = os.dup(1), os.dup(2)
    os.dup2(out, 1)
    os.dup2(out if err is None else err, 2)
    return kept


def _replay(said: str) -> None:
    """A rank's output of a task, onto this process's standard output (where a test's output is
    captured, as a spawned child's inherited output would be), and its file removed."""
    with open(said, "rb") as output:
        data = memoryview(output.read())
    while data:
        data = data[os.write(1, data) :]
    os.unlink(said)


class _Ranks:
    def __init__(self):
        self._context = multiprocessing.get_context("spawn")
        self._ranks: list[tuple] = []  # (process, tasks, results), rank by rank

    def _start(self, rank: int) -> tuple:
        tasks, results = self._context.SimpleQueue(), self._context.Queue()
        process = self._context.Process(target=_serve, args=(rank, tasks, results), daemon=True)
        process.start()
        return process, tasks, results

    def spawn(self, target, args: tuple, nprocs: int) -> None:
        while len(self._ranks) < nprocs:
            self._ranks.append(self._start(len(self._ranks)))
        for _, tasks, _ in self._ranks[:nprocs]:
            tasks.put((target, args))
        pending, failures, deadline = set(range(nprocs)), [], time.time() + TASK_TIMEOUT_S
        while pending and not failures and time.time() < deadline:
            for rank in sorted(pending):
                process, _, results = self._ranks[rank]
                try:
                    failure, said = results.get(timeout=0.2)
                except queue.Empty:
                    if not process.is_alive():
                        failures.append(f"rank {rank} ended (exit code {process.exitcode})")
                        pending.discard(rank)
                    continue
                pending.discard(rank)
                _replay(said)
                if failure:
                    failures.append(f"rank {rank} raised:\n{failure}")
        if failures or pending:  # a rank failed, or ran out of time: every rank starts afresh
            for rank, (process, _, _) in enumerate(self._ranks[:nprocs]):
                process.kill()
                process.join()
                self._ranks[rank] = self._start(rank)
        if pending and not failures:
            failures = [f"ranks {sorted(pending)} still ran after {TASK_TIMEOUT_S} s"]
        if failures:
            raise RuntimeError("\n".join(failures))


_RANKS = _Ranks()


def spawn(target, args: tuple, nprocs: int) -> None:
    """`target(rank, *args)` in each of `nprocs` ranks, as torch.multiprocessing.spawn runs it."""
    _RANKS.spawn(target, args, nprocs)

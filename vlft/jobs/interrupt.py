"""Ctrl-C for the Snakemake driver alone (`kill -INT` on it, or a terminal that signals it only): its
running jobs stop the way a terminal's Ctrl-C stops them, a training job with a checkpoint at its
next step boundary (vlft.jobs.stopping), and the driver waits for them and records how each ended before
it exits, so that the rerun resumes from their checkpoints.

Snakemake's own answer to SIGINT tells the jobs nothing and waits for them: a training job ran on
to its end, its outputs were then taken for incomplete, and the rerun trained the whole stage
again. Jobs on SLURM keep Snakemake's answer: it cancels them (scancel), and the trainer saves a
checkpoint on the SIGTERM that follows.
"""

from __future__ import annotations

import signal
import sys
import threading

import psutil  # a dependency of Snakemake's


def stop_jobs_on_interrupt(workflow) -> None:
    """Install the driver's SIGINT handler; `workflow` is the Snakefile's, asked at the signal
    (the executor is known only once the workflow runs)."""

    def interrupted(signum, frame):
        # A second Ctrl-C is Snakemake's own again: stop waiting at once.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # Snakemake's graceful stop, which its scheduler installs for SIGTERM: no new jobs, wait
        # for the running ones and record their ends. Absent before the scheduler starts.
        graceful = signal.getsignal(signal.SIGTERM)
        if not workflow.local_exec or not callable(graceful):
            raise KeyboardInterrupt
        jobs = psutil.Process().children(recursive=True)
        print(
            f"Ctrl-C: stopping {len(jobs)} process(es) of running jobs; a training job saves a checkpoint at its "
            "next step and the next run resumes from it. Ctrl-C again stops at once.",
            file=sys.stderr,
            flush=True,
        )
        for process in jobs:
            try:
                process.send_signal(signal.SIGINT)
            except psutil.NoSuchProcess:
                pass
        # In a thread: the handler runs in the scheduler's thread, which may hold the lock that
        # the graceful stop takes.
        threading.Thread(target=graceful, args=(signal.SIGTERM, None), daemon=True).start()

    signal.signal(signal.SIGINT, interrupted)

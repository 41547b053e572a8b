"""The Snakemake driver's own process: what it sets up before it starts jobs, and what its jobs
inherit from it. Called once from the Snakefile, after the config is read."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from vlft.jobs.interrupt import stop_jobs_on_interrupt


def set_up_driver(workflow, results: str) -> None:
    # SLURM's early warning before a time limit (`--signal=USR1@...`, see profiles/slurm) goes to
    # every process of the job, Snakemake's own included, and USR1's default action is to exit.
    # Snakemake ignores it, so that the job lives on while the trainer saves a checkpoint.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if workflow.is_main_process:
        # Ctrl-C to the driver stops its jobs at a checkpoint, and the driver records their ends (vlft.jobs.interrupt).
        stop_jobs_on_interrupt(workflow)
    # torch.compile's artifacts (inductor's graphs and Triton kernels) where every later job of the
    # study finds them, on this machine or, through SLURM, on another node that shares the results
    # directory: a job then compiles from the cache in seconds instead of about a minute. Jobs inherit
    # it (the local executor's subprocesses; a SLURM job parses the Snakefile again). A
    # TORCHINDUCTOR_CACHE_DIR of one's own wins.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(results).resolve() / ".cache/torch-compile"))
    # Jobs on this machine hand their scripts to a warm process that imported torch, transformers and
    # peft once, rather than each importing them anew (vlft.jobs.warm_start; never under SLURM). 0 turns it off.
    os.environ.setdefault("VLFT_WARM_START", "1")

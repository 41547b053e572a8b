"""The Snakemake driver's own process: what it sets up before it starts jobs, and what its jobs
inherit from it. Called once from the Snakefile, after the config is read."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from vlft.jobs.interrupt import stop_jobs_on_interrupt


def unwritable_records(directory: str) -> str | None:
    """Why Snakemake could not keep its records of the study run from `directory` (.snakemake/: its
    lock, its file cache, which even a dry run rewrites, its records of outputs), or None: another
    user's study, or one on a read-only file system, otherwise ends in Snakemake's traceback."""
    records = Path(directory, ".snakemake")
    needed = (
        [records, *(p for p in records.iterdir() if p.is_dir()), records / "iocache/latest.pkl"]
        if records.is_dir()
        else [Path(directory)]
    )
    blocked = next((path for path in needed if path.exists() and not os.access(path, os.W_OK)), None)
    if blocked is None:
        return None
    return (
        f"Snakemake keeps this study's records and lock in {records}, and {blocked} is not writable by you "
        f"(uid {os.getuid()}; it belongs to uid {blocked.stat().st_uid}): even a dry run writes there, so run "
        f"the study as its owner, or copy it to a directory of your own (cp -a {directory} <yours>) and run it there."
    )


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

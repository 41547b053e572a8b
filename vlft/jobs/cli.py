"""What the command-line entry points share: a first line saying where the job runs, and bad input
ending in one line naming the file and line, not a traceback; Ctrl-C too ends in one line."""

from __future__ import annotations

import os
import re
import socket
import sys
import time
import warnings
from datetime import datetime
from pathlib import Path

from vlft.jobs import warm_start
from vlft.errors import ConfigError, DeviceError, InputError, StorageError, TrainingError


def describe_placement() -> str:
    """Host and the GPUs this job may use, as SLURM or vlft.jobs.gpus handed them out: a GPU job
    shows its own CUDA_VISIBLE_DEVICES, a CPU job on SLURM shows none."""
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "none")
    job = os.environ.get("SLURM_JOB_ID")
    where = f"host {socket.gethostname()}" + (f", SLURM job {job}" if job else "")
    warm = " (run by a warm process, vlft.jobs.warm_start)" if warm_start.serving_a_job() else ""
    return f"{where}, CUDA_VISIBLE_DEVICES={gpus}; started {datetime.now():%Y-%m-%d %H:%M:%S.%f}{warm}"


def add_cpu_fallback_argument(parser) -> None:
    """Whether a job that asked for GPUs may run on the CPU where none is usable (vlft.modeling.require_gpus)."""
    parser.add_argument(
        "--cpu-fallback",
        type=int,
        choices=[0, 1],
        default=0,
        help="1: run on the CPU where no GPU is usable (the config's cpu_fallback)",
    )


def add_predicted_argument(parser) -> None:
    """The job's time as the plan predicted it (vlft.study_costs), to set beside what it took."""
    parser.add_argument("--predicted-seconds", type=int, default=0, help="the plan's prediction; 0: none")


# When the job's process started: its launcher's time where one handed it over (vlft.jobs.launch),
# else this module's import, at the script's start.
JOB_STARTED = "VLFT_JOB_STARTED"
_IMPORTED_AT = time.time()


def job_started() -> float:
    return float(os.environ.get(JOB_STARTED) or _IMPORTED_AT)


def say_took_at_exit(predicted_s: int) -> None:
    """The job's last line, once its outputs are written: what it took, from its launcher's start to
    the end of its exit, beside the plan's prediction. Said last, so that it counts what the job's
    process does at exit: torch's compile workers are shut down then (seconds, where the pool had not
    finished starting: benchmarks/README.md), and the
    job's time limit and its place on the GPU last until it is done."""
    import atexit

    def say() -> None:
        workers = sys.modules.get("torch._inductor.async_compile")
        if workers is not None:  # what torch's own exit handler would do next: here, inside the time
            workers.shutdown_compile_workers()
        print(took_line(predicted_s, time.time() - job_started()), flush=True)

    atexit.register(say)  # registered last, so run first: before the handlers that ran at import


TOOK = re.compile(r"^took (\d+) s", re.M)


def took_seconds(log: Path) -> int | None:
    """What a finished job took, launch to exit, from its log's last line (None where it has none)."""
    try:
        with open(log, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - 400))
            found = TOOK.findall(handle.read().decode(errors="replace"))
    except OSError:
        return None
    return int(found[-1]) if found else None


def took_line(predicted_s: int, took: float) -> str:
    """What the job took, in seconds, beside the plan's prediction."""
    if not predicted_s:
        return f"took {took:.0f} s (not predicted: its data or model was made by the same run)"
    return f"took {took:.0f} s, predicted {predicted_s} s ({took / predicted_s:.2f} of the prediction)"


def set_cpu_threads(threads: int) -> None:
    """Keep torch's CPU work inside the CPUs the job was given."""
    import torch

    torch.set_num_threads(max(1, threads))


# Warnings of the libraries' own API changes (transformers' "past_key_values is deprecated",
# "is_gradient_checkpointing is deprecated", torch's): addressed to this code, not to the researcher
# reading a job's output, where they were 77 of the demo's lines. Anything else still shows.
LIBRARY_DEPRECATIONS = r"(transformers|torch|peft|accelerate|huggingface_hub)(\.|$)"


def run(main) -> None:
    rank = os.environ.get("RANK")
    script = os.path.basename(sys.argv[0])
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=LIBRARY_DEPRECATIONS)
    try:
        # Said once a job: the processes of a data-parallel job (started with RANK set) say it
        # through the process that started them. On stdout: stderr stays for errors, one line each.
        if rank is None:
            print(f"{script}: {describe_placement()}", flush=True)
        main()
    except (InputError, ConfigError, DeviceError, StorageError, TrainingError) as err:
        if rank in (None, "0"):
            print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        # Ended here by SIGINT, after the exit handlers, as Python ends on an uncaught
        # KeyboardInterrupt: the job's shell and a warm start's job process read it as an interrupted
        # job. Python's own ending gives exit status 1 instead where scikit-learn is imported (peft
        # imports it), and it would wait for the job's other threads, one maybe stuck on what was
        # interrupted.
        warm_start.end_interrupted(say=rank in (None, "0"))

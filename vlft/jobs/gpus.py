"""GPUs of their own for jobs that run side by side on one machine, or inside one SLURM allocation.

Snakemake counts GPUs (`--resources gpu=N`) but hands out no GPU ids, so every job would open GPU 0.
So each GPU job, before its script starts, claims the number of GPUs the rule asked for from the
GPUs it can see, and narrows CUDA_VISIBLE_DEVICES to them (vlft.jobs.launch --gpus N, the job's
first process):

    python -m vlft.jobs.launch --gpus {resources.gpu} scripts/...

Before the script: CUDA reads CUDA_VISIBLE_DEVICES once, and an import that asks whether CUDA is
available fixes it before the script's own code could change it. The claims live
in one small JSON file per user, machine and allocation, changed under an exclusive lock (flock);
a claim belongs to a process (the job's launcher, which becomes the script or waits for the warm
process running it) and ends with it, so a crashed job's GPUs are free
again at once. A job that SLURM placed on GPUs of its own (the SLURM profile: an allocation per
job) claims all of them; a script started by hand claims nothing and sees every GPU, as before.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# Seconds between looks at the claims while all GPUs are held (only by jobs outside Snakemake's
# count: another Snakemake run's, or more GPU jobs than `--resources gpu=N` would have allowed).
POLL_S = 2.0


def visible_gpus() -> list[str]:
    """The GPU ids this process may use: CUDA_VISIBLE_DEVICES where it is set (a SLURM job's
    allocation, or the user's choice), else every GPU the NVIDIA driver lists."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [gpu.strip() for gpu in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if gpu.strip()]
    driver = Path("/proc/driver/nvidia/gpus")
    return [str(index) for index in range(len(list(driver.iterdir())))] if driver.is_dir() else []


def claims_file() -> Path:
    """One per user and host, and per SLURM allocation: jobs of one allocation share its GPUs, jobs
    of different allocations on one node never see each other's."""
    scope = os.environ.get("SLURM_JOB_ID", "local")
    return Path(tempfile.gettempdir()) / f"vlft-gpu-claims-{os.getuid()}-{scope}.json"


def process_identity(pid: int) -> str | None:
    """`pid` with its start time (clock ticks since boot), or None where no such process runs (an
    exited one not yet reaped by its parent, a zombie, counts as gone). A pid alone is not enough:
    the kernel reuses pids, and a claims file left by an earlier run (a SLURM cluster numbers its
    jobs from 1 again after a restart) could name a pid some unrelated process now has, holding a
    GPU forever."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()  # fields 3.. of proc(5): state first, starttime 20th
    return None if fields[0] == "Z" else f"{pid}@{fields[19]}"


def take_gpus(count: int, pool: list[str], pid: int, path: Path) -> list[str]:
    """Record `count` GPUs of `pool` that no living process holds as `pid`'s, in the claims file
    at `path`; wait while fewer are free. A claim names its process by pid and start time; one
    whose process has gone, or whose pid now belongs to another process, is free."""
    if count > len(pool):
        raise RuntimeError(f"this job asks for {count} GPUs, but only {len(pool)} are visible ({','.join(pool)})")
    said_waiting, owner = False, process_identity(pid)
    if owner is None:
        raise RuntimeError(f"process {pid}, which the GPUs would be claimed for, is not running")
    while True:
        with open(path, "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
            handle.seek(0)
            text = handle.read()
            claims = json.loads(text) if text.strip() else {}
            held = {gpu: who for gpu, who in claims.items() if process_identity(int(str(who).split("@")[0])) == who}
            free = [gpu for gpu in pool if gpu not in held]
            if len(free) >= count:
                held.update({gpu: owner for gpu in free[:count]})
                handle.seek(0)
                handle.truncate()
                handle.write(json.dumps(held))
                return free[:count]
        if not said_waiting:
            print(f"waiting for {count} free GPU(s) of {','.join(pool)}: held by processes {held}", file=sys.stderr)
            said_waiting = True
        time.sleep(POLL_S)


def claim(count: int, pid: int) -> str | None:
    """Claim `count` GPUs for process `pid` and make them this process's only ones (its
    CUDA_VISIBLE_DEVICES, which the processes it starts inherit); None where there is nothing to
    claim (no GPU here, or `count` 0), so that the job runs as it would have. A claim that cannot be
    met, or Ctrl-C while waiting for one, ends the process in one line."""
    pool = visible_gpus()
    if count <= 0 or not pool:
        return None
    try:
        claimed = ",".join(take_gpus(count, pool, pid, claims_file()))
    except RuntimeError as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:  # Ctrl-C while the job waits for a GPU: one line, as a script's own
        from vlft.jobs.warm_start import end_interrupted

        end_interrupted()
    os.environ["CUDA_VISIBLE_DEVICES"] = claimed
    return claimed


def main(argv: list[str]) -> None:
    """`python -m vlft.jobs.gpus COUNT PID`: claim COUNT GPUs for process PID and print the shell line
    that makes them its only ones; print nothing where there is nothing to claim. (The workflow's
    jobs claim theirs through vlft.jobs.launch; this is for a shell of one's own.)"""
    if (claimed := claim(int(argv[0]), int(argv[1]))) is not None:
        print(f"export CUDA_VISIBLE_DEVICES={claimed}")


if __name__ == "__main__":
    main(sys.argv[1:])

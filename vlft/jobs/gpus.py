"""GPUs of their own for jobs that run side by side on one machine, or inside one SLURM allocation.

Snakemake counts GPUs (`--resources gpu=N`) but hands out no GPU ids, so every job would open GPU 0.
So each GPU job, before its script starts, claims the number of GPUs the rule asked for from the
GPUs it can see, and narrows CUDA_VISIBLE_DEVICES to them (vlft.jobs.launch --gpus N, the job's
first process):

    python -m vlft.jobs.launch --gpus {resources.gpu} scripts/...

Before the script: CUDA reads CUDA_VISIBLE_DEVICES once, and an import that asks whether CUDA is
available fixes it before the script's own code could change it. The claims live
in one small JSON file per user, machine and allocation, changed under an exclusive lock (flock), and
read by the other users' jobs, which avoid the GPUs it claims but never wait on them;
a claim belongs to a process (the job's launcher, which becomes the script or waits for the warm
process running it) and ends with it, so a crashed job's GPUs are free
again at once. A job that SLURM placed on GPUs of its own (the SLURM profile: an allocation per
job) claims all of them; a script started by hand claims nothing and sees every GPU, as before.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import stat
import sys
import tempfile
import time
from contextlib import contextmanager
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


PREFIX = "vlft-gpu-claims-"  # then <uid>-<scope>.json: one file a user, machine and allocation


def scope() -> str:
    """Jobs of one SLURM allocation share its GPUs; jobs of different allocations on one node never
    see each other's; outside SLURM, every job of the machine counts."""
    return os.environ.get("SLURM_JOB_ID", "local")


def claims_file() -> Path:
    """Where this user's jobs keep their claims: in the temporary directory, where every user's jobs
    read each other's (so that two users' studies take distinct GPUs where there are enough). Where
    another user made that name first, or made it a link, this user's claims go to a directory only
    they can write instead (XDG_RUNTIME_DIR, else ~/.cache/vlft), said in one line: the jobs run as
    before, other users' jobs just do not see their claims."""
    shared = Path(tempfile.gettempdir()) / f"{PREFIX}{os.getuid()}-{scope()}.json"
    if (problem := not_own_file(shared)) is None:
        return shared
    private = Path(os.environ.get("XDG_RUNTIME_DIR") or Path.home() / ".cache/vlft")
    private.mkdir(parents=True, exist_ok=True)
    print(f"{shared} {problem}: this user's GPU claims are kept in {private} instead", file=sys.stderr)
    return private / f"{PREFIX}{socket.gethostname()}-{scope()}.json"


def not_own_file(path: Path) -> str | None:
    """Why `path` cannot be this user's claims file (another user's, a link, not a regular file), or
    None where it is, or where it does not exist yet."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(status.st_mode) or not stat.S_ISREG(status.st_mode):
        return "is not a regular file"
    if status.st_uid != os.getuid():
        return f"belongs to uid {status.st_uid}"
    return None


def open_own(path: Path) -> int:
    """A descriptor of this user's claims file, made where it is absent; never through a link, never a
    file another user owns (checked on the opened file itself, so that one put there between a look
    and the open is refused too), and writable by this user alone from now on."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    status = os.fstat(descriptor)
    if status.st_uid != os.getuid():
        os.close(descriptor)
        raise RuntimeError(f"{path}: not this user's own file (it belongs to uid {status.st_uid})")
    if status.st_mode & 0o022:  # made under a umask that lets the group (or all) write: no longer
        os.fchmod(descriptor, 0o644)
    return descriptor


def other_users_claims(directory: Path, pool: list[str]) -> dict[str, str]:
    """The GPUs of `pool` that other users' jobs hold now: from each other user's claims file in
    `directory`, only the claims of a living process of that very user (a file names its owner; a
    claim for a pid of someone else's, pid 1 say, or of a process gone, is nothing)."""
    held = {}
    for path in directory.glob(f"{PREFIX}*-{scope()}.json"):
        owner = path.name.removeprefix(PREFIX).split("-", 1)[0]
        try:
            status = os.lstat(path)
            if not owner.isdigit() or int(owner) in (os.getuid(),) or status.st_uid != int(owner):
                continue
            if not stat.S_ISREG(status.st_mode):
                continue
            claims = json.loads(path.read_text() or "{}")
        except (OSError, ValueError):
            continue
        for gpu, who in claims.items() if isinstance(claims, dict) else ():
            if gpu in pool and living_claim(str(who), int(owner)):
                held[gpu] = f"uid {owner}'s process {str(who).split('@')[0]}"
    return held


def living_claim(who: str, uid: int) -> bool:
    """Whether claim `who` (pid@start time) names a process that runs now, as user `uid`."""
    pid = who.split("@")[0]
    if not pid.isdigit() or process_identity(int(pid)) != who:
        return False
    try:
        return os.stat(f"/proc/{pid}").st_uid == uid
    except OSError:
        return False


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
    """Record `count` GPUs of `pool` that no living process holds as `pid`'s, in this user's claims
    file at `path`; wait while fewer are free of this user's own claims. A claim names its process by
    pid and start time; one whose process has gone, or whose pid now belongs to another process, is
    free. Other users' claims (their files beside `path`) are avoided where enough GPUs are free of
    them, and otherwise shared, said in one line: they never make a job wait, so that nothing another
    user writes decides whether this user's jobs run."""
    if count > len(pool):
        raise RuntimeError(f"this job asks for {count} GPUs, but only {len(pool)} are visible ({','.join(pool)})")
    said_waiting, owner = False, process_identity(pid)
    if owner is None:
        raise RuntimeError(f"process {pid}, which the GPUs would be claimed for, is not running")
    while True:
        with os.fdopen(open_own(path), "r+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
            text = handle.read()
            claims = json.loads(text) if text.strip() else {}
            held = {gpu: who for gpu, who in claims.items() if living_claim(str(who), os.getuid())}
            free = [gpu for gpu in pool if gpu not in held]
            if len(free) >= count:
                others = other_users_claims(path.parent, free)
                taken = ([gpu for gpu in free if gpu not in others] + [gpu for gpu in free if gpu in others])[:count]
                if shared := [gpu for gpu in taken if gpu in others]:
                    print(
                        f"GPU {','.join(shared)} shared with {', '.join(others[g] for g in shared)}: no other is free",
                        file=sys.stderr,
                    )
                held.update({gpu: owner for gpu in taken})
                handle.seek(0)
                handle.truncate()
                handle.write(json.dumps(held))
                return taken
        if not said_waiting:
            print(f"waiting for {count} free GPU(s) of {','.join(pool)}: held by processes {held}", file=sys.stderr)
            said_waiting = True
        time.sleep(POLL_S)


class Terminated(Exception):
    """SIGTERM (Snakemake stopping its jobs, scancel) while a job waits for a GPU."""


@contextmanager
def stoppable():
    """Ctrl-C and SIGTERM end a job while it waits for a GPU, whatever its shell set: the training
    rule's shell ignores them (for the trainer to handle once it runs), and a waiting job would
    otherwise train its whole stage after its driver had been stopped. Its own dispositions after."""

    def terminated(number, frame):
        raise Terminated

    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def claim(count: int, pid: int) -> str | None:
    """Claim `count` GPUs for process `pid` and make them this process's only ones (its
    CUDA_VISIBLE_DEVICES, which the processes it starts inherit); None where there is nothing to
    claim (no GPU here, or `count` 0), so that the job runs as it would have. A claim that cannot be
    met, or Ctrl-C while waiting for one, ends the process in one line."""
    pool = visible_gpus()
    if count <= 0 or not pool:
        return None
    from vlft.jobs.warm_start import end_by_signal, end_interrupted

    try:
        with stoppable():
            claimed = ",".join(take_gpus(count, pool, pid, claims_file()))
    except RuntimeError as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:  # Ctrl-C while the job waits for a GPU: one line, as a script's own
        end_interrupted()
    except Terminated:
        print(f"{os.path.basename(sys.argv[0])}: stopped by SIGTERM while it waited for a GPU", file=sys.stderr)
        end_by_signal(signal.SIGTERM)
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

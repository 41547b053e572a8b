"""Warm starts: the jobs of a local Snakemake run skip importing torch, transformers and peft.

Every job that trains, evaluates or caches used to spend 10-16 s on the GPU machine importing its
libraries before its first line (benchmarks/README.md, "What each job pays once"): some 100 s of a
small study's 390 on one GPU. Snakemake starts a process per job, so the workflow keeps that, and
moves only the imports: a job's launcher (vlft.jobs.launch) calls `hand_off()`, and where a warm process
runs (one that imported the libraries once), the script's own process hands it its arguments,
environment, working directory, standard streams and signal dispositions. The warm process forks
a child that runs the script as `python script args` would; the job's process waits, passes every
signal it gets on to the child, and exits with the child's status. The first job of a run starts
the warm process (and waits for it, as long as importing would have taken it); it ends by itself
`IDLE_S` seconds after its last job.

Only where that changes nothing but the time:
- inside a Snakemake run of this workflow (the Snakefile sets `VLFT_WARM_START=1`): never a script
  started by hand, never under SLURM (`SLURM_JOB_ID`): a job's processes stay inside its
  allocation, where SLURM counts, signals and ends them;
- not in the processes of a data-parallel job (torchrun starts them with `WORLD_SIZE`);
- a warm process serves only its own user: the kernel's credentials of each connection's peer are
  checked (an abstract Unix socket has no owner or mode, so any local user could connect), and a
  job hands itself only to a warm process of its own user;
- the warm process forks before anything touched CUDA, and while it runs no thread besides its own
  (it checks both, and serves nothing otherwise), so each child initializes CUDA for itself, with
  its job's CUDA_VISIBLE_DEVICES (vlft.jobs.gpus);
- a warm process serves only jobs of its interpreter, interpreter flags, code (vlft's files),
  installed packages and environment, but for the variables read when a job first uses them (`PER_JOB`: the GPUs, the
  thread counts); a job whose environment differs in anything else gets a warm process of its own;
- the child gets fresh seeds for Python's and numpy's global generators, as a new process would.
Anything that fails before the hand-off leaves the job to run as before, in its own process.
`VLFT_WARM_START=0` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

ENABLE = "VLFT_WARM_START"
IDLE_S = 20.0
START_TIMEOUT_S = 300.0  # importing takes seconds; a loaded node, many times that
BIND_TIMEOUT_S = 10.0  # a fresh interpreter, before its imports
# Read by a job only when it first uses them (CUDA at its first call, torch's thread pool at its
# first parallel op), so they may differ between a warm process and its jobs: Snakemake sets the
# thread counts per job, vlft.jobs.gpus narrows CUDA_VISIBLE_DEVICES per job. And what a shell keeps
# for itself (no library reads those).
PER_JOB = (
    "_",
    "SHLVL",
    "PWD",
    "OLDPWD",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VLFT_JOB_STARTED",  # when the job's launcher started (vlft.jobs.cli): read at its end
)


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)
PROJECT = Path(__file__).resolve().parents[1]  # the vlft package: its code is part of the key
# The warm process's program. It drops `-c`'s working directory from sys.path, so that it imports
# vlft from where the jobs' scripts do (their sys.path less their own directory).
# The warm process imports the very vlft its first job imported (argv[2]: the directory holding it;
# a job launched with `python -m` from a copy of the workflow imports the copy's), not the working
# directory's or whatever else is first on the path.
SERVER = (
    "import sys\n"
    "if not getattr(sys.flags, 'safe_path', False): del sys.path[0]\n"
    "sys.path.insert(0, sys.argv[2])\n"
    "from vlft.jobs.warm_process import serve; serve(sys.argv[1])"
)

_in_child = False  # set in the forked child, whose script calls hand_off() again


def serving_a_job() -> bool:
    """Whether this process is a warm process's child running a job's script."""
    return _in_child


def eligible(env=os.environ) -> bool:
    return env.get(ENABLE) == "1" and "SLURM_JOB_ID" not in env and "WORLD_SIZE" not in env and not _in_child


def fingerprint(env) -> str:
    """What a warm process must share with a job to run it: the interpreter and its flags, the
    project's code as it is on disk, the installed packages, the environment less `PER_JOB`."""
    code = sorted((str(p), stat.st_mtime_ns, stat.st_size) for p in PROJECT.rglob("*.py") for stat in [p.stat()])
    shared_env = sorted((k, v) for k, v in env.items() if k not in PER_JOB)
    key = [sys.executable, sys.version, _interpreter_flags(), code, installed_packages(), shared_env]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]


def installed_packages() -> list:
    """The site-packages directories and when each last changed: installing, upgrading or removing
    a package adds or renames entries there (its dist-info at least), which changes the directory's
    time. A stat each, not a walk of every package's files."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    directories = {paths["purelib"], paths["platlib"], *site.getsitepackages(), site.getusersitepackages()}
    return sorted((d, os.stat(d).st_mtime_ns) for d in directories if os.path.isdir(d))


def _interpreter_flags() -> list[str]:
    import subprocess

    return subprocess._args_from_interpreter_flags()


def _address(key: str) -> str:
    # Linux's abstract socket namespace: no file to clean up, no path length limit, per network namespace.
    return f"\0vlft-warm-{os.getuid()}-{key}"


def hand_off() -> None:
    """Run this script in a warm process, if one can: then this process exits here with the
    script's status. Otherwise (or where not `eligible`) return, and the script runs itself; where
    it tried, it says why in one line."""
    if not eligible():
        return
    key = fingerprint(os.environ)
    try:
        # Twice where the warm process ended without a word: it idled out as this job connected,
        # and the kernel dropped the connection it had not accepted yet (the job's send or read
        # fails). This job then starts the next one, as a first job does.
        for _ in range(2):
            connection = _connect(key)
            if connection is None:
                return _say(f"the warm process did not start (its log: {server_log(key)})")
            if (owner := peer_uid(connection)) != os.getuid():  # another user took the address first
                connection.close()
                return _say(f"the warm process at this job's address runs as uid {owner}, not this job's user")
            # The warm process's replies, a line each: its child's pid, then the child's exit status.
            replies = connection.makefile("rb")
            try:
                if reply := _send_job(connection, replies):
                    break
            except (BrokenPipeError, ConnectionResetError):
                reply = ""
            connection.close()
    except OSError as error:  # nothing was started
        return _say(f"no warm process ({error}; its log: {server_log(key)})")
    except KeyboardInterrupt:  # Ctrl-C while the warm process imports: no child runs the job yet
        end_interrupted()
    if not reply.isdigit():
        connection.close()  # a warm process that forks only now sees it, and starts nothing
        if reply.startswith("said "):  # to an earlier job of the run, whose line is in the run's output
            return None
        return _say(reply.removeprefix("no ") or "the warm process ended")
    _wait_for(replies, int(reply))


def _say(why: str) -> None:
    print(f"{os.path.basename(sys.argv[0])}: {why}; importing here (vlft.jobs.warm_start)", file=sys.stderr, flush=True)


def _connect(key: str) -> socket.socket | None:
    """A connection to the warm process for `key`, started here if none runs; None if it does
    not come up (it binds its address first thing, before its imports)."""
    server = None
    deadline = time.monotonic() + BIND_TIMEOUT_S
    while True:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(_address(key))
            return connection
        except (ConnectionRefusedError, FileNotFoundError):
            connection.close()
        if server is None:
            server = _start_server(key)
        elif server.poll() is not None or time.monotonic() > deadline:
            return None  # it ended (another job's took the address and ended too), or hangs
        time.sleep(0.02)


def peer_uid(connection: socket.socket) -> int:
    """The user the process at the other end of a Unix socket runs as, as the kernel tells it."""
    pid_uid_gid = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", pid_uid_gid)[1]


def server_log(key: str) -> Path:
    """Where a warm process writes what goes wrong in it."""
    return Path(tempfile.gettempdir()) / f"vlft-warm-start-{os.getuid()}-{key}.log"


def _start_server(key: str):
    import subprocess

    # Its own session, no terminal, none of the job's streams: Snakemake neither waits for it nor
    # signals it; it ends by itself when idle.
    with open(server_log(key), "ab") as log:
        return subprocess.Popen(
            [sys.executable, *_interpreter_flags(), "-c", SERVER, key, str(PROJECT.parent)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )


def _send_job(connection: socket.socket, replies) -> str:
    """Send the job; the warm process answers with its child's pid once it has forked it (it
    accepts only after its imports, so this waits about as long as importing would have taken),
    or with "no" and why not. Bounded: a warm process stuck in its imports leaves the job to run
    here."""
    dispositions = {}
    for number in FORWARDED:
        handler = signal.getsignal(number)
        dispositions[int(number)] = (
            "ignore" if handler == signal.SIG_IGN else "python" if handler is signal.default_int_handler else "default"
        )
    job = {
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "signals": dispositions,
    }
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    message = json.dumps(job).encode()
    socket.send_fds(connection, [len(message).to_bytes(8, "big") + message], [0, 1, 2])
    connection.settimeout(START_TIMEOUT_S)
    try:
        reply = replies.readline().decode().strip()
    except TimeoutError:
        return f"no answer from the warm process in {START_TIMEOUT_S:.0f} s"
    connection.settimeout(None)
    return reply


def _wait_for(replies, pid: int) -> None:
    """Pass signals on to the child and exit as it did."""
    for number in FORWARDED:
        signal.signal(number, lambda received, frame: _forward(pid, received))
    status = replies.readline().decode().strip()
    if not status:
        print("error: the warm process that ran this job ended without its exit status", file=sys.stderr)
        os._exit(1)
    kind, value = status.split()
    if kind == "exit":
        os._exit(int(value))
    # Killed by a signal: end the same way, so that the shell sees the same status.
    number = int(value)
    try:
        signal.signal(number, signal.SIG_DFL)
    except (OSError, ValueError):
        pass  # SIGKILL and SIGSTOP keep theirs
    os.kill(os.getpid(), number)
    os._exit(128 + number)


def _forward(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def run_exit_handlers() -> None:
    """What the interpreter does last before it exits: the atexit handlers, then the streams flushed."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def end_interrupted(say: bool = True) -> None:
    """A job stopped by SIGINT (a terminal's Ctrl-C, or the driver's to its jobs: vlft.jobs.interrupt):
    one line where `say`, not a traceback from wherever the job was, then its end by SIGINT."""
    if say:
        print(f"{os.path.basename(sys.argv[0])}: stopped by SIGINT (Ctrl-C) before it finished", file=sys.stderr)
    end_by_signal(signal.SIGINT)


def end_by_signal(signum: int) -> None:
    """The exit handlers run, then this process ends by `signum` (its default action), as the
    interpreter ends on an uncaught KeyboardInterrupt; 128 + signum where the signal is blocked."""
    run_exit_handlers()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)


def _print_uncaught(script: str) -> None:
    """The traceback from the script's own frame on, as `python script` prints it: the frames of
    this module and of runpy are none of the job's."""
    kind, value, start = sys.exc_info()
    path = os.path.abspath(script)
    frame = start
    while frame is not None and os.path.abspath(frame.tb_frame.f_code.co_filename) != path:
        frame = frame.tb_next
    # The exception's own traceback is what the interpreter prints (it ignores the argument where one is set).
    sys.excepthook(kind, value.with_traceback(frame or start), frame or start)


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1

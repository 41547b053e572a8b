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
START_TIMEOUT_S = 300.0  # importing takes 5-25 s
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
# What the warm process imports once: the libraries and the project's modules the scripts use. None
# of it may start CUDA, or query a GPU, when imported: a forked job could not use CUDA then
# (tests/test_warm_start.py imports them all with CUDA's entry points recording their callers).
PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.qwen3_vl.modeling_qwen3_vl",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "transformers.models.qwen2_vl.modeling_qwen2_vl",
    "vlft.caches.image_cache",
    "vlft.demo.tiny_model",
    # An evaluation's free-text metrics (vlft.generation.text_metrics): nltk alone takes a second.
    "nltk.translate.meteor_score",
    "rouge_score.rouge_scorer",
    "sacrebleu.tokenizers.tokenizer_13a",
)
# What imports peft, which imports bitsandbytes wherever it is installed (the `qlora` extra), and
# bitsandbytes' own import asks torch for every GPU's compute capability: it starts CUDA. So these
# are preloaded only where bitsandbytes is not installed; elsewhere each job imports them itself.
PRELOAD_WITH_PEFT = ("peft", "vlft.training.train", "vlft.generation.evaluate", "vlft.caches.vision_cache")


def preloaded_modules() -> tuple[str, ...]:
    """What this machine's warm process imports once."""
    import importlib.util

    return PRELOAD + (() if importlib.util.find_spec("bitsandbytes") else PRELOAD_WITH_PEFT)


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
    "from vlft.jobs.warm_start import serve; serve(sys.argv[1])"
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


# The warm process.


def serve(key: str) -> None:
    if fingerprint(os.environ) != key:  # before the imports, which set variables of their own
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(_address(key))
    except OSError:
        return  # another job started one first
    listener.listen(64)  # jobs that connect now wait in the queue until the imports are done
    # Where it cannot serve, it stays and refuses each job (so jobs do not each start another). Each
    # reason is said once, by the first job it reaches: every job's output is the run's output too.
    refusal = _preload()
    if refusal:
        print(refusal, file=sys.stderr, flush=True)
    said: set[str] = set()
    children: dict[int, socket.socket] = {}
    last_busy = time.monotonic()
    listener.settimeout(0.2)
    while children or time.monotonic() - last_busy < IDLE_S:
        _reap(children)
        if children:
            last_busy = time.monotonic()
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            continue
        last_busy = time.monotonic()
        # Only its own user's jobs: the address is in the abstract namespace, which has no owner or
        # mode, so any local user can connect. Another's job is refused unread.
        if (uid := peer_uid(connection)) != os.getuid():
            print(f"refused a job from uid {uid}: a warm process serves only its own user", file=sys.stderr, flush=True)
            _send_line(connection, "no this warm process serves only its own user's jobs")
            connection.close()
            continue
        # The job is read in full first, refused or not: a job's process still sending when this
        # end closed would fail with a broken pipe instead of reading why.
        job = _receive_job(connection)
        pid = None
        refusal = refusal or _threads_problem()
        if job is not None and refusal:
            _close(job[1])
        elif job is not None:
            pid = _start_child(connection, listener, children, *job)
        if pid is None:
            _send_line(connection, f"{'said' if refusal in said else 'no'} {refusal or 'job'}")
            said |= {refusal} - {None}
            connection.close()
        else:
            children[pid] = connection


def _preload() -> str | None:
    """Import what the jobs would: None where this process can serve them then, else why not."""
    import importlib

    for name in preloaded_modules():
        try:
            importlib.import_module(name)
        except Exception as error:
            return f"importing {name} failed: {error}"
        if touched := cuda_touched():
            return f"importing {name} {touched}, so no job can be forked from it (a forked job could not use CUDA)"
    return None


def _threads_problem() -> str | None:
    """Why this process must not fork a job, where it runs Python threads besides its own: a fork
    copies only the forking thread, and the others' half-done work (a lock held, a file half
    written) would be the job's. (Native libraries' idle worker pools, BLAS's and OpenMP's, prepare
    themselves for a fork.)"""
    import threading

    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return f"the warm process runs threads besides its own ({', '.join(others)}), which a forked job would inherit half-done"
    return None


def _send_line(connection: socket.socket, line: str) -> None:
    try:
        connection.sendall(f"{line}\n".encode())
    except OSError:
        pass  # the job's process is gone


def cuda_touched() -> str | None:
    """What this process did of CUDA, if anything, that a forked child could not live with: started
    the driver (it opens the NVIDIA device files then; merely loading libcuda, as importing torch
    does, opens none), initialized torch.cuda, or counted the GPUs (the child would see this
    process's GPUs rather than its job's)."""
    fds = Path("/proc/self/fd")
    for fd in fds.iterdir():
        try:
            if (target := os.readlink(fd)).startswith("/dev/nvidia"):
                return f"started the CUDA driver (it opened {target})"
        except OSError:
            continue  # closed meanwhile (the directory's own descriptor)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "initialized torch.cuda"
    if torch is not None and getattr(torch.cuda, "_cached_device_count", None) is not None:
        return "counted the GPUs (torch.cuda.device_count)"
    return None


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is None:
            continue
        if os.WIFSIGNALED(status):
            _send_line(connection, f"signal {os.WTERMSIG(status)}")
        else:
            _send_line(connection, f"exit {os.waitstatus_to_exitcode(status)}")
        connection.close()


def _receive_job(connection: socket.socket) -> tuple[dict, list[int]] | None:
    """The job a job's process sent (`_send_job`) and its three standard streams; None for anything
    else, its streams closed."""
    fds = []
    try:
        connection.settimeout(10)
        header, fds, _, _ = socket.recv_fds(connection, 8, 3)
        size = int.from_bytes(header, "big")
        body = b""
        while len(body) < size:
            chunk = connection.recv(size - len(body))
            if not chunk:
                raise ConnectionError("the job's process went away")
            body += chunk
        job = json.loads(body)
        connection.settimeout(None)
        if len(fds) == 3:
            return job, fds
    except (OSError, ValueError):
        pass
    _close(fds)
    return None


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _start_child(
    connection: socket.socket, listener: socket.socket, children: dict, job: dict, fds: list[int]
) -> int | None:
    if _gone(connection):
        _close(fds)
        return None
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in children.values():
            other.close()
        _become_job(job, fds, connection)  # never returns
    _close(fds)
    _send_line(connection, str(pid))  # where its job's process is gone, the child sees that and ends
    return pid


def _gone(connection: socket.socket) -> bool:
    """Whether the job's process closed its end (it stopped waiting, and runs the job itself)."""
    try:
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _become_job(job: dict, fds: list[int], connection: socket.socket) -> None:
    """In the forked child: set up as `python script args` would have, run the script, exit."""
    global _in_child
    _in_child = True
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _reopen_std_streams()
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        for number, disposition in job["signals"].items():
            handler = {"ignore": signal.SIG_IGN, "python": signal.default_int_handler}.get(disposition, signal.SIG_DFL)
            signal.signal(int(number), handler)
        _fresh_process_state()
        _watch_job_process(connection)
        code = _run_script(job["argv"])
    except BaseException:  # in setting the job up: said on the job's stderr, as it is by now
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _reopen_std_streams() -> None:
    # As the interpreter makes them at start-up: line-buffered on a terminal, block-buffered on a pipe.
    import io

    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        mode = "r" if fd == 0 else "w"
        raw = io.FileIO(fd, mode + "b", closefd=False)
        buffered = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(
            buffered,
            encoding=old.encoding,
            errors=old.errors,
            line_buffering=fd == 2 or (fd == 1 and raw.isatty()),
            write_through=fd != 0 and old.write_through,  # `python -u`, as this process was started
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _fresh_process_state() -> None:
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # what torch's pool would have read at its start


def _watch_job_process(connection: socket.socket) -> None:
    """Die with the job's process: if it is killed outright (it could not pass SIGKILL on), its
    end closes the connection."""
    import threading

    def watch():
        while True:
            try:
                if not connection.recv(1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="vlft-warm-start-watch", daemon=True).start()


def _run_script(argv: list[str]) -> int:
    """The script as __main__, and the exit status the interpreter would give it."""
    import runpy
    import threading

    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    try:
        runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")  # __file__ absolute, as Python makes it
        code = 0
    except SystemExit as exit:
        code = _exit_code(exit.code)
    except KeyboardInterrupt:
        _print_uncaught(argv[0])
        code = -signal.SIGINT
    except BaseException:
        _print_uncaught(argv[0])
        code = 1
    threading._shutdown()  # as the interpreter does at exit: non-daemon threads finish first
    if code < 0:  # an uncaught KeyboardInterrupt ends the interpreter by SIGINT
        end_by_signal(-code)
    run_exit_handlers()
    return code


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

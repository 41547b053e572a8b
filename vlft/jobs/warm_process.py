"""The warm process (vlft.jobs.warm_start): it imports what the jobs would, once, checks that it can
fork them (nothing of CUDA started, no thread besides its own), and serves its own user's jobs,
each a forked child that becomes the job's process as `python script args` would have made it."""

from __future__ import annotations
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from vlft.jobs import warm_start
from vlft.jobs.warm_start import (
    IDLE_S,
    _address,
    _exit_code,
    _print_uncaught,
    end_by_signal,
    fingerprint,
    peer_uid,
    run_exit_handlers,
)

# What the warm process imports once: the libraries and the project's modules the scripts use. None
# of it may start CUDA, or query a GPU, when imported: a forked job could not use CUDA then
# (tests/jobs/test_warm_start.py imports them all with CUDA's entry points recording their callers).
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
    warm_start._in_child = True  # its script calls hand_off() again: it runs here
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

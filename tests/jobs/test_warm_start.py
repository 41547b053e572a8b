"""Warm starts (vlft.jobs.warm_start): a job handed to a warm process runs as its own process would have,
with the same arguments, streams, working directory, environment, exit status, traceback and
signals, and the same results; where a warm start does not apply, or the warm process cannot serve,
the job runs in its own process, saying why where it tried.

Real processes throughout: each script below begins as the workflow's scripts do, and a warm
process started by the first of them serves the others (one per test module: the environment
below is its key)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import copy_demo_upstream
from vlft.jobs import warm_process, warm_start

JOB = """
import sys
preloaded = "torch" in sys.modules  # before this script imports anything: a warm process's doing
from vlft.jobs.warm_start import hand_off, serving_a_job

hand_off()
import json, os  # noqa: E401,E402

line = sys.stdin.readline()
print("to stderr", file=sys.stderr)
threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "stdin": line, "name": __name__, "file": __file__, "threads": threads}))
print(json.dumps({"warm": serving_a_job(), "preloaded": preloaded}))
sys.exit(int(sys.argv[1]))
"""

FAILING = """
from vlft.jobs.warm_start import hand_off

hand_off()


def check(value):
    raise ValueError(f"bad value {value}")


check(3)
"""

WAITING = """
from vlft.jobs.warm_start import hand_off

hand_off()
import os, signal, sys, time  # noqa: E401,E402


def stop(number, frame):
    # Straight to the file descriptor: the signal may come while the main thread is still inside
    # print("ready")'s flush, and print here would be a reentrant call into the same BufferedWriter.
    os.write(1, f"stopped by {signal.Signals(number).name}\\n".encode())
    sys.exit(75)


if "--handle" in sys.argv:
    signal.signal(signal.SIGTERM, stop)
print("ready", os.getpid(), flush=True)
time.sleep(120)
"""

# A job's standard streams, for jobs started side by side.
PIPES = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("warm-start")
    for name, text in (("job.py", JOB), ("failing.py", FAILING), ("waiting.py", WAITING)):
        (root / name).write_text(text)
    return root


@pytest.fixture(scope="module")
def warm_env(scripts) -> dict:
    """The environment of this module's jobs, as the Snakefile sets it: warm starts on. Its own
    TMPDIR (the warm process's log goes there) makes its warm process this module's own."""
    (scripts / "tmp").mkdir()
    return {**os.environ, warm_start.ENABLE: "1", "TMPDIR": str(scripts / "tmp")}


def run(script: Path, *args: str, env: dict, cwd: Path, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args], input=stdin, capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


def outcome(result: subprocess.CompletedProcess) -> tuple[dict, dict]:
    job, how = map(json.loads, result.stdout.splitlines())
    return job, how


def test_a_job_runs_in_the_warm_process_as_in_its_own(scripts, warm_env, tmp_path):
    """The same arguments, standard streams, working directory, __name__ and __file__, exit status;
    a job's own CUDA_VISIBLE_DEVICES and thread count (read when first used) though it shares the
    warm process, which had torch imported before the script's first line."""
    cold_env = warm_env | {warm_start.ENABLE: "0"}
    own = run(scripts / "job.py", "3", "an argument", env=cold_env, cwd=tmp_path, stdin="a line\n")
    assert own.returncode == 3 and own.stderr == "to stderr\n", own.stderr
    own_job, own_how = outcome(own)
    assert own_how == {"warm": False, "preloaded": False}
    assert own_job["argv"] == [str(scripts / "job.py"), "3", "an argument"] and own_job["cwd"] == str(tmp_path)
    assert own_job["stdin"] == "a line\n" and own_job["name"] == "__main__"

    for gpus, threads in (("5", "1"), ("2,3", "2")):  # the second job is served by the warm process the first started
        env = warm_env | {"CUDA_VISIBLE_DEVICES": gpus, "OMP_NUM_THREADS": threads}
        warm = run(scripts / "job.py", "3", "an argument", env=env, cwd=tmp_path, stdin="a line\n")
        assert warm.returncode == 3 and warm.stderr == "to stderr\n", warm.stderr
        warm_job, warm_how = outcome(warm)
        assert warm_how == {"warm": True, "preloaded": True}
        assert warm_job == own_job | {"gpus": gpus, "threads": int(threads)}


def test_an_uncaught_exception_prints_the_traceback_and_status_of_its_own_process(scripts, warm_env, tmp_path):
    own = run(scripts / "failing.py", env=warm_env | {warm_start.ENABLE: "0"}, cwd=tmp_path)
    warm = run(scripts / "failing.py", env=warm_env, cwd=tmp_path)
    assert own.returncode == warm.returncode == 1
    assert own.stderr.endswith("ValueError: bad value 3\n")
    # From the script's frames on, as `python failing.py` prints them: none of runpy's or the warm process's.
    assert warm.stderr == own.stderr


def start_waiting(scripts: Path, env: dict, cwd: Path, *args: str) -> tuple[subprocess.Popen, int]:
    """The waiting script, started as a job; its process, and the pid that runs the script."""
    job = subprocess.Popen(
        [sys.executable, str(scripts / "waiting.py"), *args], stdout=subprocess.PIPE, text=True, env=env, cwd=cwd
    )
    word, pid = job.stdout.readline().split()
    assert word == "ready"
    return job, int(pid)


@pytest.mark.parametrize("handled", [True, False])
def test_a_signal_to_the_job_reaches_its_script_and_the_job_ends_as_the_script_did(
    scripts, warm_env, tmp_path, handled
):
    """SLURM and Snakemake signal the job's process: the script gets the signal, and the job's
    status is the script's (its handler's exit status, or death by the same signal)."""
    job, pid = start_waiting(scripts, warm_env, tmp_path, *(["--handle"] if handled else []))
    assert pid != job.pid  # the warm process's child runs the script
    job.send_signal(signal.SIGTERM)
    rest = job.stdout.read()
    if handled:
        assert (job.wait(30), rest) == (75, "stopped by SIGTERM\n")
    else:
        assert (job.wait(30), rest) == (-signal.SIGTERM, "")


def test_a_job_process_killed_outright_takes_its_script_with_it(scripts, warm_env, tmp_path):
    """SIGKILL cannot be passed on: the child notices its job's process is gone, and ends."""
    job, pid = start_waiting(scripts, warm_env, tmp_path)
    job.kill()
    assert job.wait(30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:  # the warm process reaps it
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()


@pytest.mark.parametrize(
    "setting",
    [{warm_start.ENABLE: "0"}, {"SLURM_JOB_ID": "17"}, {"WORLD_SIZE": "2"}],
    ids=["turned off", "a SLURM job", "a data-parallel process"],
)
def test_where_warm_starts_do_not_apply_the_job_runs_in_its_own_process_silently(scripts, warm_env, tmp_path, setting):
    assert not warm_start.eligible(warm_env | setting)
    result = run(scripts / "job.py", "0", env=warm_env | setting, cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == "to stderr\n"
    assert outcome(result)[1] == {"warm": False, "preloaded": False}


def test_outside_snakemake_a_script_runs_in_its_own_process(scripts, tmp_path):
    """Started by hand, with no VLFT_WARM_START: as always."""
    env = {k: v for k, v in os.environ.items() if k != warm_start.ENABLE}
    assert not warm_start.eligible(env)
    result = run(scripts / "job.py", "0", env=env, cwd=tmp_path)
    assert result.returncode == 0 and outcome(result)[1] == {"warm": False, "preloaded": False}


# Imports what a warm process preloads, with CUDA reported present and every way into it recording
# who called it; prints those calls. Each of them starts the CUDA driver on a GPU machine or reads
# what only it can tell: `is_available` and `device_count` ask the driver how many GPUs there are
# (cudaGetDeviceCount starts it), the device's capability and properties initialize torch.cuda,
# and torch.compile called at import started the driver on an H200 (vlft.generation.sampling's did,
# and no job of a study ran warm).
IMPORTS_WITH_CUDA_PRESENT = """
import json, sys, traceback
import torch

calls = []


def recorder(name, result):
    def called(*args, **kwargs):
        frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename]
        calls.append(f"{name}, from {frames[-1].filename}:{frames[-1].lineno}")
        return result(*args) if callable(result) else result
    return called


torch.cuda.is_available = recorder("torch.cuda.is_available", True)
torch.cuda.device_count = recorder("torch.cuda.device_count", 1)
torch.cuda.get_device_capability = recorder("torch.cuda.get_device_capability", (9, 0))
torch.cuda.get_device_properties = recorder("torch.cuda.get_device_properties", None)
torch.cuda.current_device = recorder("torch.cuda.current_device", 0)
torch.cuda.init = torch.cuda._lazy_init = recorder("torch.cuda._lazy_init", None)
# A CUDA build's, which bitsandbytes' CUDA backend reads at import where CUDA is present.
torch._C._cuda_getCurrentRawStream = recorder("torch._C._cuda_getCurrentRawStream", 0)
torch.compile = recorder("torch.compile", lambda model=None: model)
if sys.argv[1] == "without-bitsandbytes":
    sys.modules["bitsandbytes"] = None  # as if not installed: its import fails, find_spec finds none

from vlft.jobs import warm_process  # noqa: E402
import importlib  # noqa: E402

modules = warm_process.preloaded_modules()
for name in modules:
    importlib.import_module(name)
print(json.dumps({"modules": modules, "calls": calls}))
"""


@pytest.mark.parametrize("extras", ["as-installed", "without-bitsandbytes"])
def test_importing_what_a_warm_process_preloads_starts_nothing_of_cuda(extras):
    """With CUDA present, a warm process that had started CUDA in its imports could fork no job (a
    forked child cannot use CUDA): every job of a study would pay its imports again. So nothing it
    preloads may start CUDA or query a GPU, with the optional extras installed (bitsandbytes, which
    PEFT imports wherever it is installed, queries every GPU at import) or not."""
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS_WITH_CUDA_PRESENT, extras], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    imported = json.loads(result.stdout.splitlines()[-1])
    assert imported["calls"] == []
    if extras == "without-bitsandbytes":  # the whole list then, PEFT and what imports it included
        assert set(warm_process.PRELOAD_WITH_PEFT) <= set(imported["modules"])


def test_a_warm_process_serves_only_jobs_of_its_environment_and_code(tmp_path, monkeypatch):
    """The variables a job reads only when it first uses them may differ; anything else, or a
    change to the project's code, needs a warm process of its own."""
    env = {"PATH": "/usr/bin", "HOME": "/home/a", "OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "0"}
    key = warm_start.fingerprint(env)
    assert warm_start.fingerprint(env | {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "1,2", "SHLVL": "3"}) == key
    assert warm_start.fingerprint(env | {"HOME": "/home/b"}) != key
    assert warm_start.fingerprint(env | {"PYTHONHASHSEED": "0"}) != key

    code = tmp_path / "vlft"
    code.mkdir()
    (code / "module.py").write_text("A = 1\n")
    monkeypatch.setattr(warm_start, "PROJECT", code)
    before = warm_start.fingerprint(env)
    (code / "module.py").write_text("A = 22\n")
    assert warm_start.fingerprint(env) != before


def test_a_warm_process_that_cannot_import_says_why_and_the_job_runs_itself(scripts, warm_env, tmp_path):
    """A library that fails to import in the warm process: the first job says so in one line, and
    runs in its own process, as without warm starts; so do the later ones, which the warm process
    refuses at once, without saying it again (every job's output is the run's too)."""
    broken = tmp_path / "site" / "transformers"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("this transformers is broken")\n')
    path = os.pathsep.join(filter(None, [str(broken.parent), os.environ.get("PYTHONPATH")]))
    env = warm_env | {"PYTHONPATH": path}
    said = "job.py: importing transformers failed: this transformers is broken; importing here (vlft.jobs.warm_start)\n"
    first = run(scripts / "job.py", "0", env=env, cwd=tmp_path)  # it starts the warm process
    assert (first.returncode, first.stderr, outcome(first)[1]) == (
        0,
        said + "to stderr\n",
        {"warm": False, "preloaded": False},
    )
    later = [
        subprocess.Popen([sys.executable, str(scripts / "job.py"), "0"], env=env, cwd=tmp_path, **PIPES)
        for _ in range(4)
    ]
    for job in later:
        out, err = job.communicate(timeout=300)
        assert (job.returncode, err, json.loads(out.splitlines()[1])) == (
            0,
            "to stderr\n",
            {"warm": False, "preloaded": False},
        )
    log = (Path(warm_env["TMPDIR"]) / warm_start.server_log(warm_start.fingerprint(env)).name).read_text()
    assert log.count("importing transformers failed: this transformers is broken") == 1


def test_ctrl_c_while_the_warm_process_imports_is_one_line_and_the_jobs_end_by_sigint(scripts, warm_env, tmp_path):
    """The first job waits for the warm process's imports: Ctrl-C then reaches the job's own process,
    before any child runs the script. One line, as a script's own Ctrl-C gives (vlft.jobs.cli), no
    traceback from the wait, and the job's end by SIGINT."""
    slow = tmp_path / "site" / "transformers"
    slow.mkdir(parents=True)
    started = tmp_path / "importing"
    (slow / "__init__.py").write_text(
        f"import os, pathlib, time\npathlib.Path({str(started)!r}).write_text(str(os.getpid()))\ntime.sleep(120)\n"
    )
    path = os.pathsep.join(filter(None, [str(slow.parent), os.environ.get("PYTHONPATH")]))
    # As a terminal starts it: Ctrl-C at its default, even where this test runs with SIGINT ignored
    # (a background job of a shell without job control, which ignores it and hands that on).
    job = subprocess.Popen(
        [sys.executable, str(scripts / "job.py"), "0"],
        env=warm_env | {"PYTHONPATH": path},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **PIPES,
    )
    deadline = time.time() + 120
    while not started.exists():
        assert job.poll() is None and time.time() < deadline, "the job ended, or no warm process imported transformers"
        time.sleep(0.05)
    try:
        job.send_signal(signal.SIGINT)
        job.wait(60)
    finally:
        # The warm process, still importing. Until it ends (or accepts the job, whose child then
        # ends at once) it holds the job's streams, sent with the job: only then do they close.
        os.kill(int(started.read_text()), signal.SIGKILL)
    out, err = job.communicate(timeout=60)
    assert (job.returncode, out, err) == (-signal.SIGINT, "", "job.py: stopped by SIGINT (Ctrl-C) before it finished\n")


def test_a_stage_trained_and_evaluated_warm_equals_the_same_jobs_in_their_own_processes(demo_workdir, tmp_path):
    """The demo ran its jobs warm (the Snakefile turns warm starts on); a stage and its evaluation
    run again with them off give the same adapter, predictions and metrics, byte for byte but the
    timings."""
    stage, evaluation = "results/train/exp1/main", "results/eval/exp1/main/val"
    demo_logs = demo_workdir / "results/logs"
    for log in ("train/exp1/main.log", "evaluate/exp1/main/val.log"):
        assert "(run by a warm process, vlft.jobs.warm_start)" in (demo_logs / log).read_text().splitlines()[0]

    workdir = copy_demo_upstream(demo_workdir, tmp_path / "demo")
    env = os.environ | {warm_start.ENABLE: "0"}
    subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2", f"{evaluation}/metrics.json"],
        cwd=workdir,
        env=env,
        check=True,
        capture_output=True,
        timeout=900,
    )
    for log in ("train/exp1/main.log", "evaluate/exp1/main/val.log"):
        assert "warm" not in (workdir / "results/logs" / log).read_text().splitlines()[0]
    adapter = "adapter/adapter_model.safetensors"
    assert (workdir / stage / adapter).read_bytes() == (demo_workdir / stage / adapter).read_bytes()
    assert losses(workdir / stage) == losses(demo_workdir / stage)  # step by step
    predictions = "predictions.jsonl"
    assert (workdir / evaluation / predictions).read_bytes() == (demo_workdir / evaluation / predictions).read_bytes()
    timings = ("wall_time_s", "samples_per_s")
    cold, warm = (json.loads((w / evaluation / "metrics.json").read_text()) for w in (workdir, demo_workdir))
    assert {k: v for k, v in cold.items() if k not in timings} == {k: v for k, v in warm.items() if k not in timings}


def losses(stage: Path) -> list:
    rows = [json.loads(line) for line in (stage / "log.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"]) for row in rows] + [
        json.loads((stage / "summary.json").read_text())["final_loss"]
    ]


def test_a_warm_process_running_threads_of_its_own_forks_no_job(scripts, warm_env, tmp_path):
    """Something that starts a thread in every interpreter (here a sitecustomize, as a site's
    configuration may have): the warm process would fork jobs with that thread's work half-done, so
    it serves none; each job says why and runs itself."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), name='busy', daemon=True).start()\n"
    )
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = warm_env | {"PYTHONPATH": path}
    said = (
        "job.py: the warm process runs threads besides its own (busy), which a forked job would inherit "
        "half-done; importing here (vlft.jobs.warm_start)\n"
    )
    # The first job starts the warm process and says why it runs itself; the second finds it running,
    # and runs itself without saying it again.
    for expected in (said + "to stderr\n", "to stderr\n"):
        result = run(scripts / "job.py", "0", env=env, cwd=tmp_path)
        assert (result.returncode, result.stderr, outcome(result)[1]) == (
            0,
            expected,
            {"warm": False, "preloaded": False},
        )


def test_an_installed_package_changes_which_warm_process_serves(tmp_path, monkeypatch):
    """A package installed, upgraded or removed in site-packages since a warm process started: the
    jobs need one that imported what is installed now."""
    import site

    packages = tmp_path / "site-packages"
    packages.mkdir()
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(packages)])
    env = {"PATH": "/usr/bin"}
    before = warm_start.fingerprint(env)
    assert warm_start.fingerprint(env) == before
    (packages / "somepackage-2.0.dist-info").mkdir()
    os.utime(packages, ns=(packages.stat().st_atime_ns, packages.stat().st_mtime_ns + 1_000_000))
    assert warm_start.fingerprint(env) != before


CHANGING = """
import json, os, sys
from vlft.jobs.warm_start import hand_off, serving_a_job

hand_off()
import torch  # noqa: E402
import vlft.training.token_budget as token_budget  # noqa: E402

seen = {
    "safety": token_budget.SAFETY,
    "variable": os.environ.get("VLFT_TEST_CHANGED"),
    "cwd": os.getcwd(),
    "dtype": str(torch.get_default_dtype()),
    "warm": serving_a_job(),
}
print(json.dumps(seen))
if sys.argv[1] == "change":
    token_budget.SAFETY = 0.1
    os.environ["VLFT_TEST_CHANGED"] = "yes"
    os.chdir("/")
    torch.set_default_dtype(torch.float64)
"""


def test_what_one_job_changes_in_its_process_the_next_job_never_sees(scripts, warm_env, tmp_path):
    """Each job runs in a fresh fork of the warm process: a module attribute, an environment
    variable, the working directory and torch's global settings that one job changes are the warm
    process's own again for the next."""
    script = scripts / "changing.py"
    script.write_text(CHANGING)
    first = json.loads(run(script, "change", env=warm_env, cwd=tmp_path).stdout)
    second = json.loads(run(script, "look", env=warm_env, cwd=tmp_path).stdout)
    expected = {"safety": 0.9, "variable": None, "cwd": str(tmp_path), "dtype": "torch.float32"}
    assert second == first == expected | {"warm": True}


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to connect as another user")
def test_a_warm_process_refuses_another_users_job_unread(scripts, warm_env, tmp_path):
    """Any local user can connect to the warm process's abstract socket: a job sent as another uid
    (here `nobody`, 65534) is refused, and its script never runs as the warm process's user."""
    marker = tmp_path / "ran"
    script = tmp_path / "hostile.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    first = run(scripts / "job.py", "0", env=warm_env, cwd=tmp_path)
    assert outcome(first)[1]["warm"], first.stderr  # the warm process runs now, for IDLE_S more seconds
    key = warm_start.fingerprint(warm_env)
    address = warm_start._address(key)  # the owner's uid is in its name: listed for all to see
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # another user's process: a raw connection, then the job as a job's process sends it
        try:
            os.setgid(65534)
            os.setuid(65534)
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.connect(address)
            sys.argv = [str(script)]
            try:
                reply = warm_start._send_job(connection, connection.makefile("rb"))
            except OSError as error:  # refused before it finished sending
                reply = f"no ({error})"
            os.write(write, reply.encode())
        except BaseException as error:  # said, for the assertion below to show
            os.write(write, f"failed: {error!r}".encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    reply = os.read(read, 1000).decode()
    assert reply.startswith("no"), reply
    time.sleep(1)  # a child it had forked would have run the script by now
    assert not marker.exists()
    log = (Path(warm_env["TMPDIR"]) / warm_start.server_log(key).name).read_text()  # the warm process's TMPDIR
    assert "refused a job from uid 65534: a warm process serves only its own user" in log


def test_a_job_that_connects_as_the_warm_process_idles_out_starts_the_next_and_runs_warm(scripts, warm_env, tmp_path):
    """A warm process ends IDLE_S after its last job; a job that connected just then waits in its
    queue, never accepted, and the kernel drops it as the warm process closes (the job's send or
    read fails). The job starts the next warm process, as a first job does, and runs there: before,
    it imported everything itself and its run's following jobs found no warm process."""
    env = warm_env | {"VLFT_TEST_ADDRESS": str(tmp_path)}  # an environment, so an address, of its own
    ending = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ending.bind(warm_start._address(warm_start.fingerprint(env)))
    ending.listen(1)
    dropped = []

    def end_idle():  # as serve() ends: the job's connection queued, the listener closed
        dropped.append(bool(select.select([ending], [], [], 60)[0]))
        ending.close()

    ender = threading.Thread(target=end_idle)
    ender.start()
    result = run(scripts / "job.py", "0", env=env, cwd=tmp_path)
    ender.join(timeout=60)
    job, how = outcome(result)
    assert dropped == [True] and how["warm"] and how["preloaded"], result.stderr
    assert "importing here" not in result.stderr and result.returncode == 0

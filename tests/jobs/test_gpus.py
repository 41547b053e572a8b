"""GPU ids for concurrent jobs (vlft.jobs.gpus): claims by real processes under a real file lock, and the demo's
GPU jobs run side by side through Snakemake, each on a GPU of its own."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from datetime import datetime
from itertools import combinations

import pytest

from tests.helpers import REPO, copy_workflow, snakemake
from vlft.jobs.gpus import process_identity, take_gpus


def sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_claims_are_distinct_and_a_finished_process_frees_its_gpus(tmp_path):
    claims, pool = tmp_path / "claims.json", ["3", "5", "7"]
    first, second, third, fourth = (sleeper() for _ in range(4))
    try:
        assert take_gpus(2, pool, first.pid, claims) == ["3", "5"]
        assert take_gpus(1, pool, second.pid, claims) == ["7"]
        first.kill()
        first.wait()
        assert take_gpus(2, pool, third.pid, claims) == ["3", "5"]
        # All held: a claim waits until a holder ends.
        got = []
        waiting = threading.Thread(target=lambda: got.extend(take_gpus(1, pool, fourth.pid, claims)))
        waiting.start()
        waiting.join(timeout=5)
        assert waiting.is_alive() and not got
        second.kill()
        waiting.join(timeout=30)
        assert got == ["7"]
        with pytest.raises(RuntimeError, match="asks for 4 GPUs, but only 3 are visible"):
            take_gpus(4, pool, fourth.pid, claims)
    finally:
        for process in (first, second, third, fourth):
            process.kill()


def claim_in_background(pool, pid, claims):
    """take_gpus(1, ...) in a thread, so that a claim that waits fails an assertion instead of the run."""
    got = []
    waiting = threading.Thread(target=lambda: got.extend(take_gpus(1, pool, pid, claims)), daemon=True)
    waiting.start()
    return waiting, got


def test_a_claim_left_by_an_earlier_run_whose_pid_another_process_now_has_holds_nothing(tmp_path):
    """A SLURM cluster restarted numbers its jobs from 1 again, so a job finds the claims file of an
    earlier job with its number; the pid in it may belong to an unrelated living process by now."""
    claims, unrelated, job = tmp_path / "claims.json", sleeper(), sleeper()
    try:
        identity = process_identity(unrelated.pid)
        started_earlier = identity.split("@")[0] + "@" + str(int(identity.split("@")[1]) - 1)
        for stale in (started_earlier, unrelated.pid):  # the pid of a process started at another time; a bare pid
            claims.write_text(json.dumps({"0": stale}))
            waiting, got = claim_in_background(["0"], job.pid, claims)
            waiting.join(timeout=10)
            assert got == ["0"], f"the stale claim {stale!r} still holds GPU 0"
            assert json.loads(claims.read_text()) == {"0": process_identity(job.pid)}
        # The claim of a process that does still run holds.
        waiting, got = claim_in_background(["0"], unrelated.pid, claims)
        waiting.join(timeout=5)
        assert waiting.is_alive() and not got
        job.kill()
        waiting.join(timeout=30)
        assert got == ["0"]
    finally:
        unrelated.kill()
        job.kill()


# A job's shell as the GPU rules run it: claim, then say what it sees, then hold the claim a while.
JOB_SHELL = 'gpus=$(python -m vlft.jobs.gpus 1 $$); eval "$gpus"; echo "$CUDA_VISIBLE_DEVICES"; sleep 30'


def test_jobs_claiming_at_once_each_get_their_own_gpu(tmp_path):
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(8))), "TMPDIR": str(tmp_path)}
    jobs = [
        subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", JOB_SHELL], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(8)
    ]
    try:
        claimed = sorted(job.stdout.readline().strip() for job in jobs)
    finally:
        for job in jobs:
            job.kill()
    assert claimed == [str(i) for i in range(8)]


def test_a_job_asking_for_more_gpus_than_visible_fails_with_one_line_and_none_claims_nothing(tmp_path):
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "0,1", "TMPDIR": str(tmp_path)}
    shell = JOB_SHELL.replace("vlft.jobs.gpus 1", "vlft.jobs.gpus 3")
    failed = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", shell], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert failed.returncode != 0 and failed.stdout == ""
    assert failed.stderr.strip() == "error: this job asks for 3 GPUs, but only 2 are visible (0,1)"
    # No GPU on this machine: nothing to claim, the job runs as it would have.
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | {"TMPDIR": str(tmp_path)}
    if not os.path.isdir("/proc/driver/nvidia/gpus"):
        none = subprocess.run(
            [sys.executable, "-m", "vlft.jobs.gpus", "1", "1"], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert none.returncode == 0 and none.stdout == ""


PLACEMENT = re.compile(r"CUDA_VISIBLE_DEVICES=([^;\s]+); started (\S+ \S+)")


def test_the_demo_runs_gpu_jobs_side_by_side_each_on_its_own_gpu(tmp_path):
    workdir = copy_workflow(tmp_path / "work")
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "0,1", "TMPDIR": str(tmp_path)}
    targets = [f"results/eval/{exp}/main/val/metrics.json" for exp in ("exp1", "exp2")]
    command = [sys.executable, "-m", "snakemake", "--cores", "4", "--resources", "gpu=2"]
    command += ["--set-threads", "train=1", "evaluate=1", "cache_images=1", "prepare_split=1", "--", *targets]
    subprocess.run(command, cwd=workdir, env=env, check=True, capture_output=True, timeout=1200)

    runs = {}  # each GPU job's log: (its GPUs, started, ended)
    for log in [*(workdir / "results/logs/train").rglob("*.log"), *(workdir / "results/logs/evaluate").rglob("*.log")]:
        if log.name.endswith(".attempts.log"):
            continue
        gpus, started = PLACEMENT.search(log.read_text()).groups()
        runs[log] = (gpus, datetime.fromisoformat(started).timestamp(), log.stat().st_mtime)
    assert len(runs) == 4 and {gpus for gpus, _, _ in runs.values()} <= {"0", "1"}, runs
    overlapping = [(a, b) for a, b in combinations(runs, 2) if runs[a][1] < runs[b][2] and runs[b][1] < runs[a][2]]
    assert overlapping, "no two GPU jobs ran at the same time"
    for a, b in overlapping:
        assert runs[a][0] != runs[b][0], f"{a} and {b} ran at the same time on GPU {runs[a][0]}"

    # A script started by hand, outside Snakemake (the job's command without the launcher), claims
    # nothing, sees every GPU and computes what the workflow's job computed.
    target = targets[0]
    plan = snakemake(workdir, "--dry-run", "--printshellcmds", "--force", target).stdout
    command = next(line.strip() for line in plan.splitlines() if "scripts/evaluate.py" in line)
    command = "python " + command[command.index("scripts/evaluate.py") :].split(" 2>&1 | tee")[0]
    command = command.replace(target, str(tmp_path / "metrics.json")).replace(
        target.replace("metrics.json", "predictions.jsonl"), str(tmp_path / "predictions.jsonl")
    )
    by_hand = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True)
    assert by_hand.returncode == 0 and "CUDA_VISIBLE_DEVICES=0,1;" in by_hand.stdout, by_hand.stderr
    assert (tmp_path / "predictions.jsonl").read_bytes() == (workdir / target).with_name(
        "predictions.jsonl"
    ).read_bytes()


NOBODY = 65534


def as_nobody():
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def claim_one(tmp_path, gpus: str = "0,1") -> subprocess.CompletedProcess:
    """A job's shell claiming one GPU (JOB_SHELL without the wait), with its own TMPDIR and home."""
    env = os.environ | {"CUDA_VISIBLE_DEVICES": gpus, "TMPDIR": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "own")}
    shell = 'gpus=$(python -m vlft.jobs.gpus 1 $$); eval "$gpus"; echo "$CUDA_VISIBLE_DEVICES"'
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", shell], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to write files as another user")
@pytest.mark.parametrize("made", ["a file", "a link"])
def test_a_claims_file_another_user_made_first_neither_stops_nor_holds_a_users_jobs(tmp_path, made):
    """Another user makes this user's claims file first (its name is predictable) and fills it with
    claims for pid 1, which runs for ever: the user's jobs take their GPUs at once all the same, keep
    their claims where only they can write, and say so in one line; no traceback."""
    (tmp_path / "own").mkdir()
    squatted = tmp_path / f"vlft-gpu-claims-{os.getuid()}-local.json"
    forged = json.dumps({"0": process_identity(1), "1": process_identity(1)})
    if made == "a file":
        squatted.write_text(forged)
        os.chown(squatted, NOBODY, NOBODY)
        squatted.chmod(0o666)
    else:
        (tmp_path / "theirs.json").write_text(forged)
        squatted.symlink_to(tmp_path / "theirs.json")
    result = claim_one(tmp_path)
    why = "belongs to uid 65534" if made == "a file" else "is not a regular file"
    assert (result.returncode, result.stdout) == (0, "0\n"), result.stderr
    assert result.stderr == f"{squatted} {why}: this user's GPU claims are kept in {tmp_path / 'own'} instead\n"
    assert squatted.is_symlink() or json.loads(squatted.read_text()) == json.loads(forged)  # theirs, untouched


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to run processes as another user")
def test_another_users_claims_count_only_for_their_living_processes_and_never_make_a_job_wait(tmp_path):
    """Two users' studies on one machine: another user's jobs' GPUs are avoided while others are free,
    and shared (in one line) rather than waited for; claims in their file for processes not theirs
    (pid 1) or gone hold nothing."""
    (tmp_path / "own").mkdir()
    theirs = tmp_path / f"vlft-gpu-claims-{NOBODY}-local.json"
    their_job = subprocess.Popen(["sleep", "120"], preexec_fn=as_nobody)
    ours = sleeper()
    try:
        theirs.write_text(json.dumps({"0": process_identity(1)}))  # pid 1 is root's, not theirs
        os.chown(theirs, NOBODY, NOBODY)
        assert claim_one(tmp_path).stdout == "0\n"
        theirs.write_text(json.dumps({"0": process_identity(their_job.pid)}))
        assert claim_one(tmp_path).stdout == "1\n"
        # GPU 1 held by one of this user's own jobs, GPU 0 by theirs: shared, not waited for.
        own = tmp_path / f"vlft-gpu-claims-{os.getuid()}-local.json"
        own.write_text(json.dumps({"1": process_identity(ours.pid)}))
        result = claim_one(tmp_path)
        assert result.stdout == "0\n"
        assert result.stderr == f"GPU 0 shared with uid {NOBODY}'s process {their_job.pid}: no other is free\n"
    finally:
        their_job.kill(), ours.kill()


def ignoring_stop_signals():
    """As the training rule's shell leaves its job (`trap '' TERM USR1 INT`, for the trainer's own handlers)."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(number, signal.SIG_IGN)


@pytest.mark.parametrize("stop, shell_ignores", [(signal.SIGINT, False), (signal.SIGINT, True), (signal.SIGTERM, True)])
def test_a_job_waiting_for_a_gpu_stops_at_ctrl_c_or_sigterm_though_its_shell_ignores_them(
    tmp_path, stop, shell_ignores
):
    """A job waiting for a GPU ends at once at Ctrl-C or SIGTERM, in one line, by the signal it got.
    Also where its shell ignores them, as the training rule's does (for the trainer's own handlers),
    and the job inherits that: it ignored the driver's Ctrl-C, and trained its whole stage once the
    GPU was free."""
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "0", "TMPDIR": str(tmp_path)}
    holder, job = sleeper(), sleeper()
    try:
        take_gpus(1, ["0"], holder.pid, tmp_path / f"vlft-gpu-claims-{os.getuid()}-local.json")
        claim = subprocess.Popen(
            [sys.executable, "-m", "vlft.jobs.gpus", "1", str(job.pid)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=ignoring_stop_signals if shell_ignores else None,
        )
        assert claim.stderr.readline().startswith("waiting for 1 free GPU(s) of 0: held by processes")
        claim.send_signal(stop)
        out, err = claim.communicate(timeout=60)
        said = {
            signal.SIGINT: "gpus.py: stopped by SIGINT (Ctrl-C) before it finished\n",
            signal.SIGTERM: "gpus.py: stopped by SIGTERM while it waited for a GPU\n",
        }[stop]
        assert (claim.returncode, out, err) == (-stop, "", said)
    finally:
        holder.kill(), job.kill()


def test_a_jobs_time_starts_once_it_has_its_gpu_not_while_it_waits(tmp_path):
    """The time a job's log ends with (and the forecast's refinement compares with its prediction)
    counts from when it has its GPUs: a wait for another job's GPU is none of its own (a stage that
    waited 7 minutes said `took 433 s, predicted 20 s`)."""
    script = tmp_path / "job.py"
    script.write_text(
        "import time\nfrom vlft.jobs.cli import job_started\nprint(f'{time.time() - job_started():.3f}')\n"
    )
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "0", "TMPDIR": str(tmp_path), "VLFT_WARM_START": "0"}
    holder = sleeper()
    try:
        take_gpus(1, ["0"], holder.pid, tmp_path / f"vlft-gpu-claims-{os.getuid()}-local.json")
        job = subprocess.Popen(
            [sys.executable, "-m", "vlft.jobs.launch", "--gpus", "1", str(script)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert job.stderr.readline().startswith("waiting for 1 free GPU(s) of 0: held by processes")
        waited = 3.0
        threading.Timer(waited, holder.kill).start()
        out, _ = job.communicate(timeout=120)
    finally:
        holder.kill()
    assert job.returncode == 0
    # The script's own start (an interpreter and vlft.jobs.cli's import) is its time: well under the wait.
    assert float(out) < waited, out

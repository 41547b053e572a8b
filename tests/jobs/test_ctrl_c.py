"""Ctrl-C to a job: one line and its end by SIGINT, with nothing written."""

import os
import signal
import subprocess
import sys
import pytest
from tests.helpers import REPO


@pytest.mark.parametrize("warm", ["0", "1"], ids=["own-process", "warm-start"])
def test_ctrl_c_to_a_job_is_one_line_and_its_end_by_sigint_with_nothing_written(tiny_model_dir, tmp_path, warm):
    """A caching job stopped by SIGINT (a terminal's Ctrl-C, or the driver passing one on) while it
    waits for its records, as on a stalled file system (a FIFO that nobody writes): one line on
    stderr, not a traceback, the job's end by SIGINT as Python's own, and no cache. In its own
    process and run by a warm process (vlft.jobs.warm_start), where the job's process passes the signal on."""
    from vlft.jobs import warm_start

    records = tmp_path / "records.jsonl"
    os.mkfifo(records)
    output = tmp_path / "cache"
    command = [
        sys.executable,
        "-m",
        "vlft.jobs.launch",
        "scripts/cache_images.py",
        "--records",
        str(records),
        "--image-root",
        str(tmp_path),
        "--model",
        str(tiny_model_dir),
    ]
    command += ["--min-pixels", "3136", "--max-pixels", "50176", "--output", str(output)]
    (tmp_path / "tmp").mkdir()  # the warm process's own, as in tests/jobs/test_warm_start.py
    env = os.environ | {warm_start.ENABLE: warm, "TMPDIR": str(tmp_path / "tmp")}
    # SIGINT as a terminal's job has it: a test run started in the background by a shell without
    # job control inherits it ignored, and the job would never see the Ctrl-C this test sends.
    job = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    first = job.stdout.readline()  # said before the script's main runs
    assert first.startswith("cache_images.py: host "), first
    assert ("run by a warm process" in first) == (warm == "1")
    job.send_signal(signal.SIGINT)
    out, err = job.communicate(timeout=120)
    assert (job.returncode, out, err) == (
        -signal.SIGINT,
        "",
        "cache_images.py: stopped by SIGINT (Ctrl-C) before it finished\n",
    )
    assert not output.exists() and [p.name for p in tmp_path.iterdir()] != []

"""When a training job must stop at its next step boundary, with a checkpoint: a signal (SIGTERM from
SLURM at a time limit or from scancel, SIGUSR1 where a site asks for an early warning, SIGINT from
Ctrl-C in the terminal), or its own time limit coming close.

Knowing its end time, the trainer stops before the limit instead of straddling it: a job still
running at its limit is recorded as TIMEOUT even when it had just finished, and a fixed early
warning (`--signal=USR1@600`) arrives at once in a job shorter than its offset. The margin follows
the job's own step times, so the same rule fits a one-minute test job and a two-day stage.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from datetime import datetime

# Time kept for what follows the last step: saving the LoRA checkpoint (tens of MB to a few GB on a
# shared file system), closing the log and leaving before SLURM's SIGTERM.
RESERVE_S = 20.0


def slurm_end_time() -> float | None:
    """The end of this SLURM job's time limit (seconds since the epoch), or None outside SLURM, for
    a job without limit, or where squeue cannot be reached (SIGTERM at the limit then stops us)."""
    if os.environ.get("SLURM_JOB_END_TIME"):  # SLURM 23.02 on
        return float(os.environ["SLURM_JOB_END_TIME"])
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=30)
        return datetime.fromisoformat(out.stdout.strip()).timestamp()  # local time, as SLURM prints it
    except (OSError, subprocess.SubprocessError, ValueError):  # ValueError: "Unknown", "NONE"
        return None


class Preempted(Exception):
    """Raised after a stop request (a signal, the time limit near): where a step could finish, after
    a checkpoint saved; the retry (or a rerun) resumes from the newest checkpoint."""


class StopRequest:
    """Asked at every step boundary whether to stop there. Catches SIGTERM, SIGUSR1 and SIGINT from
    its creation on, so create it before anything slow: a signal while the model loads is kept."""

    received: str | None = None  # the last stop signal any of them caught, for work inside a step

    def __init__(self, end_time: float | None = None, clock=time.time):
        self.end_time = end_time
        self.clock = clock
        self.signal: str | None = None
        self._last_boundary: float | None = None
        self._longest_step = 0.0
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = StopRequest.received = signal.Signals(signum).name

    def reason(self) -> str | None:
        """Why the job must stop at this boundary, or None to go on. The time limit counts as close
        once two of the slowest steps so far (a periodic checkpoint's included) and the reserve for
        saving would not fit before it."""
        now = self.clock()
        if self._last_boundary is not None:
            self._longest_step = max(self._longest_step, now - self._last_boundary)
        self._last_boundary = now
        if self.signal:
            return f"{self.signal} received"
        if self.end_time is not None and now + RESERVE_S + 2 * self._longest_step >= self.end_time:
            left = max(0, round(self.end_time - now))
            return f"the job's time limit is {left} s away"
        return None

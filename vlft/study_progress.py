"""A running study's own progress, in the driver's terminal: its jobs done and left, the time spent,
and the time left by the forecast (the dry run's, vlft.study_costs), said again as each job finishes;
at the end the forecast against the time taken, then who won and where the report is.

Snakemake says "7 of 29 steps done" and nothing of time, though the workflow predicts every job.
This listens to Snakemake's own log events (a logging handler on its logger, which a run from a
clone and a run as a module of one's own Snakefile both have, where its onstart and onsuccess
handlers run only from a clone): the run's start, each job's start and end. It reads the plan once
the run starts, and again where a job it does not know starts (a sweep's checkpoint adds jobs) or
where a job it could not price may be priced now (a CPU job made its data or its model)."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Callable

from vlft.costs import duration, wall_seconds

# The rules whose jobs the forecast prices, where their data and model are on disk.
PRICED = ("train", "evaluate", "cache_vision")
# Snakemake's log events, by the names its logger plugin interface gives them (LogEvent's values).
RUN_STARTED, JOB_STARTED, JOB_FINISHED, STEPS_DONE = "run_info", "job_info", "job_finished", "progress"


@dataclass(frozen=True)
class PlannedJob:
    jobid: int
    rule: str
    predicted_s: float | None  # None: a job the forecast does not price (the CPU jobs)
    gpus: int
    needs: tuple[int, ...]  # the jobids of the planned jobs it waits for


class StudyProgress(logging.Handler):
    """Arguments, each a function called when needed:
    - `plan(again)`: the run's jobs (PlannedJob), read when it starts (again: priced anew);
    - `capacity()`: the GPUs its jobs share (math.inf: each its own) and how that was told
      (vlft.study_costs.capacity_of);
    - `first_lines()`, `last_lines()`: what the study says at its start and when every job is done;
    - `dry_run()`: whether nothing runs (then it says nothing)."""

    def __init__(
        self,
        plan: Callable[[bool], list[PlannedJob]],
        capacity: Callable[[], tuple[float, str]],
        first_lines: Callable[[], list[str]],
        last_lines: Callable[[], list[str]],
        dry_run: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
        out=None,
    ):
        super().__init__(level=logging.INFO)
        self.plan, self.capacity, self.first_lines, self.last_lines = plan, capacity, first_lines, last_lines
        self.dry_run, self.clock, self.out = dry_run, clock, out
        self.jobs: dict[int, PlannedJob] = {}
        self.started_at: dict[int, float] = {}
        self.took: dict[int, float] = {}
        self.run_started: float | None = None
        self.forecast_s = 0.0
        self.repriced = False

    def emit(self, record: logging.LogRecord) -> None:
        event = str(getattr(record, "event", ""))
        if event not in (RUN_STARTED, JOB_STARTED, JOB_FINISHED, STEPS_DONE) or self.dry_run():
            return
        try:
            if event == RUN_STARTED:
                self.start()
            elif event == JOB_STARTED and self.run_started is not None:
                self.started_at[record.jobid] = self.clock()
                if record.jobid not in self.jobs:
                    self.read_plan()
            elif event == JOB_FINISHED and record.job_id in self.started_at:
                self.finished(record.job_id)
            elif event == STEPS_DONE and self.run_started is not None and record.done == record.total:
                # Said after Snakemake's own last count, as its onsuccess handler would be.
                self.say(self.end_line(), *self.last_lines())
        except Exception:  # the run goes on whatever this says
            self.handleError(record)

    def say(self, *lines: str) -> None:
        for line in lines:
            print(line, file=self.out or sys.stderr, flush=True)

    def start(self) -> None:
        self.run_started = self.clock()
        self.read_plan()
        self.say(*self.first_lines(), f"Study: {self.counted(self.jobs.values())} jobs to run; {self.forecast()}")

    def forecast(self) -> str:
        """The forecast of the whole run, made now: the time spent and the GPU jobs' time left."""
        priced = sum(job.predicted_s is not None for job in self.jobs.values())
        self.forecast_s = self.clock() - self.run_started + self.left_s()
        if not priced:
            return "no forecast before this run has made the data and model its GPU jobs are priced by"
        return f"the forecast: {duration(self.forecast_s)} for its {priced} GPU jobs (snakemake -n lists them)"

    def finished(self, jobid: int) -> None:
        self.took[jobid] = self.clock() - self.started_at.pop(jobid)
        job = self.jobs.get(jobid)
        if job is None or job.rule == "all":
            return
        if self.made_what_prices_them():
            self.read_plan(again=True)
            self.say(f"Study: its data and model made, {self.forecast()}")
        self.say(self.progress_line())

    def made_what_prices_them(self) -> bool:
        """Whether the jobs the forecast could not price may be priced now: the jobs they wait for that
        it never prices (those that make their data and model) have all finished. Asked once a job:
        pricing reads every split's counts, so it is done once, when it can succeed."""
        unpriced = [job for job in self.jobs.values() if job.predicted_s is None and job.rule in PRICED]
        makers = {n for job in unpriced for n in job.needs if self.jobs[n].rule not in PRICED}
        if not unpriced or self.repriced or not makers <= set(self.took):
            return False
        self.repriced = True
        return True

    def read_plan(self, again: bool = False) -> None:
        self.jobs = {job.jobid: job for job in self.plan(again)}

    @staticmethod
    def counted(jobs) -> int:
        return sum(job.rule != "all" for job in jobs)

    def left_s(self) -> float:
        """The forecast's wall time of the jobs not done, a running one less the time it has run."""
        now = self.clock()
        left = {
            jobid: max(0.0, job.predicted_s - (now - self.started_at[jobid] if jobid in self.started_at else 0.0))
            for jobid, job in self.jobs.items()
            if job.predicted_s is not None and jobid not in self.took
        }
        needs = {jobid: self.jobs[jobid].needs for jobid in left}
        gpus = {jobid: self.jobs[jobid].gpus for jobid in left}
        return wall_seconds(left, needs, gpus, self.capacity()[0])

    def measured(self) -> tuple[float, float]:
        """The finished priced jobs' predicted and taken seconds, summed."""
        done = [jobid for jobid in self.took if self.jobs.get(jobid) and self.jobs[jobid].predicted_s is not None]
        return sum(self.jobs[j].predicted_s for j in done), sum(self.took[j] for j in done)

    def progress_line(self) -> str:
        finished = [self.jobs[j] for j in self.took if j in self.jobs]
        kinds = {}
        for job in self.jobs.values():
            if job.rule in ("train", "evaluate"):
                done, total = kinds.get(job.rule, (0, 0))
                kinds[job.rule] = (done + (job.jobid in self.took), total + 1)
        by_kind = ", ".join(f"{rule} {done} of {total}" for rule, (done, total) in kinds.items())
        predicted, taken = self.measured()
        pace = f"; its finished GPU jobs took {taken / predicted:.2f}x their forecast" if predicted > 0 else ""
        return (
            f"Study: {self.counted(finished)} of {self.counted(self.jobs.values())} jobs done"
            + (f" ({by_kind})" if by_kind else "")
            + f"; {duration(self.clock() - self.run_started)} spent; about {duration(self.left_s())} left by the "
            f"forecast{pace}"
        )

    def end_line(self) -> str:
        predicted, taken = self.measured()
        ratio = f" ({taken / predicted:.2f}x)" if predicted > 0 else ""
        return (
            f"Study done in {duration(self.clock() - self.run_started)}, against {duration(self.forecast_s)} forecast "
            f"at {self.capacity()[1]}; its GPU jobs took {duration(taken)} against {duration(predicted)} predicted{ratio}"
        )


def follow_progress(*arguments) -> None:
    """Say the study's progress as Snakemake logs its run (StudyProgress's arguments): one listener a
    process, the last one set up (a Snakefile read again replaces its own)."""
    from snakemake.logging import logger

    for handler in [h for h in logger.handlers if isinstance(h, StudyProgress)]:
        logger.removeHandler(handler)
    logger.addHandler(StudyProgress(*arguments))

"""A running study's own progress (vlft.study_progress), from the log records Snakemake's scheduler
logs, on a clock the test moves: jobs done and left, the time spent, the forecast's time left as
jobs finish, a plan priced once its data is made, and the forecast against the time taken at the end.
The demo's run shows the same lines in a real terminal (tests/workflow/test_demo_pipeline.py)."""

from __future__ import annotations

import io
import logging

from snakemake_interface_logger_plugins.common import LogEvent

from vlft.study_progress import PlannedJob, StudyProgress


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def record(event, **fields):
    entry = logging.LogRecord("snakemake.logging", logging.INFO, __file__, 0, "", None, None)
    entry.__dict__.update(event=event, **fields)
    return entry


def a_study(priced: bool):
    """prepare (CPU) -> train (60 s) -> two evaluations (10 s each), then `all`."""
    train, evaluate = (60.0, 10.0) if priced else (None, None)
    return [
        PlannedJob(1, "prepare_split", None, 0, ()),
        PlannedJob(2, "train", train, 1, (1,)),
        PlannedJob(3, "evaluate", evaluate, 1, (2,)),
        PlannedJob(4, "evaluate", evaluate, 1, (2,)),
        PlannedJob(0, "all", None, 0, (3, 4)),
    ]


def test_progress_counts_jobs_and_time_left_and_ends_with_the_forecast_against_the_time_taken():
    clock, out, asked = Clock(), io.StringIO(), []

    def plan(again):
        asked.append(again)
        return a_study(priced=again)  # the data is made by the first job: priced from then on

    progress = StudyProgress(
        plan,
        lambda: (2, "gpu=2"),
        lambda: ["Results of this study: results/x/"],
        lambda: ["The report: r"],
        lambda: False,
        clock,
        out,
    )
    log = logging.getLogger("test-study-progress")
    log.addHandler(progress)
    log.setLevel(logging.INFO)

    def started(jobid, at):
        clock.now = at
        log.info("", extra={"event": LogEvent.JOB_INFO, "jobid": jobid})

    def finished(jobid, at):
        clock.now = at
        log.info("", extra={"event": LogEvent.JOB_FINISHED, "job_id": jobid})

    log.info("", extra={"event": LogEvent.RUN_INFO})
    started(1, 0)
    finished(1, 6)
    started(2, 6)
    finished(2, 96)  # 1.5x its forecast
    started(3, 96)
    started(4, 98)
    finished(1_000, 100)  # no job of this run: no line
    finished(3, 104)  # 4 has run 6 of its 10 s: 4 s left
    finished(4, 112)
    started(0, 112)
    finished(0, 112)
    log.info("", extra={"event": LogEvent.PROGRESS, "done": 5, "total": 5})  # Snakemake's last count
    log.removeHandler(progress)

    assert asked == [False, True]  # read at the start, priced again once the CPU job made its data
    assert out.getvalue().splitlines() == [
        "Results of this study: results/x/",
        "Study: 4 jobs to run; no forecast before this run has made the data and model its GPU jobs are priced by",
        "Study: its data and model made, the forecast: 1.3 min for its 3 GPU jobs (snakemake -n lists them)",
        "Study: 1 of 4 jobs done (train 0 of 1, evaluate 0 of 2); 6 s spent; about 1.2 min left by the forecast",
        "Study: 2 of 4 jobs done (train 1 of 1, evaluate 0 of 2); 1.6 min spent; about 10 s left by the forecast; "
        "its finished GPU jobs took 1.50x their forecast",
        "Study: 3 of 4 jobs done (train 1 of 1, evaluate 1 of 2); 1.7 min spent; about 4 s left by the forecast; "
        "its finished GPU jobs took 1.40x their forecast",
        "Study: 4 of 4 jobs done (train 1 of 1, evaluate 2 of 2); 1.9 min spent; about 0 s left by the forecast; "
        "its finished GPU jobs took 1.40x their forecast",
        "Study done in 1.9 min, against 1.3 min forecast at gpu=2; its GPU jobs took 1.9 min against 1.3 min "
        "predicted (1.40x)",
        "The report: r",
    ]


def test_a_dry_run_says_nothing():
    out = io.StringIO()
    progress = StudyProgress(lambda again: a_study(True), lambda: (1, "gpu=1"), list, list, lambda: True, Clock(), out)
    progress.emit(record(LogEvent.RUN_INFO))
    progress.emit(record(LogEvent.JOB_INFO, jobid=1))
    assert out.getvalue() == ""

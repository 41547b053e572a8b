"""The README's pipelines that run in copies of their own of what the demo made
(tests/workflow/test_readme.py runs every README command): started with the demo's SLURM scenarios,
they run in the background once the session's SLURM runs have ended."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from tests.helpers import copy_demo_upstream
from tests.slurm_runs import BACKGROUND_SLURM_RUNS, background_runs_working

# Why then: the cluster's jobs have CI's two cores until they end; after them the suite's tests mostly
# run one at a time, leaving a core free.
BACKGROUND_COMMANDS = (
    "snakemake --configfile config/examples/demo-qwen3_5.yaml --cores all",
    "snakemake --configfile config/examples/demo-keep-best.yaml --cores all",
    "snakemake -s <clone>/Snakefile --configfile my-study.yaml --cores all",
)


def start_readme_pipelines(session, demo_workdir: Path, tiny_model_dir: Path, directory: Path) -> SimpleNamespace:
    """BACKGROUND_COMMANDS this session selects, each run by its runner (checks and all) in a thread,
    one after the other, once no SLURM run of the session works any longer; each from a copy of the
    demo's upstream made now, while no test writes into the demo's directory. `outcomes`: each
    command's (an Event set once it ran, and what it raised)."""
    from tests.workflow.test_readme import RUNNERS

    selected = {item.callspec.params.get("command") for item in session.items if hasattr(item, "callspec")}
    commands = [command for command in BACKGROUND_COMMANDS if command in selected]
    fixtures = {
        "demo_workdir": copy_demo_upstream(demo_workdir, directory / "upstream"),
        "tiny_model_dir": tiny_model_dir,
    }
    run = SimpleNamespace(
        outcomes={command: SimpleNamespace(ran=threading.Event(), error=None) for command in commands}
    )

    def run_each():
        while background_runs_working(session, BACKGROUND_SLURM_RUNS):
            time.sleep(5)
        for number, command in enumerate(commands):
            outcome = run.outcomes[command]
            try:
                RUNNERS[command](command, fixtures.__getitem__, directory / str(number))
            except BaseException as error:  # the command's test raises it
                outcome.error = error
            finally:
                outcome.ran.set()

    for number in range(len(commands)):
        (directory / str(number)).mkdir()
    run.thread = threading.Thread(target=run_each, daemon=True)
    run.thread.start()
    return run

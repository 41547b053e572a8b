"""How every job of the workflow starts: each rule's shell line runs

    python -m vlft.jobs.launch [--gpus N] scripts/<job>.py [its arguments]

and this, before anything imports torch:

1. with `--gpus N`, claims N of the GPUs this process may see for itself and narrows
   CUDA_VISIBLE_DEVICES to them (vlft.jobs.gpus: concurrent jobs on one machine or in one
   allocation get distinct GPUs; CUDA reads the variable once, so it is set before any import);
2. hands the job to a warm process where one may run it (vlft.jobs.warm_start: its imports paid once
   a study); then this process waits for it, passes signals on, and exits as it did;
3. otherwise becomes the script (`scripts/<job>.py` of the workflow's own directory, whatever the
   working directory; exec, the same process: its GPU claim, its signals, its pid), which
   then runs exactly as `python <script>` would.

A job's life from there: vlft.jobs.cli.run says where it runs and turns bad input and Ctrl-C into
one line each; a training job given several GPUs relaunches itself under torchrun
(vlft.jobs.distributed); SIGTERM, SIGUSR1 or its time limit coming close make it save and exit 75
(vlft.jobs.stopping).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from vlft.jobs import gpus, warm_start
from vlft.jobs.cli import JOB_STARTED

# Where the workflow is (its Snakefile sets it for the jobs it starts): a job's `scripts/<job>.py`
# is its, whatever the working directory (a study of the user's own, or the workflow as a module).
WORKFLOW_DIR = "VLFT_WORKFLOW_DIR"


def scripts_of(shell_commands) -> list[str]:
    """The job scripts that rules' shell lines run (`scripts/<job>.py`), each once."""
    return sorted({name for command in shell_commands for name in re.findall(r"\bscripts/\w+\.py", command)})


def scripts_fetched(sources: dict[str, str], directory: str) -> str:
    """A workflow deployed from a release (a module whose snakefile is `github(...)`) has no files of
    its own here: Snakemake's source cache fetched each job script (`sources`: `scripts/<job>.py` ->
    the cached file, whatever its name there); they are laid out as the workflow's, under `directory`,
    which becomes the jobs' WORKFLOW_DIR. Each copy replaces the last atomically: a SLURM job's own
    Snakemake writes the same files while others run them."""
    root = Path(directory).resolve()
    for name, cached in sources.items():
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}")
        shutil.copyfile(cached, partial)
        os.replace(partial, target)
    return str(root)


def workflow_script(script: str) -> str:
    root = os.environ.get(WORKFLOW_DIR)
    return os.path.join(root, script) if root and not os.path.isabs(script) else script


def main(argv: list[str]) -> None:
    # The job's start, for the time its log ends with (vlft.jobs.cli.say_took_at_exit).
    os.environ[JOB_STARTED] = repr(time.time())
    count = 0
    if argv[:1] == ["--gpus"]:
        count, argv = int(argv[1]), argv[2:]
    if not argv:
        sys.exit("usage: python -m vlft.jobs.launch [--gpus N] SCRIPT [ARGUMENTS...]")
    sys.argv = [workflow_script(argv[0]), *argv[1:]]  # the job is the script: its name in every line it says
    # Where the `kernels` package is installed, transformers would fetch some layers' kernels from the
    # Hub as a model loads (a Qwen3.5's Gated DeltaNet and norms among them): a job runs what is
    # installed (flash-attn, flash-linear-attention) or torch, and fetches nothing. Read by
    # transformers as it imports (before 5.25) or as a model loads, so set before the job (or its
    # warm process) imports it.
    os.environ["USE_HUB_KERNELS"] = "0"
    if count > 0:
        gpus.claim(count, os.getpid())
        # Its time from here: a wait for a GPU another job held is none of its own (the forecast's
        # refinement compares what a job took with its prediction).
        os.environ[JOB_STARTED] = repr(time.time())
    warm_start.hand_off()  # returns where no warm process runs it
    flags = subprocess._args_from_interpreter_flags()
    os.execv(sys.executable, [sys.executable, *flags, *sys.argv])


if __name__ == "__main__":
    main(sys.argv[1:])

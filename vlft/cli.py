"""`vlft`: the workflow's verbs in one command, where LLaMA-Factory's and ms-swift's users look first.

    vlft run [snakemake's arguments]      the study, through Snakemake and the workflow's own Snakefile
    vlft predict STAGE --image X --question Q   answer with a trained stage (scripts/predict.py)
    vlft chat STAGE --image X              talk with a trained stage about an image (scripts/chat.py)
    vlft export STAGE [snakemake's arguments]   the stage merged into its base model (results/export/...)
    vlft env                               what a result made here would rest on: versions, GPUs, commit

Each verb runs what the README's own commands run; `vlft run` is `snakemake -s <workflow>/Snakefile`,
from any directory."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

VERBS = ("run", "predict", "chat", "export", "env")


def workflow_dir() -> Path:
    """The workflow's files beside this package (an install from a clone, `pip install -e`)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "Snakefile").is_file():
        sys.exit(
            f"vlft: the workflow's files are not beside the package ({root}): install it from a clone "
            "(pip install -e <clone>), or run snakemake -s <clone>/Snakefile"
        )
    return root


def snakemake(arguments: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", "snakemake", "-s", str(workflow_dir() / "Snakefile"), *arguments])


def export_target(stage: str) -> str:
    """results/train/<experiment>/<stage> -> results/export/<experiment>/<stage> (its study's results)."""
    path = Path(stage.rstrip("/"))
    if len(path.parts) < 4 or path.parts[-3] != "train":
        sys.exit(f"vlft export: {stage} is not a trained stage's directory (<results>/train/<experiment>/<stage>)")
    return str(path.parent.parent.parent / "export" / path.parts[-2] / path.parts[-1])


def environment() -> list[str]:
    from vlft.jobs.launch import WORKFLOW_DIR
    from vlft.provenance import provenance

    os.environ.setdefault(WORKFLOW_DIR, str(workflow_dir()))  # the commit is the workflow's

    lines = [f"{name}: {value}" for name, value in provenance().items() if name != "made"]
    lines.append(f"python: {sys.version.split()[0]}")
    import torch

    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    lines.append(
        f"GPUs: {', '.join(gpus) if gpus else 'none usable (jobs that ask for one stop, unless cpu_fallback)'}"
    )
    try:
        import flash_attn  # noqa: F401

        lines.append("flash-attn: installed (used)")
    except ImportError:
        lines.append("flash-attn: not installed (torch's attention is used)")
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in VERBS:
        sys.exit(__doc__)
    verb, rest = argv[0], argv[1:]
    if verb == "run":
        snakemake(rest)
    elif verb == "export":
        if not rest:
            sys.exit("vlft export STAGE [snakemake's arguments]: STAGE is results/train/<experiment>/<stage>")
        snakemake([export_target(rest[0]), *rest[1:]])
    elif verb in ("predict", "chat"):
        script = workflow_dir() / f"scripts/{verb}.py"
        sys.argv = [str(script), *rest]
        runpy.run_path(str(script), run_name="__main__")
    else:
        print("\n".join(environment()))


if __name__ == "__main__":
    main()

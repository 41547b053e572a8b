"""`vlft`: the workflow's verbs in one command, where LLaMA-Factory's and ms-swift's users look first.

    vlft run [snakemake's arguments]      the study, through Snakemake and the workflow's own Snakefile
    vlft predict STAGE --image X --question Q   answer with a trained stage (scripts/predict.py)
    vlft chat STAGE --image X              talk with a trained stage about an image (scripts/chat.py)
    vlft export STAGE [snakemake's arguments]   the stage merged into its base model (<results>/export/...)
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


EXPORT_HELP = """vlft export STAGE [snakemake's arguments]

The trained stage STAGE (<results>/train/<experiment>/<stage>) as a model of its own, in
<results>/export/<experiment>/<stage>: its adapter merged into the base weights, with the base's
tokenizer and chat template, the image processor at the stage's pixels and a model card. transformers
loads it with from_pretrained alone; `vllm serve` serves it. The stage is trained first if it is not.

Run it from the study's directory: the study's config is the file there (or in a folder below it)
whose outputs land in <results>, unless --configfile names it; Snakemake runs on all cores unless
--cores, --jobs or --profile says otherwise. Any other argument goes to Snakemake as it is."""

# Snakemake's arguments that already say where and how wide its jobs run.
SAYS_HOW_TO_RUN = ("--cores", "-c", "--jobs", "-j", "--profile", "--executor", "-e")


def export_target(stage: str) -> tuple[str, str]:
    """results/train/<experiment>/<stage> -> (its study's results, the export's file Snakemake makes:
    the model's config.json, so that the exported folder is the model's files alone)."""
    path = Path(stage.rstrip("/"))
    if len(path.parts) < 4 or path.parts[-3] != "train":
        sys.exit(
            f"vlft export: {stage} is not a trained stage's directory (<results>/train/<experiment>/<stage>); "
            "vlft export --help says more"
        )
    results = path.parent.parent.parent
    return str(results), str(results / "export" / path.parts[-2] / path.parts[-1] / "config.json")


def study_config(results: str, here: Path) -> str:
    """The config file in `here` or two folders below it whose study's outputs land in `results`."""
    import yaml

    from vlft.config import results_directory
    from vlft.errors import ConfigError

    found = []
    for pattern in ("*.y*ml", "*/*.y*ml", "*/*/*.y*ml"):
        for path in sorted(here.glob(pattern)):
            if path.parts[len(here.parts)] in ("results", ".snakemake"):
                continue
            try:
                config = yaml.safe_load(path.read_text())
                lands = isinstance(config, dict) and "experiments" in config and results_directory(config, [path])
            except (yaml.YAMLError, OSError, UnicodeDecodeError, ConfigError):
                continue
            if lands and os.path.normpath(lands) == os.path.normpath(results):
                found.append(str(path.relative_to(here)))
    if not found:
        sys.exit(
            f"vlft export: no config file here ({here}) writes its study to {results}/: run it from the study's "
            "directory, or give the study's config with --configfile FILE"
        )
    if len(found) > 1:
        sys.exit(f"vlft export: {', '.join(found)} all write to {results}/: give the study's with --configfile FILE")
    return found[0]


def export_arguments(stage: str, rest: list[str], here: Path) -> list[str]:
    """Snakemake's arguments for `vlft export STAGE rest...` run in `here`."""
    results, target = export_target(stage)
    arguments = [target, *rest]
    if not any(a.split("=")[0] in ("--configfile", "--configfiles") for a in rest):
        arguments += ["--configfile", study_config(results, here)]
    if not any(a.split("=")[0] in SAYS_HOW_TO_RUN for a in rest):
        arguments += ["--cores", "all"]
    return arguments


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
            sys.exit(EXPORT_HELP)
        if rest[0] in ("-h", "--help"):
            print(EXPORT_HELP)
            return
        snakemake(export_arguments(rest[0], rest[1:], Path.cwd()))
    elif verb in ("predict", "chat"):
        script = workflow_dir() / f"scripts/{verb}.py"
        sys.argv = [str(script), *rest]
        runpy.run_path(str(script), run_name="__main__")
    else:
        print("\n".join(environment()))


if __name__ == "__main__":
    main()

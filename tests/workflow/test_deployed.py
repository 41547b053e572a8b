"""The workflow run as a deployed workflow is: a `module` of the user's own Snakefile in a directory
of its own (what snakedeploy writes). Its jobs find their scripts from the workflow's location,
never the working directory's; from a tagged release, through Snakemake's source cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import vlft

from tests.helpers import copy_workflow, snakemake

pytestmark = pytest.mark.slow

STUDY = {
    "model": {"path": "my/model"},
    "datasets": {"mine": {"image_root": "my/images", "splits": {"train": "my/train.jsonl", "val": "my/val.jsonl"}}},
    "experiments": {"only": {"stages": [{"name": "main", "eval_splits": ["val"], "max_steps": 2}]}},
    "cpu_fallback": True,
}


def a_study_of_ones_own(directory, tiny_model_dir, config_name="study.yaml"):
    from vlft.demo.shapes import make_dataset

    directory.mkdir()
    make_dataset(
        {"train": directory / "my/train.jsonl", "val": directory / "my/val.jsonl"},
        directory / "my/images",
        {"train": 4, "val": 2},
        seed=0,
    )
    (directory / "my/model").symlink_to(tiny_model_dir)
    (directory / config_name).write_text(yaml.safe_dump(STUDY))
    return directory


def a_module_of(study, snakefile):
    (study / "Snakefile").write_text(
        f'configfile: "study.yaml"\n\n\nmodule vlft:\n    snakefile:\n        {snakefile}\n'
        "    config:\n        config\n\n\nuse rule * from vlft\n"
    )


def test_the_workflow_runs_as_a_module_of_the_users_own_snakefile(tmp_path, tiny_model_dir):
    from tests.helpers import planned_outputs

    """As snakedeploy deploys it: a module whose Snakefile is workflow/Snakefile. A study from a
    directory of its own with `-s` is the README's command, run by tests/workflow/test_readme.py."""
    clone = copy_workflow(tmp_path / "clone")
    study = a_study_of_ones_own(tmp_path / "study", tiny_model_dir)
    a_module_of(study, f'"{clone}/workflow/Snakefile"')
    said = snakemake(study, "--cores", "2").stderr
    # What a run from a clone says, said here too (a module's onstart and onsuccess never run).
    assert said.index("Results of this study: results/") < said.index("Study: 1 of ")
    assert said.index("Study done in ") < said.index("The report: results/report/index.html")
    # The clone's rerun policy holds too, its profiles/default unread: a second run plans nothing (and
    # a later release's command lines rerun nothing: test_a_tagged_release_runs_as_a_module_its_model...).
    assert planned_outputs(study) == set()
    # The module's config comes through `config:`, not a --configfile: the study names no
    # directory, so its outputs are the workflow's own results/ of the user's directory.
    assert (study / "results/report/index.html").is_file() and (study / "results/train/only/main/adapter").is_dir()


def hub_cache_holding(home, hub_id, model_dir, commit="0123456789abcdef0123456789abcdef01234567"):
    """A Hugging Face cache (HF_HOME) that holds `hub_id` at `commit` as the Hub's client lays it out:
    blobs by content, a snapshot of links to them, refs/main naming the commit."""
    import hashlib

    repo = home / "hub" / f"models--{hub_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for file in sorted(Path(model_dir).rglob("*")):
        if file.is_file():
            blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(file.read_bytes())
            link = snapshot / file.relative_to(model_dir)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs/main").write_text(commit)
    return snapshot


def snakemake_with(env, workdir, *args):
    done = subprocess.run(
        [sys.executable, "-m", "snakemake", *args], cwd=workdir, capture_output=True, text=True, env=os.environ | env
    )
    assert done.returncode == 0, f"snakemake {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def test_a_tagged_release_runs_as_a_module_its_model_fetched_by_its_hub_id_and_the_next_tag_reruns_nothing(
    tmp_path, tiny_model_dir
):
    """snakedeploy's `github("<owner>/<repo>", path="workflow/Snakefile", tag=...)`, with a local
    repository in GitHub's place (`gitfile`: Snakemake's source cache reads both from git, tag by
    tag). The clone's working tree is broken after tagging: every file the run reads, Snakefiles and
    job scripts alike, must come from the tag. The study names its model by a Hub id: a local rule
    (where the driver runs) takes it through huggingface_hub from the Hub's cache (offline here: what
    the cache holds, as on a machine that fetched it before) and links it at models/<hub_id>; the
    stage trains from it; the next plan has nothing to do.

    Then the finished study moves to the next tag, whose rules' command lines and library code
    changed (as a release changes them to change how jobs run, not what they compute): its plan has
    nothing to do. Without a profile of its own in the study's directory, Snakemake's default
    triggers made it plan every job again ("Code has changed")."""
    release = copy_workflow(tmp_path / "release")
    git = ["git", "-C", str(release), "-c", "user.name=t", "-c", "user.email=t@t"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "release"], ["tag", "v1.0.0"]):
        subprocess.run(git + command, check=True)
    for script in (release / "scripts").glob("*.py"):
        script.write_text("raise SystemExit('read from the working tree, not the tag')\n")
    study = a_study_of_ones_own(tmp_path / "study", tiny_model_dir)
    snapshot = hub_cache_holding(tmp_path / "hf-home", "tiny-org/tiny-qwen3-vl", tiny_model_dir)
    config = yaml.safe_load((study / "study.yaml").read_text())
    config["model"] = {"hub_id": "tiny-org/tiny-qwen3-vl"}
    (study / "study.yaml").write_text(yaml.safe_dump(config))
    a_module_of(study, f'gitfile("{release}", path="workflow/Snakefile", tag="v1.0.0")')
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}

    assert "rule fetch_model:" in snakemake_with(env, study, "-n")
    ran = snakemake_with(env, study, "--cores", "2")
    assert "localrule fetch_model:" in ran  # where the driver runs, also under SLURM
    link = study / "models/tiny-org/tiny-qwen3-vl"
    assert link.is_symlink() and link.resolve() == snapshot.resolve()
    assert (study / "results/report/index.html").is_file() and (study / "results/train/only/main/adapter").is_dir()
    # The jobs ran the tag's scripts, fetched into the study's own .snakemake/ (GitPython, which
    # Snakemake reads git through, strips the file's last newline).
    tagged = subprocess.run(git + ["show", "v1.0.0:scripts/train.py"], capture_output=True, text=True, check=True)
    assert (study / ".snakemake/vlft/scripts/train.py").read_text().rstrip() == tagged.stdout.rstrip()
    assert "Nothing to be done" in snakemake_with(env, study, "-n")

    # The next release: every rule's command line and a job script changed, nothing they compute.
    subprocess.run(git + ["checkout", "-q", "--", "scripts"], check=True)
    for rules in (release / "workflow/rules").glob("*.smk"):
        rules.write_text(rules.read_text().replace("python -m vlft.jobs.launch", "python -B -m vlft.jobs.launch"))
    train = release / "scripts/train.py"
    train.write_text(train.read_text() + "\n# a comment of the next release\n")
    for command in (["commit", "-qam", "next release"], ["tag", "v1.1.0"]):
        subprocess.run(git + command, check=True)
    a_module_of(study, f'gitfile("{release}", path="workflow/Snakefile", tag="v1.1.0")')
    assert "Nothing to be done" in snakemake_with(env, study, "-n")


def test_a_workflow_and_an_installed_package_of_different_releases_say_so(tmp_path):
    """A deployed study's workflow comes from a tag and its package from pip: of different releases,
    a missing module or a changed call failed cryptically. The plan stops at once in one sentence
    naming both releases, before any of the package's modules is imported."""
    release = copy_workflow(tmp_path / "release")
    init = release / "vlft/__init__.py"
    init.write_text(init.read_text().replace(f'__version__ = "{vlft.__version__}"', '__version__ = "9.9.9"'))
    study = tmp_path / "study"
    study.mkdir()
    (study / "study.yaml").write_text(yaml.safe_dump(STUDY))
    a_module_of(study, f'"{release}/workflow/Snakefile"')
    planned = snakemake(study, "-n", check=False)
    said = planned.stdout + planned.stderr
    assert planned.returncode != 0
    assert (
        f"This workflow is release 9.9.9 of vlft and the installed vlft package ({Path(vlft.__file__).parent}) "
        f"is release {vlft.__version__}: install vlft from the same release as the workflow" in said
    ), said
    assert "Traceback" not in said and "No module named" not in said

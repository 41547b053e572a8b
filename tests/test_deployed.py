"""The workflow run as a deployed workflow is: a `module` of the user's own Snakefile in a directory
of its own (what snakedeploy writes). Its jobs find their scripts from the workflow's location,
never the working directory's; from a tagged release, through Snakemake's source cache."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from conftest import copy_workflow, snakemake

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
    """As snakedeploy deploys it: a module whose Snakefile is workflow/Snakefile. A study from a
    directory of its own with `-s` is the README's command, run by tests/test_readme.py."""
    clone = copy_workflow(tmp_path / "clone")
    study = a_study_of_ones_own(tmp_path / "study", tiny_model_dir)
    a_module_of(study, f'"{clone}/workflow/Snakefile"')
    snakemake(study, "--cores", "2")
    # The module's config comes through `config:`, not a --configfile: the study names no
    # directory, so its outputs are the workflow's own results/ of the user's directory.
    assert (study / "results/report/index.html").is_file() and (study / "results/train/only/main/adapter").is_dir()


def test_a_tagged_release_runs_as_a_module_its_files_read_from_the_tag(tmp_path, tiny_model_dir):
    """snakedeploy's `github("<owner>/<repo>", path="workflow/Snakefile", tag=...)`, with a local
    repository in GitHub's place (`gitfile`: Snakemake's source cache reads both from git, tag by
    tag). The clone's working tree is broken after tagging: every file the run reads, Snakefiles and
    job scripts alike, must come from the tag."""
    release = copy_workflow(tmp_path / "release")
    git = ["git", "-C", str(release), "-c", "user.name=t", "-c", "user.email=t@t"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "release"], ["tag", "v1.0.0"]):
        subprocess.run(git + command, check=True)
    for script in (release / "scripts").glob("*.py"):
        script.write_text("raise SystemExit('read from the working tree, not the tag')\n")
    study = a_study_of_ones_own(tmp_path / "study", tiny_model_dir)
    a_module_of(study, f'gitfile("{release}", path="workflow/Snakefile", tag="v1.0.0")')
    snakemake(study, "--cores", "2")
    assert (study / "results/report/index.html").is_file() and (study / "results/train/only/main/adapter").is_dir()
    # The jobs ran the tag's scripts, fetched into the study's own .snakemake/ (GitPython, which
    # Snakemake reads git through, strips the file's last newline).
    tagged = subprocess.run(git + ["show", "v1.0.0:scripts/train.py"], capture_output=True, text=True, check=True)
    assert (study / ".snakemake/vlft/scripts/train.py").read_text().rstrip() == tagged.stdout.rstrip()

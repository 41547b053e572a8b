"""The workflow run as a deployed workflow is: a `module` of the user's own Snakefile in a directory
of its own (what snakedeploy writes). Its jobs find their scripts from the workflow's location,
never the working directory's."""

from __future__ import annotations

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


def test_the_workflow_runs_as_a_module_of_the_users_own_snakefile(tmp_path, tiny_model_dir):
    """As snakedeploy deploys it: a module whose Snakefile is workflow/Snakefile (which includes the
    top-level one). A study from a directory of its own with `-s` is the README's command, run by
    tests/test_readme.py."""
    entry = "workflow/Snakefile"
    clone = copy_workflow(tmp_path / "clone")
    study = a_study_of_ones_own(tmp_path / "study", tiny_model_dir)
    (study / "Snakefile").write_text(
        f'configfile: "study.yaml"\n\n\nmodule vlft:\n    snakefile:\n        "{clone}/{entry}"\n'
        "    config:\n        config\n\n\nuse rule * from vlft\n"
    )
    snakemake(study, "--cores", "2")
    # The module's config comes through `config:`, not a --configfile: the study names no
    # directory, so its outputs are the workflow's own results/ of the user's directory.
    assert (study / "results/report/index.html").is_file() and (study / "results/train/only/main/adapter").is_dir()

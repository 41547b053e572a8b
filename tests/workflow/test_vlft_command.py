"""The `vlft` command: its verbs run what the README's own commands run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vlft.cli import export_arguments, export_target


def vlft(*args, cwd):
    return subprocess.run([sys.executable, "-m", "vlft.cli", *args], cwd=cwd, capture_output=True, text=True)


def test_env_says_what_a_result_would_rest_on(tmp_path):
    import torch

    said = vlft("env", cwd=tmp_path)
    assert said.returncode == 0, said.stderr
    lines = dict(line.split(": ", 1) for line in said.stdout.splitlines())
    assert lines["torch"] == torch.__version__ and "transformers" in lines and "GPUs" in lines
    assert not lines["workflow commit"].startswith("unknown")  # the workflow's, from any directory


def test_run_is_the_workflow_through_snakemake_from_any_directory(tmp_path):
    planned = vlft("run", "-n", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert "make_tiny_model" in planned.stdout and "This was a dry-run" in planned.stdout
    assert not (tmp_path / "results").exists()


def test_export_names_the_stages_export_and_a_wrong_verb_says_the_verbs(tmp_path):
    assert export_target("results/train/exp4/stage2") == ("results", "results/export/exp4/stage2/config.json")
    assert export_target("results/my/train/exp1/main/") == ("results/my", "results/my/export/exp1/main/config.json")
    wrong = vlft("train", cwd=tmp_path)
    assert wrong.returncode != 0 and "vlft run [snakemake's arguments]" in wrong.stderr


def test_export_finds_the_studys_config_and_cores_from_its_directory_and_its_help_helps(tmp_path):
    """`vlft export STAGE` alone, in the study's directory: the config file whose outputs land in the
    stage's results (by its name, or its `results`), all cores; what the user gives is kept."""
    import yaml

    study = {"experiments": {"exp1": {"stages": {"main": {}}}}}
    (tmp_path / "my-study.yaml").write_text(yaml.safe_dump(study))
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/other.yaml").write_text(yaml.safe_dump(study | {"results": "results/elsewhere"}))
    (tmp_path / "notes.yaml").write_text("- not a study\n")
    stage = "results/my-study/train/exp1/main"
    assert export_arguments(stage, [], tmp_path) == [
        "results/my-study/export/exp1/main/config.json",
        "--configfile",
        "my-study.yaml",
        "--cores",
        "all",
    ]
    assert export_arguments("results/elsewhere/train/exp1/main", ["-j", "4"], tmp_path)[-2:] == [
        "--configfile",
        "configs/other.yaml",
    ]
    assert export_arguments(stage, ["--configfile", "x.yaml", "--profile", "p"], tmp_path) == [
        "results/my-study/export/exp1/main/config.json",
        "--configfile",
        "x.yaml",
        "--profile",
        "p",
    ]
    lost = vlft("export", "results/nobody/train/exp1/main", cwd=tmp_path)
    assert lost.returncode != 0
    assert f"no config file here ({tmp_path}) writes its study to results/nobody/: run it from" in lost.stderr
    (tmp_path / "copy.yaml").write_text(yaml.safe_dump(study | {"results": "results/my-study"}))
    twice = vlft("export", stage, cwd=tmp_path)
    assert "copy.yaml, my-study.yaml all write to results/my-study/: give the study's with --configfile" in twice.stderr
    helped = vlft("export", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "Run it from the study's directory" in helped.stdout


@pytest.mark.slow
def test_predict_answers_as_the_stages_evaluation_did(demo_workdir):
    said = vlft(
        "predict",
        "results/train/exp5/main",
        "--image",
        "results/demo/shapes/images/test/00000.png",
        "--question",
        "How many shapes are there?",
        cwd=demo_workdir,
    )
    assert said.returncode == 0, said.stderr
    answers = [json.loads(line) for line in said.stdout.splitlines() if line.startswith("{")]
    evaluated = json.loads((demo_workdir / "results/eval/exp5/main/test/predictions.jsonl").open().readline())
    assert [a["answer"] for a in answers] == [evaluated["prediction"]]


@pytest.mark.slow
def test_chat_answers_each_line_with_the_conversation_so_far_and_loads_the_model_once(demo_workdir):
    """The first question about the evaluation's first test image gets the evaluation's answer; the
    next ones are asked with the conversation so far as their history; `/image` starts another
    conversation. The model is loaded once for all of them."""
    asked = "How many shapes are there?\nAnd what color is the largest?\n/image results/demo/shapes/images/test/00001.png\nHow many shapes are there?\n/quit\n"
    said = subprocess.run(
        [
            sys.executable,
            "-m",
            "vlft.cli",
            "chat",
            "results/train/exp5/main",
            "--image",
            "results/demo/shapes/images/test/00000.png",
        ],
        cwd=demo_workdir,
        input=asked,
        capture_output=True,
        text=True,
    )
    assert said.returncode == 0, said.stderr
    answers = [line for line in said.stdout.splitlines() if not line.startswith("chat.py: host")]
    assert len(answers) == 3
    evaluated = [json.loads(line) for line in (demo_workdir / "results/eval/exp5/main/test/predictions.jsonl").open()]
    assert evaluated[0]["question"] == "How many shapes are there?"
    assert answers[0] == evaluated[0]["prediction"]
    assert "now about results/demo/shapes/images/test/00001.png" in said.stderr
    assert said.stderr.count("Loading weights: 100%") == 1

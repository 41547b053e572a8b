"""The `vlft` command: its verbs run what the README's own commands run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vlft.cli import export_target


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
    assert export_target("results/train/exp4/stage2") == "results/export/exp4/stage2"
    assert export_target("results/my/train/exp1/main/") == "results/my/export/exp1/main"
    wrong = vlft("train", cwd=tmp_path)
    assert wrong.returncode != 0 and "vlft run [snakemake's arguments]" in wrong.stderr


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

"""The rerun policy, each rule of it proven by a real Snakemake dry run over the finished demo."""

import os
import re
import shutil
import time

import yaml

from tests.helpers import planned_outputs, snakemake

R = "results"


def write_config(workdir, edit) -> str:
    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    edit(config)
    path = workdir / "config/edited.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path.relative_to(workdir))


def evaluations(experiment, stage):
    return {f"{R}/eval/{experiment}/{stage}/{split}/predictions.jsonl" for split in ("val", "test")}


def test_second_run_does_nothing(demo_workdir):
    assert planned_outputs(demo_workdir) == set()


def test_editing_one_stage_reruns_it_and_what_starts_from_it(demo_workdir):
    def edit(config):
        config["experiments"]["exp4"]["stages"][0]["learning_rate"] = 1.0e-3

    configfile = write_config(demo_workdir, edit)
    assert planned_outputs(demo_workdir, "--configfile", configfile) == {
        f"{R}/train/exp4/stage1/adapter",
        f"{R}/train/exp4/stage2/adapter",
        *evaluations("exp4", "stage1"),
        *evaluations("exp4", "stage2"),
        f"{R}/report/index.html",
        "rule:all",
    }


def test_a_changed_stage_reruns_with_what_starts_from_it_even_after_its_outputs_were_lost(demo_workdir, tmp_path):
    """exp4 stage 1 edited after its outputs were deleted (as Snakemake does when a job fails):
    stage 2, trained from the old stage 1, and every evaluation of either, are out of date."""
    import shutil

    workdir = tmp_path / "work"
    shutil.copytree(demo_workdir, workdir, symlinks=True)
    shutil.rmtree(workdir / R / "train/exp4/stage1")

    def edit(config):
        config["experiments"]["exp4"]["stages"][0]["learning_rate"] = 1.0e-3

    assert planned_outputs(workdir, "--configfile", write_config(workdir, edit)) == {
        f"{R}/train/exp4/stage1/adapter",
        f"{R}/train/exp4/stage2/adapter",
        *evaluations("exp4", "stage1"),
        *evaluations("exp4", "stage2"),
        f"{R}/report/inputs.json",  # it lists stage 1's outputs, which are missing
        f"{R}/report/index.html",
        "rule:all",
    }


def test_changing_how_a_job_runs_reruns_nothing(demo_workdir):
    def edit(config):
        config["experiments"]["exp1"]["stages"][0]["checkpoint_every"] = 7
        config["experiments"]["exp1"]["stages"][0]["activation_checkpointing"] = True
        config["experiments"]["exp1"]["stages"][0]["resources"] = {
            "runtime": 99,
            "mem_mb": 1000,
            "gpus": 1,
            "threads": 2,
        }

    assert planned_outputs(demo_workdir, "--configfile", write_config(demo_workdir, edit)) == set()


def test_a_stages_threads_are_its_training_jobs(demo_workdir):
    """`resources.threads` reaches the job's command line: exp1 given 2, the others the demo's 1."""

    def edit(config):
        config["experiments"]["exp1"]["stages"][0]["resources"] = {"threads": 2}

    adapters = [f"{R}/train/{experiment}/main/adapter" for experiment in ("exp1", "exp2")]
    planned = snakemake(
        demo_workdir, "-n", "-p", "--cores", "2", "--configfile", write_config(demo_workdir, edit), "-f", *adapters
    )
    commands = re.findall(r"scripts/train\.py .* --threads (\d+) .* --adapter (\S+)", planned.stdout)
    threads = {adapter: count for count, adapter in commands}
    assert threads == {adapters[0]: "2", adapters[1]: "1"}, planned.stdout


def test_adding_an_experiment_plans_only_its_jobs_and_the_report(demo_workdir):
    def edit(config):
        config["experiments"]["exp6"] = {"stages": [{"name": "main", "lora_r": 8, "lora_alpha": 16}]}

    assert planned_outputs(demo_workdir, "--configfile", write_config(demo_workdir, edit)) == {
        f"{R}/train/exp6/main/adapter",
        *evaluations("exp6", "main"),
        f"{R}/report/index.html",
        "rule:all",
    }


def test_touching_a_dataset_file_reruns_nothing(demo_workdir):
    later = time.time() + 60
    for path in (demo_workdir / "results/demo/shapes/train.jsonl", demo_workdir / "results/demo/tiny-qwen3-vl"):
        os.utime(path, (later, later))
    assert planned_outputs(demo_workdir) == set()


def test_changed_dataset_content_reruns_that_split_and_everything_downstream(demo_workdir):
    records = demo_workdir / "results/demo/shapes/train.jsonl"
    original = records.read_text()
    try:
        records.write_text(original.replace("What color is the shape?", "Which color is the shape?", 1))
        planned = planned_outputs(demo_workdir)
    finally:
        records.write_text(original)
    trained = [
        "exp1/main",
        "exp2/main",
        "exp3/stage1",
        "exp3/stage2",
        "exp3/stage3",
        "exp4/stage1",
        "exp4/stage2",
        "exp5/main",
        "exp6/main",
        "exp7/main",
    ]
    assert planned == {
        f"{R}/prepared/shapes/train.jsonl",
        f"{R}/cache/images/shapes/train/4096-16384",
        *(f"{R}/train/{s}/adapter" for s in trained),
        *(e for s in trained for e in evaluations(*s.split("/"))),
        f"{R}/report/index.html",
        "rule:all",
    }
    # Same content again, newer time stamp: nothing.
    assert planned_outputs(demo_workdir) == set()


def test_remaking_one_demo_dataset_reruns_what_uses_it_alone(demo_workdir):
    """More screens: the screens are made again, and the click stages and the base model's clicks
    follow; nothing that reads the shapes does."""

    def edit(config):
        config["demo"]["datasets"]["screens"]["sizes"]["train"] = 900

    screens = {f"{R}/prepared/screens/{split}.jsonl" for split in ("train", "test")}
    caches = {f"{R}/cache/images/screens/{split}/4096-16384" for split in ("train", "test")}
    assert planned_outputs(demo_workdir, "--configfile", write_config(demo_workdir, edit)) == {
        f"{R}/demo/screens/test.jsonl",  # the first of the job's outputs
        *screens,
        *caches,
        f"{R}/train/click/main/adapter",
        f"{R}/eval/click/main/test/predictions.jsonl",
        f"{R}/train/click_tower/main/adapter",
        f"{R}/eval/click_tower/main/test/predictions.jsonl",
        f"{R}/train/click_grpo/sft/adapter",
        f"{R}/eval/click_grpo/sft/test/predictions.jsonl",
        f"{R}/train/click_grpo/grpo/adapter",
        f"{R}/eval/click_grpo/grpo/test/predictions.jsonl",
        f"{R}/eval/base/screens/test/predictions.jsonl",
        f"{R}/report/index.html",
        "rule:all",
    }


def test_editing_library_code_reruns_nothing(demo_workdir):
    for path in list((demo_workdir / "vlft").rglob("*.py")) + list((demo_workdir / "scripts").glob("*.py")):
        path.write_text(path.read_text() + "\n# edited\n")
    assert planned_outputs(demo_workdir) == set()


def test_an_upgrade_that_changes_how_rules_run_reruns_nothing(demo_workdir, tmp_path):
    """A release that changes every rule's command line (as one that adds an option does) but not
    what the jobs compute: nothing of a finished study runs again. In a copy, the demo's results
    with it."""
    workdir = tmp_path / "upgraded"
    shutil.copytree(demo_workdir, workdir, symlinks=True)
    for rules in (workdir / "workflow/rules").glob("*.smk"):
        rules.write_text(re.sub(r'(?<=[ "])scripts/', "./scripts/", rules.read_text()))
    assert '"./scripts/train.py ' in (workdir / "workflow/rules/train.smk").read_text()
    assert planned_outputs(workdir) == set()


def test_forcing_exp4_stage2_alone_or_with_what_depends_on_it(demo_workdir):
    adapter = f"{R}/train/exp4/stage2/adapter"
    assert planned_outputs(demo_workdir, "-f", adapter) == {adapter}
    assert planned_outputs(demo_workdir, "--forcerun", adapter) == {
        adapter,
        *evaluations("exp4", "stage2"),
        f"{R}/report/index.html",
        "rule:all",
    }

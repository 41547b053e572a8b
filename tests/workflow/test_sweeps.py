"""Sweeps (vlft.sweeps): a stage's setting given as a list expands into one experiment per value (per
combination), named by their values, checked as the stage's own setting would be; the stages they
share are trained once, and the report plots each split's accuracy against the swept values."""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import yaml

from vlft.config import resolve_config
from vlft.errors import ConfigError
from vlft.plan import build_plan
from tests.helpers import copy_workflow, planned_outputs, snakemake
from tests.workflow.test_trained_once import demo_config, make_demo_shapes

CURRICULUM = {
    "description": "Two stages, the second's learning rate swept.",
    "stages": [
        {"name": "stage1", "epochs": 1},
        {"name": "stage2", "init_from": "stage1", "epochs": 1, "sweep": {"learning_rate": [1.0e-4, 2.0e-3]}},
    ],
}


def plan_with(experiment: dict, tmp_path):
    config = demo_config(tmp_path)
    config["experiments"] = {"lr": experiment}
    return build_plan(resolve_config(config))


def test_a_sweep_expands_into_experiments_named_by_their_values_and_checked_as_settings(tmp_path):
    plan = plan_with(CURRICULUM, tmp_path)
    arms = ["lr.learning_rate-0.0001", "lr.learning_rate-0.002"]
    assert sorted(plan.stages) == sorted(f"{arm}/{stage}" for arm in arms for stage in ("stage1", "stage2"))
    assert plan.stage(arms[1], "stage2").settings["learning_rate"] == 2.0e-3
    assert plan.stage(arms[1], "stage2").init_from == f"{arms[1]}/stage1"
    assert plan.stage(arms[0], "stage1").train_params() == plan.stage(arms[1], "stage1").train_params()
    assert plan.sweeps[arms[0]] == {"experiment": "lr", "values": {"stage2.learning_rate": 1.0e-4}, "final": "stage2"}

    # Several settings: one experiment per combination; one setting swept in two stages names its stage.
    both = copy.deepcopy(CURRICULUM)
    both["stages"][0]["sweep"] = {"learning_rate": [1.0e-3, 3.0e-3], "warmup_ratio": [0.0, 0.1]}
    plan = plan_with(both, tmp_path)
    assert len(plan.sweeps) == 8
    assert "lr.stage1.learning_rate-0.001.warmup_ratio-0.1.stage2.learning_rate-0.0001" in plan.sweeps

    for sweep, error in (
        ({"learnin_rate": [1, 2]}, "sweep.learnin_rate: not a setting a stage can sweep (did you mean learning_rate?)"),
        ({"learning_rate": ["fast", 1.0e-3]}, "sweep.learning_rate[0]: 'fast' is not of type 'number'"),
        ({"epochs": [1, 1]}, "sweep.epochs: a value is listed twice"),
        ({"init_from": ["stage1", "stage0"]}, "sweep.init_from: not a setting a stage can sweep"),
    ):
        bad = copy.deepcopy(CURRICULUM)
        bad["stages"][1]["sweep"] = sweep
        with pytest.raises(ConfigError) as raised:
            plan_with(bad, tmp_path)
        assert str(raised.value).startswith(f"experiments.lr.stages[1].{error}"), str(raised.value)
    bad = copy.deepcopy(CURRICULUM)
    bad["stages"][1]["sweep"] = {"learning_rate": [1.0e-3]}
    with pytest.raises(
        ConfigError, match=r"experiments.lr.stages\[1\].sweep.learning_rate: .*(too short|non-empty|at least)"
    ):
        plan_with(bad, tmp_path)


def workflow_with_demo_data(tmp_path):
    """A copy of the workflow and a config of the demo's shapes data (made) and tiny model, evaluated on test."""
    workdir = copy_workflow(tmp_path / "wf")
    config = demo_config(workdir / "data")
    make_demo_shapes(config)
    config["model"]["path"] = "results/demo/tiny-qwen3-vl"
    config["demo"]["datasets"].pop("shapes")
    config["defaults"]["eval_splits"] = ["test"]
    return workdir, config


def test_a_sweep_trains_its_shared_stage_once_and_the_report_plots_accuracy_against_its_values(tmp_path):
    """Through Snakemake: the dry run plans stage1 once and a stage2 per value; the run's report has
    the sweep's table and chart, each final stage on each split by its learning rate."""
    workdir, config = workflow_with_demo_data(tmp_path)
    config["experiments"] = {"lr": CURRICULUM}
    (workdir / "study.yaml").write_text(yaml.safe_dump(config))
    arms = ["lr.learning_rate-0.0001", "lr.learning_rate-0.002"]

    planned = planned_outputs(workdir, "--configfile", "study.yaml", "--cores", "1")
    assert sorted(p for p in planned if p.startswith("results/train/")) == [
        f"results/train/{arms[0]}/stage1/adapter",
        *(f"results/train/{arm}/stage2/adapter" for arm in arms),
    ]
    dry = snakemake(workdir, "--configfile", "study.yaml", "--cores", "1", "--dry-run", "-p")
    (job,) = [b for b in dry.stdout.split("\nrule ") if f"output: results/train/{arms[1]}/stage2/adapter" in b]
    assert f"--init-adapter results/train/{arms[0]}/stage1/adapter " in job  # the stage1 trained, not its own
    result = snakemake(workdir, "--configfile", "study.yaml", "--cores", "2")
    assert f"{arms[1]}/stage1 trains on the same records with the same settings as {arms[0]}/stage1" in result.stderr

    report = workdir / "results/report"
    assert (report / "sweeps.png").stat().st_size > 0
    page = (report / "index.html").read_text().replace("<wbr>", "")  # the headers' breaks
    assert "<h2>Sweeps</h2>" in page and 'aria-label="accuracy against the swept values' in page
    results = pd.read_csv(report / "results.csv")
    finals = results[(results.stage == "stage2") & (results.split == "test")].set_index("experiment")
    assert sorted(finals.index) == arms
    # Stage 1 trained once; each stage 2 from it with its own learning rate, to its own adapter.
    assert not (workdir / f"results/train/{arms[1]}/stage1").exists()
    adapters = [
        (workdir / f"results/train/{arm}/stage2/adapter/adapter_model.safetensors").read_bytes() for arm in arms
    ]
    assert adapters[0] != adapters[1]
    section = page[page.index("<h2>Sweeps</h2>") :].split("<h2>")[1]
    assert "stage2.learning_rate" in section and all(arm in section for arm in arms)
    again = snakemake(workdir, "--configfile", "study.yaml", "--cores", "1", "--dry-run")
    assert "Nothing to be done" in again.stdout + again.stderr


ARMS_FIRST = {
    "stages": [
        {"name": "stage1", "epochs": 1, "sweep": {"learning_rate": [1.0e-4, 2.0e-3, 2.0e-2]}},
        {"name": "stage2", "init_from": "stage1", "epochs": 1},
    ],
    "keep_best": {"after": "stage1", "arms": 1},
}


def test_keep_best_is_planned_and_checked_against_the_sweep_in_one_sentence(tmp_path):
    plan = plan_with(ARMS_FIRST, tmp_path)
    arms = ["lr.learning_rate-0.0001", "lr.learning_rate-0.002", "lr.learning_rate-0.02"]
    assert plan.selections == {
        "lr": {"after": "stage1", "arms": 1, "metric": "accuracy", "split": "val", "candidates": arms}
    }
    # Only the stages after the comparison wait on it.
    assert [plan.selection_of(plan.stage(arm, "stage2")) for arm in arms] == ["lr"] * 3
    assert [plan.selection_of(plan.stage(arm, "stage1")) for arm in arms] == [None] * 3

    def refused(change: dict, experiment=ARMS_FIRST) -> str:
        spec = copy.deepcopy(experiment)
        spec["keep_best"] |= change
        with pytest.raises(ConfigError) as caught:
            plan_with(spec, tmp_path)
        return str(caught.value)

    assert refused({"after": "stage3"}) == (
        "experiments.lr.keep_best.after: no stage 'stage3' in experiment 'lr' (its stages: stage1, stage2)"
    )
    assert "'stage2' is the experiment's last stage" in refused({"after": "stage2"})
    assert refused({"arms": 3}) == "experiments.lr.keep_best.arms: 3 of the sweep's 3 arms: every arm would go on"
    assert "whose eval_splits are [val, test], not 'train'" in refused({"split": "train"})
    # Compared before the arms differ: they are one there.
    late = copy.deepcopy(CURRICULUM) | {"keep_best": {"after": "stage1", "arms": 1}}
    late["stages"].append({"name": "stage3", "init_from": "stage2"})
    assert "the arms differ from stage 'stage2' on, so at the end of 'stage1' they are one" in refused({}, late)
    unswept = {"stages": [{"name": "a"}, {"name": "b", "init_from": "a"}], "keep_best": {"after": "a", "arms": 1}}
    assert "experiment 'lr' sweeps nothing" in refused({}, unswept)


def test_keep_best_keeps_the_best_arms_by_the_metric_and_says_why_the_rest_stopped(tmp_path):
    from vlft.errors import InputError
    from vlft.sweeps import keep_best

    metrics = {
        "a": {"accuracy": 0.5, "loss": 0.9},
        "b": {"accuracy": 0.7, "loss": 0.4},
        "c": {"accuracy": 0.7, "loss": 1.2},
    }
    where = {arm: f"{arm}/metrics.json" for arm in metrics}
    chosen = keep_best(metrics, 1, "accuracy", where)
    assert chosen["kept"] == ["b"]  # b and c tie: the one listed first goes on
    assert chosen["stopped"] == {
        "c": "accuracy 0.7000, below the last kept arm's 0.7000",
        "a": "accuracy 0.5000, below the last kept arm's 0.7000",
    }
    lowest = keep_best(metrics, 2, "loss", where)
    assert lowest["kept"] == ["b", "a"] and lowest["stopped"] == {"c": "loss 1.2000, above the last kept arm's 0.9000"}
    with pytest.raises(InputError, match="a/metrics.json: has no mean_distance to compare the sweep.s arms by"):
        keep_best(metrics, 1, "mean_distance", where)


def test_the_reports_command_line_is_the_same_whatever_the_number_of_arms(tmp_path):
    """The report job named every evaluation, stage and sweep arm on its command line: at a few
    hundred arms that outgrew what Linux takes in one argument (128 KiB), and the report never ran
    after every arm had trained. Now it reads them from one file, so its command line is the same
    for 2 arms and for 60, and what the file holds follows the plan."""
    workdir, config = workflow_with_demo_data(tmp_path)
    commands = {}
    for arms in (2, 60):
        swept = copy.deepcopy(CURRICULUM)
        swept["stages"][1]["sweep"] = {"learning_rate": [1.0e-4 * (n + 1) for n in range(arms)]}
        config["experiments"] = {"lr": swept}
        (workdir / f"study{arms}.yaml").write_text(yaml.safe_dump(config))
        dry = snakemake(workdir, "--configfile", f"study{arms}.yaml", "--cores", "1", "--dry-run", "-p")
        [command] = [line for line in dry.stdout.splitlines() if "scripts/report.py" in line]
        commands[arms] = command.replace(f"study{arms}", "study")
        assert "rule report_inputs:" in dry.stdout
    assert commands[2] == commands[60] and len(commands[60]) < 300, commands

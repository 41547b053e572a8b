"""The config and the plan: defaults inherited and overridden, the examples valid, checks made when the config is read."""

import pytest
import yaml

from tests.helpers import REPO, copy_workflow, planned_outputs, snakemake
from vlft.config import resolve_config
from vlft.errors import ConfigError
from vlft.files import read_jsonl, write_jsonl
from vlft.plan import build_plan, retry_runtime


def test_stages_inherit_defaults_and_override_them():
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    plan = build_plan(config)
    stage1, stage2 = plan.stage("exp4", "stage1"), plan.stage("exp4", "stage2")
    assert stage1.settings["epochs"] == 4 and stage1.settings["learning_rate"] == config["defaults"]["learning_rate"]
    assert stage1.settings["filter"] == {"category": ["color", "yes/no"]} and stage2.settings["filter"] == {}
    assert stage2.init_from == "exp4/stage1" and plan.ancestors(stage2) == [stage1]
    assert "resources" not in stage1.train_params() and "checkpoint_every" not in stage1.train_params()


def test_example_config_is_valid():
    config = resolve_config(yaml.safe_load((REPO / "config/examples/kvasir-vqa-qwen3-vl-8b.yaml").read_text()))
    plan = build_plan(config)
    assert sorted({s.experiment for s in plan.stages.values()}) == ["exp1", "exp2", "exp3", "exp4", "exp5"]
    assert plan.stage("exp4", "stage2").init_from == "exp4/stage1"
    # Kvasir asks about 9 questions an image (x1 about 25): each image computed once; from the
    # vision cache where it fits the bound (Kvasir-VQA's train split), else from pixels.
    assert all(s.settings["image_groups"] for s in plan.stages.values())
    assert {s.id for s in plan.stages.values() if s.settings["vision_cache"]} == {
        "exp1/main",
        "exp4/stage1",
        "exp4/stage2",
    }
    assert {s.settings["dataset"] for s in plan.stages.values() if not s.settings["vision_cache"]} == {"kvasir-x1"}
    assert plan.stage("exp3", "stage1").settings["filter"] == {"difficulty": [1]}
    assert plan.stage("exp5", "main").settings["answer_format"] == "cot"


def test_click_example_config_is_valid_and_its_base_model_is_asked_for_clicks():
    config = resolve_config(yaml.safe_load((REPO / "config/examples/click-qwen3-vl-8b.yaml").read_text()))
    plan = build_plan(config)
    settings = plan.stage("click", "main").settings
    assert settings["answer_format"] == "click" and settings["epochs"] == 1
    assert (settings["lora_r"], settings["lora_alpha"], settings["checkpoint_every"]) == (32, 64, 200)
    assert plan.eval_settings("base", "base", config["evaluation"])["answer_format"] == "click"
    assert plan.evaluations() == [
        ("click", "main", "val"),
        ("click", "main", "test"),
        ("base", "base", "test"),
        ("base", "base", "val"),
    ]


def test_base_model_is_evaluated_on_each_dataset_in_its_format():
    """The demo trains on two datasets: the base model answers the shapes (the defaults' dataset,
    stage `base`) directly and the screens (stage `screens`) with clicks."""
    config = resolve_config(yaml.safe_load((REPO / "config/config.yaml").read_text()))
    plan = build_plan(config)
    base = [(stage, split) for experiment, stage, split in plan.evaluations() if experiment == "base"]
    assert base == [("base", "test"), ("base", "val"), ("screens", "test")]
    shapes, screens = (plan.eval_settings("base", stage, config["evaluation"]) for stage in ("base", "screens"))
    assert (shapes["dataset"], shapes["answer_format"]) == ("shapes", "final")
    assert (screens["dataset"], screens["answer_format"]) == ("screens", "click")
    assert screens == plan.eval_settings("click", "main", config["evaluation"])


def test_a_schedule_that_never_leaves_warmup_is_refused_when_the_config_is_read():
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["experiments"]["exp1"]["stages"][0]["max_steps"] = 1
    with pytest.raises(ConfigError) as refused:
        build_plan(config)
    assert str(refused.value) == (
        "experiments.exp1.stages[0].max_steps: all 1 of its steps are warmup (warmup_ratio 0.05 of 1 is 1 step(s), "
        "the first at learning rate 0), so it never trains at learning_rate; give it more steps, or warmup_ratio: 0"
    )
    config["experiments"]["exp1"]["stages"][0].update(max_steps=None, warmup_ratio=1)
    with pytest.raises(ConfigError, match=r"^experiments.exp1.stages\[0\].warmup_ratio: 1 makes every step warmup"):
        build_plan(config)
    # Without warmup, or with a schedule that has none, one step trains.
    config["experiments"]["exp1"]["stages"][0].update(max_steps=1, warmup_ratio=0)
    build_plan(config)
    config["experiments"]["exp1"]["stages"][0].update(warmup_ratio=0.5, lr_schedule="constant")
    build_plan(config)


def test_retries_ask_for_more_time_up_to_max_runtime_never_past_it():
    """A 7-hour stage on a partition of 8 hours: 7, then 8, 8; without a ceiling 7, 14, 21."""
    assert [retry_runtime(420, attempt, 480) for attempt in (1, 2, 3)] == [420, 480, 480]
    assert [retry_runtime(420, attempt, None) for attempt in (1, 2, 3)] == [420, 840, 1260]
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["max_runtime"] = 20
    with pytest.raises(ConfigError) as refused:
        build_plan(resolve_config(config))
    assert str(refused.value) == (
        "defaults.resources.runtime: 30 minutes, more than max_runtime (20), the most a job may ask for"
    )
    config["max_runtime"] = 30
    build_plan(resolve_config(config))


def test_a_filter_is_checked_on_the_stages_splits_as_a_whole_and_one_that_selects_nothing_stops_the_dry_run(
    tmp_path, tiny_model_dir
):
    """Two splits, colors in one and counts in the other: a filter for counts trains (it was refused,
    "a.jsonl: the filter selects no records"), one for sizes stops the dry run in one sentence (it
    passed it, and failed inside the GPU training job)."""
    from vlft.demo.shapes import make_dataset

    workdir = copy_workflow(tmp_path / "clone")
    (workdir / "model").symlink_to(tiny_model_dir)
    make_dataset({"all": workdir / "all.jsonl"}, workdir / "images", {"all": 4}, seed=0)
    records = read_jsonl(workdir / "all.jsonl")
    for name, category in (("a", "color"), ("b", "count")):
        write_jsonl(workdir / f"{name}.jsonl", [r for r in records if r["category"] == category])
    config = {
        "model": {"path": "model"},
        "datasets": {"mine": {"image_root": "images", "splits": {"a": "a.jsonl", "b": "b.jsonl"}}},
        "experiments": {"x": {"stages": [{"name": "main", "train_splits": ["a", "b"], "eval_splits": ["a"]}]}},
    }
    stage = config["experiments"]["x"]["stages"][0]
    stage["filter"] = {"category": "count"}
    (workdir / "study.yaml").write_text(yaml.safe_dump(config))
    assert "results/study/train/x/main/adapter" in planned_outputs(workdir, "--configfile", "study.yaml")
    stage["filter"] = {"category": ["size", "shape"]}
    (workdir / "study.yaml").write_text(yaml.safe_dump(config))
    result = snakemake(workdir, "--dry-run", "--configfile", "study.yaml", check=False)
    assert result.returncode != 0 and not (workdir / "results").exists()
    [line] = [line for line in (result.stdout + result.stderr).splitlines() if "Invalid config" in line]
    assert line == (
        "Invalid config: experiments.x.stages[0].filter: {'category': ['size', 'shape']} selects no record of "
        "a.jsonl, b.jsonl, so the stage cannot train"
    )
    # A field no record has (a curriculum on a field the data lacks) is named, for the
    # filter and for the order alike, before any job is queued.
    for change, named in (
        ({"filter": {"severity": [1]}}, "filter: no record of a.jsonl, b.jsonl has the field 'severity'"),
        ({"order": "by_field", "order_field": "urgency"}, "order_field: no record of a.jsonl, b.jsonl has the field"),
    ):
        config["experiments"]["x"]["stages"][0] = dict(
            {"name": "main", "train_splits": ["a", "b"], "eval_splits": ["a"]}, **change
        )
        (workdir / "study.yaml").write_text(yaml.safe_dump(config))
        result = snakemake(workdir, "--dry-run", "--configfile", "study.yaml", check=False)
        assert result.returncode != 0 and not (workdir / "results").exists()
        assert f"Invalid config: experiments.x.stages[0].{named}" in result.stdout + result.stderr, result.stdout[
            -1500:
        ]


def test_a_stage_that_trains_the_tower_trains_from_pixels_says_so_and_its_later_stages_set_it_the_same(
    tmp_path, tiny_model_dir, monkeypatch
):
    """vision_cache: true for the study, one stage with vision_lora: the plan gives that stage the
    pixel cache (the vision cache holds the frozen tower's outputs) and says so in one line, while
    the other keeps its vision cache; a stage that starts from the tower's adapter without
    vision_lora is refused in one sentence (it would train the tower's LoRA it loads all the same)."""
    from vlft.demo.shapes import make_dataset

    workdir = copy_workflow(tmp_path / "clone")
    (workdir / "model").symlink_to(tiny_model_dir)
    make_dataset({"train": workdir / "train.jsonl"}, workdir / "images", {"train": 4}, seed=0)
    config = {
        "model": {"path": "model"},
        "datasets": {"mine": {"image_root": "images", "splits": {"train": "train.jsonl"}}},
        "defaults": {"vision_cache": True, "eval_splits": []},
        "experiments": {
            "frozen": {"stages": [{"name": "main"}]},
            "tower": {"stages": [{"name": "main", "vision_lora": True}]},
        },
    }
    (workdir / "study.yaml").write_text(yaml.safe_dump(config))
    result = snakemake(workdir, "--dry-run", "--configfile", "study.yaml")
    said = (
        "experiments.tower.stages[0].vision_cache: the stage trains from the pixel cache instead, as its "
        "vision_lora trains the image's path, whose outputs the vision cache (the frozen tower's) does not hold"
    )
    assert (result.stdout + result.stderr).count(said) == 1
    monkeypatch.chdir(workdir)  # where the config's relative paths lead
    plan = build_plan(resolve_config(yaml.safe_load((workdir / "study.yaml").read_text())))
    assert plan.stage("tower", "main").settings["vision_cache"] is False
    assert plan.stage("frozen", "main").settings["vision_cache"] is True and plan.notes == [said]
    # The tower stage's job reads pixels; the frozen one's the vision cache, made for it alone.
    jobs = planned_outputs(workdir, "--configfile", "study.yaml")
    assert sum(o.startswith("results/study/cache/vision/") for o in jobs) == 1

    config["experiments"]["tower"]["stages"].append({"name": "more", "init_from": "main"})
    with pytest.raises(
        ConfigError, match=r"experiments\.tower\.stages\[1\]\.vision_lora: must equal that of 'tower/main'"
    ):
        build_plan(resolve_config(config))


@pytest.mark.parametrize(
    "option, said",
    [
        ({"quantization_bit": 4}, "quantization_bit (a 4-bit base's weights are bitsandbytes tensors"),
        (
            {"eval_every": 2, "eval_split": "train"},
            "eval_every (each process decodes its share's answers for as many steps",
        ),
    ],
)
def test_a_sharded_stage_on_a_path_sharding_does_not_support_is_one_sentence(tmp_path, tiny_model_dir, option, said):
    """resources.parallelism: shard where the stage uses what a sharded base cannot run: refused at
    plan time, naming the key and the option; auto replicates such a stage instead (not refused)."""
    stage = {"name": "main", "resources": {"gpus": 2, "parallelism": "shard"}} | option
    config = {
        "model": {"path": str(tiny_model_dir)},
        "datasets": {"mine": {"image_root": str(tmp_path), "splits": {"train": str(tmp_path / "train.jsonl")}}},
        "defaults": {"eval_splits": []},
        "experiments": {"big": {"stages": [stage]}},
    }
    with pytest.raises(ConfigError) as error:
        build_plan(resolve_config(config))
    message = str(error.value)
    assert message.startswith("experiments.big.stages[0].resources.parallelism: shard: a sharded base does not support")
    assert said in message and message.endswith("give parallelism: replicate, or auto")
    stage["resources"]["parallelism"] = "auto"
    assert build_plan(resolve_config(config)).resources("big", "main")["parallelism"] == "auto"


def test_a_stage_across_nodes_without_gpus_is_one_sentence(tmp_path, tiny_model_dir):
    """resources.nodes above 1 with gpus: 0: no process would run on the nodes; refused at plan time."""
    stage = {"name": "main", "resources": {"gpus": 0, "nodes": 2}}
    config = {
        "model": {"path": str(tiny_model_dir)},
        "datasets": {"mine": {"image_root": str(tmp_path), "splits": {"train": str(tmp_path / "train.jsonl")}}},
        "defaults": {"eval_splits": []},
        "experiments": {"big": {"stages": [stage]}},
    }
    with pytest.raises(ConfigError, match=r"^experiments\.big\.stages\[0\]\.resources\.nodes: 2: a stage across nodes"):
        build_plan(resolve_config(config))
    stage["resources"]["gpus"] = 4
    assert build_plan(resolve_config(config)).resources("big", "main")["nodes"] == 2

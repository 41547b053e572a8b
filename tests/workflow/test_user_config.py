"""A user's own config file is the whole config: the demo never leaks into it, and every key it
leaves out takes the default the schema documents. Proven by planning a minimal study with real
Snakemake and reading the settings its training job would get."""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml

from tests.helpers import copy_workflow, planned_outputs, snakemake
from vlft.config import load_schema
from vlft.stage_params import LEFT_OUT_WHEN_OFF, LEFT_OUT_WITH, METHOD_KEYS, RUN_ONLY_KEYS

MINIMAL = """\
model: {path: my/model}
datasets:
  mine:
    image_root: my/images
    splits: {train: my/train.jsonl, val: my/val.jsonl}
experiments:
  only:
    stages:
      - name: main
        eval_splits: [val]
"""


def test_a_minimal_user_config_plans_its_own_jobs_with_the_documented_defaults(tmp_path, tiny_model_dir):
    from vlft.demo.shapes import make_dataset

    workdir = copy_workflow(tmp_path / "clone")
    make_dataset(
        {"train": workdir / "my/train.jsonl", "val": workdir / "my/val.jsonl"},
        workdir / "my/images",
        {"train": 4, "val": 2},
        seed=0,
    )
    (workdir / "my/model").symlink_to(tiny_model_dir)
    (workdir / "my.yaml").write_text(MINIMAL)

    # Exactly the user's one dataset and one stage: no demo data, model or experiment, in a
    # directory named by the config file (results/my), never the demo's results/.
    assert planned_outputs(workdir, "--configfile", "my.yaml") == {
        "results/my/prepared/mine/train.jsonl",
        "results/my/prepared/mine/val.jsonl",
        # The pixel range the config leaves out is the checkpoint's own (the tiny one's processor).
        "results/my/cache/images/mine/train/1024-65536",
        "results/my/cache/images/mine/val/1024-65536",
        "results/my/train/only/main/adapter",
        "results/my/eval/only/main/val/predictions.jsonl",
        "results/my/eval/base/base/val/predictions.jsonl",
        "results/my/report/inputs.json",
        "results/my/report/index.html",
        "rule:all",
    }

    output = snakemake(workdir, "--dry-run", "--printshellcmds", "--configfile", "my.yaml").stdout
    train = json.loads(re.search(r"scripts/train\.py .*--settings '(\{.*?\})'", output).group(1))
    evaluate = json.loads(re.search(r"scripts/evaluate\.py .*--settings '(\{.*?\})'", output).group(1))
    # The schema's documented defaults, read from the schema itself and spelled out for the keys
    # that the demo sets otherwise (the demo has 2e-3, 4 epochs, 256 tokens, micro-batches of 16).
    stage_schema = load_schema()["$defs"]["stage_settings"]["properties"]
    documented = {key: prop["default"] for key, prop in stage_schema.items() if "default" in prop}
    # Options added after studies ran are left out while off (vlft.stage_params.LEFT_OUT_WHEN_OFF), and a
    # training method's own settings where a stage uses another (vlft.stage_params.METHOD_KEYS): the job
    # reads them as off, and adding them reruns no finished stage.
    left_out = (*RUN_ONLY_KEYS, *LEFT_OUT_WHEN_OFF, *LEFT_OUT_WITH, *(k for keys in METHOD_KEYS.values() for k in keys))
    assert train == {
        **{k: v for k, v in documented.items() if k not in left_out},
        "dataset": "mine",
        "eval_splits": ["val"],
        "min_pixels": 1024,
        "max_pixels": 65536,
    }
    assert documented["min_pixels"] is None and documented["max_pixels"] is None
    assert (train["learning_rate"], train["epochs"], train["max_seq_len"], train["micro_batch"]) == (2e-4, 1, 4096, 4)
    evaluation = load_schema()["properties"]["evaluation"]["properties"]
    assert evaluate["max_new_tokens"] == evaluation["max_new_tokens"]["default"] == 512
    assert evaluate["batch_size"] == evaluation["batch_size"]["default"]
    resources = re.search(r"^rule train:\n(?:\s+.*\n)*?\s+resources: (.*)$", output, re.MULTILINE).group(1)
    assert "mem_mb=32000" in resources and "checkpoint_every=200" in resources
    # The runtime left out is the stage's predicted time with the documented margin, at least the floor.
    planning = load_schema()["properties"]["planning"]["properties"]
    runtime, predicted = (int(re.search(rf"{key}=(\d+)", resources).group(1)) for key in ("runtime", "predicted_s"))
    assert predicted > 0 and planning["margin"]["default"] == 1.5 and planning["floor_minutes"]["default"] == 15
    assert runtime == max(15, math.ceil(predicted * 1.5 / 60)), resources
    assert "activation_checkpointing=0" in resources  # how the job runs: a resource, not a setting


def test_the_pixel_range_a_config_leaves_out_is_the_checkpoints_own(tmp_path, tiny_model_dir):
    """Read from its preprocessor_config.json as Qwen3-VL (size) and Qwen2-VL (min/max_pixels)
    save it, recorded in the stage's settings: another checkpoint's values change what runs."""
    import shutil

    from vlft.config import resolve_config
    from vlft.errors import ConfigError
    from vlft.plan import build_plan

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = yaml.safe_load(MINIMAL.replace("my/model", str(model)))

    def pixels(cfg):
        stage = build_plan(resolve_config(cfg)).stage("only", "main")
        return stage.settings["min_pixels"], stage.settings["max_pixels"], stage.pixels()

    assert pixels(config) == (1024, 65536, "1024-65536")
    processor = json.loads((model / "preprocessor_config.json").read_text())
    del processor["size"]
    (model / "preprocessor_config.json").write_text(
        json.dumps(processor | {"min_pixels": 3136, "max_pixels": 12845056})
    )
    assert pixels(config) == (3136, 12845056, "3136-12845056")
    # What the config sets wins, key by key.
    assert pixels(dict(config, defaults={"max_pixels": 200704})) == (3136, 200704, "3136-200704")
    (model / "preprocessor_config.json").write_text(json.dumps(processor))  # no range in it
    with pytest.raises(
        ConfigError,
        match=r"defaults.min_pixels: left out, so the checkpoint's image processor decides, "
        r"but .*preprocessor_config.json: names no pixel range",
    ):
        pixels(config)
    assert pixels(dict(config, defaults={"min_pixels": 4096, "max_pixels": 16384})) == (4096, 16384, "4096-16384")


def test_without_a_config_file_the_demo_runs(tmp_path):
    workdir = copy_workflow(tmp_path / "clone")
    demo_stages = sum(
        len(e["stages"]) for e in yaml.safe_load((workdir / "config/config.yaml").read_text())["experiments"].values()
    )
    planned = planned_outputs(workdir)
    assert "results/demo/tiny-qwen3-vl" in planned
    assert len([p for p in planned if p.startswith("results/train/")]) == demo_stages == 14
    # --config on its own edits the demo rather than replacing it.
    planned = planned_outputs(workdir, "--config", "results=elsewhere")
    assert "results/demo/tiny-qwen3-vl" in planned  # model.path, a key of its own, stays the demo's
    assert len([p for p in planned if p.startswith("elsewhere/train/")]) == demo_stages

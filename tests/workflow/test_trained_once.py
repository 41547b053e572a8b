"""Stages that would compute the very same adapter are trained once (vlft.trained_once): the demo's
exp3/stage1 and exp4/stage1 select the same records through different filters, and a study may
repeat a stage outright; changing either one apart splits them again. (tests/workflow/test_sweeps.py runs a
study whose arms share a stage through Snakemake: the jobs after it read the one trained.)"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from vlft.config import resolve_config
from vlft.demo.shapes import make_dataset
from vlft.plan import build_plan
from vlft.trained_once import shared_lines, trained_once
from tests.helpers import REPO


def demo_config(root: Path) -> dict:
    """The demo's config, its shapes data made under `root` as the demo's rule makes it."""
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    shapes = config["datasets"]["shapes"]
    shapes["splits"] = {split: str(root / f"{split}.jsonl") for split in shapes["splits"]}
    shapes["image_root"] = str(root / "images")
    return config


def make_demo_shapes(config: dict) -> None:
    demo = config["demo"]["datasets"]["shapes"]
    shapes = config["datasets"]["shapes"]
    make_dataset(shapes["splits"], shapes["image_root"], demo["sizes"], demo["seed"], demo["questions_per_image"])


def shared(config: dict, trained: tuple[str, ...] = ()) -> dict[str, str]:
    plan = build_plan(resolve_config(copy.deepcopy(config)))
    return trained_once(
        plan, lambda dataset, split: config["datasets"][dataset]["splits"][split], lambda s: s.id in trained
    )


def test_stages_that_compute_one_adapter_are_found_however_their_configs_say_it(tmp_path):
    config = demo_config(tmp_path)
    # Before the data exists, filters are compared as written: the demo's differ.
    assert shared(config) == {}
    make_demo_shapes(config)
    # exp4/stage1 evaluates as it trains (keep: last) and selects the same records by category that
    # exp3/stage1 selects by difficulty: exp4/stage1 is trained, its log holding that curve.
    assert shared(config) == {"exp3/stage1": "exp4/stage1"}
    assert shared_lines({"exp3/stage1": "exp4/stage1"}) == [
        "exp3/stage1 trains on the same records with the same settings as exp4/stage1: trained once, its jobs read"
        " exp4/stage1's"
    ]
    # A stage trained already keeps its own outputs (upgrading reruns nothing), and one not trained
    # yet reads them.
    assert shared(config, trained=("exp3/stage1", "exp4/stage1")) == {}
    assert shared(config, trained=("exp3/stage1",)) == {"exp4/stage1": "exp3/stage1"}

    # Anything trained set apart splits them: a setting, the records, or keeping the best adapter
    # (then the evaluations during training decide what is kept).
    for change in ({"learning_rate": 1e-3}, {"filter": {"category": ["color"]}}, {"keep": "best"}):
        apart = copy.deepcopy(config)
        apart["experiments"]["exp4"]["stages"][0].update(change)
        assert shared(apart) == {}, change
    # Where it is evaluated after training is no part of what it trains.
    config["experiments"]["exp4"]["stages"][0]["eval_splits"] = ["test"]
    assert shared(config) == {"exp3/stage1": "exp4/stage1"}

    # A curriculum repeated outright but for its last stage: its first two stages are trained once,
    # the second starting from the first's shared adapter; the third is its own.
    repeat = copy.deepcopy(config["experiments"]["exp3"])
    repeat["stages"][2]["learning_rate"] = 1e-3
    config["experiments"]["exp8"] = repeat
    assert shared(config) == {"exp3/stage1": "exp4/stage1", "exp8/stage1": "exp4/stage1", "exp8/stage2": "exp3/stage2"}

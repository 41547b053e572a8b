"""The training tests' shared stages: the demo's exp1 stage in steps of 8, on single questions and on
images of several questions (tests/training/test_distributed.py, test_sharding.py)."""

from __future__ import annotations

import pytest

from tests.helpers import seven_step_stage
from vlft.demo.shapes import make_dataset, questions_on_shared_images


@pytest.fixture(scope="module")
def uneven_stage(tmp_path_factory, tiny_model_dir):
    """49 training samples (the root conftest's small_stage has 16): in micro-batches of 8, the seventh
    step holds one sample, so one of two processes has nothing to compute in it."""
    root = tmp_path_factory.mktemp("uneven_stage")
    make_dataset({"train": root / "train.jsonl"}, root / "images", {"train": 49}, seed=0)
    return seven_step_stage(root, root / "train.jsonl", tiny_model_dir)


@pytest.fixture(scope="module")
def grouped_stage(tmp_path_factory, tiny_model_dir):
    """48 training samples on 12 images, 4 questions each, with image_groups: a step of 8 samples
    takes two groups, and each of two processes one whole group."""
    root = tmp_path_factory.mktemp("grouped_stage")
    raw = questions_on_shared_images(root, images=12, per_image=4)
    return seven_step_stage(root, raw, tiny_model_dir, image_groups=True)


@pytest.fixture(scope="module")
def moe_stage(tmp_path_factory):
    """The grouped stage's images and questions on a tiny mixture of experts (Qwen3-VL-MoE's shape)."""
    from vlft.demo.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("moe_stage")
    make_tiny_model(root / "model", family="qwen3_vl_moe")
    raw = questions_on_shared_images(root, images=12, per_image=4)
    return seven_step_stage(root, raw, root / "model", image_groups=True)

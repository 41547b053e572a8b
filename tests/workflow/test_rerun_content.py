"""A rerun follows content, not place or time stamps: a study whose model and dataset are given (as
a user's are, not made by the demo's rules), run once; then moved, touched and changed, each case
judged by a real Snakemake dry run."""

import os
import shutil
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import copy_workflow, planned_outputs, snakemake

R = "results"
CONFIG = "config/study.yaml"


def study_config(model: str, data: str) -> dict:
    return {
        "results": R,
        "cpu_fallback": True,
        "model": {"path": model},
        "datasets": {
            "shapes": {
                "image_root": f"{data}/images",
                "splits": {"train": f"{data}/train.jsonl", "test": f"{data}/test.jsonl"},
            }
        },
        "evaluation": {"max_new_tokens": 16, "batch_size": 50, "threads": 1},
        "defaults": {
            "dataset": "shapes",
            "train_splits": ["train"],
            "eval_splits": ["test"],
            "epochs": 1,
            "micro_batch": 16,
            "min_pixels": 4096,
            "max_pixels": 16384,
            "max_seq_len": 256,
        },
        "experiments": {"exp1": {"stages": [{"name": "main"}]}},
    }


def write_config(workdir: Path, model: str, data: str) -> None:
    (workdir / CONFIG).write_text(yaml.safe_dump(study_config(model, data)))


def planned(workdir: Path) -> set[str]:
    return planned_outputs(workdir, "--configfile", CONFIG)


# Every job of the study but the report, by its first output.
CACHES = {f"{R}/cache/images/shapes/{split}/4096-16384" for split in ("train", "test")}
MODEL_USERS = {
    f"{R}/train/exp1/main/adapter",
    f"{R}/eval/exp1/main/test/predictions.jsonl",
    f"{R}/eval/base/base/test/predictions.jsonl",
}
REPORT = {f"{R}/report/index.html", "rule:all"}


@pytest.fixture(scope="module")
def study(demo_workdir, tmp_path_factory) -> Path:
    """The demo's tiny model and shapes data copied to models/ and data/, one short stage, run."""
    workdir = copy_workflow(tmp_path_factory.mktemp("study"))
    shutil.copytree(demo_workdir / "results/demo/tiny-qwen3-vl", workdir / "models/tiny")
    shutil.copytree(demo_workdir / "results/demo/shapes", workdir / "data/shapes")
    write_config(workdir, "models/tiny", "data/shapes")
    snakemake(workdir, "--configfile", CONFIG, "--cores", "2")
    assert planned(workdir) == set()
    return workdir


def later(paths) -> None:
    stamp = time.time() + 60
    for path in paths:
        os.utime(path, (stamp, stamp))


def test_the_model_and_data_moved_elsewhere_rerun_nothing(study, tmp_path):
    """The whole study copied to another directory, then its model and dataset moved again within
    it, the config following them: the same bytes, nothing to do."""
    workdir = tmp_path / "elsewhere"
    shutil.copytree(study, workdir, symlinks=True)
    assert planned(workdir) == set()
    (workdir / "store").mkdir()
    (workdir / "models/tiny").rename(workdir / "store/checkpoint")
    (workdir / "data/shapes").rename(workdir / "store/shapes-vqa")
    write_config(workdir, "store/checkpoint", "store/shapes-vqa")
    assert planned(workdir) == set()


def test_touching_every_model_and_data_file_reruns_nothing(study):
    later(p for root in ("models/tiny", "data/shapes") for p in (study / root).rglob("*"))
    assert planned(study) == set()


@pytest.mark.parametrize(
    "file, edit, reruns",
    [
        # The chat template, the tokenizer, the weights: what every job that runs the model read.
        ("chat_template.jinja", lambda text: text.replace("<|im_start|>", "<|im_start|> ", 1), MODEL_USERS),
        ("tokenizer_config.json", lambda text: text.replace("{", '{"model_max_length": 77, ', 1), MODEL_USERS),
        # The image processor's settings: the pixel caches too.
        (
            "preprocessor_config.json",
            lambda text: text.replace("{", '{"do_convert_rgb": true, ', 1),
            CACHES | MODEL_USERS,
        ),
    ],
)
def test_a_changed_model_file_reruns_exactly_what_read_it(study, file, edit, reruns):
    path = study / "models/tiny" / file
    original = path.read_text()
    try:
        path.write_text(edit(original))
        assert planned(study) == reruns | REPORT
    finally:
        path.write_text(original)
    assert planned(study) == set()


def test_other_weights_in_place_rerun_what_ran_the_model(study):
    """model.safetensors overwritten with other values of the same size, its time stamp kept."""
    path = study / "models/tiny/model.safetensors"
    original, stat = path.read_bytes(), path.stat()
    try:
        path.write_bytes(original[:-64] + bytes(64))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert planned(study) == MODEL_USERS | REPORT
    finally:
        path.write_bytes(original)
    assert planned(study) == set()


def test_an_image_with_other_bytes_reruns_its_split_and_what_follows(study):
    from PIL import Image

    image = sorted((study / "data/shapes/images/train").iterdir())[0]
    original = image.read_bytes()
    try:
        Image.new("RGB", Image.open(image).size, "white").save(image)
        assert (
            planned(study)
            == {
                f"{R}/prepared/shapes/train.jsonl",
                f"{R}/cache/images/shapes/train/4096-16384",
                f"{R}/train/exp1/main/adapter",
                f"{R}/eval/exp1/main/test/predictions.jsonl",
            }
            | REPORT
        )
    finally:
        image.write_bytes(original)
    assert planned(study) == set()


def test_a_changed_model_file_is_named_by_the_next_plan_and_an_unread_one_reruns_nothing(study):
    """A rerun's reason is the model's digest, which names no file: the plan says which of the model's
    files changed since the last plan. A file no loader reads, added empty, changes nothing."""
    template, notes = study / "models/tiny/chat_template.jinja", study / "models/tiny/notes.txt"
    original = template.read_text()
    try:
        notes.write_bytes(b"")
        assert planned(study) == set()
        template.write_text(original.replace("<|im_start|>", "<|im_start|> ", 1))
        plan = snakemake(study, "--dry-run", "--configfile", CONFIG)
        assert (
            "the model's files changed since the last plan (other content: chat_template.jinja): what read the "
            "model runs again" in plan.stderr
        ), plan.stderr
    finally:
        template.write_text(original)
        notes.unlink(missing_ok=True)
    assert planned(study) == set()

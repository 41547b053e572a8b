"""Bad input: one clear error naming the file and line, or the config key, and nothing half-written."""

import json
import subprocess
import sys

import pytest
import yaml
from PIL import Image

from conftest import REPO, copy_workflow, snakemake
from vlft.errors import ConfigError
from vlft.plan import build_plan


def record(i, **fields):
    return {"id": i, "image": f"{i}.png", "question": "What color?", "answer": "Final answer: red", **fields}


@pytest.fixture
def split(tmp_path):
    """A valid raw split of three records; tests break one thing in it."""
    for i in range(3):
        Image.new("RGB", (40, 30), (200, 0, 0)).save(tmp_path / f"{i}.png")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(record(i)) + "\n" for i in range(3)))
    return path


def prepare(split_path):
    output = split_path.parent / "prepared" / "train.jsonl"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts/prepare_split.py"), "--records", str(split_path),
         "--image-root", str(split_path.parent), "--output", str(output)],
        capture_output=True, text=True,
    )
    return result, output


def assert_one_error(result, output, *expected):
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert not output.exists() and not list(output.parent.glob(".*tmp*"))


def test_valid_split_is_prepared(split):
    result, output = prepare(split)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["width"] for r in rows] == [40, 40, 40] and rows[0]["id"] == "0"


def test_missing_image(split):
    (split.parent / "1.png").unlink()
    assert_one_error(*prepare(split), f"{split}:2", "field 'image'", "file not found", "1.png")


def test_unreadable_image(split):
    (split.parent / "2.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    assert_one_error(*prepare(split), f"{split}:3", "field 'image'", "cannot be read as an image")


def test_truncated_image(split):
    data = (split.parent / "0.png").read_bytes()
    (split.parent / "0.png").write_bytes(data[: len(data) // 2])
    assert_one_error(*prepare(split), f"{split}:1", "cannot be read as an image")


def test_malformed_line(split):
    lines = split.read_text().splitlines()
    lines[1] = lines[1][:-5]
    split.write_text("\n".join(lines) + "\n")
    assert_one_error(*prepare(split), f"{split}:2", "not valid JSON")


@pytest.mark.parametrize("field", ["question", "answer"])
def test_record_without_question_or_answer(split, field):
    rows = [record(i) for i in range(3)]
    del rows[2][field]
    split.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert_one_error(*prepare(split), f"{split}:3", f"field '{field}'", "missing")


# Config errors surface when Snakemake parses the workflow, before any job runs.

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("config"))


def dry_run_with(workdir, edit):
    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    edit(config)
    (workdir / "config/bad.yaml").write_text(yaml.safe_dump(config))
    result = snakemake(workdir, "--dry-run", "--configfile", "config/bad.yaml", check=False)
    assert result.returncode != 0
    assert not (workdir / "results").exists()
    return result.stdout + result.stderr


def test_unknown_config_key(workdir):
    output = dry_run_with(workdir, lambda c: c["experiments"]["exp1"]["stages"][0].update(learnin_rate=0.1))
    assert "learnin_rate" in output and "unexpected" in output.lower()


def test_unknown_key_in_defaults(workdir):
    output = dry_run_with(workdir, lambda c: c["defaults"].update(epoch=3))
    assert "'epoch'" in output


def test_wrong_type(workdir):
    output = dry_run_with(workdir, lambda c: c["defaults"].update(micro_batch="four"))
    assert "micro_batch" in output or "'four'" in output


def test_unknown_dataset(workdir):
    output = dry_run_with(workdir, lambda c: c["experiments"]["exp2"]["stages"][0].update(dataset="kvasir"))
    assert "experiments.exp2.stages[0].dataset: unknown dataset 'kvasir'" in output


def test_unknown_split(workdir):
    output = dry_run_with(workdir, lambda c: c["experiments"]["exp3"]["stages"][1].update(eval_splits=["dev"]))
    assert "experiments.exp3.stages[1].eval_splits: unknown split 'dev'" in output


def test_init_from_a_stage_that_does_not_exist(workdir):
    output = dry_run_with(workdir, lambda c: c["experiments"]["exp4"]["stages"][1].update(init_from="stage0"))
    assert "experiments.exp4.stages[1].init_from: stage 'exp4/stage0' does not exist" in output


def test_init_from_cycle():
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["experiments"]["exp4"]["stages"][0]["init_from"] = "stage2"
    with pytest.raises(ConfigError, match=r"cycle: exp4/stage1 -> exp4/stage2 -> exp4/stage1"):
        build_plan(config)


def test_init_from_with_a_different_lora_shape():
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["experiments"]["exp4"]["stages"][1]["lora_r"] = 8
    with pytest.raises(ConfigError, match=r"experiments.exp4.stages\[1\].lora_r: must equal that of 'exp4/stage1'"):
        build_plan(config)

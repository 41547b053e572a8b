"""Damaged caches and adapters: one sentence naming the file, removed so that the next run rebuilds them."""

import os
import shutil
from pathlib import Path
import pytest
import torch
from tests.helpers import copy_demo_upstream, planned_outputs, snakemake
from vlft.errors import InputError


def damage_in_place(path: Path, offset_from_end: int = 1000) -> None:
    """Change bytes inside a file's data, keeping its size (as an overwrite in place would)."""
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size - offset_from_end)
        data = handle.read(16)
        handle.seek(path.stat().st_size - offset_from_end)
        handle.write(bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize("damage", ["overwritten in place", "truncated"])
def test_a_damaged_cache_shard_is_one_sentence_and_the_cache_is_removed_for_its_rebuild(small_stage, tmp_path, damage):
    from vlft.caches.image_cache import ImageCache

    inputs, _ = small_stage
    cache = tmp_path / "cache"
    shutil.copytree(inputs.caches[0], cache)
    shard = cache / "shard-00000.safetensors"
    size = shard.stat().st_size
    if damage == "truncated":
        os.truncate(shard, size - 1000)
    else:
        damage_in_place(shard)
    reader = ImageCache(cache)
    with pytest.raises(InputError) as found:
        for image in reader.entries:  # the last image's bytes are the damaged ones
            reader.tensor(image)
    what = (
        f"{size - 1000} bytes where the cache wrote {size}"
        if damage == "truncated"
        else f"image {image}'s bytes differ from the checksum written with them"
    )
    assert str(found.value) == (
        f"{shard}: damaged: {what}; removed {cache}, so that the next run rebuilds this pixels cache "
        "(a dry run lists the job)"
    )
    assert not cache.exists() and (tmp_path).is_dir()


@pytest.mark.parametrize("damage", ["cut short", "emptied"])
def test_a_damaged_cache_index_is_one_sentence_and_the_cache_is_removed_for_its_rebuild(small_stage, tmp_path, damage):
    """The shards' checksums do not cover the index: a JSON traceback on every job that read it."""
    from vlft.caches.image_cache import ImageCache

    inputs, _ = small_stage
    cache = tmp_path / "cache"
    shutil.copytree(inputs.caches[0], cache)
    index = cache / "index.json"
    text = index.read_text()
    index.write_text(text[: len(text) // 2] if damage == "cut short" else "")
    with pytest.raises(InputError) as found:
        ImageCache(cache)
    said = str(found.value)
    assert said.startswith(f"{index}: damaged: not the JSON the cache wrote (") and "\n" not in said
    assert said.endswith(f"; removed {cache}, so that the next run rebuilds the cache (a dry run lists the job)")
    assert not cache.exists()


def test_an_intact_cache_reads_back_what_was_written(small_stage):
    from vlft.caches.image_cache import ImageCache
    from vlft.integrity import tensor_checksum

    reader = ImageCache(small_stage[0].caches[0])
    for image, entry in reader.entries.items():
        assert tensor_checksum(reader.tensor(image)) == entry["crc32"]
    assert len(reader._verified) == len(reader.entries)


def test_a_damaged_adapter_is_one_sentence_and_removed_so_that_its_stage_trains_again(small_stage, tmp_path):
    from vlft.modeling import load_base_model, with_adapter
    from vlft.training.train import train_stage

    inputs, settings = small_stage
    stage = tmp_path / "train/exp/stage"
    summary = train_stage(
        inputs,
        settings | {"max_steps": 2, "micro_batch": 4},
        stage / "adapter",
        stage / "log.jsonl",
        stage / "summary.json",
        tmp_path / "ckpt",
        100,
    )
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(summary["adapter_crc32"])
    model = load_base_model(inputs.model_dir, torch.device("cpu"), torch.float32)
    with_adapter(model, stage / "adapter", trainable=False)  # intact: loads
    weights = stage / "adapter/adapter_model.safetensors"
    damage_in_place(weights, offset_from_end=8)
    model = load_base_model(inputs.model_dir, torch.device("cpu"), torch.float32)
    with pytest.raises(InputError) as found:
        with_adapter(model, stage / "adapter", trainable=False)
    assert str(found.value) == (
        f"{weights}: damaged: its content differs from the checksum in {stage / 'summary.json'}; "
        f"removed {stage / 'adapter'}, so that the next run trains the stage again (a dry run lists the job)"
    )
    assert not (stage / "adapter").exists() and (stage / "summary.json").exists()


def test_after_an_evaluation_finds_its_cache_damaged_a_dry_run_lists_the_rebuild(demo_workdir, tmp_path):
    """The damaged shard of a finished demo: the job that reads it fails in one sentence, and where
    `snakemake -n` said "Nothing to be done", it now plans the cache and the evaluation again."""
    workdir = copy_demo_upstream(demo_workdir, tmp_path / "demo")
    [cache] = (workdir / "results/cache/images/shapes/test").iterdir()
    damage_in_place(cache / "shard-00000.safetensors")
    evaluation = "results/eval/base/base/test/metrics.json"
    result = snakemake(workdir, evaluation, "--cores", "2", check=False)
    assert result.returncode != 0 and not (workdir / evaluation).exists()
    log = (workdir / "results/logs/evaluate/base/base/test.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {cache.relative_to(workdir)}/shard-00000.safetensors: damaged: image "
        + errors[0].split("damaged: image ")[1].split("'s bytes")[0]
        + f"'s bytes differ from the checksum written with them; removed {cache.relative_to(workdir)}, so that the "
        "next run rebuilds this pixels cache (a dry run lists the job)"
    ], log
    assert planned_outputs(workdir, evaluation) == {
        str(cache.relative_to(workdir)),
        evaluation.replace("metrics.json", "predictions.jsonl"),
    }


def test_an_empty_adapter_or_cache_index_is_named_and_a_dry_run_lists_what_makes_it_again(demo_workdir, tmp_path):
    """Found at plan time, from stats alone: an adapter whose weights are 0 bytes (a copy cut short)
    and a cache whose index is empty. The dry run says so in a sentence each, and it and every plan
    after it (until they are made) plan exactly the jobs that make them again and what depends on
    them; no job had to trip over them first."""
    workdir = tmp_path / "demo"
    shutil.copytree(demo_workdir, workdir, symlinks=True)
    weights = workdir / "results/train/exp1/main/adapter/adapter_model.safetensors"
    weights.write_bytes(b"")
    [cache] = (workdir / "results/cache/images/screens/test").iterdir()
    (cache / "index.json").write_bytes(b"")

    result = snakemake(workdir, "--dry-run")
    said = [line for line in result.stderr.splitlines() if ": damaged: " in line]
    assert said == [
        f"{cache.relative_to(workdir)}/index.json: damaged: empty; removed {cache.relative_to(workdir)}, "
        "so that this run makes it again",
        "results/train/exp1/main/adapter/adapter_model.safetensors: damaged: empty; removed "
        "results/train/exp1/main/adapter, so that this run makes it again",
    ]
    assert planned_outputs(workdir) == {
        str(cache.relative_to(workdir)),
        "results/eval/click/main/test/predictions.jsonl",
        "results/eval/click_tower/main/test/predictions.jsonl",
        "results/eval/click_grpo/sft/test/predictions.jsonl",
        "results/eval/click_grpo/grpo/test/predictions.jsonl",
        "results/eval/base/screens/test/predictions.jsonl",
        "results/train/exp1/main/adapter",
        "results/eval/exp1/main/val/predictions.jsonl",
        "results/eval/exp1/main/test/predictions.jsonl",
        # exp7 starts from exp1's adapter.
        "results/train/exp7/main/adapter",
        "results/eval/exp7/main/val/predictions.jsonl",
        "results/eval/exp7/main/test/predictions.jsonl",
        "results/report/index.html",
        "rule:all",
    }


def test_an_output_being_written_is_no_damaged_output(tmp_path):
    """A cache or adapter whose writer has not finished lies at its temporary path (vlft.files.atomic_path)
    without its index or weights: a plan made meanwhile (a SLURM job's own, as another job writes)
    leaves it be and asks for nothing, while a finished output that lost its index is still found."""
    from vlft.empty_outputs import remove_empty_outputs, still_to_remake

    results = tmp_path / "results"
    writing = results / "cache/images/screens/train/.4096-16384.tmp-16682"
    writing.mkdir(parents=True)
    (writing / "shard-00000.safetensors").write_bytes(b"partial")
    adapter = results / "train/exp1/.main.tmp-7/adapter"
    adapter.mkdir(parents=True)
    damaged = results / "cache/images/shapes/test/4096-16384"
    damaged.mkdir(parents=True)
    to_remake = tmp_path / "to-remake.json"
    said = remove_empty_outputs(results, to_remake)
    assert writing.is_dir() and (writing / "shard-00000.safetensors").read_bytes() == b"partial" and adapter.is_dir()
    assert said == [f"{damaged}/index.json: damaged: missing; removed {damaged}, so that this run makes it again"]
    assert still_to_remake(to_remake) == [str(damaged)]


def test_after_a_forced_stage_finds_the_adapter_it_starts_from_damaged_a_dry_run_lists_its_training(
    demo_workdir, tmp_path
):
    """The finished demo, exp4's stage 1 adapter given other bytes of the same size, stage 2 forced
    (`-f`): the job stops in one sentence that promises a dry run lists the job that trains stage 1
    again, and the next dry run of the whole study does."""
    workdir = tmp_path / "demo"
    shutil.copytree(demo_workdir, workdir, symlinks=True)
    damage_in_place(workdir / "results/train/exp4/stage1/adapter/adapter_model.safetensors")
    result = snakemake(workdir, "-f", "results/train/exp4/stage2/adapter", "--cores", "2", check=False)
    assert result.returncode != 0
    log = (workdir / "results/logs/train/exp4/stage2.log").read_text()
    assert "so that the next run trains the stage again (a dry run lists the job)" in log, log
    assert "results/train/exp4/stage1/adapter" in planned_outputs(workdir)

"""Faults a researcher meets: what the project deletes, damaged files, a GPU job without a GPU, a
schedule that cannot train. Each case reproduces the fault as described, on real files."""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, copy_demo_upstream, copy_workflow, planned_outputs, snakemake
from vlft.config import resolve_config
from vlft.training.curves import SCALARS
from vlft.errors import ConfigError, DeviceError, InputError
from vlft.files import atomic_path, read_jsonl, remove_inside, write_jsonl
from vlft.modeling import cuda_problem, require_gpus
from vlft.plan import build_plan, retry_runtime


def test_nothing_outside_the_owning_directory_is_deleted(tmp_path):
    owner, outside = tmp_path / "results/checkpoints/exp", tmp_path / "elsewhere"
    (owner / "run").mkdir(parents=True)
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    for path in [owner / "..", owner / "../../..", owner / "run/../..", owner, owner / "."]:
        with pytest.raises(
            RuntimeError, match="refusing to delete .*: it is not inside .*, the directory this step owns"
        ):
            remove_inside(path, owner)
    # A link inside the owner that points outside is removed as a link; what it points to stays.
    (owner / "link").symlink_to(outside)
    remove_inside(owner / "link", owner)
    assert not (owner / "link").exists() and (outside / "keep.txt").read_text() == "x"
    # And reached through a link from outside, the owner's contents are still its own.
    (tmp_path / "alias").symlink_to(owner)
    remove_inside(tmp_path / "alias/run", owner)
    assert not (owner / "run").exists() and owner.is_dir()


def test_a_killed_writers_temporary_directory_is_removed_by_the_next_write_of_its_target(tmp_path):
    """A killed job leaves `.<target>.tmp-<pid>` behind (423 MB for a cache); the next job that writes
    the target removes it, and nobody else's temporary files."""
    target = tmp_path / "cache"
    stale = tmp_path / f".cache.tmp-{os.getpid() + 1}"
    (stale / "shard").mkdir(parents=True)
    other = tmp_path / ".cache2.tmp-1"
    other.mkdir()
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "index.json").write_text("{}")
    assert not stale.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".cache2.tmp-1", "cache"]


def run_train_script(*arguments: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "scripts/train.py"), "--model", "none", "--prepared", "none"]
    command += ["--caches", "none", "--settings", "{}", "--checkpoints", "none"]
    command += ["--adapter", "none", "--log", "none", "--summary", "none", *arguments]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is not usable")
def test_a_job_that_asked_for_a_gpu_and_finds_none_usable_fails_at_once_naming_the_host_and_cuda():
    """An 8B stage on a node whose driver fails must not train on the CPU for days."""
    started = time.time()
    result = run_train_script("--processes", "1")
    assert result.returncode == 1 and time.time() - started < 60
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert line == (
        f"error: host {socket.gethostname()}: this job asked for 1 GPU(s), but CUDA is not usable: "
        f"{cuda_problem()}; set the job's resources gpus to 0 to run it on the CPU"
    )
    # A hidden GPU and a CUDA torch give CUDA's own words; here at least the build says why.
    assert cuda_problem()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is not usable")
def test_cpu_runs_happen_where_no_gpu_was_asked_for_or_the_config_allows_them(monkeypatch, capsys):
    require_gpus(0, cpu_fallback=False)
    assert capsys.readouterr().out == ""
    monkeypatch.delenv("RANK", raising=False)
    require_gpus(2, cpu_fallback=True)
    assert capsys.readouterr().out == (
        f"host {socket.gethostname()}: no usable GPU ({cuda_problem()}): running on the CPU, as cpu_fallback allows\n"
    )
    with pytest.raises(DeviceError, match="asked for 2 GPU"):
        require_gpus(2, cpu_fallback=False)


def test_the_demo_alone_lets_gpu_jobs_fall_back_to_the_cpu():
    """The demo asks for GPUs and runs on a laptop; a study's config (the examples) never falls back."""
    assert resolve_config(yaml.safe_load((REPO / "config/config.yaml").read_text()))["cpu_fallback"] is True
    for example in sorted((REPO / "config/examples").glob("*.yaml")):
        assert resolve_config(yaml.safe_load(example.read_text()))["cpu_fallback"] is False, example


@pytest.fixture(scope="module")
def small_stage(tmp_path_factory, tiny_model_dir):
    """16 records of the demo's shapes, prepared and cached, and the demo's exp1 settings."""
    from vlft.demo.shapes import make_dataset
    from vlft.caches.image_cache import PixelSettings, build_image_cache
    from vlft.modeling import load_image_processor
    from vlft.data.records import prepare_split
    from vlft.training.train import StageInputs

    root = tmp_path_factory.mktemp("small-stage")
    make_dataset({"train": root / "train.jsonl"}, root / "images", {"train": 16}, seed=0)
    prepare_split(root / "train.jsonl", root / "images", root / "prepared.jsonl")
    pixels = PixelSettings.from_processor(load_image_processor(tiny_model_dir), 4096, 16384)
    build_image_cache(root / "prepared.jsonl", root / "cache", pixels)
    inputs = StageInputs(str(tiny_model_dir), [str(root / "prepared.jsonl")], [str(root / "cache")], None)
    settings = build_plan(yaml.safe_load((REPO / "config/config.yaml").read_text())).stage("exp1", "main")
    return inputs, settings.train_params() | {"compile": False}


def test_the_logged_learning_rate_is_the_one_the_step_used(small_stage, tmp_path):
    """Cosine with 2 warmup steps of 4: the steps use 0, 1/2, 1 and 1/2 of the rate (HF's schedule);
    the log said 1/2, 1, 1/2, 0, the rate of the step after."""
    from vlft.training.train import train_stage

    inputs, settings = small_stage
    settings = settings | {"max_steps": 4, "warmup_ratio": 0.5, "micro_batch": 4, "learning_rate": 1e-3}
    train_stage(inputs, settings, tmp_path / "a", tmp_path / "log.jsonl", tmp_path / "s.json", tmp_path / "c", 100)
    logged = [row["lr"] for row in read_jsonl(tmp_path / "log.jsonl")]
    assert logged == pytest.approx([0.0, 0.5e-3, 1e-3, 0.5e-3], rel=1e-12, abs=1e-18)


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


def test_a_stage_whose_records_make_too_few_steps_for_its_warmup_is_refused_before_it_trains(small_stage, tmp_path):
    """Epochs over few records: the step count is known only in the job, which refuses at once."""
    from vlft.training.train import train_stage

    inputs, settings = small_stage
    settings = settings | {"epochs": 1, "max_steps": None, "micro_batch": 16, "warmup_ratio": 0.05}
    with pytest.raises(ConfigError) as refused:
        train_stage(inputs, settings, tmp_path / "a", tmp_path / "log.jsonl", tmp_path / "s.json", tmp_path / "c", 100)
    assert str(refused.value).startswith("this stage's 16 records make 1 step(s): all 1 of its steps are warmup")
    assert not (tmp_path / "a").exists() and not (tmp_path / "log.jsonl").exists()


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


def test_an_intact_cache_reads_back_what_was_written(small_stage):
    from vlft.caches.image_cache import ImageCache
    from vlft.caches.integrity import tensor_checksum

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


def small_filesystem_command(mount_point: Path, size: str, script: str) -> list[str]:
    """A shell `script` run where `mount_point` is a fresh file system of `size` (tmpfs, in a mount
    namespace of its own: nothing outside sees it, and it goes when the script ends)."""
    mount_point.mkdir(parents=True, exist_ok=True)
    setup = f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(mount_point))} && "
    return ["unshare", "--map-root-user", "--mount", "sh", "-c", setup + script]


def small_filesystems_work() -> bool:
    probe = Path(tempfile.mkdtemp())
    try:
        return subprocess.run(small_filesystem_command(probe, "64k", "true"), capture_output=True).returncode == 0
    except FileNotFoundError:  # no unshare
        return False
    finally:
        probe.rmdir()


# CI's machine has them: there a missing one is a failure, not a skip.
needs_small_filesystems = pytest.mark.skipif(
    not os.environ.get("CI") and not small_filesystems_work(),
    reason="needs a private tmpfs (unshare --map-root-user --mount), which this machine refuses",
)


def run_in_small_filesystem(mount_point: Path, size: str, *commands: list[str]) -> subprocess.CompletedProcess:
    """Each command in turn inside one small file system; then what is left in it, one path a line
    after a '--- left:' line."""
    script = " ; ".join(shlex.join(c) + ' ; echo "exit $?"' for c in commands)
    script += f" ; echo '--- left:' ; cd {shlex.quote(str(mount_point))} && find . -mindepth 1 | sort"
    return subprocess.run(
        small_filesystem_command(mount_point, size, script), capture_output=True, text=True, timeout=600, cwd=REPO
    )


def left_in(result: subprocess.CompletedProcess) -> list[str]:
    return result.stdout.split("--- left:\n")[1].split()


def assert_one_full_disk_sentence(result: subprocess.CompletedProcess, path: Path, mount_point: Path) -> None:
    """The one error line a full disk gives, with no traceback, naming the file and the file system; what is
    free now depends on what the writer freed as it failed."""
    assert "Traceback" not in result.stderr, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error")]
    expected = (
        f"error: {path}: could not be written: No space left on device on {mount_point} (FREE); "
        "nothing half-written is left behind: free some space (or raise the quota) and run again"
    )
    pattern = re.escape(expected).replace("FREE", r"[\d.]+ (B|KiB|MiB) free of [\d.]+ (KiB|MiB)")
    assert re.fullmatch(pattern, line), line


@needs_small_filesystems
def test_a_full_disk_while_caching_is_one_sentence_naming_the_cache_and_leaves_nothing(small_stage, tmp_path):
    """The pixels of 16 images take some 440 KB; the file system has 256. It was a 15-line SafetensorError."""
    inputs, _ = small_stage
    full = tmp_path / "full"
    cache = full / "cache/images/shapes/train/4096-16384"
    result = run_in_small_filesystem(
        full,
        "256k",
        [sys.executable, "scripts/cache_images.py", "--records", inputs.prepared[0], "--model", inputs.model_dir]
        + ["--min-pixels", "4096", "--max-pixels", "16384", "--threads", "2", "--output", str(cache)],
    )
    assert "exit 1" in result.stdout, result.stdout + result.stderr
    assert_one_full_disk_sentence(result, cache, full)
    # The directories above the cache are the rule's to make; nothing of the cache itself is left.
    assert left_in(result) == ["./cache", "./cache/images", "./cache/images/shapes", "./cache/images/shapes/train"]


def train_command(inputs, settings: dict, stage_dir: Path, checkpoints: Path, checkpoint_every: int) -> list[str]:
    """scripts/train.py as the train rule runs it, on the CPU."""
    command = [sys.executable, "scripts/train.py", "--model", inputs.model_dir, "--prepared", *inputs.prepared]
    command += ["--caches", *inputs.caches, "--settings", json.dumps(settings), "--checkpoints", str(checkpoints)]
    command += ["--checkpoint-every", str(checkpoint_every), "--processes", "0", "--threads", "2"]
    command += ["--adapter", str(stage_dir / "adapter"), "--log", str(stage_dir / "log.jsonl")]
    return command + ["--summary", str(stage_dir / "summary.json")]


@needs_small_filesystems
def test_a_full_disk_while_saving_a_checkpoint_is_one_sentence_naming_it_and_leaves_no_part_of_it(
    small_stage, tmp_path
):
    """A checkpoint of the tiny model's adapter and optimizer takes some 300 KB; 64 KB are left. It
    was `basic_ios::clear: iostream error`, which never says the disk is full."""
    inputs, settings = small_stage
    full = tmp_path / "full"
    settings = settings | {"max_steps": 4, "micro_batch": 4}
    result = run_in_small_filesystem(
        full, "64k", train_command(inputs, settings, tmp_path / "stage", full / "checkpoints", checkpoint_every=2)
    )
    assert "exit 1" in result.stdout, result.stdout + result.stderr
    [run_dir] = {path.split("/")[2] for path in left_in(result) if path.count("/") >= 2}
    checkpoint = full / "checkpoints" / run_dir / "step-00000002"
    assert_one_full_disk_sentence(result, checkpoint, full)
    # The run's log of its two steps stays (the rerun truncates it to the checkpoint it resumes); no
    # part of the checkpoint does.
    assert left_in(result) == ["./checkpoints", f"./checkpoints/{run_dir}", f"./checkpoints/{run_dir}/log.jsonl"]
    assert not (tmp_path / "stage/adapter").exists()


@needs_small_filesystems
def test_a_full_disk_while_publishing_an_adapter_is_one_sentence_and_the_rerun_restores_it(small_stage, tmp_path):
    """The stage trained, its finished copy is kept beside its checkpoints, and copying it to
    results/train fails: the rerun (a first attempt, as after a failed job) restores it instead
    of training again. It was a traceback, then a whole stage trained again."""
    inputs, settings = small_stage
    full = tmp_path / "full"
    settings = settings | {"max_steps": 4, "micro_batch": 4}
    command = train_command(inputs, settings, full / "stage", tmp_path / "checkpoints", checkpoint_every=2)
    remount = ["mount", "-o", "remount,size=16m", str(full)]
    result = run_in_small_filesystem(full, "64k", command, remount, command)
    first, second = result.stdout.split("exit ")[1:3]
    assert first.startswith("1") and second.startswith("0"), result.stdout + result.stderr
    assert_one_full_disk_sentence(result, full / "stage/adapter", full)
    [finished] = tmp_path.glob("checkpoints/*/finished")
    assert f"this stage finished its steps in an earlier run: restoring its outputs from {finished}" in second
    assert "resuming from step" not in second and "/4 [" not in second  # no step trained again
    assert left_in(result) == [
        "./stage",
        "./stage/adapter",
        "./stage/adapter/README.md",
        "./stage/adapter/adapter_config.json",
        "./stage/adapter/adapter_model.safetensors",
        "./stage/log.jsonl",
        "./stage/summary.json",
    ]
    # Published whole now: a later first attempt (a rerun forced with -f or -R) trains again.
    assert not (finished / "unpublished").exists()


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
    assert "results/train/x/main/adapter" in planned_outputs(workdir, "--configfile", "study.yaml")
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


def test_a_training_job_takes_a_filter_on_its_splits_as_a_whole(small_stage, tmp_path):
    """Where the raw splits did not exist when the workflow started (the demo's), the job checks."""
    from vlft.modeling import load_tokenizer
    from vlft.data.prompts import PromptBuilder
    from vlft.data.stage_data import load_stage_data
    from transformers import AutoConfig

    inputs, _ = small_stage
    records = read_jsonl(inputs.prepared[0])
    for name, category in (("a", "color"), ("b", "count")):
        write_jsonl(tmp_path / f"{name}.jsonl", [r for r in records if r["category"] == category])
    splits, caches = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], inputs.caches * 2
    image_token = AutoConfig.from_pretrained(inputs.model_dir).image_token_id
    builder = PromptBuilder(load_tokenizer(inputs.model_dir), image_token)

    def load(filters):
        return load_stage_data(splits, caches, builder, filters, "cot", 512)

    counts = [r for r in records if r["category"] == "count"]
    assert counts and [r["id"] for r in load({"category": "count"}).records] == [r["id"] for r in counts]
    with pytest.raises(InputError) as refused:
        load({"category": "size"})
    assert (
        str(refused.value)
        == f"{splits[0]}, {splits[1]}: the stage's filter {{'category': 'size'}} selects no record of its splits"
    )


class KilledAfter:
    """A job killed after `steps` steps, with no chance to save (kill -9, a node lost)."""

    def __init__(self, steps: int):
        self.steps, self.seen = steps, 0

    def reason(self):
        self.seen += 1
        if self.seen == self.steps:
            raise KeyboardInterrupt


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a TensorBoard run, as TensorBoard itself reads it: (step, value) in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_stage_writes_its_curves_to_tensorboard_and_a_resumed_one_continues_them_without_duplicates(
    small_stage, tmp_path
):
    """Killed after step 5 with its last checkpoint at 4: the rerun trains steps 5 and 6 again, and
    TensorBoard shows steps 1 to 6 once each, with the values of the stage's final log."""
    from vlft.training.train import train_stage

    inputs, settings = small_stage
    settings = settings | {"max_steps": 6, "micro_batch": 4}
    stage, board = tmp_path / "train/exp/stage", tmp_path / "tensorboard/exp/stage"

    def run(stop=None):
        out = (stage / "adapter", stage / "log.jsonl", stage / "summary.json")
        return train_stage(inputs, settings, *out, tmp_path / "ckpt", 2, stop, curves_dir=board)

    with pytest.raises(KeyboardInterrupt):
        run(KilledAfter(5))
    assert [step for step, _ in tensorboard_scalars(board)["train/loss"]] == [1, 2, 3, 4, 5]
    assert run()["resumed_from_step"] == 4
    log = read_jsonl(stage / "log.jsonl")
    scalars = tensorboard_scalars(board)
    assert sorted(scalars) == [f"train/{name}" for name in sorted(SCALARS)]
    for name in SCALARS:
        assert [step for step, _ in scalars[f"train/{name}"]] == [1, 2, 3, 4, 5, 6], name
        # TensorBoard keeps float32: equal to the log's float64 within float32's rounding.
        expected = [row[name] for row in log]
        assert [value for _, value in scalars[f"train/{name}"]] == pytest.approx(expected, rel=2**-23, abs=1e-30), name
    # A run of other settings (or a forced one) starts from step 0, and its curves afresh.
    train_stage(
        inputs,
        settings | {"seed": 1},
        *(stage / n for n in ("adapter", "log.jsonl", "summary.json")),
        tmp_path / "ckpt",
        2,
        curves_dir=board,
    )
    assert [step for step, _ in tensorboard_scalars(board)["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert len(list(board.glob("events.out.tfevents.*"))) == 1


def test_a_used_up_quota_is_named_as_such_and_other_errors_pass_through(tmp_path):
    """A cluster's quota (EDQUOT) fails writes as a full disk does, with its own words; a write that
    fails for another reason on a file system with room keeps its own error."""
    import errno

    from vlft.errors import StorageError

    target = tmp_path / "cache"
    with pytest.raises(
        StorageError, match=rf"^{re.escape(str(target))}: could not be written: Disk quota exceeded on /"
    ):
        with atomic_path(target) as tmp:
            tmp.mkdir()
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="not about room"):
        with atomic_path(target) as tmp:
            raise ValueError("not about room")
    with pytest.raises(InputError):  # bad input stays bad input, whatever room is left
        with atomic_path(target) as tmp:
            raise InputError(target, "bad")


@pytest.mark.parametrize("warm", ["0", "1"], ids=["own-process", "warm-start"])
def test_ctrl_c_to_a_job_is_one_line_and_its_end_by_sigint_with_nothing_written(tiny_model_dir, tmp_path, warm):
    """A caching job stopped by SIGINT (a terminal's Ctrl-C, or the driver passing one on) while it
    waits for its records, as on a stalled file system (a FIFO that nobody writes): one line on
    stderr, not a traceback, the job's end by SIGINT as Python's own, and no cache. In its own
    process and run by a warm process (vlft.jobs.warm_start), where the job's process passes the signal on."""
    from vlft.jobs import warm_start

    records = tmp_path / "records.jsonl"
    os.mkfifo(records)
    output = tmp_path / "cache"
    command = [sys.executable, "scripts/cache_images.py", "--records", str(records), "--model", str(tiny_model_dir)]
    command += ["--min-pixels", "3136", "--max-pixels", "50176", "--output", str(output)]
    (tmp_path / "tmp").mkdir()  # the warm process's own, as in tests/test_warm_start.py
    env = os.environ | {warm_start.ENABLE: warm, "TMPDIR": str(tmp_path / "tmp")}
    job = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = job.stdout.readline()  # said before the script's main runs
    assert first.startswith("cache_images.py: host "), first
    assert ("run by a warm process" in first) == (warm == "1")
    job.send_signal(signal.SIGINT)
    out, err = job.communicate(timeout=120)
    assert (job.returncode, out, err) == (
        -signal.SIGINT,
        "",
        "cache_images.py: stopped by SIGINT (Ctrl-C) before it finished\n",
    )
    assert not output.exists() and [p.name for p in tmp_path.iterdir()] != []

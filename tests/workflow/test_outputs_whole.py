"""Outputs complete or absent: what the project deletes, a killed writer's leftovers, a full disk or used-up quota."""

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
import pytest
from tests.helpers import REPO
from vlft.errors import InputError
from vlft.files import atomic_path, remove_inside


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
        + ["--image-root", str(Path(inputs.prepared[0]).parent / "images")]
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
    assert left_in(result) == [
        "./checkpoints",
        f"./checkpoints/{run_dir}",
        f"./checkpoints/{run_dir}/.vlft-run-directory",
        f"./checkpoints/{run_dir}/log.jsonl",
    ]
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


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_outputs_follow_the_umask_though_safetensors_writes_them_private(tmp_path, mask):
    """A group-shared results directory: an adapter, cache or checkpoint written with safetensors
    (which leaves its files 0600) gets the modes a plain file of the user's umask would have."""
    import torch
    from safetensors.torch import save_file

    before = os.umask(mask)
    try:
        with atomic_path(tmp_path / "adapter") as tmp:
            tmp.mkdir()
            save_file({"w": torch.zeros(2)}, tmp / "adapter_model.safetensors")
            (tmp / "adapter_config.json").write_text("{}")
        with atomic_path(tmp_path / "index.json") as tmp:
            tmp.write_text("{}")
        (tmp_path / "plain").write_text("")
    finally:
        os.umask(before)
    plain = (tmp_path / "plain").stat().st_mode & 0o777
    assert plain == 0o666 & ~mask
    for path in ("adapter/adapter_model.safetensors", "adapter/adapter_config.json", "index.json"):
        assert (tmp_path / path).stat().st_mode & 0o777 == plain, path
    assert (tmp_path / "adapter").stat().st_mode & 0o777 == 0o777 & ~mask


def test_a_training_job_removes_only_what_it_made(demo_workdir, tmp_path):
    """A stage's checkpoint directory linked to a directory of the user's (more room elsewhere), and its
    TensorBoard directory holding a file of theirs: training the stage removes the run directory of its
    earlier settings, which this project made, and nothing else of either; no link is followed out."""
    from tests.helpers import copy_demo_upstream, snakemake

    workdir = copy_demo_upstream(demo_workdir, tmp_path / "demo")
    users = tmp_path / "users-disk"
    (users / "mydata").mkdir(parents=True)
    (users / "precious.txt").write_text("mine")
    (users / "mydata/notes.txt").write_text("mine too")
    (users / "0123456789abcdef").mkdir()  # named like a run directory, but not one this project made
    earlier = users / "fedcba9876543210"  # a run of the stage's earlier settings, as training made it
    earlier.mkdir()
    (earlier / ".vlft-run-directory").touch()
    (workdir / "results/checkpoints/exp1").mkdir(parents=True)
    (workdir / "results/checkpoints/exp1/main").symlink_to(users)
    curves = workdir / "results/tensorboard/exp1/main"
    curves.mkdir(parents=True)
    (curves / "my-notes.txt").write_text("mine")
    (curves / "events.out.tfevents.1.host.1.0").write_bytes(b"")  # an earlier run's curves

    snakemake(workdir, "--cores", "2", "results/train/exp1/main/summary.json", timeout=900)

    assert (users / "precious.txt").read_text() == "mine" and (users / "mydata/notes.txt").read_text() == "mine too"
    assert (users / "0123456789abcdef").is_dir() and not earlier.exists()
    assert (curves / "my-notes.txt").read_text() == "mine"
    assert not (curves / "events.out.tfevents.1.host.1.0").exists()  # its own, of the run before
    assert list(curves.glob("events.out.tfevents.*"))  # this run's curves


@pytest.mark.parametrize(
    "results,why",
    [
        ("/", "the file system's root"),
        (str(Path.home()), "your home directory"),
        ("..", "a directory above the study's"),
        (".", "the study's own directory"),
    ],
)
def test_a_results_directory_that_is_not_the_studys_own_is_refused(tmp_path, results, why):
    """Jobs write and clean up under `results`: the root, the home directory, or the study's own
    directory or one above it is refused in one sentence before any job, nothing written."""
    from tests.helpers import copy_workflow, snakemake
    import yaml

    workdir = copy_workflow(tmp_path / "study")
    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    (workdir / "config/bad.yaml").write_text(yaml.safe_dump(config | {"results": results}))
    result = snakemake(workdir, "--dry-run", "--configfile", "config/bad.yaml", check=False)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("Invalid config: ")]
    assert result.returncode != 0 and len(lines) == 1, result.stdout + result.stderr
    assert lines[0].startswith(f"Invalid config: results: '{results}' is {why}")
    assert not (workdir / "results").exists()

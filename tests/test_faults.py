"""Faults a researcher meets: what the project deletes, damaged files, a GPU job without a GPU, a
schedule that cannot train. Each case reproduces the fault as described, on real files."""

import os

import pytest

from vlft.files import atomic_path, remove_inside


def test_nothing_outside_the_owning_directory_is_deleted(tmp_path):
    owner, outside = tmp_path / "results/checkpoints/exp", tmp_path / "elsewhere"
    (owner / "run").mkdir(parents=True)
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    for path in [owner / "..", owner / "../../..", owner / "run/../..", owner, owner / "."]:
        with pytest.raises(RuntimeError, match="refusing to delete .*: it is not inside .*, the directory this step owns"):
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

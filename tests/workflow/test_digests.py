"""What a plan compares beside settings (vlft.digests): content, hashed once a change. (The reruns
these digests drive, through real Snakemake runs: tests/workflow/test_rerun_content.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from vlft import digests
from vlft.digests import DigestMemo, model_digests, split_digest
from vlft.errors import InputError
from vlft.files import MAX_LINE_BYTES


@pytest.fixture
def hashed(monkeypatch):
    """The files each digest of the test read whole."""
    read = []
    original = hashlib.file_digest

    def counting(handle, algorithm):
        read.append(os.path.basename(handle.name))
        return original(handle, algorithm)

    monkeypatch.setattr(hashlib, "file_digest", counting)
    return read


def a_split(root, records=4):
    (root / "images").mkdir(parents=True)
    for i in range(2):
        (root / "images" / f"{i}.png").write_bytes(bytes([i]) * 100)
    lines = [json.dumps({"id": i, "image": f"{i % 2}.png", "question": "q", "answer": "a"}) for i in range(records)]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root / "train.jsonl", root / "images"


def test_a_split_is_read_once_per_content_and_its_files_hashed_once_per_change(tmp_path, hashed, monkeypatch):
    records, images = a_split(tmp_path / "data")
    memo_path = tmp_path / ".snakemake/vlft/digests.json"
    first = split_digest(records, images, DigestMemo(memo_path))
    assert sorted(hashed) == ["0.png", "1.png", "train.jsonl"]

    # The next plan: no file hashed again, and the records not read (which images they name is kept).
    hashed.clear()
    monkeypatch.setattr(digests, "images_named", lambda path: pytest.fail("the records were read again"))
    assert split_digest(records, images, DigestMemo(memo_path)) == first and hashed == []

    # Touched: hashed again, the same digest. Other bytes: another digest.
    os.utime(images / "0.png", (1, 1))
    assert split_digest(records, images, DigestMemo(memo_path)) == first and hashed == ["0.png"]
    (images / "1.png").write_bytes(b"other")
    assert split_digest(records, images, DigestMemo(memo_path)) != first

    # Moved elsewhere, the same bytes: the same digest.
    (images / "1.png").write_bytes(bytes([1]) * 100)
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "data", moved)
    assert split_digest(moved / "train.jsonl", moved / "images", DigestMemo(memo_path)) == first


def test_a_records_line_of_absurd_length_is_one_sentence_at_plan_time(tmp_path):
    records, images = a_split(tmp_path)
    with open(records, "a") as out:
        out.write('{"id": "long", "answer": "' + "x" * (MAX_LINE_BYTES + 1) + '"}\n')
    with pytest.raises(InputError, match=r"train.jsonl:5: longer than 16 MiB: no record is this long"):
        split_digest(records, images, DigestMemo(tmp_path / "digests.json"))


def test_the_model_digest_follows_what_a_loader_reads(tmp_path, hashed):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json", "README.md"):
        (model / name).write_text(name)
    memo = DigestMemo(tmp_path / "digests.json")
    first = model_digests(model, memo)
    assert "README.md" not in hashed
    hashed.clear()
    assert model_digests(model, DigestMemo(tmp_path / "digests.json")) == first and hashed == []

    (model / "README.md").write_text("a model card, edited")
    (model / "extra.txt").write_bytes(b"")  # an empty file no loader reads, added
    (model / "my notes").write_text("which run this was")
    (model / ".cache").mkdir()
    (model / ".cache/download.lock").write_text("a download tool's")
    assert model_digests(model, memo) == first

    (model / "tokenizer.json").write_text("another tokenizer")
    changed = model_digests(model, memo)
    assert changed["whole"] != first["whole"] and changed["processor"] == first["processor"]
    (model / "preprocessor_config.json").write_text("other pixels")
    assert model_digests(model, memo)["processor"] != first["processor"]

"""Importers, each on fixture files written here in the published format."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from conftest import REPO
from PIL import Image

from vlft.errors import InputError
from vlft.files import read_jsonl
from vlft.importers import (
    import_chat,
    import_kvasir_vqa,
    import_kvasir_vqa_x1,
    import_screenspot,
    question_type,
)
from vlft.records import prepare_split


def jpeg_bytes(seed: int, size=(96, 64)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=83)
    return buffer.getvalue()


QUESTIONS = [
    ("Are there any abnormalities in the image? Check all that are present.", "polyp", "multiple choice"),
    ("How many findings are present?", "1", "count"),
    ("What color is the abnormality? ", "pink; red", "color"),
    ("Where in the image is the abnormality?", "center", "location"),
    ("Is there a green/black box artefact?", "no", "yes/no"),
    ("What type of procedure is the image taken from?", "colonoscopy", "single choice"),
]


def kvasir_parquet(path, n_images=12, answer=lambda i, a: a):
    """Kvasir-VQA as Hugging Face datasets publishes it: the Image column as {bytes, path}."""
    rows = []
    for i in range(n_images):
        data = jpeg_bytes(i)
        for question, reference, _ in QUESTIONS:
            rows.append(
                {
                    "image": {"bytes": data, "path": None},
                    "question": question,
                    "answer": answer(i, reference),
                    "source": "hyperkvasir",
                    "img_id": f"cl8k{i:04d}",
                }
            )
    pd.DataFrame(rows).to_parquet(path)
    return rows


def test_question_types_follow_kvasir_templates():
    for question, _, kind in QUESTIONS:
        assert question_type(question) == kind, question


def test_kvasir_vqa_as_published_becomes_records_split_by_image(tmp_path):
    def answer(i, reference):
        return {0: "", 1: "nan", 2: None}.get(i, reference) if reference == "1" else reference

    rows = kvasir_parquet(tmp_path / "kvasir.parquet", answer=answer)
    summary = import_kvasir_vqa([tmp_path / "kvasir.parquet"], tmp_path / "out")
    assert summary["dropped_without_answer"] == 3 and summary["records"] == len(rows) - 3
    assert summary["images"] == 12

    # Each image written once, from its original bytes.
    written = sorted((tmp_path / "out/images").iterdir())
    assert len(written) == 12
    for i in range(12):
        assert (tmp_path / f"out/images/cl8k{i:04d}.jpg").read_bytes() == jpeg_bytes(i)

    splits = {split: read_jsonl(tmp_path / f"out/{split}.jsonl") for split in ("train", "val", "test")}
    assert sum(map(len, splits.values())) == summary["records"]
    images_by_split = {split: {r["image"] for r in records} for split, records in splits.items()}
    assert not images_by_split["train"] & images_by_split["val"]
    assert not images_by_split["train"] & images_by_split["test"]
    assert not images_by_split["val"] & images_by_split["test"]
    records = [r for records in splits.values() for r in records]
    assert len({r["id"] for r in records}) == len(records)
    assert {r["category"] for r in records} == {kind for _, _, kind in QUESTIONS}

    # Stable: a second import writes the same records.
    import_kvasir_vqa([tmp_path / "kvasir.parquet"], tmp_path / "again")
    for split in splits:
        assert (tmp_path / f"again/{split}.jsonl").read_text() == (tmp_path / f"out/{split}.jsonl").read_text()

    # And they are records the workflow takes.
    prepare_split(tmp_path / "out/train.jsonl", tmp_path / "out/images", tmp_path / "prepared.jsonl")
    assert len(read_jsonl(tmp_path / "prepared.jsonl")) == len(splits["train"])


def test_kvasir_vqa_x1_takes_its_images_from_kvasir_vqa_and_its_difficulty_from_complexity(tmp_path):
    kvasir_parquet(tmp_path / "kvasir.parquet", n_images=4)
    x1 = [
        {
            "img_id": f"cl8k{i % 3:04d}",
            "complexity": i % 3 + 1,
            "question": f"Describe finding {i} and its colour.",
            "answer": f"A finding, number {i}.",
            "question_class": ["polyp_type", "color"] if i % 2 else ["instrument"],
            "original": ["q", "a"],
        }
        for i in range(9)
    ]
    pd.DataFrame(x1).to_parquet(tmp_path / "x1.parquet")
    summary = import_kvasir_vqa_x1([tmp_path / "x1.parquet"], [tmp_path / "kvasir.parquet"], tmp_path / "out")
    assert summary["records"] == 9 and summary["images"] == 3  # only the images its records use
    records = [r for s in ("train", "val", "test") for r in read_jsonl(tmp_path / f"out/{s}.jsonl")]
    assert sorted(r["difficulty"] for r in records) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert {r["category"] for r in records} == {"polyp_type+color", "instrument"}

    x1[4]["img_id"] = "missing"
    pd.DataFrame(x1).to_parquet(tmp_path / "x1.parquet")
    with pytest.raises(InputError, match=r"x1.parquet:5: field 'img_id': img_id 'missing' is not among"):
        import_kvasir_vqa_x1([tmp_path / "x1.parquet"], [tmp_path / "kvasir.parquet"], tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda rows: rows[7].update(image={"bytes": b"not an image", "path": None}), r":8: field 'image': unreadable"),
        (lambda rows: [row.pop("img_id") for row in rows], r"missing column\(s\) img_id"),
        (lambda rows: rows[8].update(image={"bytes": jpeg_bytes(99), "path": None}), r":9: field 'image': img_id"),
    ],
    ids=["unreadable-bytes", "missing-column", "one-id-two-images"],
)
def test_bad_kvasir_files_stop_with_the_file_and_row_and_write_nothing(tmp_path, break_it, message):
    rows = kvasir_parquet(tmp_path / "kvasir.parquet", n_images=2)
    break_it(rows)
    pd.DataFrame(rows).to_parquet(tmp_path / "kvasir.parquet")
    with pytest.raises(InputError, match=message):
        import_kvasir_vqa([tmp_path / "kvasir.parquet"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def chat_fixtures(root):
    """The same two samples as LLaMA-Factory (sharegpt JSON), ms-swift (JSONL) and LLaVA (JSON) write them."""
    (root / "images").mkdir()
    for name in ("a.jpg", "b.jpg"):
        (root / "images" / name).write_bytes(jpeg_bytes(len(name)))
    sharegpt = [
        {
            "conversations": [
                {"from": "human", "value": f"<image>What is {x}?"},
                {"from": "gpt", "value": f"It is {x}."},
            ],
            "images": [f"{x}.jpg"],
        }
        for x in "ab"
    ]
    swift = [
        {
            "messages": [
                {"role": "user", "content": f"<image>What is {x}?"},
                {"role": "assistant", "content": f"It is {x}."},
            ],
            "images": [str(root / "images" / f"{x}.jpg")],
        }
        for x in "ab"
    ]
    llava = [
        {
            "id": f"llava-{x}",
            "image": f"{x}.jpg",
            "conversations": [
                {"from": "human", "value": f"<image>\nWhat is {x}?"},
                {"from": "gpt", "value": f"It is {x}."},
            ],
        }
        for x in "ab"
    ]
    (root / "sharegpt.json").write_text(json.dumps(sharegpt, indent=1))
    (root / "swift.jsonl").write_text("".join(json.dumps(r) + "\n" for r in swift))
    (root / "llava.json").write_text(json.dumps(llava))
    return sharegpt, swift, llava


@pytest.mark.parametrize("name", ["sharegpt.json", "swift.jsonl", "llava.json"])
def test_chat_formats_become_one_record_a_conversation(tmp_path, name):
    chat_fixtures(tmp_path)
    summary = import_chat([tmp_path / name], tmp_path / "images", tmp_path / "out")
    records = read_jsonl(tmp_path / "out/train.jsonl")
    assert summary["records"] == 2
    assert [(r["image"], r["question"], r["answer"]) for r in records] == [
        ("a.jpg", "What is a?", "It is a."),
        ("b.jpg", "What is b?", "It is b."),
    ]
    prepare_split(tmp_path / "out/train.jsonl", tmp_path / "images", tmp_path / "prepared.jsonl")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r["images"].append("b.jpg"), r"sharegpt.json:2: field 'images': needs exactly one image, has 2"),
        (
            lambda r: r["conversations"].extend([{"from": "human", "value": "And?"}, {"from": "gpt", "value": "No."}]),
            r"sharegpt.json:2: needs exactly one user turn then one assistant turn",
        ),
        (
            lambda r: r["conversations"].insert(0, {"from": "system", "value": "Be brief."}),
            r"sharegpt.json:2: needs exactly one user turn then one assistant turn, has \['system'",
        ),
    ],
    ids=["two-images", "two-rounds", "system-turn"],
)
def test_chat_records_that_do_not_fit_are_refused_never_cut(tmp_path, change, message):
    sharegpt, _, _ = chat_fixtures(tmp_path)
    change(sharegpt[1])
    (tmp_path / "sharegpt.json").write_text(json.dumps(sharegpt))
    with pytest.raises(InputError, match=message):
        import_chat([tmp_path / "sharegpt.json"], tmp_path / "images", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_duplicate_ids_are_refused_with_both_places(tmp_path):
    _, _, llava = chat_fixtures(tmp_path)
    llava[1]["id"] = llava[0]["id"]
    (tmp_path / "llava.json").write_text(json.dumps(llava))
    with pytest.raises(
        InputError, match=r"llava.json:2: field 'id': duplicate id 'llava-a' \(first seen at .*llava.json:1\)"
    ):
        import_chat([tmp_path / "llava.json"], tmp_path / "images", tmp_path / "out")


@pytest.mark.parametrize("layout, box", [("xywh", [10, 20, 30, 40]), ("xyxy", [10, 20, 40, 60])])
def test_screenspot_boxes_in_either_layout_become_corner_boxes_in_pixels(tmp_path, layout, box):
    rows = [{"img_filename": "web_1.png", "bbox": box, "instruction": "click the search button", "data_type": "icon"}]
    (tmp_path / "screenspot.json").write_text(json.dumps(rows))
    import_screenspot([tmp_path / "screenspot.json"], tmp_path / "out", bbox=layout)
    (record,) = read_jsonl(tmp_path / "out/test.jsonl")
    assert record["box"] == [10, 20, 40, 60] and record["answer"] == "(25, 40)" and record["category"] == "icon"

    del rows[0]["instruction"]
    (tmp_path / "screenspot.json").write_text(json.dumps(rows))
    with pytest.raises(InputError, match=r"screenspot.json:1: field 'instruction': missing"):
        import_screenspot([tmp_path / "screenspot.json"], tmp_path / "bad", bbox=layout)


def test_the_import_script_runs_as_the_readme_shows(tmp_path):
    kvasir_parquet(tmp_path / "kvasir.parquet", n_images=3)
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/import_dataset.py"),
            "kvasir-vqa",
            "--parquet",
            "kvasir.parquet",
            "--out",
            "kvasir",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["records"] == 18 and summary["images"] == 3
    bad = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/import_dataset.py"),
            "kvasir-vqa",
            "--parquet",
            "nothing.parquet",
            "--out",
            "x",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0

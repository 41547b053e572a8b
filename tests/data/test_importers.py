"""Importers, each on fixture files written here in the published format."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from tests.helpers import REPO
from PIL import Image

from vlft.errors import InputError
from vlft.files import read_jsonl, write_jsonl
from vlft.data.importers import (
    import_chat,
    import_kvasir_vqa,
    import_kvasir_vqa_x1,
    import_screenspot,
    question_type,
)
from vlft.data.records import prepare_split, select_records


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


def x1_rows(n=9, images=3):
    """Kvasir-VQA-x1 rows as the Hub publishes them: question_class and original as lists."""
    return [
        {
            "img_id": f"cl8k{i % images:04d}",
            "complexity": i % 3 + 1,
            "question": f"Describe finding {i} and its colour.",
            "answer": f"A finding, number {i}.",
            "question_class": ["polyp_type", "color"] if i % 2 else ["instrument"],
            "original": [json.dumps({"q": f"q{i}", "a": f"a{i}"})],
        }
        for i in range(n)
    ]


def test_kvasir_vqa_x1_keeps_its_published_splits_classes_and_originals(tmp_path):
    kvasir_parquet(tmp_path / "kvasir.parquet", n_images=40)
    train, test = x1_rows(300, images=30), x1_rows(20, images=40)[-10:]
    pd.DataFrame(train).to_parquet(tmp_path / "train-00000-of-00001.parquet")
    pd.DataFrame(test).to_parquet(tmp_path / "test-00000-of-00001.parquet")
    files = [tmp_path / "train-00000-of-00001.parquet", tmp_path / "test-00000-of-00001.parquet"]
    summary = import_kvasir_vqa_x1(files, [tmp_path / "kvasir.parquet"], tmp_path / "out")
    splits = {s: read_jsonl(tmp_path / f"out/{s}.jsonl") for s in ("train", "val", "test")}

    # The published test split whole, and nothing else in it; val carved from train by image.
    assert [r["question"] for r in splits["test"]] == [r["question"] for r in test]
    assert len(splits["train"]) + len(splits["val"]) == len(train) and splits["val"] and splits["train"]
    assert not {r["image"] for r in splits["train"]} & {r["image"] for r in splits["val"]}
    assert summary["splits"] == {s: len(r) for s, r in splits.items()} and summary["images"] == 30
    assert "as published" in summary["split_by"]
    images_of = {s: {r["image"] for r in records} for s, records in splits.items()}
    assert summary["images_in_train_and_test"] == len((images_of["train"] | images_of["val"]) & images_of["test"])

    records = [r for s in splits.values() for r in s]
    by_question = {r["question"]: r for r in records}
    for row in train + test:
        record = by_question[row["question"]]
        assert record["difficulty"] == row["complexity"] and record["original"] == row["original"]
        assert record["question_class"] == row["question_class"] and record["category"] == "+".join(
            row["question_class"]
        )
    # A filter on one class selects every record that has it, alone or with others.
    color = select_records(records, {"question_class": "color"})
    assert color and len(color) == sum("color" in r["question_class"] for r in records)
    assert len(select_records(records, {"question_class": ["instrument", "color"]})) == len(records)

    bad = x1_rows()
    bad[4]["img_id"] = "missing"
    pd.DataFrame(bad).to_parquet(tmp_path / "train-bad.parquet")
    with pytest.raises(InputError, match=r"train-bad.parquet:5: field 'img_id': img_id 'missing' is not among"):
        import_kvasir_vqa_x1([tmp_path / "train-bad.parquet"], [tmp_path / "kvasir.parquet"], tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    pd.DataFrame(x1_rows()).to_parquet(tmp_path / "x1.parquet")
    with pytest.raises(InputError, match=r"x1.parquet: cannot tell its split: Kvasir-VQA-x1 publishes train-\*"):
        import_kvasir_vqa_x1([tmp_path / "x1.parquet"], [tmp_path / "kvasir.parquet"], tmp_path / "bad")


def test_kvasir_vqa_is_read_one_row_group_at_a_time_with_the_same_records(tmp_path):
    rows = kvasir_parquet(tmp_path / "whole.parquet", n_images=5)
    pd.DataFrame(rows).to_parquet(tmp_path / "groups.parquet", row_group_size=4)
    assert pq.ParquetFile(tmp_path / "groups.parquet").num_row_groups == 8
    import_kvasir_vqa([tmp_path / "whole.parquet"], tmp_path / "a")
    import_kvasir_vqa([tmp_path / "groups.parquet"], tmp_path / "b")
    for split in ("train", "val", "test"):
        assert (tmp_path / f"a/{split}.jsonl").read_text() == (tmp_path / f"b/{split}.jsonl").read_text()


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


def test_mantis_conversations_of_role_content_turns_are_read_several_images_refused_as_such(tmp_path):
    """Mantis-Instruct's rows: `conversation` as role / content turns (ms-swift's field name, the
    messages layout). One image imports; several are refused for what they are; a video row is
    skipped and counted."""
    chat_fixtures(tmp_path)

    def turns(question):
        return [{"role": "user", "content": question}, {"role": "assistant", "content": "The second."}]

    rows = [
        {"id": "m1", "images": ["a.jpg"], "conversation": turns("<image> Which shape is it?")},
        {"id": "m2", "images": ["a.jpg", "b.jpg"], "conversation": turns("<image><image> Which differs?")},
        {"id": "m3", "video": "clip.mp4", "conversation": turns("<video> What happens?")},
    ]
    (tmp_path / "mantis.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = import_chat([tmp_path / "mantis.jsonl"], tmp_path / "images", tmp_path / "out", skip_bad_rows=True)
    assert [(r["image"], r["question"]) for r in read_jsonl(tmp_path / "out/train.jsonl")] == [
        ("a.jpg", "Which shape is it?")
    ]
    assert summary["skipped_video"] == 1 and summary["refused"] == 1
    (refused,) = read_jsonl(tmp_path / "out.refused.jsonl")
    assert "needs one image, has 2: a.jpg, b.jpg" in json.dumps(refused)


def test_ms_swifts_pairs_with_a_rejected_message_list_and_the_same_image_named_again_import(tmp_path):
    """ms-swift's preference rows: `rejected_response` as a list of one assistant message, and
    `rejected_images` naming the chosen answer's image again (by its absolute path): one pair."""
    chat_fixtures(tmp_path)
    row = {
        "messages": [{"role": "user", "content": "<image>What is a?"}, {"role": "assistant", "content": "It is a."}],
        "images": ["a.jpg"],
        "rejected_response": [{"role": "assistant", "content": "It is b."}],
        "rejected_images": [str((tmp_path / "images/a.jpg").resolve())],
    }
    (tmp_path / "pairs.jsonl").write_text(json.dumps(row) + "\n")
    import_chat([tmp_path / "pairs.jsonl"], tmp_path / "images", tmp_path / "out")
    (record,) = read_jsonl(tmp_path / "out/train.jsonl")
    assert (record["image"], record["answer"], record["rejected"]) == ("a.jpg", "It is a.", "It is b.")


def test_ms_swifts_grpo_rows_take_their_solution_as_the_answer_its_r1_tags_read(tmp_path):
    """ms-swift's GRPO rows: a user turn, `images`, `solution` (R1-style tags, with or without
    reasoning). The answer is the tags' text (reasoning, then 'Final answer:'), which answer_match
    scores against a plain '3'; counted; a box solution is refused as such."""
    from vlft.data.answers import is_correct

    chat_fixtures(tmp_path)

    def row(solution):
        return {
            "messages": [{"role": "user", "content": "<image>How many shapes?"}],
            "images": ["a.jpg"],
            "solution": solution,
        }

    rows = [row("<answer> 3 </answer>"), row("<think>I count them.</think> <answer>3</answer>"), row([1, 2, 30, 40])]
    (tmp_path / "grpo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = import_chat([tmp_path / "grpo.jsonl"], tmp_path / "images", tmp_path / "out", skip_bad_rows=True)
    answers = [r["answer"] for r in read_jsonl(tmp_path / "out/train.jsonl")]
    assert answers == ["3", "I count them.\nFinal answer: 3"]
    assert all(is_correct("3", answer) for answer in answers) and not is_correct("3", "<answer> 3 </answer>")
    assert summary["answers_from_solution"] == 2 and summary["refused"] == 1
    (refused,) = read_jsonl(tmp_path / "out.refused.jsonl")
    assert (refused["row"], refused["field"]) == (3, "solution")
    assert refused["reason"].startswith("is a list of 4 values, not text: this importer reads text solutions")


def test_r1_v_rows_import_through_vqa_their_solution_tags_read_and_counted(tmp_path):
    from vlft.data.importers import import_flat_vqa

    (tmp_path / "images").mkdir()
    (tmp_path / "images/a.png").write_bytes(jpeg_bytes(0))
    rows = [{"image": "a.png", "problem": "How many?", "solution": "<answer> 3 </answer>"}]
    (tmp_path / "train.jsonl").write_text(json.dumps(rows[0]) + "\n")
    summary = import_flat_vqa([tmp_path / "train.jsonl"], tmp_path / "out", tmp_path / "images")
    assert [r["answer"] for r in read_jsonl(tmp_path / "out/train.jsonl")] == ["3"]
    assert summary["answer_tags_read"] == 1 and summary["fields"][str(tmp_path / "train.jsonl")]["answer"] == "solution"


def test_chat_files_as_windows_tools_write_them_read_the_same(tmp_path):
    """A byte-order mark and CRLF line ends (Notepad, Excel, PowerShell), and a U+2028 that JSON
    text may hold unescaped: the same records as the plain file, none split or refused."""
    _, swift, _ = chat_fixtures(tmp_path)
    swift[0]["messages"][1]["content"] = "It is\u2028a."
    plain = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in swift)
    (tmp_path / "plain.jsonl").write_text(plain, encoding="utf-8")
    (tmp_path / "windows.jsonl").write_bytes(b"\xef\xbb\xbf" + plain.replace("\n", "\r\n").encode())
    read = {}
    for name in ("plain", "windows"):
        import_chat([tmp_path / f"{name}.jsonl"], tmp_path / "images", tmp_path / name)
        read[name] = [(r["image"], r["question"], r["answer"]) for r in read_jsonl(tmp_path / name / "train.jsonl")]
    assert (
        read["windows"]
        == read["plain"]
        == [("a.jpg", "What is a?", "It is\u2028a."), ("b.jpg", "What is b?", "It is b.")]
    )


def test_a_chat_file_that_is_not_utf8_is_one_sentence_naming_the_line(tmp_path):
    _, swift, _ = chat_fixtures(tmp_path)
    swift[1]["messages"][0]["content"] = "Qué es b?"
    lines = [json.dumps(r, ensure_ascii=False) for r in swift]
    (tmp_path / "latin1.jsonl").write_bytes("\n".join(lines).encode("latin-1"))
    column = lines[1].encode("latin-1").index(b"\xe9") + 1
    with pytest.raises(InputError) as refused:
        import_chat([tmp_path / "latin1.jsonl"], tmp_path / "images", tmp_path / "out")
    assert str(refused.value) == f"{tmp_path / 'latin1.jsonl'}:2: not UTF-8 text (byte 0xe9 at column {column})"
    assert not (tmp_path / "out").exists()


MLLM_DEMO = [  # LLaMA-Factory's data/mllm_demo.json, in its shape: two rounds on one image, no <image> marker
    {
        "messages": [
            {"content": f"Who is in {x}?", "role": "user"},
            {"content": f"Someone in {x}.", "role": "assistant"},
            {"content": "What are they doing?", "role": "user"},
            {"content": f"Celebrating in {x}.", "role": "assistant"},
        ],
        "images": [f"{x}.jpg"],
    }
    for x in "ab"
]


def typed_parts(row: dict) -> dict:
    """The same conversation in LLaMA-Factory's v1 format (data/v1_multimodal_demo.jsonl): typed
    parts, the image a part of the first question and shown again with the second."""
    messages = []
    for n, m in enumerate(row["messages"]):
        parts = [{"type": "text", "value": m["content"]}]
        if m["role"] == "user":
            parts.insert(0 if n == 0 else 1, {"type": "image_url", "value": row["images"][0]})
        messages.append({"role": m["role"], "content": parts})
    return {"messages": messages}


def swift_shapes(row: dict, shape: str) -> dict:
    """The same conversation in ms-swift's sharegpt and query-response layouts."""
    turns = [m["content"] for m in row["messages"]]
    if shape == "swift_sharegpt":
        return {"conversation": [{"human": q, "assistant": a} for q, a in zip(turns[::2], turns[1::2])], **row}
    pairs = [[q, a] for q, a in zip(turns[::2], turns[1::2])]
    return {"query": pairs[-1][0], "response": pairs[-1][1], "history": pairs[:-1], "images": row["images"]}


@pytest.mark.parametrize("shape", ["mllm_demo", "v1_typed_parts", "swift_sharegpt", "swift_query_response"])
def test_a_conversation_of_n_rounds_becomes_n_records_each_with_its_history(tmp_path, shape):
    chat_fixtures(tmp_path)
    rows = {
        "mllm_demo": MLLM_DEMO,
        "v1_typed_parts": [typed_parts(r) for r in MLLM_DEMO],
        "swift_sharegpt": [
            {k: v for k, v in swift_shapes(r, "swift_sharegpt").items() if k != "messages"} for r in MLLM_DEMO
        ],
        "swift_query_response": [swift_shapes(r, "query") for r in MLLM_DEMO],
    }[shape]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = import_chat([tmp_path / "chat.jsonl"], tmp_path / "images", tmp_path / "out")
    records = read_jsonl(tmp_path / "out/train.jsonl")
    assert summary["records"] == 4 and summary["conversations"] == 2
    assert summary["image_shown_again"] == (2 if shape == "v1_typed_parts" else 0)
    first, second = records[:2]
    assert (first["id"], first["image"], first["question"], first["answer"]) == (
        "chat-1-1",
        "a.jpg",
        "Who is in a?",
        "Someone in a.",
    )
    assert "history" not in first and second["id"] == "chat-1-2"
    assert second["history"] == [{"question": "Who is in a?", "answer": "Someone in a."}]
    assert (second["question"], second["answer"]) == ("What are they doing?", "Celebrating in a.")
    prepare_split(tmp_path / "out/train.jsonl", tmp_path / "images", tmp_path / "prepared.jsonl")


def test_system_turns_are_kept_and_rows_without_an_image_are_skipped_and_counted(tmp_path):
    sharegpt, swift, llava = chat_fixtures(tmp_path)
    swift[0]["messages"].insert(0, {"role": "system", "content": "You are a careful radiologist."})
    sharegpt[1]["system"] = "Answer in one word."
    llava.insert(
        1, {"id": "text-only", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}
    )
    for name, rows in (("swift.jsonl", swift), ("sharegpt.json", sharegpt), ("llava.json", llava)):
        (tmp_path / name).write_text(
            json.dumps(rows) if name.endswith(".json") else "".join(json.dumps(r) + "\n" for r in rows)
        )
    import_chat([tmp_path / "swift.jsonl"], tmp_path / "images", tmp_path / "swift")
    assert [r.get("system") for r in read_jsonl(tmp_path / "swift/train.jsonl")] == [
        "You are a careful radiologist.",
        None,
    ]
    import_chat([tmp_path / "sharegpt.json"], tmp_path / "images", tmp_path / "sharegpt")
    assert [r.get("system") for r in read_jsonl(tmp_path / "sharegpt/train.jsonl")] == [None, "Answer in one word."]
    summary = import_chat([tmp_path / "llava.json"], tmp_path / "images", tmp_path / "llava")
    assert summary["records"] == 2 and summary["skipped_without_image"] == 1
    assert [r["id"] for r in read_jsonl(tmp_path / "llava/train.jsonl")] == ["llava-a", "llava-b"]


def chat_row(question="<image>What is shown?", answer="A polyp.", **fields):
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]} | fields


@pytest.mark.parametrize(
    "name, row, said",
    [
        # ms-swift's documentation example: an image and a video in one row.
        (
            "image and video",
            chat_row("<image><video>What differs?", images=["a.jpg"], videos=["clip.mp4"]),
            "holds video beside its image: only images are read",
        ),
        ("KTO, label as text", chat_row(images=["a.jpg"], label="false"), "field 'label': a KTO row"),
        ("KTO, LLaMA-Factory's kto_tag", chat_row(images=["a.jpg"], kto_tag=False), "field 'kto_tag': a KTO row"),
        ("rejected_images alone", chat_row(images=["a.jpg"], rejected_images=["b.jpg"]), "about other images"),
        (
            "rejected the same as chosen",
            chat_row(images=["a.jpg"], rejected_response=" A polyp. "),
            "field 'rejected': the same as the chosen answer: a preference pair needs two different answers",
        ),
        (
            "Qwen-VL's inline URL",
            {
                "conversations": [
                    {"from": "user", "value": "Picture 1: <img>https://example.org/a.jpg</img>\nWhat is shown?"},
                    {"from": "assistant", "value": "A polyp."},
                ]
            },
            "image https://example.org/a.jpg is a URL",
        ),
        ("data: URL", chat_row(images=["data:image/jpeg;base64,/9j/4AAQ"]), "written into the row as a data: URL"),
    ],
)
def test_a_row_of_what_no_record_holds_is_refused_saying_what_it_holds(tmp_path, name, row, said):
    chat_fixtures(tmp_path)
    (tmp_path / "rows.json").write_text(json.dumps([chat_row(images=["a.jpg"]), row]))
    with pytest.raises(InputError, match=rf"rows.json:2: .*{said}"):
        import_chat([tmp_path / "rows.json"], tmp_path / "images", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_video_audio_and_not_learned_rows_are_counted_as_what_they_are_and_inline_and_file_images_read(tmp_path):
    """Rows of LLaMA-Factory's video and audio demos and Qwen's video.json are skipped under their
    own names; a round marked not to be learned (ms-swift's loss: false, LLaMA-Factory v1's
    loss_weight: 0) makes no record but stays in the next round's history; Qwen-VL's inline
    <img>path</img> and Qwen's file:// paths name the row's image."""
    chat_fixtures(tmp_path)
    rows = [
        chat_row("<video>What happens?", videos=["clip.mp4"]),  # LLaMA-Factory's video demo
        chat_row("<audio>What is said?", audios=["speech.wav"]),  # its audio demo
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "Describe."}],
                },
                {"role": "assistant", "content": "A scope moves."},
            ]
        },  # Qwen's video.json
        chat_row(
            images=["a.jpg"],
            messages=[
                {"role": "user", "content": "<image>What is shown?"},
                {"role": "assistant", "content": "I am not sure.", "loss": False},
                {"role": "user", "content": "Look again: what is shown?"},
                {"role": "assistant", "content": "A polyp."},
            ],
        ),
        {
            "messages": [
                {"role": "user", "content": "<image>Colour?"},
                {"role": "assistant", "content": "Red.", "loss_weight": 0.0},
            ],
            "images": ["b.jpg"],
        },
        {
            "conversations": [
                {"from": "user", "value": "Picture 1: <img>a.jpg</img>\nHow many?"},
                {"from": "assistant", "value": "One."},
            ]
        },
        chat_row(images=[f"file://{tmp_path / 'images/b.jpg'}"]),
    ]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    summary = import_chat([tmp_path / "rows.json"], tmp_path / "images", tmp_path / "out")
    assert (summary["skipped_video"], summary["skipped_audio"], summary["skipped_without_image"]) == (2, 1, 0)
    assert (summary["skipped_not_learned"], summary["rounds_not_learned"]) == (1, 1)
    records = read_jsonl(tmp_path / "out/train.jsonl")
    assert [(r["image"], r["question"], r["answer"]) for r in records] == [
        ("a.jpg", "Look again: what is shown?", "A polyp."),
        ("a.jpg", "How many?", "One."),
        ("b.jpg", "What is shown?", "A polyp."),
    ]
    assert records[0]["history"] == [{"question": "What is shown?", "answer": "I am not sure."}]


def grounding_row(refs=("sheep", "sheep"), boxes=([10, 20, 50, 60],), **objects):
    """ms-swift's grounding example's shape (docs, Custom-dataset, grounding): the referring
    expression in the question and as the answer's label, one box per <bbox>."""
    label = '{"bbox_2d": <bbox>, "label": "<ref-object>"}'
    return {
        "messages": [
            {"role": "system", "content": "You are a grounding model."},
            {"role": "user", "content": "<image>Locate the <ref-object> in the image"},
            {"role": "assistant", "content": "[\n\t" + ",\n\t".join([label] * len(boxes)) + "\n]"},
        ],
        "images": ["a.jpg"],
        "objects": {"ref": list(refs), "bbox": [list(b) for b in boxes], **objects},
    }


def test_grounding_rows_with_one_target_become_click_records(tmp_path):
    chat_fixtures(tmp_path)  # a.jpg is 96 x 64
    click = {  # ms-swift's documented click example: a point
        "messages": [
            {"role": "user", "content": "<image>Help me open Google Chrome"},
            {"role": "assistant", "content": "Action: click(start_box='<bbox>')"},
        ],
        "images": ["a.jpg"],
        "objects": {"ref": [], "bbox": [[61, 22]]},
    }
    rows = [grounding_row(), grounding_row(boxes=([0.1, 0.25, 0.5, 0.75],), bbox_type="norm1"), click]
    (tmp_path / "ground.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = import_chat([tmp_path / "ground.jsonl"], tmp_path / "images", tmp_path / "out")
    first, second, third = read_jsonl(tmp_path / "out/train.jsonl")
    assert summary["grounding_rows"] == 3
    assert (first["question"], first["box"], first["answer"]) == (
        "Locate the sheep in the image",
        [10, 20, 50, 60],
        "(30, 40)",
    )
    assert first["system"] == "You are a grounding model."
    assert second["box"] == [9.6, 16.0, 48.0, 48.0]  # fractions of 96 x 64
    assert (third["question"], third["point"], third["answer"]) == ("Help me open Google Chrome", [61, 22], "(61, 22)")
    prepare_split(tmp_path / "out/train.jsonl", tmp_path / "images", tmp_path / "prepared.jsonl")


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"messages": [{"role": "user", "content": "<image>Hi"}, {"role": "assistant", "content": "Hello"}]},
            r"chat.jsonl:2: field 'images': has <image> in its text but names no image",
        ),
        (
            dict(MLLM_DEMO[0], images=["a.jpg", "b.jpg"]),
            r"chat.jsonl:2: field 'images': needs one image, has 2: a.jpg, b.jpg",
        ),
        (
            dict(MLLM_DEMO[0], images=["https://example.org/a.jpg"]),
            r"chat.jsonl:2: field 'images': image https://example.org/a.jpg is a URL",
        ),
        (
            {"messages": MLLM_DEMO[0]["messages"], "label": False, "images": ["a.jpg"]},
            r"chat.jsonl:2: field 'label': a KTO row \(label: true/false marks one answer desirable or not\)",
        ),
        (
            {
                "messages": MLLM_DEMO[0]["messages"],
                "rejected_response": "No.",
                "images": ["a.jpg"],
                "rejected_images": ["b.jpg"],
            },
            r"chat.jsonl:2: field 'rejected_images': the rejected answer is about other images",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": "<image>And this?"},
                    {"role": "assistant", "content": "A cat."},
                ],
                "images": ["a.jpg"],
            },
            r"chat.jsonl:2: its image is first shown in turn 3",
        ),
        (
            {
                "messages": [{"role": "user", "content": "<image>Hi"}, {"role": "user", "content": "Hello"}],
                "images": ["a.jpg"],
            },
            r"chat.jsonl:2: needs user and assistant turns in turn, ending with an answer; has \['user', 'user'\]",
        ),
        (
            {"messages": [{"role": "user", "content": "<image>Hi"}, {"role": "function_call", "content": "{}"}]},
            r"chat.jsonl:2: a turn of role 'function_call'",
        ),
        (  # ms-swift's own example: two sheep, two boxes
            grounding_row(refs=("sheep",) * 3, boxes=([90.9, 160.8, 135, 212.8], [360.9, 480.8, 495, 532.8])),
            r"chat.jsonl:2: field 'objects': asks for 2 targets \(2 <bbox> in the answer, 2 in objects.bbox\)",
        ),
        (
            dict(
                grounding_row(),
                messages=[
                    {"role": "user", "content": "<image>What is in <bbox>?"},
                    {"role": "assistant", "content": "<ref-object>"},
                ],
            ),
            r"chat.jsonl:2: asks about a box \(<bbox> in the question\), as a grounded caption does: ms-swift "
            r"writes that box in each model family's own coordinates",
        ),
        (
            dict(MLLM_DEMO[0], messages=grounding_row()["messages"]),
            r"chat.jsonl:2: has <ref-object> or <bbox> placeholders",
        ),
    ],
    ids=[
        "marker-without-image",
        "two-images",
        "url",
        "kto",
        "rejected-images",
        "image-later",
        "no-answer",
        "tool-turn",
        "two-targets",
        "box-asked",
        "unfilled",
    ],
)
def test_chat_rows_that_do_not_fit_are_refused_with_the_row_and_the_reason(tmp_path, row, message):
    chat_fixtures(tmp_path)
    (tmp_path / "chat.jsonl").write_text(json.dumps(MLLM_DEMO[1]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(InputError, match=message):
        import_chat([tmp_path / "chat.jsonl"], tmp_path / "images", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_rows_that_share_an_id_get_ids_of_their_own_said_in_the_summary(tmp_path):
    _, _, llava = chat_fixtures(tmp_path)
    llava[1]["id"] = llava[0]["id"]
    (tmp_path / "llava.json").write_text(json.dumps(llava))
    summary = import_chat([tmp_path / "llava.json"], tmp_path / "images", tmp_path / "out")
    assert [r["id"] for r in read_jsonl(tmp_path / "out/train.jsonl")] == ["llava-a", "llava-a-2"]
    assert summary["ids_renamed"] == 1
    assert re.fullmatch(
        r".*llava.json:2: 'llava-a' -> 'llava-a-2' \(first at .*llava.json:1\)", summary["ids_renamed_first"][0]
    )


def test_every_refused_row_is_named_at_once_and_skip_bad_rows_imports_the_others(tmp_path):
    """ms-swift's documentation examples in one file: each bad row is named, not the first alone;
    the message shows the first few and the list beside the output holds every one; with
    --skip-bad-rows the rows that fit are imported, the list written all the same, and the
    summary counts the refused rows. A JSONL line that is not JSON is a refused row too."""
    chat_fixtures(tmp_path)
    good = chat_row(images=["a.jpg"])
    lines = [
        json.dumps(good),
        json.dumps(chat_row(images=["a.jpg", "b.jpg"])),  # two images
        "{not json",
        json.dumps(chat_row(images=["https://example.org/x.jpg"])),  # a URL
        json.dumps(dict(good, label=True)),  # KTO
        json.dumps(chat_row("<image>Where?", images=["b.jpg"])),
    ]
    (tmp_path / "swift.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(
        InputError,
        match=r"out.refused.jsonl: 4 rows refused, every one listed in this file: .*swift.jsonl:2: field 'images': needs one image.*swift.jsonl:3: not valid JSON.*\(and 1 more\).*--skip-bad-rows",
    ):
        import_chat([tmp_path / "swift.jsonl"], tmp_path / "images", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    listed = read_jsonl(tmp_path / "out.refused.jsonl")
    assert [(r["row"], r["field"]) for r in listed] == [(2, "images"), (3, None), (4, "images"), (5, "label")]

    summary = import_chat([tmp_path / "swift.jsonl"], tmp_path / "images", tmp_path / "out", skip_bad_rows=True)
    assert summary["records"] == 2 and summary["refused"] == 4
    assert summary["refused_by_field"] == {"images": 2, "row": 1, "label": 1}
    assert [r["question"] for r in read_jsonl(tmp_path / "out/train.jsonl")] == ["What is shown?", "Where?"]
    assert len(read_jsonl(tmp_path / "out.refused.jsonl")) == 4


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


def test_screenspot_v1_v2_pro_and_their_republications_each_read_in_their_own_layout(tmp_path):
    v1 = {"img_filename": "web_1.png", "bbox": [10, 20, 30, 40], "instruction": "search", "data_type": "icon"}
    pro = {  # ScreenSpot-Pro's annotations: corners, img_size, ui_type
        "img_filename": "pr_1.png",
        "bbox": [1774, 1586, 1887, 1604],
        "instruction": "open the layer panel",
        "id": "photoshop_windows_0",
        "application": "photoshop",
        "platform": "windows",
        "img_size": [3840, 2160],
        "ui_type": "icon",
        "group": "Creative",
    }
    mirror = {"file_name": "web_1.png", "bbox": [10, 20, 40, 60], "instruction": "search", "data_type": "icon"}
    uground = {"image": "web_1.png", "bbox": [10, 20, 30, 40], "instruction": "search", "data_type": "text"}
    for name, row in (("v1", v1), ("pro", pro), ("mirror", mirror), ("uground", uground)):
        (tmp_path / f"{name}.json").write_text(json.dumps([row]))
        summary = import_screenspot([tmp_path / f"{name}.json"], tmp_path / name)
        (record,) = read_jsonl(tmp_path / f"{name}/test.jsonl")
        assert summary["bbox"] == {str(tmp_path / f"{name}.json"): "xywh" if name in ("v1", "uground") else "xyxy"}
        assert record["image"] == ("pr_1.png" if name == "pro" else "web_1.png")
        assert record["box"] == ([1774, 1586, 1887, 1604] if name == "pro" else [10, 20, 40, 60])
    (record,) = read_jsonl(tmp_path / "pro/test.jsonl")
    assert record["id"] == "photoshop_windows_0" and record["category"] == "icon"
    assert (record["platform"], record["application"], record["img_size"]) == ("windows", "photoshop", [3840, 2160])

    # Pro's corners read as x, y, w, h leave its image: refused, with the image's size.
    with pytest.raises(InputError, match=r"pro.json:1: field 'bbox': .* outside the 3840x2160 image \(img_size\)"):
        import_screenspot([tmp_path / "pro.json"], tmp_path / "bad", bbox="xywh")
    assert not (tmp_path / "bad").exists()


def test_the_hub_mirrors_boxes_in_fractions_of_the_image_become_pixels_by_its_own_size(tmp_path):
    """rootsautomation/ScreenSpot as the Hub publishes it: parquet rows of the screenshot's bytes,
    `file_name`, and `bbox` as corners in fractions of the image (lmms-eval's ScreenSpot task reads
    them so: the target's centre is ((x1 + x2) / 2, (y1 + y2) / 2) of the fractions). Read as pixels
    every box would shrink under a pixel at the top-left corner; here each is scaled by its image's
    own size (96 x 64), the screenshot written once to <out>/images/."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fractions = [[0.25, 0.25, 0.75, 0.5], [0.5, 0.5, 0.625, 0.75]]
    rows = [
        {
            "file_name": "mobile_1.jpg",
            "bbox": box,
            "instruction": f"tap target {i}",
            "data_type": "icon",
            "data_source": "ios",
            "image": {"bytes": jpeg_bytes(0), "path": None},
        }
        for i, box in enumerate(fractions)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test-00000-of-00001.parquet")
    summary = import_screenspot([tmp_path / "test-00000-of-00001.parquet"], tmp_path / "out")
    assert summary["bbox_units"] == {str(tmp_path / "test-00000-of-00001.parquet"): "fractions"}
    records = read_jsonl(tmp_path / "out/test.jsonl")
    assert [r["box"] for r in records] == [[24, 16, 72, 32], [48, 32, 60, 48]]
    for record, box in zip(records, fractions):
        x, y = (float(v) for v in record["answer"].strip("()").split(","))
        assert (x / 96, y / 64) == ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)  # the publisher's centre
        assert record["image"] == "mobile_1.jpg" and record["data_source"] == "ios"
    assert (tmp_path / "out/images/mobile_1.jpg").read_bytes() == jpeg_bytes(0) and summary["images"] == 1

    # The same rows as JSON, images as files: their size is read from --image-root, which they need.
    for row in rows:
        del row["image"]
    (tmp_path / "mirror.json").write_text(json.dumps(rows))
    with pytest.raises(
        InputError, match=r"mirror.json:1: field 'bbox': .* fractions of the image .* give --image-root"
    ):
        import_screenspot([tmp_path / "mirror.json"], tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    (tmp_path / "shots").mkdir()
    (tmp_path / "shots/mobile_1.jpg").write_bytes(jpeg_bytes(0))
    import_screenspot([tmp_path / "mirror.json"], tmp_path / "json", image_root=tmp_path / "shots")
    assert [r["box"] for r in read_jsonl(tmp_path / "json/test.jsonl")] == [[24, 16, 72, 32], [48, 32, 60, 48]]
    # Pixel boxes checked against the image file where --image-root is given.
    (tmp_path / "wide.json").write_text(
        json.dumps([{"img_filename": "mobile_1.jpg", "bbox": [50, 10, 60, 20], "instruction": "x"}])
    )
    with pytest.raises(InputError, match=r"wide.json:1: field 'bbox': .* outside the 96x64 image \(its file\)"):
        import_screenspot([tmp_path / "wide.json"], tmp_path / "bad", bbox="xywh", image_root=tmp_path / "shots")


def test_ui_r1s_corner_boxes_without_img_size_stop_for_the_layout_option_and_import_by_it(tmp_path):
    """UI-R1's test.json: corner boxes, no img_size, nothing that names the layout; one box fits its
    screenshot read either way. Read as x, y, width, height, it would land elsewhere silently: the
    import stops naming the option, and with it imports the corners as they are."""
    (tmp_path / "shots").mkdir()
    (tmp_path / "shots/mobile_1.jpg").write_bytes(jpeg_bytes(0))  # 96 x 64
    rows = [
        {"img_filename": "mobile_1.jpg", "bbox": [10, 10, 30, 20], "instruction": "open the menu"},
        {"img_filename": "mobile_1.jpg", "bbox": [50, 10, 60, 20], "instruction": "search"},
    ]
    (tmp_path / "test.json").write_text(json.dumps(rows))
    with pytest.raises(
        InputError, match=r"test.json: its boxes read both as corners and .* give --bbox xyxy or --bbox xywh"
    ):
        import_screenspot([tmp_path / "test.json"], tmp_path / "out", image_root=tmp_path / "shots")
    assert not (tmp_path / "out").exists()
    import_screenspot([tmp_path / "test.json"], tmp_path / "out", bbox="xyxy", image_root=tmp_path / "shots")
    assert [r["box"] for r in read_jsonl(tmp_path / "out/test.jsonl")] == [[10, 10, 30, 20], [50, 10, 60, 20]]


def test_ui_r1s_steps_of_actions_other_than_a_click_are_skipped_and_counted(tmp_path):
    """UI-R1's rows carry an `action`: a click step is a click record; a scroll or typing step has
    no box to click and is skipped, counted by its action, not refused as a row without `bbox`."""
    (tmp_path / "shots").mkdir()
    (tmp_path / "shots/mobile_1.jpg").write_bytes(jpeg_bytes(0))  # 96 x 64
    rows = [
        {"img_filename": "mobile_1.jpg", "bbox": [10, 10, 30, 20], "instruction": "open the menu", "action": "click"},
        {"img_filename": "mobile_1.jpg", "instruction": "scroll down", "action": "scroll"},
        {"img_filename": "mobile_1.jpg", "instruction": "type hello", "action": "type"},
    ]
    (tmp_path / "train.json").write_text(json.dumps(rows))
    summary = import_screenspot([tmp_path / "train.json"], tmp_path / "out", "xyxy", "train", tmp_path / "shots")
    (record,) = read_jsonl(tmp_path / "out/train.jsonl")
    assert (record["box"], record["answer"]) == ([10, 10, 30, 20], "(20, 15)")
    assert summary["skipped_actions"] == {"scroll": 1, "type": 1} and summary["records"] == 1


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("box", [10, 20, 100, 40], r"box \[10, 20, 100, 40\] is not a box of positive area inside the 96x64 image"),
        ("box", [10, 20, 10, 40], r"box \[10, 20, 10, 40\] is not a box of positive area inside the 96x64 image"),
        ("point", [50, 70], r"point \[50, 70\] is not inside the 96x64 image"),
    ],
)
def test_prepare_split_refuses_a_box_or_point_outside_its_image(tmp_path, field, value, message):
    (tmp_path / "images").mkdir()
    (tmp_path / "images/a.jpg").write_bytes(jpeg_bytes(0))  # 96 x 64
    good = {"id": "1", "image": "a.jpg", "question": "Where?", "answer": "(1, 1)", field: [1, 1, 5, 5][: len(value)]}
    bad = dict(good, id="2", **{field: value})
    write_jsonl(tmp_path / "raw.jsonl", [good, bad])
    with pytest.raises(InputError, match=rf"raw.jsonl:2: field '{field}': {message} of .*a.jpg"):
        prepare_split(tmp_path / "raw.jsonl", tmp_path / "images", tmp_path / "prepared.jsonl")
    assert not (tmp_path / "prepared.jsonl").exists()


def test_preference_pairs_as_llama_factory_and_ms_swift_write_them_become_records_with_rejected(tmp_path):
    """LLaMA-Factory's ranking rows (the conversation ends with the question; `chosen` and
    `rejected` turns beside it) and ms-swift's (`rejected_response` beside a conversation whose last
    answer is the chosen one): one record a pair, its last round, the rounds before as history."""
    chat_fixtures(tmp_path)
    llama_factory = {
        "conversations": [{"from": "human", "value": "<image>What is in the image?"}],
        "chosen": {"from": "gpt", "value": "A red circle."},
        "rejected": {"from": "gpt", "value": "A blue square."},
        "images": ["a.jpg"],
    }
    swift = {
        "messages": [
            {"role": "user", "content": "<image>Describe it."},
            {"role": "assistant", "content": "Noise."},
            {"role": "user", "content": "Which colour dominates?"},
            {"role": "assistant", "content": "Grey."},
        ],
        "rejected_response": "Green.",
        "images": ["b.jpg"],
    }
    (tmp_path / "pairs.json").write_text(json.dumps([llama_factory, swift]))
    summary = import_chat([tmp_path / "pairs.json"], tmp_path / "images", tmp_path / "out")
    assert summary["records"] == 2 and summary["preference_pairs"] == 2
    first, second = read_jsonl(tmp_path / "out/train.jsonl")
    assert (first["question"], first["answer"], first["rejected"]) == (
        "What is in the image?",
        "A red circle.",
        "A blue square.",
    )
    assert (second["question"], second["answer"], second["rejected"]) == ("Which colour dominates?", "Grey.", "Green.")
    assert second["history"] == [{"question": "Describe it.", "answer": "Noise."}]
    prepare_split(tmp_path / "out/train.jsonl", tmp_path / "images", tmp_path / "prepared.jsonl")
    assert [r["rejected"] for r in read_jsonl(tmp_path / "prepared.jsonl")] == ["A blue square.", "Green."]


def test_flat_preference_pairs_as_rlaif_v_publishes_them(tmp_path):
    """RLAIF-V's parquet shape: the image's bytes, question, chosen, rejected and provenance; each
    image written once by its content; a row whose answers are the same is refused with its place."""
    from vlft.data.importers import import_pairs

    rows = [
        {
            "ds_name": "RLAIF-V",
            "image": {"bytes": jpeg_bytes(i % 2), "path": None},
            "question": f"What do you see ({i})?",
            "chosen": "A field of grey noise.",
            "rejected": "A cat on a sofa.",
            "origin_dataset": "VQAv2",
            "idx": f"row-{i}",
        }
        for i in range(3)
    ]
    pd.DataFrame(rows).to_parquet(tmp_path / "rlaif.parquet")
    summary = import_pairs([tmp_path / "rlaif.parquet"], tmp_path / "out")
    assert summary == {"records": 3, "images": 2, "splits": {"train": 3}}
    records = read_jsonl(tmp_path / "out/train.jsonl")
    assert [r["id"] for r in records] == ["row-0", "row-1", "row-2"] and records[0]["image"] == records[2]["image"]
    assert records[1] | {"image": None} == {
        "id": "row-1",
        "image": None,
        "question": "What do you see (1)?",
        "answer": "A field of grey noise.",
        "rejected": "A cat on a sofa.",
        "ds_name": "RLAIF-V",
        "origin_dataset": "VQAv2",
    }
    prepare_split(tmp_path / "out/train.jsonl", tmp_path / "out/images", tmp_path / "prepared.jsonl")
    rows[1]["rejected"] = rows[1]["chosen"]
    pd.DataFrame(rows).to_parquet(tmp_path / "same.parquet")
    with pytest.raises(InputError, match=r"same.parquet:2: field 'rejected': the same as 'chosen'"):
        import_pairs([tmp_path / "same.parquet"], tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def slake(root):
    """SLAKE as its authors publish it: train.json, validate.json, test.json (JSON arrays), images
    under imgs/<folder>/source.jpg, English and Chinese questions (q_lang)."""
    for folder in ("xmlab1", "xmlab2"):
        (root / "imgs" / folder).mkdir(parents=True)
        (root / "imgs" / folder / "source.jpg").write_bytes(jpeg_bytes(len(folder)))

    def row(qid, folder, question, answer, lang="en"):
        return {
            "img_id": int(folder[-1]),
            "img_name": f"{folder}/source.jpg",
            "question": question,
            "answer": answer,
            "q_lang": lang,
            "location": "Abdomen",
            "modality": "CT",
            "answer_type": "CLOSED" if answer in ("Yes", "No") else "OPEN",
            "base_type": "vqa",
            "content_type": "Organ",
            "triple": ["vhead", "_", "_"],
            "qid": qid,
        }

    files = {
        "train.json": [row(1, "xmlab1", "Is this a CT?", "Yes"), row(2, "xmlab1", "这是CT吗?", "是", "zh")],
        "validate.json": [row(3, "xmlab2", "Which organ is shown?", "Liver")],
        "test.json": [row(4, "xmlab2", "Is the liver healthy?", "No")],
    }
    for name, rows in files.items():
        (root / name).write_text(json.dumps(rows, ensure_ascii=False))
    return [root / name for name in files]


def hub_vqa_parquet(root, splits=("train", "test")):
    """VQA-RAD and PathVQA as the Hub publishes them: data/<split>-00000-of-00001.parquet of the
    image's bytes ({bytes, path}), question and answer (VQA-RAD's counts as numbers in some exports)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "data").mkdir(parents=True)
    paths = []
    for n, split in enumerate(splits):
        rows = [
            {"image": {"bytes": jpeg_bytes(10 + n), "path": None}, "question": "how many kidneys?", "answer": "2"},
            {"image": {"bytes": jpeg_bytes(10 + n), "path": None}, "question": "is this normal?", "answer": "yes"},
        ]
        paths.append(root / "data" / f"{split}-00000-of-00001.parquet")
        pq.write_table(pa.Table.from_pylist(rows), paths[-1])
    return paths


def test_slake_imports_as_published_with_its_splits_fields_and_english_rows(tmp_path):
    from vlft.data.importers import import_flat_vqa

    files = slake(tmp_path / "SLAKE")
    summary = import_flat_vqa(
        files, tmp_path / "slake", tmp_path / "SLAKE/imgs", category="content_type", keep={"q_lang": "en"}
    )
    assert summary["splits"] == {"train": 1, "val": 1, "test": 1} and summary["skipped_by_keep"] == 1
    (train,) = read_jsonl(tmp_path / "slake/train.jsonl")
    assert (train["id"], train["image"], train["question"], train["answer"]) == (
        "1",
        "xmlab1/source.jpg",
        "Is this a CT?",
        "Yes",
    )
    assert (train["category"], train["modality"], train["answer_type"]) == ("Organ", "CT", "CLOSED")
    assert summary["fields"][str(files[0])] == {
        "image": "img_name",
        "question": "question",
        "answer": "answer",
        "id": "qid",
    }
    assert summary["image_root"] == str(tmp_path / "SLAKE/imgs")
    # The records are ours: prepare_split reads them against the images as they are.
    from vlft.data.records import prepare_split

    prepare_split(tmp_path / "slake/test.jsonl", tmp_path / "SLAKE/imgs", tmp_path / "prepared.jsonl")
    assert read_jsonl(tmp_path / "prepared.jsonl")[0]["answer"] == "No"


def test_vqa_rad_and_pathvqa_parquet_with_embedded_images_keep_their_published_splits(tmp_path):
    from vlft.data.importers import import_flat_vqa

    files = hub_vqa_parquet(tmp_path / "path-vqa", ("train", "validation", "test"))
    summary = import_flat_vqa(files, tmp_path / "out")
    assert summary["splits"] == {"train": 2, "val": 2, "test": 2} and summary["images"] == 3
    assert summary["image_root"] == f"{tmp_path / 'out'}/images"
    records = read_jsonl(tmp_path / "out/train.jsonl")
    assert [r["answer"] for r in records] == ["2", "yes"] and records[0]["image"] == records[1]["image"]
    assert (tmp_path / "out/images" / records[0]["image"]).read_bytes() == jpeg_bytes(10)


def test_vqa_rads_own_json_and_csv_name_their_splits_by_a_field_mapped_to_ours(tmp_path):
    """VQA-RAD's own release: one JSON file, its test rows by `phrase_type` (test_freeform,
    test_para), image_name, numbers as answers; the same rows as CSV. An unmapped split value is
    refused with the option that maps it."""
    from vlft.data.importers import import_flat_vqa

    (tmp_path / "images").mkdir()
    (tmp_path / "images/synpic1.jpg").write_bytes(jpeg_bytes(0))
    rows = [
        {
            "qid": "0",
            "image_name": "synpic1.jpg",
            "question": "How many lesions?",
            "answer": 2,
            "phrase_type": "freeform",
            "answer_type": "OPEN",
            "question_type": "COUNT",
        },
        {
            "qid": "1",
            "image_name": "synpic1.jpg",
            "question": "Is there a lesion?",
            "answer": "yes",
            "phrase_type": "test_para",
            "answer_type": "CLOSED",
            "question_type": "PRES",
        },
    ]
    (tmp_path / "VQA_RAD Dataset Public.json").write_text(json.dumps(rows))
    mapped = {"freeform": "train", "para": "train", "test_freeform": "test", "test_para": "test"}
    with pytest.raises(
        InputError, match=r"Public.json:1: field 'phrase_type': split 'freeform' is none of .*--split-map"
    ):
        import_flat_vqa(
            [tmp_path / "VQA_RAD Dataset Public.json"], tmp_path / "bad", tmp_path / "images", split_field="phrase_type"
        )
    summary = import_flat_vqa(
        [tmp_path / "VQA_RAD Dataset Public.json"],
        tmp_path / "rad",
        tmp_path / "images",
        category="question_type",
        split_field="phrase_type",
        split_map=mapped,
    )
    assert summary["splits"] == {"train": 1, "test": 1}
    assert read_jsonl(tmp_path / "rad/train.jsonl")[0]["answer"] == "2"
    import pandas as pd

    pd.DataFrame(rows).to_csv(tmp_path / "rad.csv", index=False)
    import_flat_vqa(
        [tmp_path / "rad.csv"], tmp_path / "csv", tmp_path / "images", split_field="phrase_type", split_map=mapped
    )
    assert [r["question"] for r in read_jsonl(tmp_path / "csv/test.jsonl")] == ["Is there a lesion?"]


def test_llava_meds_evaluation_file_names_its_fields_and_a_missing_field_is_named(tmp_path):
    from vlft.data.importers import import_flat_vqa

    (tmp_path / "images").mkdir()
    (tmp_path / "images/fig1.jpg").write_bytes(jpeg_bytes(0))
    row = {
        "question_id": 7,
        "image": "fig1.jpg",
        "domain": {"ct_scan": True},
        "text": "What is seen?",
        "gpt4_answer": "A mass.",
        "type": "conversation",
    }
    (tmp_path / "llava_med_eval_qa50_qa.jsonl").write_text(json.dumps(row) + "\n")
    summary = import_flat_vqa(
        [tmp_path / "llava_med_eval_qa50_qa.jsonl"],
        tmp_path / "med",
        tmp_path / "images",
        category="type",
        split="test",
    )
    (record,) = read_jsonl(tmp_path / "med/test.jsonl")
    assert (record["id"], record["question"], record["answer"], record["category"]) == (
        "7",
        "What is seen?",
        "A mass.",
        "conversation",
    )
    assert summary["fields"][str(tmp_path / "llava_med_eval_qa50_qa.jsonl")]["answer"] == "gpt4_answer"
    with pytest.raises(InputError, match=r"has no field 'caption' \(--answer\)"):
        import_flat_vqa(
            [tmp_path / "llava_med_eval_qa50_qa.jsonl"], tmp_path / "bad", tmp_path / "images", {"answer": "caption"}
        )


def mevf_vqa_rad(root):
    """VQA-RAD as MEVF releases it: data_RAD/trainset.json and testset.json (JSON arrays), images by
    name under data_RAD/images, `phrase_type` on every row."""
    (root / "images").mkdir(parents=True)
    (root / "images/synpic1.jpg").write_bytes(jpeg_bytes(0))

    def row(qid, question, answer, phrase):
        return {
            "qid": qid,
            "image_name": "synpic1.jpg",
            "image_organ": "HEAD",
            "answer": answer,
            "answer_type": "CLOSED",
            "question_type": "PRES",
            "question": question,
            "phrase_type": phrase,
        }

    files = {"trainset.json": [row(1, "Is there a mass?", "yes", "freeform")]}
    files["testset.json"] = [row(2, "Is the brain normal?", "no", "test_freeform")]
    for name, rows in files.items():
        (root / name).write_text(json.dumps(rows))
    return [root / name for name in files]


def test_mevfs_vqa_rad_files_land_in_the_splits_their_names_say(tmp_path):
    """testset.json is the test split, with or without the phrase_type recipe; a file whose name
    says no split stops the import, naming the file and the option that decides it."""
    from vlft.data.importers import import_flat_vqa

    files = mevf_vqa_rad(tmp_path / "data_RAD")
    images = tmp_path / "data_RAD/images"
    summary = import_flat_vqa(files, tmp_path / "by-name", images)
    assert summary["splits"] == {"train": 1, "test": 1}
    assert read_jsonl(tmp_path / "by-name/test.jsonl")[0]["question"] == "Is the brain normal?"
    recipe = {"freeform": "train", "para": "train", "test_freeform": "test", "test_para": "test"}
    summary = import_flat_vqa(files, tmp_path / "recipe", images, split_field="phrase_type", split_map=recipe)
    assert summary["splits"] == {"train": 1, "test": 1}
    (tmp_path / "data_RAD/rad_all.json").write_text(files[1].read_text())
    with pytest.raises(InputError, match=r"rad_all.json: its name says no split .*give --split"):
        import_flat_vqa([tmp_path / "data_RAD/rad_all.json"], tmp_path / "none", images)
    assert not (tmp_path / "none").exists()
    summary = import_flat_vqa([tmp_path / "data_RAD/rad_all.json"], tmp_path / "given", images, split="test")
    assert summary["splits"] == {"test": 1}


def test_the_image_marker_llava_med_leaves_in_its_questions_is_taken_out_and_counted(tmp_path):
    """LLaVA-Med's evaluation file writes "<question>\n<image>": the record's question is the text
    alone, the summary counts the rows; a question that shows two images is refused as such."""
    from vlft.data.importers import import_flat_vqa

    (tmp_path / "images").mkdir()
    (tmp_path / "images/fig1.jpg").write_bytes(jpeg_bytes(0))
    rows = [
        {
            "question_id": 1,
            "image": "fig1.jpg",
            "text": "What is the organ in the image?\n<image>",
            "gpt4_answer": "Liver.",
        },
        {"question_id": 2, "image": "fig1.jpg", "text": "Is there a mass?", "gpt4_answer": "No."},
    ]
    (tmp_path / "llava_med_eval_qa50_qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = import_flat_vqa(
        [tmp_path / "llava_med_eval_qa50_qa.jsonl"], tmp_path / "med", tmp_path / "images", split="test"
    )
    assert [r["question"] for r in read_jsonl(tmp_path / "med/test.jsonl")] == [
        "What is the organ in the image?",
        "Is there a mass?",
    ]
    assert summary["image_markers_removed"] == 1
    rows[1]["text"] = "<image>\nCompare <image>"
    (tmp_path / "two.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match=r"two.jsonl:2: field 'text': 2 <image> markers: a record shows one image"):
        import_flat_vqa([tmp_path / "two.jsonl"], tmp_path / "two", tmp_path / "images", split="test")


def test_vlm_r1_rec_box_solutions_become_click_records_in_the_images_pixels(tmp_path):
    """VLM-R1's REC rows: `image`, `problem`, `solution` a box [x1, y1, x2, y2] in the image's
    pixels (as a list, or as text in answer tags). Each becomes a click record: `box`, its centre
    the answer, counted. A list of three numbers, a box outside the image and an object that is no
    action are refused as what they are; a text row beside them imports as text."""
    from vlft.data.importers import import_flat_vqa

    (tmp_path / "coco").mkdir()
    (tmp_path / "coco/COCO_train2014_1.jpg").write_bytes(jpeg_bytes(0))  # 96 x 64
    row = {"image": "COCO_train2014_1.jpg", "problem": "the man on the left", "normal_caption": "a man"}
    rows = [
        row | {"solution": [10, 20, 30, 40]},
        row | {"solution": "<answer>[12, 8, 40, 30]</answer>"},
        row | {"solution": [10, 20, 30]},
        row | {"solution": [10, 20, 300, 40]},
        row | {"solution": {"label": "man"}},
        row | {"solution": "<answer> a man </answer>"},
    ]
    (tmp_path / "refcoco_train.json").write_text(json.dumps(rows))
    options = dict(image_root=tmp_path / "coco", skip_bad_rows=True)
    summary = import_flat_vqa([tmp_path / "refcoco_train.json"], tmp_path / "out", **options)
    records = read_jsonl(tmp_path / "out/train.jsonl")
    assert [(r.get("box"), r["answer"]) for r in records] == [
        ([10, 20, 30, 40], "(20, 30)"),
        ([12, 8, 40, 30], "(26, 19)"),
        (None, "a man"),
    ]
    assert records[0]["question"] == "the man on the left" and records[0]["normal_caption"] == "a man"
    assert summary["click_records"] == 2 and summary["refused"] == 3
    reasons = {r["row"]: r["reason"] for r in read_jsonl(tmp_path / "out.refused.jsonl")}
    assert reasons[3].startswith("a list of 3 numbers: a place is 2 (a point) or 4 (a box's corners)")
    assert reasons[4].startswith("box [10, 20, 300, 40] (pixels) is not [x1, y1, x2, y2] of positive area inside")
    assert reasons[5] == "the answer is an object (its fields: label), not text"


def test_gui_r1_and_android_control_click_steps_become_click_records_other_actions_counted(tmp_path):
    """GUI-R1's parquet: the screenshot's bytes in `image`, `instruction`, `history` (its earlier
    steps, which its prompt shows), `gt_action`, `gt_bbox` in fractions of the image (a point or a
    box). AndroidControl's steps: an action object {action_type, x, y} in pixels. Click steps become
    click records in the image's pixels; typing, scrolling and going back are skipped, counted by
    action; a click without a place is refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlft.data.importers import import_flat_vqa

    screen = {"bytes": jpeg_bytes(1), "path": None}  # 96 x 64
    step = {"image": screen, "instruction": "Open the settings.", "gt_input_text": "no input text"}
    rows = [
        step | {"history": "", "gt_action": "click", "gt_bbox": [0.5, 0.25]},
        step | {"history": "click(0.1, 0.2)", "gt_action": "click", "gt_bbox": [0.25, 0.5, 0.5, 0.75]},
        step | {"history": "", "gt_action": "type", "gt_bbox": [-1.0, -1.0], "gt_input_text": "wifi"},
        step | {"history": "", "gt_action": "scroll", "gt_bbox": [-1.0, -1.0]},
    ]
    (tmp_path / "gui").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "gui/train-00000-of-00001.parquet")
    summary = import_flat_vqa([tmp_path / "gui/train-00000-of-00001.parquet"], tmp_path / "gui-out")
    records = read_jsonl(tmp_path / "gui-out/train.jsonl")
    assert [(r.get("point"), r.get("box"), r["answer"]) for r in records] == [
        ([48.0, 16.0], None, "(48, 16)"),
        (None, [24.0, 32.0, 48.0, 48.0], "(36, 40)"),
    ]
    assert records[1]["question"] == "Open the settings.\nPrevious actions: click(0.1, 0.2)"
    assert "history" not in records[0] and records[0]["gt_action"] == "click"
    assert summary["skipped_actions"] == {"type": 1, "scroll": 1} and summary["click_records"] == 2
    assert summary["fields"][str(tmp_path / "gui/train-00000-of-00001.parquet")]["answer"] == "gt_bbox"

    (tmp_path / "images").mkdir()
    (tmp_path / "images/step1.png").write_bytes(jpeg_bytes(2))
    steps = [
        {"image": "step1.png", "instruction": "Tap Wi-Fi.", "gt": {"action_type": "click", "x": 50, "y": 30}},
        {"image": "step1.png", "instruction": "Type wifi.", "gt": {"action_type": "input_text", "text": "wifi"}},
        {"image": "step1.png", "instruction": "Go back.", "gt": {"action_type": "navigate_back"}},
        {"image": "step1.png", "instruction": "Tap it.", "gt": {"action_type": "click"}},
    ]
    (tmp_path / "android_control_test.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    options = dict(image_root=tmp_path / "images", fields={"answer": "gt"}, skip_bad_rows=True)
    summary = import_flat_vqa([tmp_path / "android_control_test.jsonl"], tmp_path / "ac", **options)
    (record,) = read_jsonl(tmp_path / "ac/test.jsonl")
    assert (record["point"], record["answer"], record["question"]) == ([50, 30], "(50, 30)", "Tap Wi-Fi.")
    assert summary["skipped_actions"] == {"input_text": 1, "navigate_back": 1} and summary["refused"] == 1
    (refused,) = read_jsonl(tmp_path / "ac.refused.jsonl")
    assert (refused["row"], refused["field"]) == (4, "gt")
    assert refused["reason"] == "an action without a place (x and y): fields action_type"


def test_a_published_field_named_as_ours_is_kept_under_its_own_prefix(tmp_path):
    from vlft.data.importers import import_flat_vqa

    (tmp_path / "images").mkdir()
    (tmp_path / "images/a.png").write_bytes(jpeg_bytes(0))
    row = {"image": "a.png", "question": "Q?", "answer": "A", "history": "seen before", "system": "be brief"}
    (tmp_path / "test.jsonl").write_text(json.dumps(row) + "\n")
    summary = import_flat_vqa([tmp_path / "test.jsonl"], tmp_path / "out", tmp_path / "images")
    (record,) = read_jsonl(tmp_path / "out/test.jsonl")
    assert (record["published_history"], record["published_system"]) == ("seen before", "be brief")
    assert "history" not in record and "system" not in record and summary["fields_renamed"] == 2


def test_a_file_of_rows_without_answers_names_the_first_of_them(tmp_path):
    from vlft.data.importers import import_flat_vqa

    (tmp_path / "images").mkdir()
    (tmp_path / "images/a.png").write_bytes(jpeg_bytes(0))
    rows = [{"image": "a.png", "question": "Q?", "answer": ""}, {"image": "a.png", "question": "Q2?", "answer": []}]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        InputError,
        match=r"no row to import: 2 dropped without answer \(the first without answer: .*test.jsonl:1, field 'answer'\)",
    ):
        import_flat_vqa([tmp_path / "test.jsonl"], tmp_path / "out", tmp_path / "images")


def test_easyr1s_images_column_imports_its_one_embedded_image_and_no_message_carries_bytes(tmp_path):
    """EasyR1's geometry3k and verl's RL parquet: `images` a list of the Hub's {bytes, path},
    `problem` with an <image> marker, `answer`. One image: imported from its bytes; two: refused as
    two images. The chat importer, given the same column, says it holds bytes, and shows none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlft.data.importers import import_flat_vqa

    png = jpeg_bytes(3)
    rows = [
        {"images": [{"bytes": png, "path": None}], "problem": "<image>Find x.", "answer": "3"},
        {"images": [{"bytes": png, "path": None}] * 2, "problem": "<image><image>Compare.", "answer": "4"},
    ]
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data/train-00000-of-00001.parquet")
    summary = import_flat_vqa([tmp_path / "data/train-00000-of-00001.parquet"], tmp_path / "out", skip_bad_rows=True)
    (record,) = read_jsonl(tmp_path / "out/train.jsonl")
    assert (record["question"], record["answer"]) == ("Find x.", "3")
    assert (tmp_path / "out/images" / record["image"]).read_bytes() == png
    refused = read_jsonl(tmp_path / "out.refused.jsonl")
    assert summary["refused"] == 1 and "2 images: a record shows one image" in json.dumps(refused)
    (tmp_path / "images").mkdir()
    row = {"messages": [{"role": "user", "content": "<image>Find x."}, {"role": "assistant", "content": "3"}]}
    row["images"] = [{"bytes": png.decode("latin-1"), "path": None}]
    (tmp_path / "chat.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(InputError) as said:
        import_chat([tmp_path / "chat.jsonl"], tmp_path / "images", tmp_path / "chat")
    assert "chat.jsonl:1: field 'images': holds its images' bytes, not their paths" in str(said.value)
    assert "\\x" not in str(said.value)


@pytest.mark.parametrize(
    "answer, coordinates, expected",
    [
        # Qwen2-VL's own syntax: a 0-1000 grid of the image (its syntax names its family).
        (
            "<|object_ref_start|>OK<|object_ref_end|><|box_start|>(250,500),(500,750)<|box_end|>",
            None,
            {"box": [24, 32, 48, 48]},
        ),
        # Qwen3-VL's JSON, on the same grid.
        ('```json\n[{"bbox_2d": [250, 500, 500, 750], "label": "OK"}]\n```', "qwen3-vl", {"box": [24, 32, 48, 48]}),
        ('{"point_2d": [500, 500]}', "qwen3-vl", {"point": [48, 32]}),
        # Qwen2.5-VL's JSON, in pixels of the image as its processor resizes it (96x64 -> 84x56).
        ('[{"bbox_2d": [21, 28, 42, 42], "label": "OK"}]', "qwen2.5-vl", {"box": [24, 32, 48, 48]}),
        ('[{"bbox_2d": [24, 32, 48, 48]}]', "pixels", {"box": [24, 32, 48, 48]}),
    ],
)
def test_a_target_written_in_the_answer_becomes_a_click_record_in_the_images_pixels(
    tmp_path, answer, coordinates, expected
):
    chat_fixtures(tmp_path)  # a.jpg is 96 x 64
    (tmp_path / "rows.json").write_text(json.dumps([chat_row("<image>Click OK.", answer, images=["a.jpg"])]))
    summary = import_chat(
        [tmp_path / "rows.json"], tmp_path / "images", tmp_path / "out", answer_coordinates=coordinates
    )
    (record,) = read_jsonl(tmp_path / "out/train.jsonl")
    ((field, value),) = expected.items()
    assert record[field] == value and summary["grounding_rows"] == 1
    x, y = value if field == "point" else ((value[0] + value[2]) / 2, (value[1] + value[3]) / 2)
    assert record["answer"] == f"({x:g}, {y:g})" and record["question"] == "Click OK."


@pytest.mark.parametrize(
    "answer, coordinates, said",
    [
        (
            '[{"bbox_2d": [1, 2, 30, 40]}]',
            None,
            r"give --answer-coordinates \(qwen3-vl, qwen2.5-vl, qwen2-vl, pixels\)",
        ),
        ('[{"bbox_2d": [1, 2, 30, 40]}, {"bbox_2d": [5, 6, 7, 8]}]', "qwen3-vl", "writes 2 targets in 1 rounds"),
        ('[{"bbox_2d": [100, 2, 1300, 40]}]', "qwen3-vl", r"leaves the 1000x1000 it is measured in"),
    ],
)
def test_a_written_target_that_cannot_be_one_click_is_refused_saying_why(tmp_path, answer, coordinates, said):
    chat_fixtures(tmp_path)
    (tmp_path / "rows.json").write_text(json.dumps([chat_row("<image>Click OK.", answer, images=["a.jpg"])]))
    with pytest.raises(InputError, match=rf"rows.json:1: .*{said}"):
        import_chat([tmp_path / "rows.json"], tmp_path / "images", tmp_path / "out", answer_coordinates=coordinates)


def test_a_pair_whose_rejected_images_name_its_own_image_is_imported(tmp_path):
    """ms-swift writes `rejected_images` beside `images`; the same image there is the pair's one image
    (it was refused as "about other images")."""
    chat_fixtures(tmp_path)
    rows = [chat_row(images=["a.jpg"], rejected_response="A cat.", rejected_images=["a.jpg"])]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    import_chat([tmp_path / "rows.json"], tmp_path / "images", tmp_path / "out")
    [record] = read_jsonl(next((tmp_path / "out").glob("*.jsonl")))
    assert (record["image"], record["answer"], record["rejected"]) == ("a.jpg", "A polyp.", "A cat.")


def rl_layouts(root):
    """RL datasets as their publishers lay them out, at the paths the README's commands name:
    ms-swift's GRPO rows, R1-V's (CLEVR) and VLM-R1's REC rows, EasyR1's geometry3k parquet, GUI-R1's
    parquet, AndroidControl's steps (an action object) and UI-R1's rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def files(directory: str, rows, name: str):
        (root / directory / "images").mkdir(parents=True)
        (root / directory / "images/a.png").write_bytes(jpeg_bytes(5))  # 96 x 64
        text = json.dumps(rows) if name.endswith(".json") else "".join(json.dumps(r) + "\n" for r in rows)
        (root / directory / name).write_text(text)

    user = {"role": "user", "content": "<image>How many cubes?"}
    files("swift-grpo", [{"messages": [user], "images": ["a.png"], "solution": "<answer> 3 </answer>"}], "train.jsonl")
    files(
        "clevr-r1",
        [{"image": "a.png", "problem": "How many cubes?", "solution": "<answer> 3 </answer>"}],
        "train.jsonl",
    )
    files("rec", [{"image": "a.png", "problem": "the red cube", "solution": [10, 20, 30, 40]}], "refcoco_train.json")
    files(
        "android_control",
        [{"image": "a.png", "instruction": "Tap OK.", "gt": {"action_type": "click", "x": 9, "y": 8}}],
        "test.jsonl",
    )
    files(
        "UI-R1",
        [{"img_filename": "a.png", "instruction": "Tap OK.", "bbox": [1, 2, 30, 40], "action": "click"}],
        "train.json",
    )
    image = {"bytes": jpeg_bytes(6), "path": None}
    (root / "geometry3k/data").mkdir(parents=True)
    geometry = [{"images": [image], "problem": "<image>Find x.", "answer": "3"}]
    pq.write_table(pa.Table.from_pylist(geometry), root / "geometry3k/data/train-00000-of-00001.parquet")
    (root / "GUI-R1").mkdir()
    steps = [{"image": image, "instruction": "Tap OK.", "history": "", "gt_action": "click", "gt_bbox": [0.5, 0.5]}]
    pq.write_table(pa.Table.from_pylist(steps), root / "GUI-R1/train.parquet")

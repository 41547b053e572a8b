"""The peers benchmark's own logic, on the CPU: what it counts in a peer's steps, the tokenizer it
gives the peers, and the data files it writes in each peer's format. The peers themselves run on
the GPU machine only (benchmarks/README.md, "Peers")."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM, Trainer, TrainingArguments

# benchmarks/ is on the tests' path (pyproject.toml).
import peer_timer
import peers
from tests.helpers import REPO
from vlft.demo.tiny_model import make_tokenizer

VISION_START, PAD = 5, 0


class Rows(torch.utils.data.Dataset):
    """Samples of known lengths, each with one vision-start token, as a peer's encoded samples are."""

    def __init__(self, lengths):
        self.rows = [[VISION_START] + [7 + i % 20 for i in range(n - 1)] for n in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def pad_right(rows):
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    mask = (ids != PAD).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_step_timer_counts_the_samples_and_tokens_each_optimizer_step_computed(tmp_path, monkeypatch):
    init, step = Trainer.__init__, Trainer.training_step
    monkeypatch.setattr(Trainer, "__init__", init)  # restored after the test, as the timer replaces them
    monkeypatch.setattr(Trainer, "training_step", step)
    result = tmp_path / "timer.json"
    peer_timer.install(str(result), VISION_START, PAD)
    config = Qwen3Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, pad_token_id=PAD,
    )  # fmt: skip
    lengths = [3, 9, 4, 6, 5, 2, 8, 7]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    batches = []  # the micro-batches' sample lengths, in the order the steps took them

    def collate(rows):
        batches.append([len(r) for r in rows])
        return pad_right(rows)

    trainer = Trainer(model=Qwen3ForCausalLM(config), args=args, train_dataset=Rows(lengths), data_collator=collate)
    trainer.train()

    timed = json.loads(result.read_text())
    steps = [batches[0:2], batches[2:4]]  # accumulation 2: two micro-batches a step
    expected = [
        (sum(len(b) for b in step), sum(sum(b) for b in step), sum(len(b) * max(b) for b in step)) for step in steps
    ]
    assert sorted(sum(batches, [])) == sorted(lengths)  # one epoch: every sample once
    assert [(s["samples"], s["tokens"], s["computed"]) for s in timed["steps"]] == expected
    assert expected[0][2] > expected[0][1] or expected[1][2] > expected[1][1]  # padding is told apart
    assert len(timed["losses"]) == 2 and all(s["s"] > 0 for s in timed["steps"])


def test_the_peers_tokenizer_numbers_special_tokens_as_qwen_and_encodes_text_as_the_benchmarks():
    plain, numbered = make_tokenizer(), peers.qwen_numbered_tokenizer()
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>is the circle red?<|im_end|>\n"
    special = {plain.convert_tokens_to_ids(t): i for t, i in peers.QWEN_SPECIAL_IDS.items()}
    expected = [special.get(i, i) for i in plain(text)["input_ids"]]
    assert numbered(text)["input_ids"] == expected
    assert numbered.convert_tokens_to_ids("<|image_pad|>") == 151655 and numbered.pad_token_id == 151643
    assert numbered.decode(expected) == text


def test_the_peers_tokenizer_loads_back_as_a_checkpoints_does(tmp_path):
    numbered = peers.qwen_numbered_tokenizer()
    numbered.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>assistant\nthree<|im_end|>"
    assert loaded(text)["input_ids"] == numbered(text)["input_ids"]
    assert loaded.convert_tokens_to_ids("<|vision_start|>") == 151652


def test_peer_data_files_hold_every_record_in_each_peers_format(tmp_path):
    raw = peers.make_workload(tmp_path, 6, make_tokenizer(), 0, 3, True)
    records = [json.loads(line) for line in raw.read_text().splitlines()]
    swift, lf_dir = peers.write_peer_data(records, tmp_path / "images", tmp_path)

    swift_rows = [json.loads(line) for line in swift.read_text().splitlines()]
    lf_rows = json.loads((lf_dir / "bench.json").read_text())
    assert swift_rows == lf_rows and len(swift_rows) == len(records)
    for row, record in zip(swift_rows, records):
        assert row["messages"] == [
            {"role": "user", "content": "<image>" + record["question"]},
            {"role": "assistant", "content": record["answer"]},
        ]
        assert row["images"] == [str(tmp_path / "images" / record["image"])] and Path(row["images"][0]).is_file()
    entry = json.loads((lf_dir / "dataset_info.json").read_text())["bench"]
    assert entry["file_name"] == "bench.json" and entry["formatting"] == "sharegpt"
    assert entry["columns"] == {"messages": "messages", "images": "images"}
    assert entry["tags"]["user_tag"] == "user" and entry["tags"]["assistant_tag"] == "assistant"


def test_peer_pair_files_hold_every_pair_in_each_peers_preference_format(tmp_path):
    """--method dpo: ms-swift's `rejected_response` rows and LLaMA-Factory's `ranking` sharegpt rows,
    the first record of each image chosen and the second's answer rejected (dpo_speed.paired)."""
    raw = peers.make_workload(tmp_path, 4, make_tokenizer(), 0, 2, True)
    pairs, _ = peers.paired(peers.read_rows(raw))
    swift, lf_dir = peers.write_peer_data(pairs, tmp_path / "images", tmp_path)

    swift_rows = [json.loads(line) for line in swift.read_text().splitlines()]
    lf_rows = json.loads((lf_dir / "bench.json").read_text())
    assert len(swift_rows) == len(lf_rows) == len(pairs) == 2
    for swift_row, lf_row, pair in zip(swift_rows, lf_rows, pairs):
        user = {"role": "user", "content": "<image>" + pair["question"]}
        assert pair["rejected"] != pair["answer"]
        assert swift_row["messages"] == [user, {"role": "assistant", "content": pair["answer"]}]
        assert swift_row["rejected_response"] == pair["rejected"]
        assert lf_row["messages"] == [user]
        assert lf_row["chosen"] == {"role": "assistant", "content": pair["answer"]}
        assert lf_row["rejected"] == {"role": "assistant", "content": pair["rejected"]}
        assert swift_row["images"] == lf_row["images"] == [str(tmp_path / "images" / pair["image"])]
    entry = json.loads((lf_dir / "dataset_info.json").read_text())["bench"]
    assert entry["ranking"] is True
    assert entry["columns"] == {"messages": "messages", "images": "images", "chosen": "chosen", "rejected": "rejected"}


def test_the_benchmarks_caches_hold_every_record_of_the_workload(tmp_path):
    """build_caches, which the training and peers benchmarks run on the GPU, here on the CPU with the
    tiny model: a pixel and a vision cache entry for each record, as the jobs make them."""
    from transformers import AutoModelForImageTextToText

    from vlft.demo.tiny_model import make_tiny_model
    from vlft.files import read_jsonl
    from vlft.caches.image_cache import ImageCache
    from vlft.data.records import prepare_split
    from vlft.caches.vision_cache import VisionCache

    make_tiny_model(tmp_path / "model")
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "model")
    raw = peers.make_workload(tmp_path, 4, make_tokenizer(), 0, 2, True)  # two images, two questions each
    prepare_split(raw, tmp_path / "images", tmp_path / "prepared.jsonl")
    peers.build_caches(tmp_path, peers.image_processor_for(model), model, device="cpu")
    records = read_jsonl(tmp_path / "prepared.jsonl")
    pixels, vision = ImageCache(tmp_path / "pixels"), VisionCache(tmp_path / "vision")
    images = {pixels.image_of(r["id"]) for r in records}
    assert len(images) == 2 and {vision.image_of(r["id"]) for r in records} == images
    for image in images:  # the tower's output for each image: one row per merged patch group
        assert vision.tensor(image).shape[0] == pixels.num_image_tokens(image)


def test_the_grpo_benchmarks_matched_sft_step_learns_as_many_tokens_as_its_grpo_update(tmp_path):
    """benchmarks/grpo_speed.py sets a GRPO step against the image-grouped SFT step over the same
    images with answers as long as GRPO's: each matched SFT sample's learned answer is
    max_completion_length tokens (its end of turn among them), as a sampled answer that runs to the
    limit is, so that the SFT step's image groups hold the GRPO update's tokens exactly."""
    from argparse import Namespace
    from types import SimpleNamespace

    import grpo_speed
    import train_speed
    from transformers import AutoConfig

    from vlft.caches.image_cache import PixelSettings, build_image_cache
    from vlft.data.prompts import PromptBuilder, Sample
    from vlft.data.stage_data import load_stage_data
    from vlft.forward.image_groups import ImageGroup
    from vlft.training.steps import groups_in_order, image_of

    images, per_image, generations, longest = 2, 3, 4, 12
    args = Namespace(
        steps=1, max_batch_tokens=None, learning_rate=None, prompts=images * per_image, generations=generations,
        beta=0.0, questions_per_image=per_image, max_completion_length=longest,
    )  # fmt: skip
    sft, grpo = grpo_speed.stage_settings(args)
    tokenizer = grpo_speed.make_tokenizer()
    prompts, _, matched = grpo_speed.questions(tmp_path, images, per_image, generations, tokenizer, longest)
    builder = PromptBuilder(tokenizer, tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    eight_b = AutoConfig.for_model(**json.loads((REPO / "benchmarks/configs/qwen3-vl-8b.json").read_text()))
    processor = grpo_speed.image_processor_for(SimpleNamespace(config=eight_b))  # as it reads a model's
    pixels = PixelSettings.from_processor(processor, train_speed.MIN_PIXELS, train_speed.MAX_PIXELS)

    def image_groups(directory: Path, answer_format: str) -> list[list[Sample]]:
        build_image_cache(directory / "prepared.jsonl", tmp_path / "images", directory / "pixels", pixels)
        data = load_stage_data(
            [str(directory / "prepared.jsonl")], [str(directory / "pixels")], builder, {}, answer_format, 10**5
        )
        records = [{"key": key} for key in data.samples]
        return [[data.samples[r["key"]] for r in group] for group in groups_in_order(records, image_of(data.images))]

    learned = image_groups(matched, sft["answer_format"])
    assert [len(g) for g in learned] == [per_image * generations] * images
    assert {len(s.input_ids) - s.prompt_length for g in learned for s in g} == {longest}

    def at_the_limit(s: Sample, n: int) -> Sample:  # an answer at the limit, as the GRPO update learns it
        return Sample(f"{s.record_id}#{n}", s.input_ids[: s.prompt_length] + [7] * longest, [], s.prompt_length)

    asked = image_groups(prompts, grpo["answer_format"])
    drawn = [[at_the_limit(s, n) for s in group for n in range(generations)] for group in asked]
    assert [ImageGroup.of(g).tokens for g in learned] == [ImageGroup.of(g).tokens for g in drawn]

"""Conversations as the checkpoint's template renders them: a record's system prompt and history in
its prompt, the loss on its own answer, Thinking checkpoints' closed think block, and the template
found where a checkpoint keeps it."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoConfig

from vlft.data.answers import final_answer, is_correct
from vlft.errors import InputError
from vlft.files import read_jsonl, write_jsonl
from vlft.caches.image_cache import PixelSettings, build_image_cache
from vlft.modeling import load_image_processor, load_tokenizer
from vlft.data.prompts import IMAGE_PAD, PromptBuilder, conversation
from vlft.data.records import prepare_split
from vlft.data.stage_data import load_stage_data

# The shape of Qwen3-VL-*-Thinking's template (its assistant turn and generation prompt), on the
# tiny model's tokens: the generation prompt opens a think block; the last assistant turn renders
# its reasoning_content inside a closed one, earlier turns their content alone.
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{% if message['role'] == 'assistant' and loop.last %}"
    "<think>\n{{ (message.get('reasoning_content') or '').strip() }}\n</think>\n\n{{ message['content'] }}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

RECORD = {
    "id": "r3",
    "image": "a.jpg",
    "system": "You are a careful endoscopist.",
    "history": [
        {"question": "What procedure is this?", "answer": "Colonoscopy."},
        {"question": "Is there a polyp?", "answer": "Yes."},
    ],
    "question": "What color is it?",
    "answer": "The lesion is reddish. Final answer: red",
}


@pytest.fixture
def builder(tiny_model_dir):
    return PromptBuilder(load_tokenizer(tiny_model_dir), AutoConfig.from_pretrained(tiny_model_dir).image_token_id)


def test_a_record_with_history_is_prompted_as_its_whole_conversation_and_learns_its_own_answer(builder):
    sample = builder.sample("r3", RECORD, "red", num_image_tokens=4, max_seq_len=512)
    prompt = builder.tokenizer.decode(sample.input_ids[: sample.prompt_length])
    assert prompt == (
        "<|im_start|>system\nYou are a careful endoscopist.<|im_end|>\n"
        f"<|im_start|>user\n<|vision_start|>{IMAGE_PAD * 4}<|vision_end|>What procedure is this?<|im_end|>\n"
        "<|im_start|>assistant\nColonoscopy.<|im_end|>\n"
        "<|im_start|>user\nIs there a polyp?<|im_end|>\n<|im_start|>assistant\nYes.<|im_end|>\n"
        "<|im_start|>user\nWhat color is it?<|im_end|>\n<|im_start|>assistant\n"
    )
    learned = [token for token in sample.labels if token != -100]
    assert builder.tokenizer.decode(learned) == "red<|im_end|>"  # not the history's answers
    assert sample.labels[: sample.prompt_length] == [-100] * sample.prompt_length
    # Without history or system, the prompt is the one-turn prompt it always was.
    alone = {"question": RECORD["question"]}
    assert conversation(alone) == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is it?"}]}
    ]


def test_a_stage_and_an_evaluation_read_each_record_with_its_history(tmp_path, tiny_model_dir, builder):
    """load_stage_data makes the samples that training and evaluation both use: each record's
    prompt holds its own history, and its question is the last one."""
    from vlft.demo.shapes import make_dataset

    make_dataset({"train": tmp_path / "raw.jsonl"}, tmp_path / "images", {"train": 3}, seed=0)
    records = read_jsonl(tmp_path / "raw.jsonl")
    records[1]["history"] = [{"question": "How many shapes?", "answer": "Two."}]
    records[2]["system"] = "Answer briefly."
    write_jsonl(tmp_path / "raw.jsonl", records)
    prepare_split(tmp_path / "raw.jsonl", tmp_path / "images", tmp_path / "prepared.jsonl")
    pixels = PixelSettings.from_processor(load_image_processor(tiny_model_dir), 4096, 16384)
    build_image_cache(tmp_path / "prepared.jsonl", tmp_path / "images", tmp_path / "pixels", pixels)
    data = load_stage_data([str(tmp_path / "prepared.jsonl")], [str(tmp_path / "pixels")], builder, {}, "final", 512)
    prompts = [builder.tokenizer.decode(s.input_ids[: s.prompt_length]) for s in data.samples.values()]
    assert "How many shapes?<|im_end|>\n<|im_start|>assistant\nTwo.<|im_end|>" in prompts[1]
    assert prompts[1].endswith(f"{records[1]['question']}<|im_end|>\n<|im_start|>assistant\n")
    assert "How many shapes?" not in prompts[0] + prompts[2]
    assert prompts[2].startswith("<|im_start|>system\nAnswer briefly.<|im_end|>")


def test_a_thinking_template_learns_a_closed_think_block_and_is_judged_after_it(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = THINKING_TEMPLATE
    builder = PromptBuilder(tokenizer, AutoConfig.from_pretrained(tiny_model_dir).image_token_id)
    assert builder.thinking
    for target, rendered in (
        ("The lesion is reddish. Final answer: red", "The lesion is reddish.\n</think>\n\nred<|im_end|>"),
        ("red", "\n</think>\n\nred<|im_end|>"),
    ):
        sample = builder.sample("r3", RECORD, target, num_image_tokens=4, max_seq_len=512)
        assert tokenizer.decode(sample.input_ids[: sample.prompt_length]).endswith("<|im_start|>assistant\n<think>\n")
        learned = [token for token in sample.labels if token != -100]
        assert tokenizer.decode(learned) == rendered
        assert learned[-1] == builder.end_of_turn
    # What a Thinking model says is judged on what follows its think block.
    said = "It looks red, so the final answer: maybe pink\n</think>\n\nFinal answer: red"
    assert final_answer(said) == "red" and is_correct(said, RECORD["answer"])
    assert not is_correct("Final answer: red\n</think>\n\npink", RECORD["answer"])

    # A template whose assistant turn does not continue its generation prompt is refused in one sentence.
    tokenizer.chat_template = THINKING_TEMPLATE.replace("<think>\n{{ (message", "<reason>\n{{ (message")
    with pytest.raises(InputError, match="does not continue its generation prompt"):
        PromptBuilder(tokenizer, 5).sample("r3", RECORD, "red", 4, 512)


def test_the_chat_template_is_read_from_chat_template_json_where_the_tokenizer_has_none(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").unlink()
    (model / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert load_tokenizer(model).chat_template == template
    (model / "chat_template.json").unlink()
    with pytest.raises(InputError, match=r"model: has no chat template \(in tokenizer_config.json"):
        load_tokenizer(model)


# Records with history and system prompts in image groups, their losses and gradients equal to
# each computed alone (float64, three families): tests/forward/test_fast_path.py's grouped fixture.

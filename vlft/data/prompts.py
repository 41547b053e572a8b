"""Token sequences for one sample: the chat-templated prompt with its image placeholders, and the target.

A record's prompt is its conversation as the checkpoint's own chat template renders it: the
record's `system` prompt if it has one, its `history` (earlier rounds of question and answer, the
image shown with the first question), then its question and the template's generation prompt. Only
the record's own answer is learned.

Thinking checkpoints (Qwen3-VL-*-Thinking) end the generation prompt with an open `<think>`. Their
target is the assistant turn as the template renders it after that prompt: the reasoning (where the
answer has some, the text before its "Final answer:"), the closed think block, then the final
answer. Other templates' target is the answer and the end of the turn, as they render it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlft.data.answers import FINAL_ANSWER
from vlft.errors import InputError

IMAGE_PAD = "<|image_pad|>"
END_OF_TURN = "<|im_end|>"
OPEN_THINK = "<think>"


@dataclass
class Sample:
    record_id: str
    input_ids: list[int]
    labels: list[int]  # -100 on the prompt: only the answer is learned
    prompt_length: int


def conversation(record: dict) -> list[dict]:
    """A record's messages up to its question: system, the earlier rounds, the question; the image
    is a part of the first question."""
    messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    rounds = list(record.get("history") or []) + [{"question": record["question"]}]
    for n, turn in enumerate(rounds):
        question = turn["question"]
        content = [{"type": "image"}, {"type": "text", "text": question}] if n == 0 else question
        messages.append({"role": "user", "content": content})
        if "answer" in turn:
            messages.append({"role": "assistant", "content": turn["answer"]})
    return messages


class PromptBuilder:
    """Renders prompts with the checkpoint's own chat template, as its processor would."""

    def __init__(self, tokenizer, image_token_id: int):
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self.end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        probe = self._render([{"role": "user", "content": "?"}], generation_prompt=True)
        self.thinking = probe.rstrip().endswith(OPEN_THINK)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def prompt_ids(self, record: dict, num_image_tokens: int) -> list[int]:
        text = self._render(conversation(record), generation_prompt=True)
        # The template holds one placeholder per image; the model needs one per merged patch.
        text = text.replace(IMAGE_PAD, IMAGE_PAD * num_image_tokens, 1)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def answer_ids(self, record: dict, target: str) -> list[int]:
        """The target's tokens through the end of the turn, as the template renders the turn."""
        if not self.thinking:
            return self.tokenizer(target, add_special_tokens=False)["input_ids"] + [self.end_of_turn]
        parts = FINAL_ANSWER.split(target)
        reasoning, answer = ("", target) if len(parts) == 1 else (" ".join(parts[:-1]).strip(), parts[-1].strip())
        messages = conversation(record)
        prompt = self._render(messages, generation_prompt=True)
        turn = {"role": "assistant", "content": answer, "reasoning_content": reasoning}
        whole = self._render(messages + [turn], generation_prompt=False)
        if not whole.startswith(prompt) or END_OF_TURN not in whole[len(prompt) :]:
            raise InputError(
                "the checkpoint's chat template",
                "renders an assistant turn that does not continue its generation prompt, so the target cannot be cut from it",
            )
        rendered = whole[len(prompt) :].split(END_OF_TURN, 1)[0]
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"] + [self.end_of_turn]

    def sample(self, record_id: str, record: dict, target: str, num_image_tokens: int, max_seq_len: int) -> Sample:
        prompt = self.prompt_ids(record, num_image_tokens)
        answer = self.answer_ids(record, target)
        if len(prompt) + len(answer) > max_seq_len:
            raise InputError(
                f"record {record_id}",
                f"{len(prompt)} prompt and {len(answer)} answer tokens exceed max_seq_len {max_seq_len}",
            )
        return Sample(record_id, prompt + answer, [-100] * len(prompt) + answer, len(prompt))

    def mm_token_type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """1 on image tokens, 0 on text: what M-RoPE needs to place the image patches in 3-D."""
        return (input_ids == self.image_token_id).int()

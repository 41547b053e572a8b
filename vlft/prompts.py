"""Token sequences for one sample: the chat-templated prompt with its image placeholders, and the target."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlft.errors import InputError

IMAGE_PAD = "<|image_pad|>"
END_OF_TURN = "<|im_end|>"


@dataclass
class Sample:
    record_id: str
    input_ids: list[int]
    labels: list[int]  # -100 on the prompt: only the answer is learned
    prompt_length: int


class PromptBuilder:
    """Renders prompts with the checkpoint's own chat template, as its processor would."""

    def __init__(self, tokenizer, image_token_id: int):
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self.end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)

    def prompt_ids(self, question: str, num_image_tokens: int) -> list[int]:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template holds one placeholder per image; the model needs one per merged patch.
        text = text.replace(IMAGE_PAD, IMAGE_PAD * num_image_tokens, 1)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def sample(self, record_id: str, question: str, target: str, num_image_tokens: int, max_seq_len: int) -> Sample:
        prompt = self.prompt_ids(question, num_image_tokens)
        answer = self.tokenizer(target, add_special_tokens=False)["input_ids"] + [self.end_of_turn]
        if len(prompt) + len(answer) > max_seq_len:
            raise InputError(
                f"record {record_id}",
                f"{len(prompt)} prompt and {len(answer)} answer tokens exceed max_seq_len {max_seq_len}",
            )
        return Sample(record_id, prompt + answer, [-100] * len(prompt) + answer, len(prompt))

    def mm_token_type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """1 on image tokens, 0 on text: what M-RoPE needs to place the image patches in 3-D."""
        return (input_ids == self.image_token_id).int()

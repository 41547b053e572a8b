"""A tiny Qwen3-VL saved like a real checkpoint: config, weights, tokenizer, chat template, image processor.

Everything downstream loads it with from_pretrained on its directory, through the same code
that loads Qwen3-VL-8B.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlft.demo.shapes import corpus
from vlft.files import atomic_path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The Qwen chat format, images as <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the demo's texts: any text still encodes, byte by byte."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus() + ["user", "assistant", "system"], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tokenizer


def make_config(tokenizer, hidden_size: int, layers: int) -> Qwen3VLConfig:
    token = tokenizer.convert_tokens_to_ids
    head_dim = 32
    return Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": layers,
            "num_attention_heads": hidden_size // head_dim,
            "num_key_value_heads": max(1, hidden_size // head_dim // 2),
            "head_dim": head_dim,
            "max_position_embeddings": 4096,
            # M-RoPE splits the rotary half of head_dim (16) into temporal, height and width parts.
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True},
            "pad_token_id": token("<|endoftext|>"),
            "eos_token_id": token("<|im_end|>"),
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": hidden_size,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [1],
        },
        image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
    )


def make_tiny_model(output_dir: str | Path, seed: int = 0, hidden_size: int = 128, layers: int = 2) -> None:
    tokenizer = make_tokenizer()
    config = make_config(tokenizer, hidden_size, layers)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    # A pretrained head is confident; a random one at the usual 0.02 scale, behind a unit-RMS
    # norm, caps every logit near 2.5, so no adapter could fit even one answer. Scale it up.
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    processor = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=256 * 256
    )
    with atomic_path(output_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        processor.save_pretrained(tmp)

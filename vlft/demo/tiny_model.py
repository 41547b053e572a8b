"""A tiny Qwen3-VL saved like a real checkpoint: config, weights, tokenizer, chat template, image processor.

Everything downstream loads it with from_pretrained on its directory, through the same code
that loads Qwen3-VL-8B.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForImageTextToText,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2VLConfig,
    Qwen3VLConfig,
)
from transformers.models.qwen3_5 import Qwen3_5Config
from transformers.models.qwen3_vl_moe import Qwen3VLMoeConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlft.demo import screens, shapes
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
    """Byte-level BPE trained on the demo's texts (both datasets): any text still encodes, byte by byte."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(shapes.corpus() + screens.corpus() + ["user", "assistant", "system"], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tokenizer


FAMILIES = ("qwen3_vl", "qwen2_5_vl", "qwen2_vl")
# Families whose text model mixes linear-attention (Gated DeltaNet) layers with full attention: built
# here (three DeltaNet layers, then one of attention, as the released models repeat them).
HYBRID_FAMILIES = ("qwen3_5",)
# Families whose MLPs are mixtures of experts (Qwen3-VL-30B-A3B's shape, `experts_of`).
MOE_FAMILIES = ("qwen3_vl_moe",)
# Vision patch size of each family (Qwen3-VL and Qwen3.5 16 pixels, the earlier ones 14).
# The families with Qwen3-VL's vision tower (learned position embeddings) and interleaved M-RoPE.
QWEN3_VISION = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5")
PATCH_SIZE = {"qwen3_vl": 16, "qwen3_vl_moe": 16, "qwen3_5": 16, "qwen2_5_vl": 14, "qwen2_vl": 14}


def experts_of(hidden_size: int) -> dict:
    """A tiny mixture of experts' text settings: four experts as wide as the model, two a token."""
    return {"moe_intermediate_size": hidden_size, "num_experts": 4, "num_experts_per_tok": 2}


def make_config(tokenizer, hidden_size: int, layers: int, family: str = "qwen3_vl"):
    token = tokenizer.convert_tokens_to_ids
    head_dim = 32
    # M-RoPE splits the rotary half of head_dim (16) into temporal, height and width parts.
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5]}
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden_size // head_dim,
        "num_key_value_heads": max(1, hidden_size // head_dim // 2),
        "head_dim": head_dim,
        "max_position_embeddings": 4096,
        "rope_parameters": dict(rope, mrope_interleaved=True) if family in QWEN3_VISION else rope,
        "bos_token_id": token("<|endoftext|>"),
        "pad_token_id": token("<|endoftext|>"),
        "eos_token_id": token("<|im_end|>"),
    }
    vision_common = {
        "depth": 2,
        "num_heads": 2,
        "patch_size": PATCH_SIZE[family],
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        config_class = Qwen3VLMoeConfig if family in MOE_FAMILIES else Qwen3VLConfig
        text |= experts_of(hidden_size) if family in MOE_FAMILIES else {}
        vision = {
            **vision_common,
            "hidden_size": 64,
            "intermediate_size": 128,
            "out_hidden_size": hidden_size,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [1],
        }
    elif family == "qwen3_5":
        config_class = Qwen3_5Config
        text |= {
            "num_hidden_layers": 4 * max(1, layers // 2),  # each four: DeltaNet x3, then attention
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
        }
        # The released models rotate a quarter of each head's dimensions: M-RoPE splits those 8 in 2, 1, 1.
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[2, 1, 1], partial_rotary_factor=0.25)
        vision = {
            **vision_common,
            "hidden_size": 64,
            "intermediate_size": 128,
            "out_hidden_size": hidden_size,
            "num_position_embeddings": 256,
        }
    elif family == "qwen2_5_vl":
        config_class = Qwen2_5_VLConfig
        vision = {
            **vision_common,
            "hidden_size": 64,
            "intermediate_size": 128,
            "out_hidden_size": hidden_size,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        }
    elif family == "qwen2_vl":
        config_class = Qwen2VLConfig
        vision = {**vision_common, "embed_dim": 64, "hidden_size": hidden_size, "mlp_ratio": 2}
    else:
        raise ValueError(f"unknown model family {family!r}; one of {FAMILIES + HYBRID_FAMILIES + MOE_FAMILIES}")
    return config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
    )


def make_tiny_model(
    output_dir: str | Path, seed: int = 0, hidden_size: int = 128, layers: int = 2, family: str = "qwen3_vl"
) -> None:
    tokenizer = make_tokenizer()
    config = make_config(tokenizer, hidden_size, layers, family)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    # A pretrained head is confident; a random one at the usual 0.02 scale, behind a unit-RMS
    # norm, caps every logit near 2.5, so no adapter could fit even one answer. Scale it up.
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
        # Likewise a random vision tower's learned position embeddings (0.02 scale) are some 25x
        # smaller than its patch embeddings of the pixels: where a thing is would be all but lost.
        if family in QWEN3_VISION:
            model.model.visual.pos_embed.weight.mul_(25.0)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE[family], merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=256 * 256
    )
    with atomic_path(output_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        processor.save_pretrained(tmp)

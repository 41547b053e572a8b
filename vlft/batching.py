"""Micro-batches from samples: token ids padded per batch, image patches from the pixel cache.

Padding happens per micro-batch only (never to a global length), and micro-batches can be cut
to a token budget from samples of similar length, so little of each batch is padding.
"""

from __future__ import annotations

import torch

from vlft.image_cache import ImageCache
from vlft.prompts import PromptBuilder, Sample


def collate(
    samples: list[Sample],
    images: dict[str, tuple[ImageCache, str]],
    builder: PromptBuilder,
    pad_id: int,
    device: torch.device,
    dtype: torch.dtype,
    left_pad: bool = False,
    prompt_only: bool = False,
) -> dict:
    """Model inputs for a list of samples. `prompt_only` drops the answers (for generation, left-padded)."""
    sequences = [s.input_ids[: s.prompt_length] if prompt_only else s.input_ids for s in samples]
    labels = [s.labels[: s.prompt_length] if prompt_only else s.labels for s in samples]
    width = max(len(seq) for seq in sequences)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    label_ids = torch.full((len(samples), width), -100, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    for row, (seq, lab) in enumerate(zip(sequences, labels)):
        span = slice(width - len(seq), width) if left_pad else slice(0, len(seq))
        input_ids[row, span] = torch.tensor(seq)
        label_ids[row, span] = torch.tensor(lab)
        attention[row, span] = 1
    # Each image as its cache holds it: pixel patches, or the vision tower's cached outputs.
    patches, grids = [], []
    for sample in samples:
        cache, image_id = images[sample.record_id]
        patches.append(cache.model_input(image_id, device, dtype))
        grids.append(cache.grid_thw(image_id))
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention.to(device),
        "labels": label_ids.to(device),
        "mm_token_type_ids": builder.mm_token_type_ids(input_ids).to(device),
        "pixel_values": torch.cat(patches),
        "image_grid_thw": torch.tensor(grids, dtype=torch.long, device=device),
    }


def token_budget_batches(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """Split one optimizer step's samples into micro-batches of similar length, each holding at most
    `max_tokens` tokens once padded (one sample alone may exceed it).

    Long samples are grouped with long ones and short with short, so padding stays small, and
    the micro-batch grows where samples are short. The step's loss and gradient are unchanged: the
    loss is summed per token over all micro-batches of the step.
    """
    batches, current = [], []
    for sample in sorted(samples, key=lambda s: len(s.input_ids), reverse=True):
        # Sorted longest first: the first sample of a batch sets its padded width.
        width = len(current[0].input_ids) if current else len(sample.input_ids)
        if current and (len(current) + 1) * width > max_tokens:
            batches.append(current)
            current = []
        current.append(sample)
    if current:
        batches.append(current)
    return batches

"""Micro-batches from samples: token ids padded per batch, image patches from the pixel cache.

Padding happens per micro-batch only (never to a global length); another batching strategy
(packing, precomputed vision outputs) plugs in by producing the same model inputs.
"""

from __future__ import annotations

import torch

from vlft.image_cache import ImageCache, to_patches
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
    patches, grids = [], []
    for sample in samples:
        cache, image_id = images[sample.record_id]
        patches.append(to_patches(cache.pixels(image_id).to(device), cache.settings, dtype))
        grids.append(cache.grid_thw(image_id))
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention.to(device),
        "labels": label_ids.to(device),
        "mm_token_type_ids": builder.mm_token_type_ids(input_ids).to(device),
        "pixel_values": torch.cat(patches),
        "image_grid_thw": torch.tensor(grids, dtype=torch.long, device=device),
    }


def token_loss_sum(model, batch: dict) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over the answer tokens, and how many there were.

    Summing (not averaging) per micro-batch lets gradient accumulation weight every token
    equally, however the tokens fall into micro-batches.
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return loss, int((targets != -100).sum())

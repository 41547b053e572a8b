"""Micro-batches from samples: built on the host, then moved to the model's device in one go.

`collate` does all the host work (token ids padded per micro-batch, image tensors read from the
cache, M-RoPE positions, which positions carry an answer token) and touches no GPU, so the training
loop runs it for the next step in a background thread while the GPU works on this one
(`prefetched`). `to_device` then only copies, from pinned memory without waiting, and turns cached
pixels into patches on the device. Nothing in a forward pass has to wait for the host: the model
is given its positions and the loss its answer positions, where computing them on the GPU would
stop the host at every micro-batch.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, TypeVar

import torch

from vlft.caches.image_cache import ImageCache
from vlft.data.prompts import PromptBuilder, Sample

T = TypeVar("T")

# What a batch carries for the loss rather than for the model's forward pass.
# A micro-batch computed only so that every process runs as many (vlft.training.host_batches).
FILLER = "filler"
NOT_MODEL_INPUTS = ("labels", "answer_positions", "answer_targets", "answer_owners", "sample_ids", FILLER)


def collate(
    samples: list[Sample],
    images: dict[str, tuple[ImageCache, str]],
    builder: PromptBuilder,
    pad_id: int,
    left_pad: bool = False,
    prompt_only: bool = False,
    rope_index: Callable | None = None,
    pin: bool = False,
    read_images: bool = True,
    held: dict | None = None,
) -> dict:
    """A micro-batch on the host. `prompt_only` drops the answers (for generation, left-padded).
    `read_images` false leaves the images out (a sample whose image another one brings). `held`:
    images read already, by their source ((cache, image id)), taken as they are, not read again.

    With `rope_index` (the model's M-RoPE position function) a right-padded batch gets its
    positions here and no attention mask: under causal attention a real token only sees tokens
    before it, which padding at the end never is, so the mask changes nothing for them, and
    without one SDPA can use its flash kernel. `pin` puts the tensors in pinned memory, so the
    copy to a GPU does not block the host.
    """
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
    # Token t predicts token t + 1: the answer positions index the flattened (batch x width)
    # hidden states, and their targets are the next tokens.
    rows, columns = (label_ids[:, 1:] != -100).nonzero(as_tuple=True)
    sources = [images[s.record_id] for s in samples]  # (cache, image id) of each sample
    batch = {
        "input_ids": input_ids,
        "labels": label_ids,
        "mm_token_type_ids": builder.mm_token_type_ids(input_ids),
        "image_grid_thw": torch.tensor([cache.grid_thw(image_id) for cache, image_id in sources]),
        "answer_positions": rows * width + columns,
        "answer_targets": label_ids[rows, columns + 1],
        # Whose each answer position is: the sample's place in the batch (for per-sample sums).
        "answer_owners": rows,
        "sample_ids": [s.record_id for s in samples],
    }
    if rope_index is not None and not left_pad:
        batch["position_ids"] = rope_index(
            input_ids=input_ids,
            mm_token_type_ids=batch["mm_token_type_ids"],
            image_grid_thw=batch["image_grid_thw"],
            attention_mask=attention,
        )[0]
    else:
        batch["attention_mask"] = attention
    # Each image as its cache holds it (pixels, or the vision tower's outputs), with the cache
    # that knows how to turn it into model input.
    held = held or {}
    batch["images"] = (
        [
            (cache, held[cache, image_id] if (cache, image_id) in held else cache.tensor(image_id))
            for cache, image_id in sources
        ]
        if read_images
        else []
    )
    return pinned(batch) if pin else batch


def pinned(batch: dict) -> dict:
    """A host batch with its tensors (images too) in pinned memory, so that copies to a GPU do not block."""
    moved = {key: value.pin_memory() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    moved["images"] = [(cache, tensor.pin_memory()) for cache, tensor in batch["images"]]
    return moved


def host_to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`, the host not waiting for the device: a blocking copy waits for
    everything queued before it (a reward stage queues its passes without gradients before its
    update, whose layers the host then launches meanwhile). From pinned memory the copy runs
    beside the host; from pageable memory it goes through a staging buffer at once, so the tensor
    may go right after."""
    return tensor.to(device, non_blocking=True)


def to_device(batch: dict, device: torch.device, dtype: torch.dtype, placed: dict | None = None) -> dict:
    """Model inputs (and answer positions and targets) on the device; non-blocking from pinned memory.
    `placed`: the images put on the device already, by their host tensor's id (several batches that
    share an image's host tensor share its one copy on the device too; the host tensors must live
    as long as `placed` is used, so that no id is taken by another tensor)."""
    moved = {
        key: host_to_device(value, device) if isinstance(value, torch.Tensor) else value
        for key, value in batch.items()
        if key != "images"
    }
    placed = {} if placed is None else placed
    for cache, tensor in batch["images"]:
        if id(tensor) not in placed:
            placed[id(tensor)] = cache.device_input(host_to_device(tensor, device), dtype)
    images = [placed[id(tensor)] for _, tensor in batch["images"]]
    moved["pixel_values"] = images[0] if len(images) == 1 else torch.cat(images)
    return moved


def prefetched(items: Iterator[T]) -> Iterator[T]:
    """The items of an iterator, each produced in a background thread while the caller uses the one before."""
    end = object()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(next, items, end)
        while (item := pending.result()) is not end:
            pending = pool.submit(next, items, end)
            yield item


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

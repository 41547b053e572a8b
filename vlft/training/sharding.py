"""A stage's frozen base sharded across its processes (`parallelism: shard`), rather than whole in each.

Each decoder layer of the language model (nearly all of a Qwen-VL's weights) is sharded with torch's
own FSDP2 (`fully_shard`): a process holds 1/N of each layer's frozen weights, all-gathers a layer's
just before its forward (and again for the backward to the layer's inputs) and frees them after.
The adapter is left out of the sharding (`ignored_params`): LoRA's few MB stay whole in every
process, their gradients summed by vlft.jobs.distributed as a replicated stage's are, so the
optimizer, the gradient clipping and the checkpoints are the replicated stage's, untouched: a
checkpoint saved by a sharded stage resumes on any number of processes, sharded or not. The
embeddings, the head, the final norm and the vision tower stay whole: the forward reaches them
outside their modules' own calls (the head's weight, the embedding of image tokens), and together
they are a few percent of the weights.

Every all-gather is a collective: each process must run every sharded layer's forward and
backward as many times as the others. A step's micro-batches are shared out by tokens, so one
process may have fewer (or none); the batcher pads such a share with filler micro-batches
(vlft.training.host_batches), computed with no weight: their gradients are exact zeros.
"""

from __future__ import annotations

import torch

from vlft import parallelism
from vlft.errors import ConfigError
from vlft.jobs.distributed import Group
from vlft.modeling import unwrapped


def decoder_layers(model) -> list[torch.nn.Module]:
    """The language model's decoder layers, whatever the family (Qwen2-VL to Qwen3.5)."""
    return list(unwrapped(model).model.language_model.layers)


def shard_frozen_base(model, group: Group, device: torch.device) -> None:
    """Shard each decoder layer's frozen weights across the job's processes, in place; each layer's
    all-gather for its forward is started as the layer before it computes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (group.size,))
    trainable = {p for p in model.parameters() if p.requires_grad}
    language_model = unwrapped(model).model.language_model
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, ignored_params=trainable & set(layer.parameters()))
    # The language model, holding nothing sharded of its own (its embeddings, its norm), as the layers'
    # root: they share its streams and lazy setup, so that each layer's all-gather can be started
    # ahead, as the layer before it computes.
    in_layers = {p for layer in layers for p in layer.parameters()}
    fully_shard(language_model, mesh=mesh, ignored_params=set(language_model.parameters()) - in_layers)
    for layer, following in zip(layers, layers[1:]):
        layer.set_modules_to_forward_prefetch([following])


def shards_the_base(setting: str, model_dir: str, settings, device: torch.device, group: Group) -> bool:
    """Whether a stage whose resources.parallelism is `setting` shards its frozen base across its
    processes (vlft.parallelism), decided with this GPU's memory and said once."""
    gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    try:
        choice = parallelism.chosen(setting, settings, group.size, parallelism.weight_bytes(model_dir), gpu)
    except ValueError as error:
        raise ConfigError(f"resources.parallelism: shard: {error}") from None
    if group.is_main and group.size > 1:
        held = "sharded across" if choice == "shard" else "whole in each of"
        print(f"parallelism {setting}: the frozen base {held} the {group.size} processes", flush=True)
    return choice == "shard"


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(layer, FSDPModule) for layer in decoder_layers(model))

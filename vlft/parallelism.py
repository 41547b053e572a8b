"""Whether a stage of several processes shards its frozen base or replicates it (`resources.parallelism`).

`replicate`: each process holds the whole model (vlft.jobs.distributed); `shard`: each holds 1/N of
its decoder layers' weights (vlft.jobs.sharding); `auto`, the default: shard where the base's
weights would take more than half of one GPU's memory (the rest is for the step's activations),
replicate otherwise, and always where the stage uses a path sharding does not support yet. Which
one runs changes no result (the same steps, to rounding): it is a resource, and changing it reruns
nothing. The plan decides with `planning.device`'s memory for the dry run; the training job decides
again with its own GPU's.
"""

from __future__ import annotations

from pathlib import Path

CHOICES = ("auto", "shard", "replicate")
# Of one GPU's memory, the most the base's weights may take in each process before `auto` shards them.
REPLICATED_SHARE = 0.5


def unsharded_paths(settings) -> list[str]:
    """The stage's settings that a sharded base does not support (yet), each as its key and why."""
    paths = []
    if settings["method"] == "grpo":
        paths.append("method: grpo (its rollouts generate with the whole model in each process)")
    if settings["quantization_bit"]:
        paths.append("quantization_bit (a 4-bit base's weights are bitsandbytes tensors, which FSDP2 does not shard)")
    if settings["eval_every"]:
        paths.append("eval_every (the evaluation during training answers in the main process alone)")
    if settings["max_batch_tokens"] == "auto":
        paths.append("max_batch_tokens: auto (it measures one process's memory with the whole model in it)")
    return paths


def chosen(setting: str, settings, processes: int, weight_bytes: float | None, gpu_bytes: float | None) -> str:
    """`shard` or `replicate` for a stage of `processes` processes whose `resources.parallelism` is
    `setting`. `weight_bytes`: the base's weights (None: not known); `gpu_bytes`: one GPU's memory
    (None: no GPU). Raises ValueError with the sentence's reason where `shard` is asked for a stage
    that cannot shard."""
    if setting == "shard":
        if paths := unsharded_paths(settings):
            raise ValueError(f"a sharded base does not support {'; nor '.join(paths)}: give parallelism: replicate")
        return "shard" if processes > 1 else "replicate"
    if setting == "replicate" or processes == 1 or unsharded_paths(settings):
        return "replicate"
    if weight_bytes is None or gpu_bytes is None:
        return "replicate"
    return "shard" if weight_bytes > REPLICATED_SHARE * gpu_bytes else "replicate"


def weight_bytes(model_dir: str | Path) -> float | None:
    """The base's weights as its checkpoint stores them (its safetensors files), or None where the
    checkpoint is not on disk yet (a model the run fetches)."""
    files = list(Path(model_dir).glob("*.safetensors"))
    return float(sum(f.stat().st_size for f in files)) if files else None

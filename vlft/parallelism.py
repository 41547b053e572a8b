"""Whether a stage of several processes shards its frozen base or replicates it (`resources.parallelism`).

`replicate`: each process holds the whole model (vlft.jobs.distributed); `shard`: each holds 1/N of
its decoder layers' weights (vlft.training.sharding); `auto`, the default: shard where the base's
weights would take more than half of one GPU's memory (the rest is for the step's activations),
replicate otherwise, and always where the stage uses a path sharding does not support yet. Which
one runs changes no result (the same steps, to rounding): it is a resource, and changing it reruns
nothing. The plan decides with `planning.device`'s memory for the dry run, and prices the stage's
processes (`Layout`); the training job decides again with its own GPU's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CHOICES = ("auto", "shard", "replicate")
# Of one GPU's memory, the most the base's weights may take in each process before `auto` shards them.
REPLICATED_SHARE = 0.5


def unsharded_paths(settings) -> list[str]:
    """The stage's settings that a sharded base does not support (yet), each as its key and why. A
    sharded layer gathers its weights from every process at each of its calls, so every process must
    call it as often as the others: generation, whose decode steps follow each process's own answers,
    does not."""
    paths = []
    if settings["method"] == "grpo":
        paths.append("method: grpo (each process decodes its rollouts' answers for as many steps as they take)")
    if settings["quantization_bit"]:
        paths.append("quantization_bit (a 4-bit base's weights are bitsandbytes tensors, which FSDP2 does not shard)")
    if settings["eval_every"]:
        paths.append("eval_every (each process decodes its share's answers for as many steps as they take)")
    if settings["max_batch_tokens"] == "auto":
        paths.append("max_batch_tokens: auto (it measures one process's memory with the whole model in it)")
    return paths


def shard_refused(settings) -> str | None:
    """Why a stage cannot shard its base, in a sentence's second half; None where it can."""
    if paths := unsharded_paths(settings):
        return f"a sharded base does not support {'; nor '.join(paths)}: give parallelism: replicate, or auto"
    return None


def chosen(setting: str, settings, processes: int, weight_bytes: float | None, gpu_bytes: float | None) -> str:
    """`shard` or `replicate` for a stage of `processes` processes whose `resources.parallelism` is
    `setting`. `weight_bytes`: the base's weights (None: not known); `gpu_bytes`: one GPU's memory
    (None: no GPU). Raises ValueError with the sentence's reason where `shard` is asked for a stage
    that cannot shard."""
    if setting == "shard":
        if problem := shard_refused(settings):
            raise ValueError(problem)
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


# Across nodes, what one GPU sends to the others: a 400 Gb/s (NDR) InfiniBand adapter a GPU, as H100
# and H200 nodes are commonly built.
INTER_NODE_GB_S = 50


@dataclass(frozen=True)
class Layout:
    """A training job's processes: how many, on how many nodes, and whether they shard the frozen base
    (vlft.parallelism), all-gathering its decoder layers' `layer_bytes` over links of `link_gb_s` a GPU
    (vlft/devices.csv)."""

    processes: int = 1
    nodes: int = 1
    sharded: bool = False
    layer_bytes: float = 0.0
    link_gb_s: float = 0.0

    def priced(self, seconds: float, steps: float, rows: float) -> tuple[float, str]:
        """A stage's `seconds` of one GPU's work over its `steps` spread over the processes (`rows`: each
        process's micro-batches a step), and what the prediction says of it."""
        shared = seconds / self.processes
        where = f"{self.processes} processes" + (f" on {self.nodes} nodes" if self.nodes > 1 else "")
        if not self.sharded:
            return shared, f"; {where}, the base replicated, the steps' work shared out (not yet measured on GPUs)"
        link = INTER_NODE_GB_S if self.nodes > 1 else self.link_gb_s
        # Each micro-batch all-gathers every layer twice (for its forward and its backward), (N-1)/N of
        # it from the others; each layer's gather starts as the layer before computes, so the slower
        # of the two sets the time.
        gathered = 2 * rows * steps * self.layer_bytes * (self.processes - 1) / self.processes
        moving = gathered / (link * 1e9) if link else 0.0
        said = f"{gathered / 1e9:,.0f} GB all-gathered at {link:g} GB/s a GPU"
        return max(shared, moving), f"; {where}, the base sharded ({said}; not yet measured on GPUs)"

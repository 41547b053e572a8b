"""The reference of a preference stage: the log-probability of every pair's two answers under the
stage's starting weights (the base with the adapter it starts from, or the base with a fresh
adapter, which changes nothing yet), computed once before the first step (TRL's
`precompute_ref_log_probs`) rather than by a second model at every step.

Computed with the very model the stage trains, before a checkpoint is restored into it and with
dropout off, laid out as training lays pairs out (each pair's prompt once; with image groups each
image once), its micro-batches shared out among data-parallel processes. Kept in the run
directory, so a resumed stage, or a retry after a time limit, reads them instead.
"""

from __future__ import annotations

import json
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch

from vlft.data.stage_data import StageData
from vlft.files import write_json
from vlft.jobs import distributed
from vlft.forward.batching import FILLER, prefetched, to_device
from vlft.forward.loss import answer_logps
from vlft.forward.image_groups import pair_group
from vlft.training.steps import groups_in_order, image_of

REFERENCE_FILE = "reference_logps.json"


def reference_logps(
    model, data: StageData, image_groups: bool, batcher, path: Path, forward_context, device, dtype, group
) -> dict[str, tuple[float, float]]:
    """By record key: the starting weights' log-probabilities of its chosen and rejected answers,
    read from `path` where a run computed them for these very records, else computed and kept there."""
    if path.exists() and (kept := read_kept(path, group.is_main)) is not None:
        if set(kept) == {r["key"] for r in data.records}:
            return {key: tuple(pair) for key, pair in kept.items()}
    computed = pair_logps(model, data, image_groups, batcher, forward_context, device, dtype, group)
    if group.is_main:
        write_json(path, {"logps": computed, "crc32": checksum(computed)})
    return computed


def checksum(logps: dict) -> str:
    """CRC-32 of the log-probabilities as JSON writes them (exact: floats round-trip)."""
    return f"{zlib.crc32(json.dumps(logps, sort_keys=True).encode()):08x}"


def read_kept(path: Path, say: bool) -> dict | None:
    """The kept log-probabilities where the file is whole and matches the checksum written with them;
    else None (they are computed again), said in one line: a value edited in the file would change
    every step's loss and the final adapter, silently."""
    try:
        kept = json.loads(path.read_text())
        logps, recorded = kept["logps"], kept["crc32"]
        problem = None if checksum(logps) == recorded else "its values differ from the checksum written with them"
    except (OSError, ValueError, KeyError, TypeError) as error:
        problem = f"cannot be read whole ({type(error).__name__}: {error}), or is of an earlier version"
    if problem is None:
        return logps
    if say:
        print(f"{path}: {problem}: the reference is computed again", flush=True)
    return None


def pair_logps(
    model, data: StageData, image_groups: bool, batcher, forward_context, device, dtype, group
) -> dict[str, tuple[float, float]]:
    """By record key: the model's log-probabilities of its chosen and rejected answers, as it stands
    (no dropout), laid out as training lays pairs out; every process gets all of them."""
    by_group = image_of(data.images) if image_groups else (lambda record: record["key"])
    groups = [pair_group(data, [r["key"] for r in records]) for records in groups_in_order(data.records, by_group)]
    keys, logps = [], []
    with without_dropout(model), forward_context:
        # Each micro-batch laid out in a background thread while the GPU computes the one before;
        # the values are read back once at the end, so the GPU never waits for the host to read them.
        for host_batch in prefetched(batcher.each(groups)):
            computed = answer_logps(model, to_device(host_batch, device, dtype)).detach()
            if not host_batch.get(FILLER):  # a filler's pairs are another process's (vlft.training.sharding)
                logps.append(computed)
                keys += host_batch["sample_ids"][0::2]
    values = torch.cat(logps).tolist() if logps else []
    computed = {key: (values[2 * n], values[2 * n + 1]) for n, key in enumerate(keys)}
    if group.size > 1:
        computed = {key: pair for share in distributed.gathered(computed) for key, pair in share.items()}
    return computed


def has_dropout(model) -> bool:
    """Whether any part of the model drops anything in training mode: a dropout module or a
    configured dropout rate (attention's is a config value, not a module)."""
    configs = [model.config, *(value for value in vars(model.config).values() if hasattr(value, "to_dict"))]
    rates = [v for c in configs for k, v in vars(c).items() if "dropout" in k and isinstance(v, (int, float))]
    modules = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    return any(rate > 0 for rate in rates + modules)


@contextmanager
def without_dropout(model):
    """Dropout off for a pass whose gradients are not wanted. Where the model has no dropout to turn
    off, the pass keeps training's module and grad modes: torch.compile guards on both, so the
    forward is then the one the training step compiles (one compile a stage, not two; seconds
    on the 8B) and computes what step 1's forward computes. Its autograd graph goes with each
    micro-batch's output. Otherwise: eval mode without gradients."""
    if not has_dropout(model):
        yield
        return
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train()

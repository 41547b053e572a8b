"""Training checkpoints: adapter weights, optimizer, schedule and RNG state, saved atomically.

They live outside the workflow's declared outputs (Snakemake deletes those when a job fails),
under a directory named by a fingerprint of everything the stage computes from, so a rerun
after a kill resumes, and a rerun after a change starts over.

Nothing in them is pickled: tensors go to safetensors files and everything else to JSON, so that
loading a checkpoint runs no code whatever its files hold (a `torch.load` of a replaced file
would). A checkpoint is complete when its `state.json` exists, written last; one that cannot be
read whole is set aside with one sentence naming the file, and the run resumes from the one before.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from vlft.integrity import file_checksum
from vlft.files import atomic_path, remove_inside

COMPLETE = "state.json"  # written last inside the checkpoint; its presence marks it complete
ADAPTER = "adapter.safetensors"
TENSORS = "state.safetensors"  # the optimizer's moments, the random generators' states, the method's
METHOD = "method."  # the prefix of the method's own tensors in TENSORS
OLDER_FORMAT = "state.pt"  # a pickle, of versions before this one: never loaded
KEEP = 2


def fingerprint(settings: dict, files: list[str | Path]) -> str:
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for path in files:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def step_of(checkpoint: Path) -> int:
    """The step a checkpoint was saved after, from its name."""
    return int(checkpoint.name.removeprefix("step-"))


def complete(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    return sorted(p.parent for p in run_dir.glob(f"step-*/{COMPLETE}"))


def latest(run_dir: Path) -> Path | None:
    saved = complete(run_dir)
    return saved[-1] if saved else None


def older_format(run_dir: Path) -> list[Path]:
    """Checkpoints of an earlier version (pickled), which are not loaded."""
    return sorted(p.parent for p in run_dir.glob(f"step-*/{OLDER_FORMAT}") if not (p.parent / COMPLETE).exists())


def save(run_dir: Path, step: int, model, optimizer, scheduler, method_tensors: dict | None = None) -> Path:
    """A checkpoint after `step`; `method_tensors`: the training method's own state, if any."""
    target = run_dir / f"step-{step:08d}"
    with atomic_path(target) as tmp:
        tmp.mkdir(parents=True)
        save_file(get_peft_model_state_dict(model), tmp / ADAPTER)
        tensors, state = state_dicts(optimizer, scheduler)
        tensors |= {METHOD + name: t.detach().contiguous().cpu() for name, t in (method_tensors or {}).items()}
        save_file(tensors, tmp / TENSORS)
        # Each file's CRC-32, checked when the checkpoint is read (`readable`): a file altered in place
        # loads as tensors of another value, and a resumed stage would train on from them.
        checksums = {name: file_checksum(tmp / name) for name in (ADAPTER, TENSORS)}
        (tmp / COMPLETE).write_text(json.dumps({"step": step, "crc32": checksums} | state))
    for old in sorted(run_dir.glob("step-*"))[:-KEEP]:
        remove_inside(old, run_dir)
    return target


def restore(checkpoint: Path, model, optimizer, scheduler) -> int:
    """Load a checkpoint into the live objects; returns the step it was taken after."""
    state = json.loads((checkpoint / COMPLETE).read_text())
    tensors = load_file(checkpoint / TENSORS)
    set_peft_model_state_dict(model, load_file(checkpoint / ADAPTER, device=str(model.device)))
    optimizer.load_state_dict(_optimizer_state(state["optimizer"], tensors))
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(tensors["rng.torch"])
    cuda = sorted((k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
    if cuda:
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    np.random.set_state((state["numpy"][0], tensors["rng.numpy"].numpy().astype(np.uint32), *state["numpy"][1:]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    return state["step"]


def method_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The training method's own state a checkpoint keeps (empty for most)."""
    tensors = load_file(checkpoint / TENSORS)
    return {name[len(METHOD) :]: t for name, t in tensors.items() if name.startswith(METHOD)}


def readable(checkpoint: Path) -> str | None:
    """Why a complete checkpoint cannot be loaded (a file cut short, overwritten, or altered in place),
    or None. One of an earlier version, which recorded no checksums, is only loaded whole."""
    try:
        recorded = json.loads((checkpoint / COMPLETE).read_text()).get("crc32", {})
        for name in (ADAPTER, TENSORS):
            if name in recorded and file_checksum(checkpoint / name) != recorded[name]:
                return f"{name}: its content differs from the checksum in {COMPLETE}"
            load_file(checkpoint / name)
    except (OSError, ValueError, SafetensorError) as error:
        return f"{error}"
    return None


def state_dicts(optimizer, scheduler) -> tuple[dict[str, torch.Tensor], dict]:
    """What a checkpoint keeps besides the adapter: tensors (the optimizer's state, the random
    generators') apart from everything else (JSON)."""
    tensors, per_param = {}, {}
    optimizer_state = optimizer.state_dict()
    for index, values in optimizer_state["state"].items():
        per_param[str(index)] = {}
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{name}"] = value.detach().contiguous().cpu()
            else:
                per_param[str(index)][name] = value
    tensors["rng.torch"] = torch.get_rng_state()
    for i, rng in enumerate(torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []):
        tensors[f"rng.cuda.{i}"] = rng
    kind, keys, position, has_gauss, cached = np.random.get_state()
    tensors["rng.numpy"] = torch.from_numpy(keys.astype(np.int64))
    state = {
        "optimizer": {"state": per_param, "param_groups": optimizer_state["param_groups"]},
        "scheduler": scheduler.state_dict(),
        "numpy": [kind, int(position), int(has_gauss), float(cached)],
        "python": random.getstate(),
    }
    return tensors, state


def _optimizer_state(saved: dict, tensors: dict[str, torch.Tensor]) -> dict:
    state = {}
    for index, values in saved["state"].items():
        state[int(index)] = dict(values)
    for key, tensor in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = tensor
    return {"state": state, "param_groups": saved["param_groups"]}


def truncate_log(path: Path, last_step: int) -> None:
    """Drop a running log's lines past the resumed step: they belong to work that is being redone."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))

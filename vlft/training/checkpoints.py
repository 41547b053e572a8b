"""Training checkpoints: adapter weights, optimizer, schedule and RNG state, saved atomically.

They live outside the workflow's declared outputs (Snakemake deletes those when a job fails),
under a directory named by a fingerprint of everything the stage computes from, so a rerun
after a kill resumes, and a rerun after a change starts over.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from vlft.files import atomic_path, remove_inside

COMPLETE = "state.pt"  # written last inside the checkpoint; its presence marks it complete
KEEP = 2


def fingerprint(settings: dict, files: list[str | Path]) -> str:
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for path in files:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def step_of(checkpoint: Path) -> int:
    """The step a checkpoint was saved after, from its name."""
    return int(checkpoint.name.removeprefix("step-"))


def latest(run_dir: Path) -> Path | None:
    complete = sorted(p.parent for p in run_dir.glob(f"step-*/{COMPLETE}"))
    return complete[-1] if complete else None


def save(run_dir: Path, step: int, model, optimizer, scheduler) -> Path:
    target = run_dir / f"step-{step:08d}"
    with atomic_path(target) as tmp:
        tmp.mkdir(parents=True)
        save_file(get_peft_model_state_dict(model), tmp / "adapter.safetensors")
        state = {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
        }
        torch.save(state, tmp / COMPLETE)
    for old in sorted(run_dir.glob("step-*"))[:-KEEP]:
        remove_inside(old, run_dir)
    return target


def restore(checkpoint: Path, model, optimizer, scheduler) -> int:
    """Load a checkpoint into the live objects; returns the step it was taken after."""
    set_peft_model_state_dict(model, load_file(checkpoint / "adapter.safetensors", device=str(model.device)))
    state = torch.load(checkpoint / COMPLETE, map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    return state["step"]


def truncate_log(path: Path, last_step: int) -> None:
    """Drop a running log's lines past the resumed step: they belong to work that is being redone."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))

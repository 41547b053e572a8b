"""The model families this version trains, by the `model_type` of a checkpoint's config.json.

A checkpoint of another family is refused when the config is read, in one sentence: its layers may
load and train without a word while our packed rows, image groups or decode cache compute them
wrong (a Qwen3.5 checkpoint did exactly that before its hybrid layers were handled), which is worse
than not running at all. A family joins the list once every rule has run on a tiny model of it
and the per-family tests (tests/forward/test_fast_path.py) hold for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Family:
    name: str  # as its publisher writes it
    coordinates: str  # what a box or point in its answers is measured in (vlft.data.clicks)


FAMILIES = {
    "qwen3_vl": Family("Qwen3-VL", "relative"),
    "qwen3_vl_moe": Family("Qwen3-VL (MoE)", "relative"),
    "qwen2_5_vl": Family("Qwen2.5-VL", "absolute"),
    "qwen2_vl": Family("Qwen2-VL", "relative"),
    # Its text model's Gated DeltaNet layers (vlft.forward.linear_attention); its vision tower and
    # grounding (0-1000 of the image, as Qwen3-VL's) are Qwen3-VL's.
    "qwen3_5": Family("Qwen3.5 / Qwen3.6", "relative"),
}

# Families known and not trained yet: their name, and why not, said instead of the list alone.
NOT_YET = {
    "qwen3_5_moe": (
        "Qwen3.5 / Qwen3.6 (MoE)",
        "its experts beside the Gated DeltaNet layers have not run through these rules yet; "
        "the dense Qwen3.5 / Qwen3.6 models (qwen3_5) train",
    ),
}


def family_problem(config_json: str | Path) -> str | None:
    """Why the checkpoint whose config.json this is cannot be trained here (said of the file), or None."""
    model_type = json.loads(Path(config_json).read_text()).get("model_type")
    if model_type in FAMILIES:
        return None
    trained = ", ".join(f"{f.name} ({t})" for t, f in FAMILIES.items())
    if model_type in NOT_YET:
        name, reason = NOT_YET[model_type]
        return (
            f"names model_type '{model_type}' ({name}), which this version does not train yet: "
            f"{reason}; the families it trains are {trained}"
        )
    return f"names model_type '{model_type}', a family this version does not know; the families it trains are {trained}"

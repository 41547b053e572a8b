"""What a stage trained, by part of the model (language model, vision tower, merger, LoRA adapter): each
tensor's checksum at the stage's start and at its end, so that a part meant to stay frozen that
moved, or a trained part none of whose tensors changed, is said in one sentence. Peers' users met
both silently: a vision-language model's mergers trained while its tower was "frozen"
(LLaMA-Factory PR #9399), and a tower "unfrozen" whose weights never changed
(2U1/Qwen-VL-Series-Finetune#115). The summary holds the census (`trained_parts`) and its
sentences (`trained_parts_problems`); the report shows both.

A tensor's checksum is the sum of its bits read as integers of its width, taken on its own
device a chunk at a time: any update that changes a value changes it, but for changes that
cancel exactly, which an optimizer's step does not make.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The parts, in the order a reader meets them in the report.
PARTS = ("language model", "vision tower", "merger", "LoRA adapter", "vision LoRA adapter")

# Elements a checksum reads at once: a bounded int64 copy, whatever the tensor's size.
CHUNK = 1 << 24

_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def part_of(name: str) -> str:
    """The part a parameter belongs to, by its name in a Qwen-VL model (PEFT-wrapped or not)."""
    if "lora_" in name:  # the language model's adapter, or the tower's (`vision_lora`)
        return "vision LoRA adapter" if "visual." in name else "LoRA adapter"
    if "merger" in name:  # the merger, and Qwen3-VL's DeepStack mergers
        return "merger"
    if "visual." in name:
        return "vision tower"
    return "language model"


def checksum(tensor: torch.Tensor) -> int:
    """The sum of the tensor's bits read as integers of its element's width."""
    flat = tensor.detach().reshape(-1)
    bits = flat.view(_INTEGERS[flat.element_size()])
    return sum(int(bits[i : i + CHUNK].to(torch.int64).sum()) for i in range(0, bits.numel(), CHUNK))


def checksums(model) -> dict[str, int]:
    return {name: checksum(p) for name, p in model.named_parameters()}


# What every stage trains: its LoRA adapter, the rest frozen unless its settings say (trained_by).
TRAINED_BY_SETTINGS = ("LoRA adapter",)


def trained_by(settings) -> tuple[str, ...]:
    """The parts a stage's settings train: its adapter, the tower's LoRA (`vision_lora`), the
    mergers (`train_merger`: PEFT's trained copy of each; the original stays as it was)."""
    return (
        TRAINED_BY_SETTINGS
        + ("vision LoRA adapter",) * settings["vision_lora"]
        + ("merger",) * settings["train_merger"]
    )


@dataclass
class Census:
    """The stage's starting checksums (`start`), compared with the model at its end (`finish`)
    against the parts its settings train (`trained`)."""

    before: dict[str, int]
    trained: tuple[str, ...] = TRAINED_BY_SETTINGS

    @classmethod
    def start(cls, model, trained: tuple[str, ...] = TRAINED_BY_SETTINGS) -> "Census":
        return cls(checksums(model), trained)

    def finish(self, model) -> dict:
        """The summary's `trained_parts` (by part: tensors changed and unchanged, whether the
        settings train it) and `trained_parts_problems` (a sentence each)."""
        parts: dict[str, dict] = {}
        for name, value in checksums(model).items():
            part = part_of(name)
            counts = parts.setdefault(part, {"changed": 0, "unchanged": 0, "trained": part in self.trained})
            counts["changed" if value != self.before[name] else "unchanged"] += 1
        problems = []
        for name in PARTS:
            part = parts.get(name)
            if part is None:
                continue
            tensors = part["changed"] + part["unchanged"]
            if part["trained"] and not part["changed"]:
                problems.append(f"the {name} was trained, yet none of its {tensors} tensors changed")
            if not part["trained"] and part["changed"]:
                problems.append(f"the {name} was frozen, yet {part['changed']} of its {tensors} tensors changed")
        ordered = {name: parts[name] for name in PARTS if name in parts}
        return {"trained_parts": ordered, "trained_parts_problems": problems}

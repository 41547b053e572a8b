"""How the generation engine chooses each next token from its logits.

A sampler takes the logits of the rows a step computes (rows x vocabulary) and gives each row's
next token. It runs inside the decode step, which a GPU captures as a CUDA graph: it must keep to
tensor operations on the device, with any per-row state (a sampled answer's seed and position, so
that a resumed run draws what an uninterrupted one would) held in tensors the engine updates in
place, as it does the rows' tokens and positions. Evaluation answers greedily; sampled answers
(temperature, top-p, top-k) for reward-driven stages go here beside it.
"""

from __future__ import annotations

from typing import Callable

import torch

Sampler = Callable[[torch.Tensor], torch.Tensor]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of each row: the answers `generate` gives with do_sample=False."""
    return logits.argmax(-1)

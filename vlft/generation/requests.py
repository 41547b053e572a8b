"""What the generation engine is asked to answer: a request, one prompt as model inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Request:
    key: int  # the caller's name for the answer
    # One sample as model inputs (input_ids 1 x L, pixel_values, ...): its prompt, and where it is
    # scored, the reference answer after it.
    inputs: dict
    positions: torch.Tensor  # its M-RoPE positions (3 x 1 x L)
    max_new_tokens: int
    image: str | None = None  # the image's id in its cache: prompts on one image share its prefix
    image_tokens: int = 0  # the image's tokens in the prompt: what a prompt after one on its image costs less
    prompt_length: int | None = None  # where the prompt ends in `inputs`; None: all of it
    # Scored (the validation loss, in the same forward as the prompt's prefill): the positions of
    # `inputs` whose next token is a reference answer token, and those tokens.
    loss_positions: torch.Tensor | None = None
    loss_targets: torch.Tensor | None = None
    seed: int = 0  # what a sampled answer is drawn with (vlft.generation.sampling); greedy ones need none

    @property
    def prompt(self) -> int:
        return self.inputs["input_ids"].shape[1] if self.prompt_length is None else self.prompt_length


def asks_again(request: Request, before: Request) -> bool:
    """Whether `request` asks the very prompt of the request `before` it (made from the same
    inputs, as a reward stage's answers to one question are), unscored: a prefill computes it once
    for both (vlft.generation.runner.prefill), so it adds no tokens to one (the scheduler's count)."""
    return (
        request.inputs is before.inputs
        and request.positions is before.positions
        and request.prompt == before.prompt
        and request.loss_targets is None
        and before.loss_targets is None
    )

"""How the generation engine chooses each next token from its logits: greedily (evaluation), or drawn
from the softmax (sampled answers, as reward-driven stages need them).

A sampler chooses the first answer token of each prompt a prefill computes (`first`) and the next
token of each row a decode step computes (`next`). The decode step runs inside a CUDA graph on a GPU,
so `next` keeps to tensor operations on the device, and any per-row state lives in tensors the
engine updates in place (`start`, `move`), as it does the rows' tokens and positions.

A sampled token's randomness is a hash of (its prompt's seed, its position in the answer, the
token), not a generator's state (vlft.generation.sampling.draw_tokens): a prompt draws the same
answer in any batch, row or order, and a resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of each row: the answers `generate` gives with do_sample=False."""
    return logits.argmax(-1)


class Greedy:
    """Evaluation's sampler: the most likely token, no state (and no log-probabilities kept)."""

    logps = None

    def first(self, logits: torch.Tensor, requests: list) -> torch.Tensor:
        return greedy(logits)

    def next(self, logits: torch.Tensor) -> torch.Tensor:
        return greedy(logits)

    def start(self, slots: torch.Tensor, requests: list, positions: torch.Tensor) -> None:
        pass

    def move(self, source: int, target: int) -> None:
        pass


@dataclass(frozen=True)
class Sampling:
    """How sampled answers are drawn, under the names transformers, TRL and ms-swift give them:
    `temperature` (0: greedy), `top_k` (0: every token), `top_p` (1.0: every token)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Tokens never drawn: an image's placeholders and markers, which no answer can hold (a sampled
    # one would ask the next forward for an image that is not there).
    never: tuple[int, ...] = ()


def image_markers(config) -> tuple[int, ...]:
    """The ids of the tokens that stand for or around an image or a video in a Qwen-VL prompt."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return tuple(sorted({getattr(config, n) for n in names if getattr(config, n, None) is not None}))


class Seeded:
    """Sampled answers, each prompt with its own seed (`Request.seed`). A row's seed and the text
    position of its answer's first token are set when it gets a prompt; a decode step reads how far
    each answer has come from the step's own text positions (`positions`, bound by the engine), so
    a step changes no state of the sampler's (a CUDA graph's warm-up runs the step three times).

    Each drawn token's log-probability under the model (`drawn_logps`) is kept: the first tokens'
    of a prefill in `first_logps`, each row's latest in `logps` (written by the step, within its
    CUDA graph), so that a reward stage can measure how far its update's lie from them
    (vlft.training.mismatch)."""

    def __init__(self, settings: Sampling, slots: int, positions: torch.Tensor):
        self.settings, self.positions = settings, positions
        self.seeds = torch.zeros(slots, dtype=torch.long, device=positions.device)
        self.first_positions = torch.zeros(slots, dtype=torch.long, device=positions.device)
        self.logps = torch.zeros(slots, dtype=torch.float64, device=positions.device)
        self.first_logps = self.logps[:0]
        # A GPU's decode step adds the noise and takes the argmax compiled (the same arithmetic,
        # fused): eagerly, the noise of every row over the whole vocabulary is some 25 elementwise
        # kernels over int64 and float64 tensors, a tenth of the 8B's step (benchmarks/README.md).
        self.noise_and_argmax = gumbel_max_compiled() if positions.is_cuda else gumbel_max

    def first(self, logits: torch.Tensor, requests: list) -> torch.Tensor:
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.long, device=logits.device)
        tokens = draw_tokens(logits, seeds, torch.zeros_like(seeds), self.settings)
        self.first_logps = drawn_logps(logits, tokens)
        return tokens

    def next(self, logits: torch.Tensor) -> torch.Tensor:
        rows = logits.shape[0]
        # The step's input is the row's latest token, at answer index positions - first_positions:
        # it predicts the token one further.
        index = self.positions[:rows] - self.first_positions[:rows] + 1
        tokens = draw_tokens(logits, self.seeds[:rows], index, self.settings, self.noise_and_argmax)
        self.logps[:rows].copy_(drawn_logps(logits, tokens))
        return tokens

    def start(self, slots: torch.Tensor, requests: list, positions: torch.Tensor) -> None:
        """Rows `slots` answer `requests`, each one's first answer token (already drawn) at its text
        position of `positions`."""
        self.seeds[slots] = torch.tensor([r.seed for r in requests], dtype=torch.long, device=self.seeds.device)
        self.first_positions[slots] = positions

    def move(self, source: int, target: int) -> None:
        for state in (self.seeds, self.first_positions):
            state[target] = state[source]


def sampler_for(sampling: Sampling | None, slots: int, positions: torch.Tensor):
    """Greedy where `sampling` is None or at temperature 0, else seeded draws."""
    if sampling is None or sampling.temperature == 0:
        return Greedy()
    return Seeded(sampling, slots, positions)


def drawn_logps(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's drawn token's log-probability under the model's own softmax (not the warped one
    it was drawn from): what the update computes of the same token (vlft.forward.loss), in float64."""
    return torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, None])[:, 0]


def warped_logits(logits: torch.Tensor, settings: Sampling) -> torch.Tensor:
    """The logits sampled from: divided by the temperature, then all but the `top_k` largest and
    then all outside the nucleus of `top_p` set to -inf (the order and the ties transformers'
    TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper give; tests/generation/test_sampling.py)."""
    scaled = logits / settings.temperature
    for token in settings.never:  # a fill of one column each: tensor operations a CUDA graph replays
        scaled[..., token] = float("-inf")
    if settings.top_k:
        kth = torch.topk(scaled, min(settings.top_k, scaled.shape[-1])).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if settings.top_p < 1.0:
        ascending, order = torch.sort(scaled, descending=False)
        outside = ascending.softmax(-1).cumsum(-1) <= 1 - settings.top_p
        outside[..., -1] = False  # the most likely token stays
        scaled = scaled.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return scaled


def sampling_probabilities(logits: torch.Tensor, settings: Sampling) -> torch.Tensor:
    """The distribution each token is drawn from."""
    return warped_logits(logits, settings).softmax(-1)


def draw_tokens(
    logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, settings: Sampling, noise_and_argmax=None
) -> torch.Tensor:
    """Each row's next token drawn from its warped softmax, by the Gumbel-max trick: the argmax of
    the warped logits plus Gumbel noise is a draw from their softmax. The noise of a row's token v
    is a hash of (the row's seed, the answer's position, v), not a generator's state, so a draw
    depends on its prompt's seed and position alone: the same in any batch, row or order, in a
    CUDA graph (tensor operations only) and after a restart. At temperature 0, the greedy token.
    `noise_and_argmax`: what computes the last part (`gumbel_max`, or it compiled)."""
    if settings.temperature == 0:
        return greedy(logits)
    return (noise_and_argmax or gumbel_max)(warped_logits(logits.double(), settings), seeds, positions)


def gumbel_max(warped: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The argmax of the warped logits plus each row's Gumbel noise (`draw_tokens`)."""
    vocabulary = torch.arange(warped.shape[-1], device=warped.device)
    gumbel = -torch.log(-torch.log(uniform(seeds, positions, vocabulary)))
    return (warped + gumbel).argmax(-1)


@functools.cache
def gumbel_max_compiled():
    """`gumbel_max` compiled for one shape a decode step (its rows and the vocabulary), as the step's
    layers are. (Not the top-p's sort and cumulative sum: inductor failed to generate the float64
    scan's kernel.) Compiled when first asked for, never at import: torch.compile called while this
    module was imported initialized the CUDA driver, and a warm process that has done so
    cannot fork jobs (vlft.jobs.warm_start; tests/jobs/test_warm_start.py holds every preloaded module to it)."""
    return torch.compile(gumbel_max, dynamic=False)


MASK32 = 0xFFFFFFFF


def uniform(seeds: torch.Tensor, positions: torch.Tensor, vocabulary: torch.Tensor) -> torch.Tensor:
    """rows x vocabulary numbers in (0, 1), each of 53 random bits: two 32-bit hashes of (seed,
    position, token) (lowbias32, a bijective integer hash), in int64 arithmetic on any device."""
    base = _mix32(_mix32(seeds & MASK32) ^ ((seeds >> 32) & MASK32))
    base = _mix32(base ^ (positions & MASK32))[:, None]
    high = _mix32(base ^ vocabulary[None, :])
    low = _mix32(high ^ 0x9E3779B9)
    return ((high & 0x1FFFFF) * 2.0**32 + low.double() + 0.5) / 2.0**53


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Chris Wellons' integer hash) on int64 tensors holding 32-bit values: a product may
    wrap past 2^63, which keeps its low 32 bits, all that the mask keeps."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)

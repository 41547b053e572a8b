"""Sampled answers (vlft.generation.sampling): each token drawn from the softmax of its row's logits
(after temperature, top-k and top-p, as transformers' warpers apply them), with randomness that is
a function of the prompt's seed and the token's position alone: the same draws whatever the batch,
the row or the restart; greedy at temperature 0."""

from __future__ import annotations

import math

import pytest
import torch

from vlft.generation.sampling import Sampling, draw_tokens, greedy, gumbel_max_compiled, sampling_probabilities


def test_temperature_zero_is_greedy_token_for_token():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    seeds, positions = torch.arange(16), torch.zeros(16, dtype=torch.long)
    assert torch.equal(draw_tokens(logits, seeds, positions, Sampling(temperature=0.0)), greedy(logits))
    # top-k of 1 is greedy at any temperature
    assert torch.equal(draw_tokens(logits, seeds, positions, Sampling(temperature=1.0, top_k=1)), greedy(logits))


def test_a_draw_depends_on_its_seed_and_position_alone():
    """Rows permuted, batched with others or alone, run again: each (seed, position) draws the same
    token; another seed or position draws independently."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 40, generator=generator)
    seeds = torch.tensor([3, 3, 5, 7, 11, 13, 17, 19])
    positions = torch.tensor([0, 1, 0, 4, 2, 9, 0, 1])
    settings = Sampling(temperature=1.3, top_p=0.95, top_k=30)
    tokens = draw_tokens(logits, seeds, positions, settings)
    assert torch.equal(draw_tokens(logits, seeds, positions, settings), tokens)
    order = torch.randperm(8, generator=generator)
    assert torch.equal(draw_tokens(logits[order], seeds[order], positions[order], settings), tokens[order])
    for row in range(8):
        alone = draw_tokens(logits[row : row + 1], seeds[row : row + 1], positions[row : row + 1], settings)
        assert alone.item() == tokens[row].item()
    # Over many seeds the draws differ (a flat distribution of 40 tokens).
    flat = torch.zeros(200, 40)
    many = draw_tokens(flat, torch.arange(200), torch.zeros(200, dtype=torch.long), Sampling(temperature=1.0))
    assert len(set(many.tolist())) > 30


@pytest.mark.parametrize(
    "settings",
    [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=4), Sampling(temperature=1.5, top_p=0.8)],
    ids=["plain", "top-k", "top-p"],
)
def test_draws_follow_the_softmax_they_sample_from(settings):
    """20,000 draws on a vocabulary of 6 (each a distinct (seed, position)): the share of each token
    is within 5 standard errors of its probability under the warped softmax, and tokens outside
    top-k / top-p never come. (A share p of n draws has standard error sqrt(p(1-p)/n) <= 0.0035
    here: 5 of them, 0.018, fail a wrong temperature or an off-by-one in the nucleus.)"""
    n = 20_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    expected = sampling_probabilities(logits, settings)
    assert expected.sum().item() == pytest.approx(1.0)
    seeds = torch.arange(n) // 4
    positions = torch.arange(n) % 4
    drawn = draw_tokens(logits.expand(n, -1), seeds, positions, settings)
    shares = torch.bincount(drawn, minlength=6).double() / n
    for token in range(6):
        p = expected[token].item()
        if p == 0:
            assert shares[token] == 0, token
        else:
            assert abs(shares[token].item() - p) <= 5 * math.sqrt(p * (1 - p) / n), (token, shares[token].item(), p)


def test_the_warped_softmax_is_transformers_own():
    """Temperature, then top-k, then top-p, as `generate(do_sample=True)` applies its warpers."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for temperature, top_k, top_p in [(0.7, 5, 0.9), (1.3, 0, 0.5), (1.0, 12, 1.0)]:
        warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
        if top_k:
            warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))
        theirs = torch.softmax(warpers(None, logits.clone()), dim=-1)
        ours = sampling_probabilities(logits, Sampling(temperature=temperature, top_k=top_k, top_p=top_p))
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-15)


def test_tokens_never_drawn_are_not_drawn_however_likely_and_the_rest_keep_their_odds():
    """`never` (a GRPO rollout's image markers): those tokens get no probability, whatever their
    logits; the others' odds are unchanged."""
    logits = torch.tensor([[5.0, 0.0, 1.0, 4.0]], dtype=torch.float64)
    settings = Sampling(temperature=1.0, never=(0, 3))
    probabilities = sampling_probabilities(logits, settings)
    assert probabilities[0, 0] == 0 and probabilities[0, 3] == 0
    assert probabilities[0, 2] / probabilities[0, 1] == pytest.approx(math.e)
    seeds = torch.arange(500)
    drawn = draw_tokens(logits.expand(500, -1), seeds, torch.zeros_like(seeds), settings)
    assert set(drawn.tolist()) == {1, 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled draw runs in a GPU's decode step")
@pytest.mark.parametrize(
    "settings",
    [Sampling(1.0), Sampling(0.7, top_p=0.9), Sampling(1.3, top_k=50, never=(3, 7))],
)
def test_the_compiled_draw_draws_the_eager_draws_tokens(settings):
    """A GPU's decode step adds the noise and takes the argmax compiled: over 64 rows of a Qwen-sized vocabulary,
    at several answer positions, it draws the eager draw's tokens, every one (the same integer
    hash and float64 arithmetic, element by element)."""
    torch.manual_seed(0)
    logits = torch.randn(64, 151_936, device="cuda", dtype=torch.bfloat16) * 4
    seeds = torch.randint(0, 2**62, (64,), device="cuda")
    for position in range(0, 40, 7):
        positions = torch.full((64,), position, device="cuda")
        eager = draw_tokens(logits, seeds, positions, settings)
        compiled = draw_tokens(logits, seeds, positions, settings, gumbel_max_compiled())
        assert torch.equal(compiled, eager), position

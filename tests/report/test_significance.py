"""The report's statistics against values computed by hand or published."""

import math

import pytest

from vlft.significance import paired_p_value, wilson_interval


def test_wilson_interval_matches_its_formula_and_published_values():
    # Newcombe (1998), Table I, example (81 of 263): 0.2553 to 0.3662 (the score method without correction).
    low, high = wilson_interval(81, 263)
    assert (round(low, 4), round(high, 4)) == (0.2553, 0.3662)
    # All right of 10: the upper end is 1, the lower n / (n + z^2).
    low, high = wilson_interval(10, 10)
    assert high == pytest.approx(1.0, abs=4e-16) and low == pytest.approx(10 / (10 + 1.959963984540054**2))
    assert all(math.isnan(v) for v in wilson_interval(0, 0))


def test_the_paired_p_value_is_the_exact_mcnemar_test_on_the_samples_answered_differently():
    # 10 samples answered differently, the first right on 9 of them: 2 * P(X <= 1) with X ~ Bin(10, 1/2).
    first = {i: i < 9 for i in range(10)} | {i: True for i in range(10, 20)}
    second = {i: i >= 9 for i in range(10)} | {i: True for i in range(10, 20)}
    assert paired_p_value(first, second) == pytest.approx(2 * (1 + 10) / 2**10)
    # The same answers right: no difference at all, whatever the accuracies' noise.
    assert paired_p_value(first, dict(first)) == 1.0
    # 2 against 1 of 3: as likely as not.
    assert paired_p_value({0: True, 1: True, 2: False}, {0: False, 1: False, 2: True}) == 1.0
    assert paired_p_value({"a": True}, {"b": True}) is None

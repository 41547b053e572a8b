"""How far an accuracy can be trusted: the interval it lies in, and whether two stages' accuracies
on the same samples differ by more than chance.

- `wilson_interval`: the 95% Wilson score interval of k right of n (sound at small n and near 0
  or 1, where the normal approximation's is not).
- `paired_p_value`: the exact McNemar test of two evaluations on the same samples: of the samples
  they answer differently, how likely a split at least this lopsided is if either were as likely to
  be the one that is right (two-sided binomial with p = 1/2). It uses the pairing: two stages that
  are right on the same samples differ by nothing, however their accuracies compare to the noise of
  one evaluation.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile


def wilson_interval(right: int, n: int, z: float = Z95) -> tuple[float, float]:
    if n == 0:
        return float("nan"), float("nan")
    p = right / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_p_value(first: dict, second: dict) -> float | None:
    """Exact McNemar p of two evaluations' {sample id: right} on their common samples; None where
    they share none."""
    common = [k for k in first if k in second and first[k] is not None and second[k] is not None]
    if not common:
        return None
    only_first = sum(bool(first[k]) and not second[k] for k in common)
    only_second = sum(bool(second[k]) and not first[k] for k in common)
    differ = only_first + only_second
    if differ == 0:
        return 1.0
    tail = sum(math.comb(differ, k) for k in range(min(only_first, only_second) + 1)) / 2**differ
    return min(1.0, 2 * tail)

"""Confidence intervals and paired tests for the study's accuracy tables (binary outcomes per case).

- accuracy: exact (Clopper-Pearson) binomial interval, ``scipy.stats.binomtest(...).proportion_ci("exact")``;
- paired difference of two accuracies on the same cases: Newcombe's hybrid score interval
  (Newcombe 1998, Statistics in Medicine 17:2635, method 10), built from the two Wilson score
  intervals and the continuity-corrected phi correlation of the paired outcomes; unlike a
  bootstrap it stays honest when no case is discordant (the interval is then not the point 0);
- paired test: the exact McNemar test (two-sided binomial test of the discordant pairs at 1/2).
"""
from __future__ import annotations

import math

import numpy as np
from scipy.stats import binomtest

LEVEL = 0.95


def accuracy_interval(successes: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval of a binomial proportion."""
    _check_counts(successes, n)
    ci = binomtest(successes, n).proportion_ci(confidence_level=level, method="exact")
    return float(ci.low), float(ci.high)


def wilson_interval(successes: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion."""
    _check_counts(successes, n)
    ci = binomtest(successes, n).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def paired_difference(x, y, level: float = LEVEL) -> dict:
    """Accuracy ``x`` minus accuracy ``y`` on the same cases (bool arrays): estimate, interval, McNemar p.

    Returns ``{"diff", "low", "high", "x_only", "y_only", "p_mcnemar"}`` where ``x_only`` counts the
    cases only ``x`` got right. The interval is Newcombe's method 10.
    """
    x, y = np.asarray(x, dtype=bool), np.asarray(y, dtype=bool)
    if x.shape != y.shape or x.ndim != 1 or not len(x):
        raise ValueError(f"x and y must be non-empty 1-d outcome arrays of one length, got {x.shape} and {y.shape}")
    n = len(x)
    a, b = int(np.sum(x & y)), int(np.sum(x & ~y))
    c, d = int(np.sum(~x & y)), int(np.sum(~x & ~y))
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n, level)
    l2, u2 = wilson_interval(a + c, n, level)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    # phi with Newcombe's continuity correction (AD - BC shrunk by n/2 when positive): without it,
    # few discordant pairs give phi near 1 and an interval of about zero width around 0
    excess = a * d - b * c
    if excess > 0:
        excess = max(excess - n / 2, 0.0)
    phi = excess / math.sqrt(margins) if margins else 0.0
    diff = p1 - p2
    low = diff - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    high = diff + math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    p_value = binomtest(b, b + c, 0.5).pvalue if b + c else 1.0
    return {"diff": diff, "low": max(-1.0, low), "high": min(1.0, high), "x_only": b, "y_only": c,
            "p_mcnemar": float(p_value)}


def _check_counts(successes: int, n: int) -> None:
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got successes={successes}, n={n}")

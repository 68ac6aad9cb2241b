"""Upper confidence bounds on the mean of [0, 1] samples (registry SCB; spec mirror ``witcert.spec.spot_check``).

Published results, NOT proved in Lean (registry SCB names the sources):

* betting: Waudby-Smith & Ramdas (2023, JRSS-B), predictable plug-in bets, one-sided. If
  ``E X >= m`` the capital ``K(m) = prod_i (1 + lambda_i (m - X_i))`` is a nonnegative
  supermartingale of mean <= 1, so ``P(K(m) >= 1/delta) <= delta``; ``K`` increases in ``m``, so
  every ``m`` with ``K(m) >= 1/delta`` is above the mean on the complementary event;
* empirical Bernstein: Maurer & Pontil (2009), Theorem 4.

Assumptions: i.i.d. draws (with replacement) from a distribution fixed before the draw, values in
``[0, 1]``. Computed in fp64 on at most a few hundred samples; the capital test keeps a margin
(``LOG_MARGIN``) so a rounded ``log K`` never accepts an ``m`` the exact one rejects.
"""
import math

import torch

BETTING_CAP = 0.5
"""Largest bet: every capital factor ``1 + lambda (m - X)`` stays >= 1/2 for X, m in [0, 1]."""
GRID_POINTS = 257
"""Values of ``m`` per round of the betting bound's search (two rounds: resolution ``256^-2``)."""
LOG_MARGIN = 1e-9
"""Required excess of the fp64 ``log K(m)`` over ``log(1/delta)``: far above the rounding of a
sum of a few hundred ``log1p`` terms of magnitude <= 1."""


def _check(xs: torch.Tensor, delta: float) -> torch.Tensor:
    if not 0 < delta < 1:
        raise ValueError(f"delta: expected a probability in (0, 1), got {delta!r}")
    x = xs.detach().to(torch.float64).reshape(-1)
    if x.numel() and not bool(((x >= 0) & (x <= 1)).all()):
        raise ValueError("xs: every sample must lie in [0, 1] (the bounds need bounded values)")
    return x


def empirical_bernstein_upper(xs: torch.Tensor, delta: float) -> float:
    """Maurer & Pontil (2009), Thm 4: ``mean + sqrt(2 V ln(2/delta)/n) + 7 ln(2/delta)/(3(n-1))``, at most 1."""
    x = _check(xs, delta)
    n = x.numel()
    if n < 2:
        return 1.0
    log_term = math.log(2 / delta)
    var = float(x.var(unbiased=True))
    bound = float(x.mean()) + math.sqrt(2 * var * log_term / n) + 7 * log_term / (3 * (n - 1))
    return min(1.0, bound * (1 + 1e-12) + 1e-15)  # round up past the fp64 evaluation


def betting_lambdas(x: torch.Tensor, delta: float) -> torch.Tensor:
    """Predictable bets ``min(sqrt(2 ln(1/delta) / (n sigma^2_{i-1})), BETTING_CAP)`` (spec ``betting_lambdas``)."""
    n = x.numel()
    seen = torch.arange(1, n + 1, dtype=torch.float64)  # (n,) samples seen after draw i
    mu = (0.5 + torch.cumsum(x, 0)) / (seen + 1)  # running means mu_i
    squares = 0.25 + torch.cumsum((x - mu) ** 2, 0)  # 1/4 + sum_{j<=i} (X_j - mu_j)^2
    before = torch.cat([torch.tensor([0.25], dtype=torch.float64), squares[:-1]])  # uses draws < i only
    sigma2 = before / seen
    return torch.clamp(torch.sqrt(2 * math.log(1 / delta) / (n * sigma2)), max=BETTING_CAP)


def betting_upper(xs: torch.Tensor, delta: float) -> float:
    """Smallest grid ``m`` with ``log K(m) >= log(1/delta) + LOG_MARGIN``; 1 if none (spec ``betting_upper``).

    Two vectorized rounds over ``GRID_POINTS`` values of ``m`` (the second inside the first's
    bracket) instead of a bisection; the answer is an accepted ``m``, within ``GRID_POINTS^-2`` of
    the smallest one.
    """
    x = _check(xs, delta)
    if x.numel() == 0:
        return 1.0
    lambdas = betting_lambdas(x, delta)[:, None]  # (n, 1)
    threshold = math.log(1 / delta) + LOG_MARGIN
    lo, hi = 0.0, 1.0
    for _ in range(2):
        grid = torch.linspace(lo, hi, GRID_POINTS, dtype=torch.float64)  # (G,)
        accepted = torch.log1p(lambdas * (grid[None, :] - x[:, None])).sum(0) >= threshold  # K increases in m
        if not bool(accepted.any()):
            return hi  # 1 in the first round; the previous round accepted hi
        first = int(accepted.to(torch.int8).argmax())
        hi = float(grid[first])
        if first == 0:
            return hi
        lo = float(grid[first - 1])
    return hi


def mean_upper(xs: torch.Tensor, delta: float) -> float:
    """Upper bound on the mean of ``[0, 1]`` samples at level ``delta``: min(betting, EB) at ``delta/2`` each."""
    return min(betting_upper(xs, delta / 2), empirical_bernstein_upper(xs, delta / 2))


def signed_mean_interval(ys: torch.Tensor, delta: float) -> tuple[float, float]:
    """``(lo, hi)`` for the mean of ``[-1, 1]`` samples; each side fails with probability ``<= delta``."""
    y = ys.detach().to(torch.float64).reshape(-1)
    hi = 2 * mean_upper((1 + y) / 2, delta) - 1
    lo = 1 - 2 * mean_upper((1 - y) / 2, delta)
    return lo, hi

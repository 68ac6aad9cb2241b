"""Upper confidence bounds on the mean of [0, 1] samples (registry SCB; spec mirror ``witcert.spec.spot_check``).

Published results, NOT proved in Lean (registry SCB names the sources):

* betting: Waudby-Smith & Ramdas (2023, JRSS-B), predictable plug-in bets, one-sided. If
  ``E X >= m`` the capital ``K(m) = prod_i (1 + lambda_i (m - X_i))`` is a nonnegative
  supermartingale of mean <= 1, so ``P(K(m) >= 1/delta) <= delta``; ``K`` increases in ``m``, so
  every ``m`` with ``K(m) >= 1/delta`` is above the mean on the complementary event;
* empirical Bernstein: Maurer & Pontil (2009), Theorem 4.

Assumptions: i.i.d. draws (with replacement) from a distribution fixed before the draw, values in
``[0, 1]``. The betting bound is also valid at a stopping time (Ville's inequality bounds the
capital's supremum over every sample size): the one-sided estimator draws until a number of
*distinct* keys has been read, and its bets use the planned count ``planned`` in place of ``n``
(any constant keeps the bets predictable). The empirical Bernstein bound needs a fixed ``n``.

Computed in fp64 on at most a few hundred samples; the capital test keeps a margin
(``LOG_MARGIN``) so a rounded ``log K`` never accepts an ``m`` the exact one rejects.
"""
import math

import torch


BETTING_CAP = 0.9
"""Largest ``lambda (1 - m)`` by default: every capital factor ``1 + lambda (m - X)`` stays >= 0.1 for X in [0, 1]."""
ONE_SIDED_CAP = 0.99
"""The cap of the one-sided estimator's bets: factors >= 0.01. Its variables sit near one end of their
range with a small spread, where the width is set by the largest bet (on SmolLM2 int4 cells 0.99
reads coverage 0.454 -> 0.473 against 0.9)."""
GRID_CELLS = 256
"""Cells of ``[0, 1]`` in the betting bound's search: its resolution."""
LOG_MARGIN = 1e-9
"""Required excess of the fp64 ``log K(m)`` over ``log(1/delta)``: far above the rounding of a sum of
up to ``2^14`` terms ``log(1 + z)``, ``1 + z >= 0.01``, each off by less than ``1.2e-14``."""


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


def betting_lambdas(x: torch.Tensor, delta: float, planned: int | None = None) -> torch.Tensor:
    """Predictable plug-in bets ``sqrt(2 ln(1/delta) / (n sigma^2_{i-1}))`` before the cell's cap (spec ``betting_lambdas``).

    ``n`` is ``planned`` when given (a constant fixed before the draws, for a stopped sequence),
    else the number of samples.
    """
    n = x.numel() if planned is None else planned
    valid = torch.ones(1, x.numel(), dtype=torch.bool)
    return row_lambdas(x.reshape(1, -1), valid, torch.tensor([float(delta)]), torch.tensor([float(n)]))[0]


def row_lambdas(x: torch.Tensor, valid: torch.Tensor, delta: torch.Tensor, planned: torch.Tensor) -> torch.Tensor:
    """:func:`betting_lambdas` of every row of ``x`` (R, T) at once, each over its valid prefix ``valid`` (R, T);
    ``delta`` and ``planned`` (R,) per row. 0 past a row's prefix."""
    seen = torch.cumsum(valid, -1).to(torch.float64).clamp(min=1.0)  # samples seen after draw i
    xv = torch.where(valid, x, 0.0)
    mu = (0.5 + torch.cumsum(xv, -1)) / (seen + 1)  # running means mu_i
    squares = 0.25 + torch.cumsum(torch.where(valid, (xv - mu) ** 2, 0.0), -1)  # 1/4 + sum_{j<=i} (X_j - mu_j)^2
    before = torch.cat([torch.full_like(squares[:, :1], 0.25), squares[:, :-1]], dim=-1)  # uses draws < i only
    sigma2 = before / seen
    lambdas = torch.sqrt(2 * torch.log(1 / delta)[:, None] / (planned[:, None] * sigma2))
    return torch.where(valid, lambdas, 0.0)


def betting_upper(xs: torch.Tensor, delta: float, cap: float = BETTING_CAP, planned: int | None = None) -> float:
    """Upper confidence bound from cell-wise bets on a grid of ``m`` (spec ``betting_upper``).

    The grid ``m_j = j / GRID_CELLS`` splits ``[0, 1]`` into cells ``(m_{j-1}, m_j]``. In cell ``j``
    the bets are ``min(plug-in, cap / (1 - m_{j-1}))``: fixed across the cell, so every
    factor ``1 + lambda (m - X) >= 1 - cap > 0`` and ``K_j(m)`` increases in ``m``; its
    value at ``m_{j-1}`` is its minimum over the cell. The bound is ``m_{j*-1}`` for the first cell
    ``j*`` from which every cell has ``log K_j(m_{j-1}) >= log(1/delta) + LOG_MARGIN`` (1 if the last
    cell does not). If the mean lies in a cell ``j >= j*``, the capital of that cell's bets at the
    mean is ``>= 1/delta``, an event of probability ``<= delta``; by Ville's inequality also when
    the sample size is a stopping time, with ``planned`` (a constant) in the bets. Found by a two-level grid
    search (:func:`row_betting_upper`).
    """
    x = _check(xs, delta)
    if not 0 < cap < 1:
        raise ValueError(f"cap: expected a number in (0, 1), got {cap!r}")
    if x.numel() == 0:
        return 1.0
    n = x.numel() if planned is None else planned
    valid = torch.ones(1, x.numel(), dtype=torch.bool)
    return float(row_betting_upper(x.reshape(1, -1), valid, torch.tensor([float(delta)]), torch.tensor([float(n)]),
                                   cap)[0])


def row_betting_upper(x: torch.Tensor, valid: torch.Tensor, delta: torch.Tensor, planned: torch.Tensor,
                      cap: float) -> torch.Tensor:
    """:func:`betting_upper` of every row of ``x`` (R, T) over its valid prefix, in one grid search (R,) fp64.

    ``L_j = log K_j(m_j) = sum_i log(1 + b_ij (m_j - X_i))`` at ``m_j = j / GRID_CELLS``, ``b_ij = min(lambda_i, cap /
    (1 - m_j))``, is non-decreasing in ``j``: each ``b(m) (m - X)`` is (for ``m >= X`` a product of non-negative
    non-decreasing factors; for ``m < X``, ``-min(lambda (X - m), cap (X - m) / (1 - m))`` with both non-increasing in
    ``m``). So the rejected grid points (``L_j >= log(1/delta) + LOG_MARGIN``) are those from the first rejected one
    up, and the bound is that point ``j* / G`` (1 when none is rejected, 0 when all are). Small inputs (``R T <=
    GRID_SEARCH_MOST``) are searched on the grid: the capital of every row at every ``GRID_STRIDE``-th point at once
    (one ``(R, G / GRID_STRIDE, T)`` evaluation), then at the ``GRID_STRIDE - 1`` points below the first coarse point
    rejected (a second one), no loop per step; larger ones by bisection (``log2 G + 1`` evaluations of ``(R, T)``: 3.5x
    less arithmetic, which wins once the per-step overhead is small beside it). Both find the same first rejected
    point. Wherever fp64 breaks the monotonicity by a rounding,
    the point found is rejected by ``LOG_MARGIN`` (so by the exact capital too) and every point above it is by the
    exact monotone ``L``: the bound is still valid. Rows without a valid sample give 1.

    Always eager, whatever ``WITCERT_COMPILE`` says: torch 2.13's inductor miscompiled the search's step from a
    reduction to its use, in two forms and on two vector ISAs (an ``argmax`` then ``gather`` read its index before
    forming it on AVX-512 for single rows; a masked minimum gave other first points than eager under AVX2 code), and
    a wrong first point is a wrong bound. Compiling it measured no faster at the few cells of a gate's or an
    audit's check (8.7 against 7.9 ms per call).
    """
    cap_t = torch.tensor(float(cap), dtype=torch.float64)
    search = _grid_search if x.numel() <= GRID_SEARCH_MOST else _bisection
    return search(x.to(torch.float64), valid, delta.to(torch.float64), planned.to(torch.float64), cap_t)


GRID_SEARCH_MOST = 4096
"""Most samples (``R T``) searched on the grid; bisection above (measured, one thread: the grid wins at ``9 x 300``,
bisection at ``9 x 2000`` and ``288 x 300``)."""
GRID_STRIDE = 16
"""Grid points between the first search's points: ``GRID_CELLS / GRID_STRIDE`` coarse points, then ``GRID_STRIDE - 1``."""
assert GRID_CELLS % GRID_STRIDE == 0


def _rejected(x: torch.Tensor, lambdas: torch.Tensor, threshold: torch.Tensor, points: torch.Tensor,
              cap: torch.Tensor) -> torch.Tensor:
    """(R, P) bool: ``log K(m) >= threshold`` at the grid points ``points`` (R, P) of every row, at once."""
    m = (points.to(torch.float64) / GRID_CELLS)[:, :, None]  # (R, P, 1)
    bets = torch.minimum(lambdas[:, None, :], cap / (1 - m))  # (R, P, T), 0 past a row's prefix
    # log(1 + z), not log1p (vectorised, ~20x faster here): 1 + z >= 1 - cap is rounded by 2^-53, so each term is
    # off by < 2^-53 / (1 - cap) = 1.2e-14 and a sum of 8 x 2^11 draws by < 2.1e-10, inside LOG_MARGIN
    return torch.log(1 + bets * (m - x[:, None, :])).sum(-1) >= threshold[:, None]


def _first(hit: torch.Tensor, points: torch.Tensor, otherwise: torch.Tensor) -> torch.Tensor:
    """Per row, the first of ``points`` (R, P), ascending, where ``hit``, else ``otherwise`` (R,), above every point:
    the least point hit, one masked minimum."""
    return torch.where(hit, points, otherwise[:, None]).amin(-1)


def _grid_search(x: torch.Tensor, valid: torch.Tensor, delta: torch.Tensor, planned: torch.Tensor,
                 cap: torch.Tensor) -> torch.Tensor:
    """:func:`row_betting_upper`'s two-level grid search, tensors only."""
    x = torch.where(valid, x, 0.0)  # past a row's prefix: any value, its bet is 0
    lambdas = row_lambdas(x, valid, delta, planned)  # (R, T)
    threshold = torch.log(1 / delta) + LOG_MARGIN  # (R,)
    rows = x.shape[0]
    coarse = torch.arange(0, GRID_CELLS, GRID_STRIDE, device=x.device).expand(rows, -1)  # (R, G / stride)
    top = _first(_rejected(x, lambdas, threshold, coarse, cap), coarse,
                 torch.full((rows,), GRID_CELLS, dtype=torch.int64, device=x.device))  # rejected; G: none
    below = (top[:, None] - GRID_STRIDE) + torch.arange(1, GRID_STRIDE, device=x.device)  # not rejected below them
    inside = below >= 0  # top = 0: nothing below
    fine = _rejected(x, lambdas, threshold, below.clamp(min=0), cap) & inside
    bound = _first(fine, below, top).to(torch.float64) / GRID_CELLS  # the first rejected point; GRID_CELLS -> 1
    return torch.where(valid.any(-1), bound, 1.0)


_STEPS = GRID_CELLS.bit_length()  # bisection steps over GRID_CELLS + 1 outcomes


def _bisection(x: torch.Tensor, valid: torch.Tensor, delta: torch.Tensor, planned: torch.Tensor,
               cap: torch.Tensor) -> torch.Tensor:
    """:func:`row_betting_upper` by bisection over the grid points, tensors only."""
    x = torch.where(valid, x, 0.0)  # past a row's prefix: any value, its bet is 0
    lambdas = row_lambdas(x, valid, delta, planned)  # (R, T)
    threshold = torch.log(1 / delta) + LOG_MARGIN  # (R,)
    low = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)  # invariant: points < low are not rejected
    high = torch.full_like(low, GRID_CELLS)  # invariant: points >= high are rejected (GRID_CELLS: none known)
    for _ in range(_STEPS):
        middle = (low + high) // 2  # < GRID_CELLS while low < high
        hit = _rejected(x, lambdas, threshold, middle.clamp(max=GRID_CELLS - 1)[:, None], cap)[:, 0]
        open_ = low < high
        high = torch.where(open_ & hit, middle, high)
        low = torch.where(open_ & ~hit, middle + 1, low)
    return torch.where(valid.any(-1), high.to(torch.float64) / GRID_CELLS, 1.0)  # GRID_CELLS -> 1


def mean_upper(xs: torch.Tensor, delta: float) -> float:
    """Upper bound on the mean of ``[0, 1]`` samples at level ``delta``: min(betting, EB) at ``delta/2`` each."""
    return min(betting_upper(xs, delta / 2), empirical_bernstein_upper(xs, delta / 2))


def signed_mean_interval(ys: torch.Tensor, delta: float) -> tuple[float, float]:
    """``(lo, hi)`` for the mean of ``[-1, 1]`` samples; each side fails with probability ``<= delta``."""
    y = ys.detach().to(torch.float64).reshape(-1)
    hi = 2 * mean_upper((1 + y) / 2, delta) - 1
    lo = 1 - 2 * mean_upper((1 - y) / 2, delta)
    return lo, hi

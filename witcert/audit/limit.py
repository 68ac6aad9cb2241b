"""The exact binomial limits of the request audit (registry AU; spec ``witcert.spec.audit``).

On the event that no picked cell's spot check fails, every picked cell with TV above ``tau`` is
flagged, so the flagged count ``X`` is at least ``Y ~ Binomial(M, r)`` (``M`` the request's cells
above ``tau``, ``r`` the pick rate). :func:`upper_limit` inverts the binomial's lower tail::

    M_upper = max{ m <= N : P(Binomial(m, r) <= X) >= delta_s }

``m -> P(Binomial(m, r) <= x)`` decreases, so ``M > M_upper`` means ``F_M(X) < delta_s``, hence
``F_M(Y) < delta_s`` (``Y <= X``, ``F_M`` increasing), an event of probability at most ``delta_s``
(a distribution function evaluated at its own variable is stochastically at least uniform).

:func:`flagged_interval` is the descriptive companion: the estimate ``X / (r N)`` and an exact
two-sided binomial interval (the Clopper-Pearson construction with ``r`` known and the count
unknown) for ``K / N``, ``K`` the number of cells the audit would flag if it picked every cell.
It is not an interval for the fraction above ``tau``: a flag can come from a loose bound.

The binomial tails are scipy's (``scipy.stats.binom``, double precision, relative error far below
:data:`RELAXED`); each limit accepts ``m`` when the computed tail is at least its level lowered by
``RELAXED``, so a rounded tail can only widen the limit, never narrow it below the exact one.
"""
from __future__ import annotations

import numpy as np

RELAXED = 1e-9
"""Relative slack on the level when a computed tail is compared with it (widens the limits only)."""
LEVEL = 0.95
"""Two-sided level of the reported interval."""


def _binom():
    try:
        from scipy.stats import binom
    except ImportError:
        raise ImportError("the request audit's binomial limits need scipy (pip install scipy, or "
                          "pip install 'witcert[hf]')") from None
    return binom


def _counts(flagged, cells) -> tuple[np.ndarray, np.ndarray]:
    """``(X, N)`` as int64 arrays of one shape, checked: ``0 <= X <= N``."""
    x, n = np.broadcast_arrays(np.asarray(flagged), np.asarray(cells))
    if not (np.issubdtype(x.dtype, np.integer) and np.issubdtype(n.dtype, np.integer)):
        raise ValueError(f"flagged and cells must be integer counts, got {x.dtype} and {n.dtype}")
    x, n = x.astype(np.int64), n.astype(np.int64)
    if np.any(x < 0) or np.any(x > n):
        raise ValueError("flagged must lie in [0, cells] for every request")
    return x, n


def _check_level(name: str, value: float) -> float:
    if isinstance(value, bool) or not 0.0 < float(value) < 1.0:
        raise ValueError(f"{name} must lie in (0, 1), got {value!r}")
    return float(value)


def _check_rate(rate: float) -> float:
    if isinstance(rate, bool) or not 0.0 < float(rate) <= 1.0:
        raise ValueError(f"rate must lie in (0, 1], got {rate!r}")
    return float(rate)


def _largest(accept, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Per entry, the largest ``m`` in ``[low, high]`` with ``accept(m)``, given ``accept(low)`` and that the
    accepted ``m`` form an initial segment (bisection, all entries at once)."""
    low, high = low.copy(), high.copy()
    while np.any(low < high):
        mid = (low + high + 1) // 2
        ok = accept(mid) | (low >= high)
        low, high = np.where(ok, mid, low), np.where(ok, high, mid - 1)
    return low


def upper_limit(flagged, cells, rate: float, delta_s: float) -> np.ndarray:
    """``M_upper = max{m <= N : P(Binomial(m, rate) <= X) >= delta_s}`` per request (registry AU).

    Parameters
    ----------
    flagged : int or array of int
        ``X``, the flagged picked cells of each request.
    cells : int or array of int
        ``N``, each request's cells (broadcast against ``flagged``).
    rate : float
        The pick probability ``r`` in ``(0, 1]`` (a true pick probability at least ``r`` keeps the limit valid).
    delta_s : float
        Level in ``(0, 1)``.

    Returns
    -------
    int64 array of ``M_upper``, ``X <= M_upper <= N``: nondecreasing in ``X``, nonincreasing in ``rate`` and
    ``delta_s``; ``N`` when ``X = N``, ``X`` when ``rate = 1``, ``min(N, floor(ln delta_s / ln(1 - r)))`` when
    ``X = 0``.
    """
    x, n = _counts(flagged, cells)
    r, level = _check_rate(rate), _check_level("delta_s", delta_s) * (1 - RELAXED)
    binom = _binom()
    return _largest(lambda m: binom.cdf(x, m, r) >= level, x, n)


def lower_limit(flagged, cells, rate: float, alpha: float) -> np.ndarray:
    """``min{k in [X, N] : P(Binomial(k, rate) >= X) >= alpha}`` per request: the lower end of the interval."""
    x, n = _counts(flagged, cells)
    r, level = _check_rate(rate), _check_level("alpha", alpha) * (1 - RELAXED)
    binom = _binom()
    # P(Bin(k, r) >= X) = sf(X - 1) grows with k: the rejected k form an initial segment [X, K_lo - 1]
    rejected = _largest(lambda k: binom.sf(x - 1, k - 1, r) < level, x, n)  # largest k whose k - 1 is rejected
    return np.where(binom.sf(x - 1, x, r) >= level, x, rejected)


def flagged_interval(flagged, cells, rate: float, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(estimate, low, high)`` fractions of ``N`` per request.

    ``estimate = min(1, X / (rate N))``; ``[low, high]`` an exact two-sided binomial interval at ``level`` for
    ``K / N``, where ``K`` is the number of cells the audit would flag if it picked every cell (each spot-checked
    cell's flag taken as one draw of its check): ``X ~ Binomial(K, rate)`` given ``K``, so the interval covers
    ``K / N`` with probability at least ``level``. Not an interval for the fraction above ``tau``: a flag can
    come from a loose bound, never the converse (on the spot checks' event).
    """
    x, n = _counts(flagged, cells)
    r = _check_rate(rate)
    alpha = (1 - _check_level("level", level)) / 2
    high = upper_limit(x, n, r, alpha)
    low = np.minimum(lower_limit(x, n, r, alpha), high)
    size = np.maximum(n, 1)
    return np.minimum(1.0, x / (r * size)), low / size, high / size

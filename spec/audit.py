"""Executable statement of the request audit (docs/design.md "The request audit"; registry key AU).

Pure Python + mpmath at the caller's working precision; no torch, no numpy, no scipy.

Population: the ``N`` cells of one request, ``M`` of them with TV above ``tau``; each picked
independently with probability ``r'`` (the exact pick probability, :func:`pick_probability`); a
picked cell whose spot check (failure probability ``delta_c``) does not fail and whose TV exceeds
``tau`` is flagged, so on the event that no picked check fails the flagged count ``X`` is at least
``Y ~ Binomial(M, r')``. With ``F_m(x) = P(Binomial(m, r') <= x)`` (nonincreasing in ``m``)::

    M_upper = max{ m <= N : F_m(X) >= delta_s }
    P(M > M_upper) <= delta_s + sum_cells r' delta_c(cell)       (Lean: WitCert.measure_auditUpper_lt_le)

and the per-step allocation ``delta_c(k) = delta_spot 6 / (pi^2 k^2) / cells_per_step / r'`` keeps
the union term at most ``delta_spot`` for a request of any length (registry SCD).

The exact audit (registry AE, ``witcert.Audit(keys=None)``) bounds a picked cell by its true TV
(:func:`true_tv`, from every exact key the cell sees): no check can fail, the event above is everything,
and ``P(M > M_upper) <= delta_s`` with ``delta_s = delta`` (Lean: ``WitCert.measure_auditUpper_exact_le``).
"""
import mpmath
from mpmath import mpf

from .bounds import Real


def binomial_cdf(x: int, m: int, r: Real) -> mpf:
    """``P(Binomial(m, r) <= x)`` as an exact sum at the working precision."""
    if m < 0:
        raise ValueError(f"m: must be >= 0, got {m!r}")
    r = mpf(r)
    if not 0 <= r <= 1:
        raise ValueError(f"r: must lie in [0, 1], got {r!r}")
    if x < 0:
        return mpf(0)
    if x >= m:
        return mpf(1)
    return mpmath.fsum(mpmath.binomial(m, j) * r ** j * (1 - r) ** (m - j) for j in range(x + 1))


def upper_limit(x: int, n: int, r: Real, delta_s: Real) -> int:
    """``max{m <= n : P(Binomial(m, r) <= x) >= delta_s}`` (registry AU), by bisection over the exact tail.

    Lean: ``WitCert.auditUpper`` (definition) and ``WitCert.measure_auditUpper_lt_le`` (``M <= M_upper``
    fails with probability at most ``delta_s`` plus the union of the picked checks' failures).
    """
    if not 0 <= x <= n:
        raise ValueError(f"x: must lie in [0, n], got x={x!r}, n={n!r}")
    delta_s = mpf(delta_s)
    if not 0 < delta_s < 1:
        raise ValueError(f"delta_s: must lie in (0, 1), got {delta_s!r}")
    low, high = x, n  # F_x(x) = 1 >= delta_s; the accepted m form an initial segment
    while low < high:
        mid = (low + high + 1) // 2
        if binomial_cdf(x, mid, r) >= delta_s:
            low = mid
        else:
            high = mid - 1
    return low


def pick_probability(rate: Real) -> mpf:
    """``ceil(rate 2^32) / 2^32``: the probability a 32-bit Philox word below the threshold has."""
    return mpmath.ceil(mpf(rate) * 2 ** 32) / 2 ** 32


def check_delta(delta_spot: Real, step: int, cells_per_step: int, pick: Real, cap: Real = mpf(1) / 2) -> mpf:
    """``min(cap, delta_spot 6 / (pi^2 k^2) / cells_per_step / pick)``: a picked cell's spot-check delta at step ``k``."""
    if step < 1:
        raise ValueError(f"step: must be >= 1, got {step!r}")
    return min(mpf(cap), mpf(delta_spot) * 6 / (mpmath.pi ** 2 * step ** 2) / cells_per_step / mpf(pick))


def statement_delta(delta_s: Real, check_deltas, pick: Real) -> mpf:
    """``delta_s + pick sum_cells delta_c``: the failure probability of one request's statement, every cell's
    allocated ``delta_c`` given (picked or not: the union is over the cells that might be picked)."""
    return mpf(delta_s) + mpf(pick) * mpmath.fsum(mpf(d) for d in check_deltas)


def true_tv(exact_logits, read_logits) -> mpf:
    """``TV(softmax(l), softmax(l~)) = 1/2 sum_t |p_t - p~_t|`` over the visible tokens (registry AE): ``exact_logits``
    ``l`` of the exact keys, ``read_logits`` ``l~`` of the keys attention read, same length, finite, at least one."""
    l, lr = [mpf(x) for x in exact_logits], [mpf(x) for x in read_logits]
    if not l or len(l) != len(lr):
        raise ValueError(f"exact_logits, read_logits: need the same positive length, got {len(l)} and {len(lr)}")
    if not all(mpmath.isfinite(x) for x in l + lr):
        raise ValueError("exact_logits, read_logits: every logit must be finite")
    p, q = _softmax(l), _softmax(lr)
    return mpmath.fsum(abs(a - b) for a, b in zip(p, q)) / 2


def _softmax(logits: list) -> list:
    top = max(logits)
    weights = [mpmath.exp(x - top) for x in logits]
    total = mpmath.fsum(weights)
    return [w / total for w in weights]

"""The fused fp64 pass: meter (``T1``, ``P1``, ``MN``), risk and value term, with an a-priori budget.

The eager reference (:func:`witcert.core.metering.meter`) encloses every rounding per operation
(directed fp64 steps, per-token ``Terms``): exact, but some forty small tensor passes per call.
Here every per-token term is computed once in fp64 and enclosed by **one relative budget per
token and one absolute slack per term**, valid for any evaluation order, FMA contraction and any
exp/tanh within :data:`REL` of the true value -- the eager libm (<= 4 ulps, ``FP``) and
``torch.compile``'s vectorized code alike (measured on a dense grid by
``tests/test_fastpath.py::test_transcendental_budget``: at most ``2^-50``, budget ``2^-40``).
``expm1`` is not used: compiled, it has no relative accuracy for small arguments (measured).

Per live token (``y = x - max x``, ``f = 1 - e^{-c}``), all non-negative:

* mass ``M = e^{y}``; excess ``K = e^{y + c} f = e^{y}(e^{c} - 1)`` (formed from ``e^{y+c}`` so an
  underflowed mass never meets a large ``e^{c}``); shortfall ``J = e^{y} f <= M``.
* Exponent errors: ``y`` and ``y + c`` are rounded once each, so the exponent of a term is off by
  at most ``u (|y| + |y + c|) (1 + u)`` (``u = 2^-53``; ``|y|`` alone for ``M`` and ``J``); we budget
  ``2^-51 (|y| + |y + c|)`` plus ``8 REL`` for the exp (``REL``), ``f`` (``4 REL``) and the product. With ``b <= 1`` the exact term
  lies within ``(1 +- b (1 + b))`` of the computed one (``e^{b} - 1 <= b (1 + b)``). A live term
  with ``b > 1`` (scores spanning more than ~10^15) is negligible if even its exponent plus ``b``
  is below -1000 (then ``ABS`` covers it), else it gets the trivial upper bound ``inf``.
* A term computed in (or flushed from) the subnormal range is off by less than :data:`ABS` =
  ``2^-1020`` absolutely (every subnormal is below ``2^-1022``, and ``(1 + b(1 + b)) <= 3``).
* Sums of ``S <= MAX_TOKENS`` non-negative fp64 terms in any order: relative ``gamma_S <= 2^-29``
  (Higham, Thm. 4.4); :data:`GROW` ``= 1 + 2^-28`` covers it and the few roundings after it.
* The row-level formulas (``T1 = k (k + 2)/2``, ``P1 = (k + j)/2 (1/A- + 1/(1 + k))``,
  ``MN = tanh(D/2)``) take a handful of fp64 operations: relative ``(1 + REL)`` each result
  (far above their ``u``), and ``2^-1068`` absolute for subnormal results.

Not computed here (sound: a minimum of fewer sound bounds is still a sound bound): the direct
``A-`` lower bound from ``e^{y - c}`` (only ``A- >= 1 - j``), the retention form ``P1r`` and any
bound added to the eager minimum later. Their absence can only make this meter larger.
"""
import torch


REL = 2.0**-40  # budget of one exp/tanh/row-level result, relative (compiled exp, tanh measured <= 2^-50)
ABS = 2.0**-1020  # absolute error of one term computed in the subnormal range (or flushed to zero)
TINY = 2.0**-1068  # absolute slack of a row-level result that may be subnormal
GROW = 1.0 + 2.0**-28  # any-order sum of at most MAX_TOKENS non-negative terms, and what follows it
MAX_TOKENS = 2**24
_EXPONENT_U = 2.0**-51  # >= u (1 + u) with margin: the exponent's rounding per unit of |y| + |y + c|


def _up(x: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """A row-level fp64 result lifted past its few roundings; exactly 0 where the exact value is 0."""
    return torch.where(positive, x * (1.0 + REL) + TINY, torch.zeros_like(x))


def _enclose(value: torch.Tensor, exponent: torch.Tensor, budget: torch.Tensor, zero: torch.Tensor):
    """``(upper, lower)`` of one non-negative term ``exp(exponent) * factor``, its log off by at most ``budget``.

    ``budget <= 1``: within ``(1 +- r)``, ``r = b (1 + b) >= e^{b} - 1`` (lifted past its own roundings).
    Otherwise the term is negligible (below ``ABS``: upper 0 here, the caller adds ``ABS`` per term)
    when even ``exponent + budget < -1000``, else unknown: upper ``inf``, lower 0.
    """
    ok = budget <= 1.0
    r = torch.where(ok, budget * (1.0 + budget) * (1.0 + REL), zero)
    far = torch.where(exponent + budget < -1000.0, zero, torch.full_like(zero, float("inf")))
    return torch.where(ok, value * (1.0 + r), far), torch.where(ok, value * (1.0 - r), zero)


def _one_minus_exp_neg(c: torch.Tensor) -> torch.Tensor:
    """``1 - e^{-c}``, at most ``4 REL`` below it (what the term budget charges), without ``expm1``.

    Only upper bounds (``K``, ``J``) use it, so the series' truncation, which errs upward, is free.

    ``torch.compile``'s vectorized fp64 ``expm1`` loses all relative accuracy for small arguments
    (it returned 0 for ``1e-20``: measured, ``tests/test_fastpath.py``). Below ``1/4`` the
    alternating Taylor series cut after its ``c^7/7!`` term (truncation upward, below ``c^6/8! < 2^-26``
    relative: terms decrease), in nested form (factors near 1: a few ``u`` of rounding).
    Above, ``1 - e^{-c} >= 0.22`` so the exp's ``REL`` grows at most 4-fold in the subtraction.
    """
    series = c * (1 - c / 2 * (1 - c / 3 * (1 - c / 4 * (1 - c / 5 * (1 - c / 6 * (1 - c / 7))))))
    return torch.where(c <= 0.25, series, 1.0 - torch.exp(-c))


def lean_cells_kernel(scores: torch.Tensor, c: torch.Tensor, rho: torch.Tensor,
                      v_norm: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The fused pass on validated fp64 inputs (..., S); returns ``(meter, risk, value_term, v_norm_max)``.

    ``scores`` finite or ``-inf`` (masked; every row has a live token), ``c >= 0`` (``inf`` allowed),
    ``rho >= 0`` and ``v_norm >= 0`` broadcastable to ``scores``. No host synchronisation: this is
    the function :mod:`witcert.fastpath.compiled` compiles.
    """
    live = scores > float("-inf")
    zero = torch.zeros_like(scores)
    c = torch.where(live, c, zero)
    y = scores - scores.amax(-1, keepdim=True)  # -inf where masked
    g = torch.where(live, y + c, y)  # inf where c is
    f = _one_minus_exp_neg(c)  # >= 1 - e^{-c}, in [0, 1]; exactly 0 where c = 0
    mass = torch.exp(y)
    excess = torch.exp(g) * f
    shortfall = mass * f

    ay = torch.where(live, y.abs(), zero)
    ag = torch.where(live, g.abs(), zero)
    # M and J have the exponent y, K the exponent y + c (inf where c is: K is inf then)
    mass_up, mass_lo = _enclose(mass, y, _EXPONENT_U * ay + 8 * REL, zero)
    shortfall_up = _enclose(shortfall, y, _EXPONENT_U * ay + 8 * REL, zero)[0]
    excess_up = _enclose(excess, g, _EXPONENT_U * (ay + ag) + 8 * REL, zero)[0]
    # exactly 0: masked tokens, and K, J where c = 0
    has_f = live & (f > 0)
    excess_up = torch.where(has_f, excess_up, zero)
    shortfall_up = torch.where(has_f, shortfall_up, zero)
    mass_up = torch.where(live, mass_up, zero)
    mass_lo = torch.where(live, mass_lo, zero)

    n_live = live.sum(-1).to(scores.dtype)
    n_f = has_f.sum(-1).to(scores.dtype)
    total_lo = (mass_lo.sum(-1) / GROW - n_live * ABS) / GROW  # > 1/2: the max token has y = 0, M = 1
    k_sum = excess_up.sum(-1) * GROW + n_f * ABS
    j_sum = shortfall_up.sum(-1) * GROW + n_f * ABS
    k = _up(k_sum / total_lo, k_sum > 0)
    j = torch.clamp(_up(j_sum / total_lo, j_sum > 0), max=1.0)  # the exact j = 1 - A- is <= 1
    a_minus = torch.clamp((1.0 - j) * (1.0 - REL), min=0.0)  # <= A- (1 - j rounds by u only)

    eform = _up(0.5 * k * (k + 2.0), k > 0)
    spread = k + j
    two_sided = _up(0.5 * spread * (1.0 / a_minus + 1.0 / (1.0 + k)), spread > 0)
    two_sided = torch.where((a_minus > 0) & torch.isfinite(k), two_sided, torch.full_like(two_sided, float("inf")))
    half_d = c.amax(-1) * 0.5  # exact unless subnormal: then one 2^-1074 step covers it
    half_d = torch.where(half_d > 0, half_d + 2.0**-1074, half_d)
    maxnorm = torch.minimum(torch.minimum(half_d, _up(torch.tanh(half_d), half_d > 0)), torch.ones_like(half_d))
    meter = torch.clamp(torch.minimum(torch.minimum(eform, two_sided), maxnorm), max=1.0)

    # an underflowed mass keeps its slack ABS through the product; each product rounds by at most
    # half a 2^-1074 step below the normal range (ABS rho itself may be subnormal)
    weighted_live = live & (rho > 0)
    weighted = torch.where(weighted_live, (mass_up + ABS) * rho, zero)
    w_sum = weighted.sum(-1) * GROW + weighted_live.sum(-1).to(scores.dtype) * 2.0**-1074
    value_term = _up(w_sum / total_lo, w_sum > 0)
    v_norm_max = torch.where(live, v_norm.expand_as(scores), zero).amax(-1)
    return meter, eform, value_term, v_norm_max

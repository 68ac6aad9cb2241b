"""The fused fp32 pass: every row's moments in one pass, then the meter from an a-priori budget (T1, P1, MN, CS, MS; FP).

The eager reference (:func:`witcert.core.metering.meter`) encloses every rounding per operation
(directed fp64 steps, per-token ``Terms``): exact, but some forty small tensor passes per call.
Here :func:`sums_kernel` makes one pass in fp32 and :func:`lean_from_sums` turns its per-row sums
into fp64 upper bounds with one
relative error per kind of term and one absolute slack per token, valid for any evaluation order,
FMA contraction and any ``exp`` within ``eps`` = :func:`~witcert.core.rounding.exp_relative_error`
(fp32) of the true value: the eager libm and ``torch.compile``'s vectorized code alike (measured on a
dense grid by ``tests/test_fastpath.py::test_compiled_transcendentals_within_budget``).

Per live token, with ``y = s - max s`` and ``c'`` the radius rounded up to fp32 (``c' >= c``)::

    l = sum e^{y},  k = sum e^{y} g,  j = sum e^{y} g / (1 + g),  s = sum e^{y} min(g, G)^2,  w = sum e^{y} rho'

``g = e^{c'} - 1`` (:func:`expm1_nonneg`, never ``torch.expm1``: compiled, it has no relative
accuracy for small arguments), ``1 - e^{-c} = g / (1 + g)``, ``G = G_CAP``, ``rho'`` the value
residual rounded up to fp32. The exact moments at ``c`` are at most these at ``c'`` (each term grows
with ``c``), so ``A - 1 <= K/L``, ``1 - A- <= J/L``, ``E_p~[expm1(c)^2] <= S/L`` and the value term
``<= W/L`` in exact arithmetic (capital letters: exact sums at ``c'``).

Budget (``u = 2^-24``, ``tiny = 2^-126``, ``n`` tokens in the row):

* the logit offset ``y`` is the fp64 difference cast to fp32 (fp32 scores: their fp32 difference,
  one rounding, exact where subnormal): off by at most ``a |y|``, ``a = 2^-24 (1 + 2^-20)``; a term that is normal in fp32 has ``|y| <= 88``, so its mass
  ``e^{y}`` is within ``rho_m = e^{88 a} (1 + eps) - 1`` relative; any term (normal or not) is
  within ``rho_m`` relative plus ``2 tiny`` absolute;
* ``g`` within ``rho_g`` = :func:`~witcert.core.rounding.series_expm1_relative_error` (the Horner
  analysis there); ``g / (1 + g)`` within ``rho_f = (1 + rho_g)(1 + u)^2 / (1 - rho_g) - 1``
  (``1 + g`` inherits at most ``rho_g``);
* each product adds ``u`` relative or ``2^-149`` absolute (underflow); an absolute error ``2 tiny`` of
  the mass is multiplied by the other factor: the slack per token is ``3 tiny max(1, factor)``;
* the terms are summed in fp64 (each converted exactly), in any order: ``gamma_{n-1}`` at ``2^-53``
  (Higham Thm 4.4), so the budget does not grow with the row as an fp32 sum's ``(n - 1) 2^-24`` would;
* the row-level formulas (``Enclosure``: directed fp64 operations) and the few fp64 operations
  here: ``FP64_MARGIN``.

A row whose ``c'`` reaches ``C_CAP = 64`` reports the trivial meter 1 and risk ``inf`` (then
``tanh(D/2) = 1`` in fp64 anyway); CS is ``inf`` where ``c'_max > CS_C_LIMIT = 31``, below which no
``s`` term is capped (``e^{31} - 1 < 2^45 < G``).

The mass split ``MS`` (Lean ``WitCert.tv_le_mass_split``, any low set ``L``) is formed on the low
sets ``L_k = {c' <= g_k}``, ``g_k = fl32(D f_k)``, ``f = SPLIT_FRACTIONS``, ``D = max c'``: the same
token loop sums ``e^{y} g`` and ``e^{y} min(g, G)^2`` over each low set in fp32 (``gamma_{n-1}`` at
``2^-24``, relative to the low set's own sums), ``max_L c <= min(g_k, D)``; the high set's ``k`` is
the row's less the low set's. The eager reference's grid (11 thresholds of ``(1 + r/4) 2^q`` below
``D``, three sums each) would put 33 more sums in the loop; these four sets cost about an eighth of
the pass and keep the coverage on real cells (docs/design.md "The meter and the risk score"). Any
partition is sound, so the sets may differ from the eager ones; the meter is never below the exact
value on its own sets (:func:`split_low_sets`). Not formed: the retention form ``P1r`` (not in the
meter either).
"""
import math
from dataclasses import dataclass

import torch

from witcert.core import rounding
from witcert.core.bounds import Enclosure, Split

C_CAP = 64.0  # radii are capped here inside the exponent; such a row reports meter 1, risk inf
G_CAP = 2.0**46  # cap of g in the s terms: each below 2^92, any sum finite in fp32
CS_C_LIMIT = 31.0  # c'_max at or below this: no s term was capped, CS holds
SPLIT_FRACTIONS = (0.875, 0.75, 0.5, 0.25)  # MS thresholds g_k = fl32(D f_k) (docs/design.md "The meter and the risk score")
MAX_TOKENS = 2**24  # rows longer than this are refused (a bound on n in the budget)
UNIT = 2.0**-24
TINY = 2.0**-126  # smallest normal fp32
_FP32_MAX = float(torch.finfo(torch.float32).max)
_ARG = 2.0**-24 * (1 + 2.0**-20)  # |fl32(fl64(s - m)) - (s - m)| / |s - m|
_Y_NORMAL = 88.0  # |y| of any term whose fp32 mass e^y is normal
_RADIUS_UP = 2.0**-21  # x (1 + this), rounded twice, is above x (kernels/radius.py)
FP64_MARGIN = 1.0 + 64 * 2.0**-52  # the few fp64 roundings of lean_from_sums


def expm1_nonneg(x: torch.Tensor) -> torch.Tensor:
    """``e^x - 1`` for fp32 ``x >= 0`` within :func:`~witcert.core.rounding.series_expm1_relative_error`.

    The degree-8 Horner polynomial of ``kernels/expm1.py`` below ``1/2``, ``exp(x) - 1`` above; the
    same operations in torch, so the same analysis holds (FMA contraction only removes roundings).
    """
    poly = 1.0 + x * (1.0 / 7.0) * (1.0 + x * (1.0 / 8.0))
    for k in (6.0, 5.0, 4.0, 3.0, 2.0):
        poly = 1.0 + x * (1.0 / k) * poly
    return torch.where(x <= 0.5, x * poly, torch.exp(x) - 1.0)


def _expm1_up(x: torch.Tensor) -> torch.Tensor:
    """fp64 ``>= e^x - 1`` for ``x >= 0`` without ``expm1`` (compiled, it returned 0 for ``1e-20``):
    ``x e^x`` below ``1/2`` (``(e^x - 1)/x <= e^x``), ``e^x - 1`` above (cancellation ``<= 2.6``-fold),
    each lifted by ``2^-40`` (the exp's ``EXP_ULPS`` and the two roundings are below ``2^-47``)."""
    return torch.where(x <= 0.5, x * torch.exp(x), torch.exp(x) - 1.0) * (1.0 + 2.0**-40)


def fp32_up(x: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor ``>= x`` for ``x >= 0`` (``0`` and ``inf`` kept): fp32/half unchanged, fp64 lifted by
    ``2^-21`` then cast, with the normal floor ``2^-126`` for positive values the cast would flush."""
    if x.dtype != torch.float64:
        return x.float()
    up = (x * (1.0 + _RADIUS_UP)).float()
    return torch.where(x > 0, torch.clamp(up, min=TINY), torch.zeros_like(up))


def sums_kernel(scores: torch.Tensor, c: torch.Tensor, rho: torch.Tensor, v_norm: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One fp32 pass over validated (..., S) inputs; returns ``(l, k, j, s, low, w, c_max, rho_max, v_norm_max)``
    per row (sums in fp64, maxima in fp32 or the norms' dtype).

    ``low`` (..., 3, K): the ``k`` and ``s`` terms summed in fp32 over each MS low set ``L_k = {c' <= g_k}``
    (``g_k``: :func:`split_thresholds`), and ``min(g_k, c'_max)`` (one reduction per set and term in the
    same token loop: fused, not a loop per threshold).
    ``scores`` fp32 or fp64, finite or ``-inf`` (masked; every row has a live token); ``c``, ``rho``,
    ``v_norm`` ``>= 0`` (``inf`` allowed), broadcastable to ``scores`` (a kv head's value statistics
    serve all its query rows without a copy); ``rho`` and ``v_norm`` may both be ``None``: no value
    statistics, those results 0, and no value work in the token loop (a graph of its own when compiled).
    No host synchronisation.
    """
    live = scores > float("-inf")
    zero = torch.zeros((), dtype=torch.float32, device=scores.device)
    top = scores.amax(-1, keepdim=True)
    if scores.dtype == torch.float32:  # one correctly rounded fp32 subtraction: within a |y| (exact if subnormal)
        y = scores - top
    else:
        y = (scores - top).float()  # -inf where masked
    c = torch.where(live, fp32_up(c), zero)
    c_max = c.amax(-1)
    g = expm1_nonneg(torch.clamp(c, max=C_CAP))
    mass = torch.exp(y)  # 0 where masked
    terms = (mass, mass * g, mass * (g / (1.0 + g)), mass * torch.square(torch.clamp(g, max=G_CAP)))
    sums = tuple(t.sum(-1, dtype=torch.float64) for t in terms)
    low = _low_sums(c, split_thresholds(c_max), (terms[1], terms[3]))
    if rho is None:
        none = torch.zeros_like(sums[0])
        return (*sums, low, none, c_max, none.float(), none.float())
    r = torch.where(live, fp32_up(rho), zero)
    weighted = mass * torch.clamp(r, max=_FP32_MAX)  # never 0 * inf; an infinite residual makes r_max (so the term) inf
    v_max = torch.where(live, v_norm, torch.zeros_like(v_norm)).amax(-1)
    return (*sums, low, weighted.sum(-1, dtype=torch.float64), c_max, r.amax(-1), v_max)


def split_thresholds(c_max: torch.Tensor) -> torch.Tensor:
    """fp32 (..., K): the MS thresholds ``g_k = fl32(D f_k)`` of the pass, ``D = c_max`` (...,) its fp32 ``max c'``."""
    return c_max.unsqueeze(-1) * torch.tensor(SPLIT_FRACTIONS, dtype=torch.float32, device=c_max.device)


def split_low_sets(scores: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """(..., K, S) bool: the low sets ``L_k = {c' <= g_k}`` the pass splits valid ``scores``, ``c`` at (eager, for
    oracles: ``witcert.spec.golden.meter_on_sets_from_scores``); a masked token is in every set (no mass)."""
    live = scores > float("-inf")
    radii = torch.where(live, fp32_up(torch.as_tensor(c).expand(scores.shape)), torch.zeros((), dtype=torch.float32))
    return radii.unsqueeze(-2) <= split_thresholds(radii.amax(-1)).unsqueeze(-1)


def _low_sums(c: torch.Tensor, thresholds: torch.Tensor, terms: tuple) -> torch.Tensor:
    """(..., len(terms) + 1, K): fp32 sums of each term over ``{c <= thresholds[..., k]}``, then ``min(g_k, max c)``,
    at least the set's largest ``c``; one masked reduction per set and term, written out so that a compiled
    graph fuses them into the token loop that forms the terms. (Each set's own max, four more reductions,
    made Inductor split the per-layer pass into two token loops: 0.69 against 0.53 ms at 9 x 512.)"""
    zero = torch.zeros((), dtype=terms[0].dtype, device=c.device)
    sets = [c <= thresholds[..., k:k + 1] for k in range(thresholds.shape[-1])]
    sums = [torch.stack([torch.where(inside, t, zero).sum(-1) for inside in sets], dim=-1) for t in terms]
    top = torch.minimum(thresholds, c.amax(-1, keepdim=True)).expand_as(sums[0])  # >= max_L c', no reduction
    return torch.stack([*sums, top], dim=-2)


@dataclass(frozen=True)
class PassBudget:
    """The relative errors of one row's fp32 sums (see the module docstring), for rows of ``n <= MAX_TOKENS`` tokens."""

    n: int

    gamma = rounding.summation_gamma(MAX_TOKENS, torch.float64)  # every row: no shape-dependent branch when compiled

    @property
    def mass(self) -> float:
        eps = rounding.exp_relative_error(torch.float32)
        return math.exp(_Y_NORMAL * _ARG) * (1 + eps) * FP64_MARGIN - 1

    @property
    def g(self) -> float:
        return rounding.series_expm1_relative_error(UNIT, rounding.exp_relative_error(torch.float32))

    def product(self, factor_error: float, factors: int = 1) -> float:
        """Relative error of ``mass x factor^factors`` (each factor within ``factor_error``, one rounding per product)."""
        return ((1 + self.mass) * ((1 + factor_error) * (1 + UNIT)) ** factors) * FP64_MARGIN - 1

    @property
    def f(self) -> float:
        return (1 + self.g) * (1 + UNIT) ** 2 / (1 - self.g) * FP64_MARGIN - 1

    @property
    def gamma_fp32(self) -> float:
        """``gamma_{n-1}`` of an fp32 sum of ``n`` terms in any order (the MS low sets), rounded up; finite for
        every ``n <= MAX_TOKENS`` (``(n - 1) 2^-24 < 1``), large near the cap (then MS just helps less)."""
        nu = (self.n - 1) * UNIT
        return nu / (1 - nu) * FP64_MARGIN

    def upper(self, total, rel: float, factor_max, gamma: float | None = None) -> torch.Tensor:
        """Exact sum ``<=`` this, from the computed ``total`` of fp32 terms within ``rel`` and ``3 tiny factor_max``,
        summed within ``gamma`` (default: the fp64 sums' :attr:`gamma`)."""
        gamma = self.gamma if gamma is None else gamma
        slack = 3 * TINY * self.n * torch.clamp(factor_max, min=1.0)
        return (total / (1 - gamma) + slack) / (1 - rel) * FP64_MARGIN

    def lower(self, total, rel: float, factor_max, gamma: float) -> torch.Tensor:
        """Exact sum ``>=`` this (``>= 0``): :meth:`upper`'s bounds from the other side."""
        slack = 3 * TINY * self.n * torch.clamp(factor_max, min=1.0)
        return torch.clamp((total / (1 + gamma) - slack) / (1 + rel) / FP64_MARGIN, min=0.0)

    def lower_mass(self, total) -> torch.Tensor:
        """Exact ``L >=`` this (``> 0``: the max token's mass is 1)."""
        return (total / (1 + self.gamma) - 2 * TINY * self.n) / (1 + self.mass) / FP64_MARGIN


def lean_from_sums(sums: tuple, n_tokens: int) -> tuple[torch.Tensor, ...]:
    """``(meter, risk, value_term, v_norm_max)`` (fp64, per row) from :func:`sums_kernel`'s results.

    ``meter = min(1, T1, P1, MN, CS, MS)`` through :class:`~witcert.core.bounds.Enclosure`; ``risk`` the
    unclamped T1 (``inf`` on a capped row); ``value_term >= sum_t p~_t rho_t``.
    """
    l, k, j, s, low, w, c_max, r_max, v_max = sums
    budget = PassBudget(n_tokens)
    c_max = c_max.double()
    any_c = c_max > 0  # all radii 0: A = A- = 1 exactly, every bound 0
    g_max = _expm1_up(torch.clamp(c_max, max=C_CAP)) * (1 + budget.g)  # >= every computed g
    l_lo = budget.lower_mass(l)
    zero = torch.zeros_like(l_lo)
    rel = (budget.product(budget.g), budget.product(budget.f), budget.product(budget.g, factors=2))
    factor = (g_max, zero, g_max * g_max)
    k_all, j_all, s_all = (budget.upper(x, e, f) for x, e, f in zip((k, j, s), rel, factor))
    k_hi = torch.where(any_c, k_all / l_lo * FP64_MARGIN, zero)
    j_hi = torch.where(any_c, j_all / l_lo * FP64_MARGIN, zero)
    j_hi = torch.clamp(j_hi, max=1.0)  # the exact 1 - A- is below 1
    s_hi = s_all / l_lo * FP64_MARGIN
    s_hi = torch.where(any_c, torch.minimum(s_hi, g_max * k_hi * FP64_MARGIN), zero)  # E[g^2] <= g_max E[g]
    s_hi = torch.where(c_max <= CS_C_LIMIT, s_hi, torch.full_like(s_hi, math.inf))
    k_all_lo = budget.lower(k, rel[0], g_max, budget.gamma)
    split = _split(budget, low, (k_all_lo, k_all, j_all), (rel[0], rel[2]), (factor[0], factor[2]), l_lo,
                   (k_hi, j_hi, s_hi), c_max, g_max)
    enclosure = Enclosure(k_hi, j_hi, rounding.sub_down(1.0, j_hi).clamp(min=0.0), c_max, s_hi, split)
    capped = c_max >= C_CAP
    eform = enclosure.eform()
    meter = torch.where(capped, torch.ones_like(eform), enclosure.meter())
    risk = torch.where(capped, torch.full_like(eform, math.inf), eform)
    r_max = r_max.double()
    value_term = torch.where(r_max > 0, budget.upper(w, budget.product(_RADIUS_UP), r_max) / l_lo * FP64_MARGIN, zero)
    value_term = torch.where(torch.isinf(r_max) | torch.isinf(w), torch.full_like(value_term, math.inf), value_term)
    return meter, risk, value_term, v_max.double()


def _split(budget: PassBudget, low: torch.Tensor, k_j_all: tuple, rel: tuple, factor: tuple, l_lo, whole: tuple,
           c_max, g_max) -> Split:
    """The MS enclosures (:class:`~witcert.core.bounds.Split`): the whole set (``whole``: the ``k``, ``j``, ``s``
    enclosures, and ``D``) and the low sets ``L_k = {c' <= g_k}`` of :func:`sums_kernel` (``low``).

    Any partition gives a sound split (``WitCert.tv_le_mass_split``), so the threshold values need no
    care. ``k_L`` and ``s_L`` are the low sets' own fp32 sums (:attr:`PassBudget.gamma_fp32`) from above;
    the high set's ``K_H = K - K_L`` from above (``k_j_all``: the whole row's unnormalised ``K`` from
    below and above, ``J`` from above); ``j`` has no sums of its own: ``J_L = J - J_H`` with
    ``J_H >= K_H / (1 + g_max)`` (``g / (1 + g)`` with ``g <= g_max``). ``max_L c <= min(g_k, D)``: a low
    token has ``c <= c' <= g_k``. A low set whose ``c'`` may exceed ``CS_C_LIMIT`` may hold capped ``s``
    terms: CS is not formed there.
    """
    gamma, n_lo = budget.gamma_fp32, l_lo.unsqueeze(-1)
    low = low.double()  # exact: the fp32 sums and maxima of the pass
    k_sums, s_sums, max_low = low.unbind(-2)
    (k_low_lo, k_low_hi), (_, s_low_hi) = ((budget.lower(x, e, f.unsqueeze(-1), gamma), budget.upper(x, e, f.unsqueeze(-1), gamma))
                                          for x, e, f in zip((k_sums, s_sums), rel, factor))
    k_all_lo, k_all_hi, j_all_hi = (x.unsqueeze(-1) for x in k_j_all)
    k_high = rounding.next_up(k_all_hi - k_low_lo).clamp(min=0.0) / n_lo * FP64_MARGIN
    j_high_lo = (rounding.next_down(k_all_lo - k_low_hi).clamp(min=0.0) / (1 + g_max.unsqueeze(-1))) / FP64_MARGIN
    j_low = rounding.next_up(j_all_hi - j_high_lo).clamp(min=0.0) / n_lo * FP64_MARGIN
    k_low = torch.minimum(k_low_hi / n_lo * FP64_MARGIN, whole[0].unsqueeze(-1))
    j_low = torch.minimum(j_low, whole[1].unsqueeze(-1))
    s_low = torch.minimum(s_low_hi / n_lo * FP64_MARGIN, _expm1_up(max_low) * (1 + budget.g) * k_low * FP64_MARGIN)
    s_low = torch.where(max_low <= CS_C_LIMIT, s_low, torch.full_like(s_low, math.inf))
    cols = [torch.cat([x.unsqueeze(-1), y], dim=-1) for x, y in zip((whole[0], whole[1], whole[2], c_max),
                                                                     (k_low, j_low, s_low, max_low))]
    low_sets = Enclosure(cols[0], cols[1], rounding.sub_down(1.0, cols[1]).clamp(min=0.0), cols[3], cols[2])
    return Split(low_sets, torch.cat([torch.zeros_like(k_high[..., :1]), k_high], dim=-1))


def lean_pass(scores: torch.Tensor, c: torch.Tensor, rho: torch.Tensor, v_norm: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`sums_kernel` then :func:`lean_from_sums`: the whole pass, what :mod:`witcert.fastpath.compiled` compiles."""
    return lean_from_sums(sums_kernel(scores, c, rho, v_norm), scores.shape[-1])


def probe() -> tuple[torch.Tensor, ...]:
    """Arguments that compile :func:`lean_pass` (sizes >= 2: no 0/1 specialisation; no value statistics, the
    common call: :func:`~witcert.fastpath.fused.lean_cells` without them)."""
    return torch.zeros(2, 2, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64), None, None

"""Torch implementations of every sound TV bound, sharing one pass over the tokens.

Notation (DESIGN.md §2): compressed logits ``x`` (``scores``), ``p~ = softmax(x)``, per-token
bounds ``c_t >= |eps_t|``, ``A = sum p~ e^{c}``, ``A- = sum p~ e^{-c}``, ``D = max c``.
To avoid cancellation for small ``c`` the moments are carried as
``k = A - 1 = sum p~ (e^{c} - 1) >= 0`` and ``j = 1 - A- = sum p~ (1 - e^{-c}) in [0, 1]``;
every bound is then a sum/product of non-negative quantities.

Each public bound validates its input, computes in the input's working dtype (fp32 or fp64;
fp16/bf16 are widened to fp32) and returns an upper bound on the exact-arithmetic value
(rounding inflation: ``witcert.rounding``, registry key ``FP``) in that dtype. Masked tokens
(``-inf`` logits) carry no mass and their ``c`` is ignored.
"""
from dataclasses import dataclass

import torch

from witcert import rounding
from witcert.validate import check_scores_and_bounds

# Above this c the e^{y}(e^{c}-1) term is formed as e^{y+c}(1-e^{-c}) so it cannot overflow early.
_SPLIT_C = 1.0


@dataclass(frozen=True)
class Enclosure:
    """Per-row fp64 enclosures that every bound is formed from (T1, P1, MN, RC).

    ``k_hi >= A - 1``, ``j_hi >= 1 - A-``, ``a_minus_lo <= A-`` and ``max_c = D``, each (...,).
    The torch reference builds them in :func:`moments`; the Triton kernel from its fp32
    accumulators (``kernels/certificate.py``). Every method returns an fp64 upper bound.
    """

    k_hi: torch.Tensor
    j_hi: torch.Tensor
    a_minus_lo: torch.Tensor
    max_c: torch.Tensor

    def eform(self) -> torch.Tensor:
        """T1: 1/2 (A^2 - 1) = 1/2 k (k + 2), increasing in k."""
        return rounding.up(0.5 * self.k_hi * (self.k_hi + 2))

    def two_sided(self) -> torch.Tensor:
        """P1: 1/2 (A/A- - A-/A) = (k + j)(1 + k + A-) / (2 (1 + k) A-): increasing in k, j; decreasing in A-."""
        a_minus = self.a_minus_lo
        # ((k + j) / 2A-) (1 + A-/(1 + k)): no intermediate overflow before the result itself overflows
        value = rounding.up((self.k_hi + self.j_hi) / (2 * a_minus) * (1 + a_minus / (1 + self.k_hi)), 8)
        finite = (a_minus > 0) & torch.isfinite(self.k_hi)  # else A- <= 0 or A = inf: trivial bound
        return torch.where(finite, value, torch.full_like(value, float("inf")))

    def maxnorm(self) -> torch.Tensor:
        """MN: tanh(D/2) (fp64 halving is exact)."""
        return rounding.up(torch.tanh(self.max_c / 2)).clamp(max=1.0)  # tanh <= 1 exactly

    def competitor(self) -> torch.Tensor:
        """RC: the Runtime-Certified competitor's shape tanh(D): sound, looser than tanh(D/2)."""
        return rounding.up(torch.tanh(self.max_c)).clamp(max=1.0)

    def meter(self) -> torch.Tensor:
        """The reported meter: min(1, e-form, two-sided, tanh(D/2)) -- a minimum of sound bounds."""
        return torch.minimum(torch.minimum(self.eform(), self.two_sided()), self.maxnorm()).clamp(max=1.0)


@dataclass(frozen=True)
class Moments(Enclosure):
    """The torch reference's enclosures plus the per-token masses the retention form needs.

    ``mass`` (..., S) is the computed unnormalised ``e^{x_t - max x}`` in the working dtype with
    relative errors ``mass_rho``; ``total_lo`` is a lower bound on their exact sum.
    """

    mass: torch.Tensor
    mass_rho: torch.Tensor
    total_lo: torch.Tensor


def _excess_terms(y, c, mass, y_err, live, u_ratio, dtype):
    """Per-token terms (and relative errors) of ``A - 1``, ``1 - A-`` and ``A-`` (unnormalised).

    ``k_t = e^{y}(e^{c} - 1)``, ``j_t = e^{y}(1 - e^{-c})``, ``a_t = e^{y - c}``. While every
    ``c <= 1`` (the usual case: logit errors are small) one ``m = expm1(c)`` serves all three:
    ``j_t = e^{y} m/(1 + m)``, ``a_t = e^{y}/(1 + m)``; otherwise large radii are formed from
    ``e^{y + c}`` so nothing overflows before the bound itself does.
    """
    if bool((c <= _SPLIT_C).all()):
        m = torch.expm1(c)
        one_plus = 1 + m
        return (
            (mass * m, rounding.term_relative_error(y_err, 3, dtype)),  # exp, expm1, product
            (mass * m / one_plus, rounding.term_relative_error(y_err, 5, dtype)),  # + add, division
            (mass / one_plus, rounding.term_relative_error(y_err, 4, dtype)),  # exp, expm1, add, division
        )
    small = c <= _SPLIT_C
    g = y + c  # exponent of the large-c branch
    g_err = y_err + torch.where(live, g.double().abs() * u_ratio, torch.zeros_like(y_err))
    k_terms = torch.where(small, mass * torch.expm1(c), torch.exp(g) * -torch.expm1(-c))
    k_rho = torch.where(
        small,
        rounding.term_relative_error(y_err, 3, dtype),  # exp, expm1, product
        rounding.term_relative_error(g_err, 3, dtype),  # exp, expm1, product
    )
    g_minus = y - c
    shrunk_err = y_err + torch.where(live, g_minus.double().abs() * u_ratio, torch.zeros_like(y_err))
    return (
        (k_terms, k_rho),
        (mass * -torch.expm1(-c), rounding.term_relative_error(y_err, 3, dtype)),  # in [0, e^{y}]
        (torch.exp(g_minus), rounding.term_relative_error(shrunk_err, 1, dtype)),
    )


def moments(scores: torch.Tensor, c: torch.Tensor) -> Moments:
    """One pass over the tokens: the enclosures every bound is built from (T1, P1, MN inputs)."""
    dtype = scores.dtype
    u_ratio = rounding.unit_roundoff(dtype) / (1 - rounding.unit_roundoff(dtype))
    live = scores > float("-inf")
    masked = not bool(live.all())
    if masked:
        c = c.masked_fill(~live, 0.0)  # a masked token's c is irrelevant (and may be inf)
    y = scores - scores.amax(-1, keepdim=True)  # (..., S) <= 0; -inf where masked
    y_err = y.double().abs() * u_ratio  # (not in place: .double() of fp64 is y itself)
    if masked:
        y_err = y_err.masked_fill(~live, 0.0)

    mass = torch.exp(y)  # e^{y_t}: p~_t times the normaliser
    mass_rho = rounding.term_relative_error(y_err, 1, dtype)
    (k_terms, k_rho), (j_terms, j_rho), (shrunk, shrunk_rho) = _excess_terms(y, c, mass, y_err, live, u_ratio, dtype)

    total_lo = rounding.sum_lower(mass, mass_rho)  # >= 1 - tiny slack: the max token contributes 1
    total_hi = rounding.sum_upper(mass, mass_rho)
    k_hi = rounding.up(rounding.sum_upper(k_terms, k_rho) / total_lo)
    j_hi = rounding.up(rounding.sum_upper(j_terms, j_rho) / total_lo)
    direct = rounding.sum_lower(shrunk, shrunk_rho) / total_hi
    a_minus_lo = torch.maximum(1 - j_hi, direct * (1 - 4 * rounding.FP64_SLACK))
    max_c = c.amax(-1).double()  # masked tokens already carry c = 0
    return Moments(k_hi, j_hi, a_minus_lo, max_c, mass, mass_rho, total_lo)


def _retention(m: Moments, c: torch.Tensor) -> torch.Tensor:
    """P1r: 1/2 sum p~_t min(A e^{c} - 1, max(e^{c}/A- - 1, 1 - e^{-c}/A)), written without cancellation.

    ``A e^c - 1 = expm1(c) + k e^c``; ``e^c/A- - 1 = (expm1(c) + j)/A-``;
    ``1 - e^{-c}/A = (k - expm1(-c))/(1 + k)``: each increasing in ``k``, ``j`` and decreasing in ``A-``.
    """
    c64 = c.double()
    k, j, a_minus = m.k_hi.unsqueeze(-1), m.j_hi.unsqueeze(-1), m.a_minus_lo.unsqueeze(-1)
    em1 = torch.expm1(c64)
    grow = em1 + k * torch.exp(c64)
    rise = torch.where(a_minus > 0, (em1 + j) / a_minus, torch.full_like(em1, float("inf")))
    fall = (k - torch.expm1(-c64)) / (1 + k)
    per_token = torch.minimum(grow, torch.maximum(rise, fall))  # (..., S)
    mass = m.mass.double()
    weighted = torch.where(mass > 0, mass * (1 + m.mass_rho) * per_token, torch.zeros_like(mass))
    n = c.shape[-1]
    value = rounding.up(0.5 * weighted.sum(-1) * (1 + (n + 4) * 2.0**-52) / m.total_lo, 16)
    return torch.where(torch.isfinite(m.k_hi), value, torch.full_like(value, float("inf")))


def _public(bound_of_moments):
    """Wrap a moments -> fp64 bound function as a validated public bound in the working dtype."""

    def bound(scores, c) -> torch.Tensor:
        scores, c = check_scores_and_bounds(scores, c)
        return rounding.round_up_to(bound_of_moments(moments(scores, c)), scores.dtype)

    bound.__name__ = bound_of_moments.__name__ + "_bound"
    bound.__doc__ = (
        f"{bound_of_moments.__doc__}\n\n"
        "Parameters\n----------\nscores : Tensor (..., S)\n    compressed logits; -inf masks a token.\n"
        "c : Tensor broadcastable to scores\n    per-token bounds c_t >= |eps_t| (>= 0, may be inf).\n\n"
        "Returns\n-------\nTensor (...)\n    an upper bound (not clamped) in the working dtype, never below the exact value."
    )
    return bound


eform_bound = _public(Enclosure.eform)
two_sided_bound = _public(Enclosure.two_sided)
maxnorm_bound = _public(Enclosure.maxnorm)
competitor_bound = _public(Enclosure.competitor)


def retention_bound(scores, c) -> torch.Tensor:
    """P1r, the per-token retention form (sound; rarely tighter, so not in the default meter).

    Parameters and returns as :func:`eform_bound`; computed in fp64 from the working-dtype masses.
    """
    scores, c = check_scores_and_bounds(scores, c)
    live = scores > float("-inf")
    m = moments(scores, c)
    c_live = torch.where(live, c, torch.zeros_like(c))
    return rounding.round_up_to(_retention(m, c_live), scores.dtype)

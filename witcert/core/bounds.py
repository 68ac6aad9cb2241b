"""Torch implementations of every sound TV bound, sharing one pass over the tokens.

Notation (docs/design.md "Notation"): compressed logits ``x`` (``scores``), ``p~ = softmax(x)``, per-token
bounds ``c_t >= |eps_t|``, ``A = sum p~ e^{c}``, ``A- = sum p~ e^{-c}``, ``D = max c``.
To avoid cancellation for small ``c`` the moments are carried as
``k = A - 1 = sum p~ (e^{c} - 1) >= 0`` and ``j = 1 - A- = sum p~ (1 - e^{-c}) in [0, 1]``;
every bound is then a sum/product of non-negative quantities.

Each public bound validates its input, computes in the input's working dtype (fp32 or fp64;
fp16/bf16 are widened to fp32) and returns an upper bound on the exact-arithmetic value
(rounding inflation: ``witcert.core.rounding``, registry key ``FP``) in that dtype. Masked tokens
(``-inf`` logits) carry no mass and their ``c`` is ignored.
"""
from dataclasses import dataclass

import torch

from witcert.core import rounding
from witcert.core.rounding import add_down, add_up, div_up, mul_up
from witcert.core.checks import check_scores_and_bounds

# Above this c the e^{y}(e^{c}-1) term is formed as e^{y+c}(1-e^{-c}) so it cannot overflow early.
_SPLIT_C = 1.0


@dataclass(frozen=True)
class Enclosure:
    """Per-row fp64 enclosures that every bound is formed from (T1, P1, MN, RC).

    ``k_hi >= A - 1``, ``j_hi >= 1 - A-``, ``a_minus_lo <= A-`` and ``max_c >= D``, each (...,).
    The torch reference builds them in :func:`moments`; the Triton kernel from its fp32
    accumulators (``kernels/certificate.py``). Every method returns an fp64 upper bound, formed
    with directed operations (``witcert.core.rounding``) so it holds in the subnormal range too.
    """

    k_hi: torch.Tensor
    j_hi: torch.Tensor
    a_minus_lo: torch.Tensor
    max_c: torch.Tensor

    def eform(self) -> torch.Tensor:
        """T1: 1/2 (A^2 - 1) = 1/2 k (k + 2), increasing in k."""
        k = self.k_hi
        return rounding.mul_up(rounding.mul_up(k, rounding.add_up(k, 2.0)), 0.5)

    def two_sided(self) -> torch.Tensor:
        """P1: 1/2 (A/A- - A-/A) = (k + j)/2 (1/A- + 1/(1 + k)): increasing in k (j <= 1) and j, decreasing in A-."""
        k, a_minus = self.k_hi, self.a_minus_lo
        excess = rounding.add_up(k, self.j_hi)
        # (k + j)/A- + (k + j)/(1 + k): no intermediate overflow before the result itself overflows
        both = rounding.add_up(rounding.div_up(excess, a_minus), rounding.div_up(excess, rounding.add_down(1.0, k)))
        value = rounding.mul_up(both, 0.5)
        finite = (a_minus > 0) & torch.isfinite(k)  # else A- <= 0 or A = inf: trivial bound
        return torch.where(finite, value, torch.full_like(value, float("inf")))

    def maxnorm(self) -> torch.Tensor:
        """MN: tanh(D/2) (halving a subnormal D rounds: rounded up here)."""
        return rounding.tanh_up(rounding.mul_up(self.max_c.double(), 0.5))

    def competitor(self) -> torch.Tensor:
        """RC: the Runtime-Certified competitor's shape tanh(D): sound, looser than tanh(D/2)."""
        return rounding.tanh_up(self.max_c.double())

    def meter(self) -> torch.Tensor:
        """The reported meter: min(1, e-form, two-sided, tanh(D/2)) -- a minimum of sound bounds."""
        return torch.minimum(torch.minimum(self.eform(), self.two_sided()), self.maxnorm()).clamp(max=1.0)


@dataclass(frozen=True)
class Moments(Enclosure):
    """The torch reference's enclosures plus the per-token terms the retention form needs.

    ``mass``, ``excess`` and ``shortfall`` are the unnormalised ``e^{y}``, ``e^{y}(e^{c} - 1)``
    and ``e^{y}(1 - e^{-c})`` (``y = x - max x``) as :class:`witcert.core.rounding.Terms`;
    ``total_lo`` is a lower bound on the exact sum of the masses (the softmax normaliser);
    ``live`` (..., S) marks the unmasked tokens.
    """

    mass: rounding.Terms
    excess: rounding.Terms
    shortfall: rounding.Terms
    total_lo: torch.Tensor
    live: torch.Tensor


def _excess_terms(y, c, mass, y_err, live, live_or_all, u_ratio, dtype):
    """Per-token :class:`~witcert.core.rounding.Terms` of ``A - 1``, ``1 - A-`` and ``A-`` (unnormalised).

    ``k_t = e^{y}(e^{c} - 1)``, ``j_t = e^{y}(1 - e^{-c})``, ``a_t = e^{y - c}``. While every
    ``c <= 1`` (the usual case: logit errors are small) one ``m = expm1(c)`` serves all three:
    ``j_t = e^{y} m/(1 + m)``, ``a_t = e^{y}/(1 + m)`` (factors <= e - 1 < 2 on ``e^{y}``);
    otherwise large radii are formed from ``e^{y + c}`` so nothing overflows before the bound
    itself does.
    """
    of_exp = rounding.Terms.of_exp
    if bool((c <= _SPLIT_C).all()):
        m = torch.expm1(c)
        one_plus = 1 + m
        return (
            of_exp(mass * m, y, y_err, 3, live_or_all),  # exp, expm1, product
            of_exp(mass * m / one_plus, y, y_err, 5, live_or_all),  # + add, division
            of_exp(mass / one_plus, y, y_err, 4, live_or_all),  # exp, expm1, add, division
        )
    small = c <= _SPLIT_C
    g = y + c  # exponent of the large-c branch
    g_err = y_err + torch.where(live, g.double().abs() * u_ratio, torch.zeros_like(y_err))
    k_values = torch.where(small, mass * torch.expm1(c), torch.exp(g) * -torch.expm1(-c))
    k_exponent = torch.where(small, y, g)
    k_err = torch.where(small, y_err, g_err)
    g_minus = y - c
    shrunk_err = y_err + torch.where(live, g_minus.double().abs() * u_ratio, torch.zeros_like(y_err))
    return (
        of_exp(k_values, k_exponent, k_err, 3, live_or_all),  # exp, expm1, product
        of_exp(mass * -torch.expm1(-c), y, y_err, 3, live_or_all),  # in [0, e^{y}]
        of_exp(torch.exp(g_minus), g_minus, shrunk_err, 1, live_or_all),
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

    live_or_all = live if masked else None  # None: every token live (scalar underflow slack)
    mass = rounding.Terms.of_exp(torch.exp(y), y, y_err, 1, live_or_all)  # e^{y_t}: p~_t times the normaliser
    excess, shortfall, shrunk = _excess_terms(y, c, mass.values, y_err, live, live_or_all, u_ratio, dtype)

    total_lo = rounding.sum_lower(mass)  # >= 1 - tiny slack: the max token contributes 1
    total_hi = rounding.sum_upper(mass)
    k_hi = rounding.div_up(rounding.sum_upper(excess), total_lo)
    j_hi = rounding.div_up(rounding.sum_upper(shortfall), total_lo)
    direct = rounding.div_down(rounding.sum_lower(shrunk), total_hi)
    a_minus_lo = torch.maximum(rounding.sub_down(1.0, j_hi), direct).clamp(min=0.0)
    max_c = c.amax(-1).double()  # masked tokens already carry c = 0
    return Moments(k_hi, j_hi, a_minus_lo, max_c, mass, excess, shortfall, total_lo, live)


def _retention(m: Moments) -> torch.Tensor:
    """P1r: 1/2 sum p~_t min(A e^{c} - 1, max(e^{c}/A- - 1, 1 - e^{-c}/A)), each branch times the mass.

    With ``M_t = e^{y}``, ``K_t = e^{y}(e^{c} - 1)``, ``J_t = e^{y}(1 - e^{-c})`` (``p~_t = M_t / Z``):
    ``M (A e^c - 1) = K (1 + k) + k M``, ``M (e^c/A- - 1) = (K + j M)/A-``,
    ``M (1 - e^{-c}/A) = (k M + J)/(1 + k)``. The per-token factors ``e^{c}`` never meet a mass
    that underflowed: each term carries its own underflow slack (:meth:`Terms.upper`), and
    each branch is increasing in ``M, K, J, k, j`` and decreasing in ``A-`` (``J <= M``).
    """
    k, j, a_minus = m.k_hi.unsqueeze(-1), m.j_hi.unsqueeze(-1), m.a_minus_lo.unsqueeze(-1)
    mass, excess = m.mass.upper(), m.excess.upper()
    shortfall = torch.minimum(m.shortfall.upper(), mass)  # J <= M keeps fall increasing in k
    k_mass = mul_up(k, mass)
    grow = add_up(mul_up(excess, add_up(1.0, k)), k_mass)
    rise = div_up(add_up(excess, mul_up(j, mass)), a_minus)  # inf where A- = 0
    fall = div_up(add_up(k_mass, shortfall), add_down(1.0, k))
    per_token = torch.minimum(grow, torch.maximum(rise, fall))  # (..., S)
    per_token = torch.where(m.live, per_token, torch.zeros_like(per_token))  # masked tokens: no mass
    value = mul_up(div_up(rounding.sum_up(per_token), m.total_lo), 0.5)
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

    Parameters and returns as :func:`eform_bound`; computed in fp64 from the working-dtype terms.
    """
    scores, c = check_scores_and_bounds(scores, c)
    return rounding.round_up_to(_retention(moments(scores, c)), scores.dtype)

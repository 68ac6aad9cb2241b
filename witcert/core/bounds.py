"""Torch implementations of every sound TV bound, sharing one pass over the tokens.

Notation (docs/design.md "Notation"): compressed logits ``x`` (``scores``), ``p~ = softmax(x)``, per-token
bounds ``c_t >= |eps_t|``, ``A = sum p~ e^{c}``, ``A- = sum p~ e^{-c}``, ``D = max c``.
To avoid cancellation for small ``c`` the moments are carried as
``k = A - 1 = sum p~ (e^{c} - 1) >= 0`` and ``j = 1 - A- = sum p~ (1 - e^{-c}) in [0, 1]``;
every bound is then a sum/product of non-negative quantities. The chi-square bound (CS) adds
``s = sum p~ expm1(c)^2``; the mass-split bound (MS) needs ``k``, ``j``, ``s`` and ``max c`` over the
low sets ``L_g = {c <= g}`` and ``k`` over their complements, for its fixed thresholds ``g``: each
token falls in one bucket of the threshold grid (:func:`split_buckets`), the pass keeps per-bucket
sums, and running sums over the buckets give every set (no second pass over the tokens).

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
SPLIT_LEVELS = 12
"""MS thresholds: ``D = max c`` and the ``SPLIT_LEVELS - 1`` largest floats ``(1 + r/4) 2^q`` below ``D``
(``spec.bounds.MASS_SPLIT_LEVELS``, ``mass_split_thresholds``)."""


@dataclass(frozen=True)
class Enclosure:
    """Per-row fp64 enclosures that every bound is formed from (T1, P1, MN, RC, CS, MS).

    ``k_hi >= A - 1``, ``j_hi >= 1 - A-``, ``a_minus_lo <= A-`` and ``max_c >= D``, each (...,);
    optionally ``second_hi >= sum p~ expm1(c)^2`` (CS; ``None``: CS is not formed) and ``split``,
    the MS enclosures (``None``: MS reduces to its ``g = D`` term). The torch reference builds them
    in :func:`moments`; the Triton kernel from its fp32 accumulators (``kernels/certificate.py``).
    Every method returns an fp64 upper bound, formed with directed operations
    (``witcert.core.rounding``) so it holds in the subnormal range too.
    """

    k_hi: torch.Tensor
    j_hi: torch.Tensor
    a_minus_lo: torch.Tensor
    max_c: torch.Tensor
    second_hi: torch.Tensor | None = None
    split: "Split | None" = None

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

    def chi_square(self) -> torch.Tensor:
        """CS: sqrt(s) / (2 A-), increasing in s, decreasing in A- (``inf`` without ``second_hi`` or at A- = 0)."""
        if self.second_hi is None:
            return torch.full_like(self.k_hi, float("inf"))
        return rounding.div_up(rounding.sqrt_up(self.second_hi), rounding.mul_down(self.a_minus_lo, 2.0))  # x/0 = inf

    def unsplit(self) -> torch.Tensor:
        """min(T1, P1, CS, MN): every bound of the radii themselves (MS at g = D)."""
        return torch.minimum(torch.minimum(self.eform(), self.two_sided()), torch.minimum(self.chi_square(), self.maxnorm()))

    def mass_split(self) -> torch.Tensor:
        """MS: min over the thresholds of the split bound (:class:`Split`, whose first threshold is
        ``g = D``, i.e. :meth:`unsplit`); without ``split``, :meth:`unsplit` alone."""
        return self.unsplit() if self.split is None else self.split.bound()

    def meter(self) -> torch.Tensor:
        """The reported meter: min(1, T1, P1, MN, CS, MS) -- a minimum of sound bounds (MS holds the others)."""
        return self.mass_split().clamp(max=1.0)


@dataclass(frozen=True)
class Split:
    """The MS enclosures at the thresholds ``g_0 = D > g_1 > ... > g_{K-1}``, each field (..., K).

    ``low`` encloses the radii ``c 1_L`` of each low set ``L_k = {c <= g_k}`` (its ``a_minus_lo <= A-_L =
    E_p~[e^{-c 1_L}]``, ``max_c >= max_L c``); ``high_hi >= sum_H p~ expm1(c)`` over the complement
    ``H_k`` (0 at ``k = 0``, where ``L_0`` holds every token and the bound is the unsplit one).
    """

    low: Enclosure
    high_hi: torch.Tensor

    def bound(self) -> torch.Tensor:
        """min_k [B_L + 1/2 ((1 + delta)^2 - 1)], ``B_L = min(T1, P1, CS, MN)(c 1_L)``, ``delta = high / A-_L``
        (Lean ``WitCert.tv_le_mass_split_min``), increasing in ``high`` and decreasing in ``A-_L``."""
        first = self.low.unsplit()
        delta = rounding.div_up(self.high_hi, self.low.a_minus_lo)
        second = rounding.mul_up(rounding.mul_up(delta, rounding.add_up(delta, 2.0)), 0.5)
        split = torch.where(second == 0, first, rounding.add_up(first, second))  # x + 0 is exact: MS = 0 at c = 0
        return split.amin(-1)


@dataclass(frozen=True, kw_only=True)
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


@dataclass(frozen=True)
class TokenSums:
    """What one pass over the tokens produces: enclosed sums of the unnormalised terms, per row.

    ``mass`` and ``shrunk``: ``sum e^{y}`` and ``sum e^{y - c}`` (K = 1). ``excess``, ``shortfall`` and
    ``second``: the per-bucket sums (K = ``SPLIT_LEVELS``, bucket ``r`` of :func:`split_buckets`) of
    ``e^{y}(e^{c} - 1)``, ``e^{y}(1 - e^{-c})`` and ``e^{y}(e^{c} - 1)^2``; ``bucket_max_c`` (..., K) the
    largest radius in each bucket (0 if empty) and ``max_c`` (...,) ``D``. :func:`moments` fills it.
    """

    mass: rounding.Sums
    shrunk: rounding.Sums
    excess: rounding.Sums
    shortfall: rounding.Sums
    second: rounding.Sums
    bucket_max_c: torch.Tensor
    max_c: torch.Tensor

    def enclosure(self) -> tuple[Enclosure, torch.Tensor]:
        """The :class:`Enclosure` (with CS and MS) and ``total_lo``, the normaliser from below.

        Every threshold at once, in (..., K) tensors: set ``k`` is ``L_k`` = buckets ``r >= k`` (running
        sums from the top bucket; ``L_0`` = every token, the unsplit bound) and ``H_k`` = buckets ``r < k``.
        """
        mass = _stack_sums((self.mass, self.shrunk))  # (..., 2, 1)
        total_lo, shrunk_lo = mass.lower().squeeze(-1).unbind(-1)  # total >= 1 - tiny slack: the max token gives 1
        total_hi = mass.upper()[..., 0, 0]
        per = _stack_sums((self.excess, self.excess, self.shortfall, self.second))  # (..., 4, K)
        running = per.computed.flip(-1).cumsum(-1).flip(-1)  # suffix: L_k, continuing the bucket sums' tree
        high = torch.cat([torch.zeros_like(running[..., 1, :1]), per.computed[..., 1, :-1].cumsum(-1)], dim=-1)
        running = torch.stack([running[..., 0, :], high, running[..., 2, :], running[..., 3, :]], dim=-2)
        sets = rounding.div_up(rounding.Sums(running, per.n_terms, per.rho, per.absolute).upper(), total_lo[..., None, None])
        k_sets, k_high, j_sets, second_sets = sets.unbind(-2)  # (..., K) each, normalised
        # H_0 is empty: exactly 0, not the underflow slack of every token (which A-_0 ~ e^{-700} would magnify)
        k_high = torch.cat([torch.zeros_like(k_high[..., :1]), k_high[..., 1:]], dim=-1)
        max_low = self.bucket_max_c.double().flip(-1).cummax(-1).values.flip(-1)  # max c over r >= k
        # s <= max(expm1 c) k: keeps CS exact at c = 0, where sqrt would magnify the underflow slack
        second_sets = torch.minimum(second_sets, rounding.mul_up(rounding.expm1_up(max_low), k_sets))
        direct = rounding.div_down(shrunk_lo, total_hi)  # A- summed directly (keeps A- ~ e^{-700}), set 0 only
        a_minus = rounding.sub_down(1.0, j_sets)
        a_minus = torch.cat([torch.maximum(a_minus[..., :1], direct.unsqueeze(-1)), a_minus[..., 1:]], dim=-1).clamp(min=0.0)
        low = Enclosure(k_sets, j_sets, a_minus, max_low, second_sets)
        encl = Enclosure(k_sets[..., 0], j_sets[..., 0], a_minus[..., 0], self.max_c.double(), second_sets[..., 0],
                         Split(low, k_high))
        return encl, total_lo


def _stack_sums(parts: tuple[rounding.Sums, ...]) -> rounding.Sums:
    """One :class:`Sums` (..., P, K) of several with the same ``n_terms`` (one enclosure pass for all)."""
    computed = torch.stack([p.computed for p in parts], dim=-2)
    lead = (*computed.shape[:-2], 1)

    def rows(x) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.float64).expand(lead)

    return rounding.Sums(computed, parts[0].n_terms, torch.stack([rows(p.rho) for p in parts], dim=-2),
                         torch.stack([rows(p.absolute) for p in parts], dim=-2))


def split_buckets(c: torch.Tensor, max_c: torch.Tensor) -> torch.Tensor:
    """Bucket ``r_t`` (..., S) in ``[0, SPLIT_LEVELS - 1]``: token ``t`` is in ``L_k = {c <= g_k}`` iff ``r_t >= k``.

    ``g_k`` (``1 <= k < SPLIT_LEVELS``) is the ``k``-th largest float ``(1 + r/4) 2^q`` strictly below
    ``D = max_c`` (``spec.bounds.mass_split_thresholds``). With ``c = m 2^e`` (``frexp``), the least
    grid value ``>= c`` has index ``4e + ceil(8m)`` (up to a constant), exactly: ``8m`` is exact and
    in ``[4, 8)``. So ``c <= g_k`` iff ``index(c) <= index(D) - k``. A radius 0 lands in some
    bucket; it adds nothing to any sum there. An infinite radius lands in bucket 0 (never low).
    """
    def index(x):
        mantissa, exponent = torch.frexp(x)
        return torch.ceil(mantissa * 8) + exponent * 4

    top = index(max_c)
    top = torch.where(torch.isfinite(max_c), top, torch.zeros_like(top))  # D = inf: MS is 1 anyway
    return (top.unsqueeze(-1) - index(c)).clamp_(0, SPLIT_LEVELS - 1).long()


def _row_exponent_error(y: torch.Tensor, live: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``u/(1-u) min(max_t |y_t|, reach')`` (..., 1) >= the error of every exponent ``y = fl(x - max x)``
    whose term may reach the normal range (``Terms.of_exp_rows``: ``|y| u/(1-u)``, and only tokens with
    ``y + |y| u/(1-u) > -reach``, i.e. ``|y| < reach (1 + 2^-20) = reach'``, can). Two working-dtype passes."""
    u = rounding.unit_roundoff(dtype)
    low = (y if live is None else torch.where(live, y, torch.zeros_like(y))).amin(-1, keepdim=True)  # -max |y|
    reach = rounding.exponent_reach(dtype) * (1 + 2.0**-20)
    return low.double().neg().clamp(max=reach) * (u / (1 - u) * (1 + 2.0**-40))


def _terms_small(y, c, mass, live, dtype):
    """Every per-token term while every ``c <= 1`` (the usual case: logit errors are small).

    One ``m = expm1(c)`` serves all: ``k_t = e^{y} m``, ``j_t = k_t/(1 + m)``, ``a_t = e^{y}/(1 + m)``
    (``= e^{y - c}``), ``s_t = k_t m``; the factors on ``e^{y}`` are below ``e - 1 < 2`` (``(e - 1)^2 < 3``
    for ``s_t``), and every exponent is ``y``: one relative error per row (:meth:`Terms.of_exp_rows`).
    """
    m = torch.expm1(c)
    one_plus = 1 + m
    excess = mass * m
    err = _row_exponent_error(y, live, dtype)
    rows = rounding.Terms.of_exp_rows
    return (
        rows(mass, err, 1),  # exp
        rows(excess, err, 3),  # exp, expm1, product
        rows(excess / one_plus, err, 5),  # + add, division
        rows(mass / one_plus, err, 4),  # exp, expm1, add, division
        rows(excess * m, err, 5, factor=3.0),  # exp, expm1 twice, two products
    )


def _terms_large(y, c, mass, live, dtype):
    """Every per-token term when some ``c > 1``: large radii are formed from ``e^{y + c}`` (and
    ``e^{y + 2c}``, ``e^{y - c}``) so that nothing underflows or overflows before the exact term does.

    A shifted exponent ``e = fl(y + k c)`` is off by ``(|y| + |e|) u/(1-u)``, which can be large (a
    huge ``|y|`` under a huge ``c``): each row takes the largest error over the tokens whose exponent
    interval reaches above ``-reach`` (the others are below the normal range); an error above
    ``log 2`` makes the row's bounds ``inf`` (sound; such radii saturate the meter anyway).
    """
    u_ratio = rounding.unit_roundoff(dtype) / (1 - rounding.unit_roundoff(dtype))
    reach = rounding.exponent_reach(dtype)
    y_abs = y.double().abs()
    small = c <= _SPLIT_C

    def row_error(exponent: torch.Tensor, shifted: torch.Tensor | None) -> torch.Tensor:
        e = exponent.double()
        err = y_abs if shifted is None else y_abs + torch.where(shifted, e.abs(), torch.zeros_like(e))
        err = err * u_ratio
        relevant = live & (e + err > -reach)  # masked tokens: -inf + inf is NaN, not relevant
        return torch.where(relevant, err, torch.zeros_like(err)).amax(-1, keepdim=True) * (1 + 2.0**-40)

    m = torch.expm1(c)
    shrink = -torch.expm1(-c)  # 1 - e^{-c}, in [0, 1]
    g1, g2, g_minus = y + c, y + 2.0 * c, y - c
    rows = rounding.Terms.of_exp_rows
    excess_exponent, second_exponent = torch.where(small, y, g1), torch.where(small, y, g2)
    y_error = row_error(y, None)
    return (
        rows(mass, y_error, 1),
        rows(torch.where(small, mass * m, torch.exp(g1) * shrink), row_error(excess_exponent, ~small), 3),
        rows(mass * shrink, y_error, 3),  # exp, expm1, product; in [0, e^{y}]
        rows(torch.exp(g_minus), row_error(g_minus, torch.ones_like(small)), 1),
        rows(torch.where(small, mass * m * m, torch.exp(g2) * shrink * shrink), row_error(second_exponent, ~small),
             5, factor=3.0),  # exp, expm1 twice, two products
    )


def moments(scores: torch.Tensor, c: torch.Tensor) -> Moments:
    """One pass over the tokens: the enclosures every bound is built from (T1, P1, MN, CS, MS inputs)."""
    dtype = scores.dtype
    live = scores > float("-inf")
    masked = not bool(live.all())
    if masked:
        c = c.masked_fill(~live, 0.0)  # a masked token's c is irrelevant (and may be inf)
    y = scores - scores.amax(-1, keepdim=True)  # (..., S) <= 0; -inf where masked
    max_c = c.amax(-1)  # masked tokens already carry c = 0
    if bool((max_c <= _SPLIT_C).all()):
        terms = _terms_small(y, c, torch.exp(y), live if masked else None, dtype)
    else:
        terms = _terms_large(y, c, torch.exp(y), live, dtype)
    mass, excess, shortfall, shrunk, second = terms
    buckets = split_buckets(c, max_c)  # (..., S)

    def bucketed(t: rounding.Terms) -> rounding.Sums:
        per = torch.zeros(*t.values.shape[:-1], SPLIT_LEVELS, dtype=dtype).scatter_add_(-1, buckets, t.values)
        return t.sums(per)

    bucket_max = torch.zeros(*c.shape[:-1], SPLIT_LEVELS, dtype=dtype).scatter_reduce_(-1, buckets, c, "amax")
    sums = TokenSums(mass.sums(mass.values.sum(-1, keepdim=True)), shrunk.sums(shrunk.values.sum(-1, keepdim=True)),
                     bucketed(excess), bucketed(shortfall), bucketed(second), bucket_max, max_c)
    encl, total_lo = sums.enclosure()
    return Moments(encl.k_hi, encl.j_hi, encl.a_minus_lo, encl.max_c, encl.second_hi, encl.split,
                   mass=mass, excess=excess, shortfall=shortfall, total_lo=total_lo, live=live)


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
chi_square_bound = _public(Enclosure.chi_square)
mass_split_bound = _public(Enclosure.mass_split)


def retention_bound(scores, c) -> torch.Tensor:
    """P1r, the per-token retention form (sound; rarely tighter, so not in the default meter).

    Parameters and returns as :func:`eform_bound`; computed in fp64 from the working-dtype terms.
    """
    scores, c = check_scores_and_bounds(scores, c)
    return rounding.round_up_to(_retention(moments(scores, c)), scores.dtype)

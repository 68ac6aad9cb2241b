"""The kernel's meter: fp64 enclosures of ``A - 1``, ``1 - A-`` and ``sum p~ expm1(c)^2`` from the fp32 accumulators (FP).

``kernels/decode_attention.py`` accumulates, per (batch, query head), in fp32 with an online
max and split-KV merge (``kernels/merge.py``)::

    l = sum_t e^{y_t},  k = sum_t e^{y_t} g_t,  j = sum_t e^{y_t} (1 - e^{-c'_t}),  s = sum_t e^{y_t} min(g_t, G)^2

with ``y_t = s'_t - m`` (``s'_t`` the kernel's fp64 logit, ``m`` the max), ``g_t = e^{c'_t} - 1``
and ``G = SECOND_G_CAP``. This module turns them into an upper bound on the exact-arithmetic meter
``min(1, 1/2(A^2-1), 1/2(A/A- - A-/A), tanh(D/2), 1/2 sqrt(E_p~[expm1(c)^2]) / A-)`` of Theorem 1
(``T1``), Proposition 1 (``P1``), the max-norm bound (``MN``) and the chi-square bound (``CS``),
reusing the bound formulas of ``witcert.core.bounds`` and the error constants of
``witcert.core.rounding`` (registry key ``FP``).

The torch meter also takes the mass-split bound (``MS``), which needs per-bucket sums over a
grid anchored at ``D = max c`` (not known until the last split is merged); the kernel does not
accumulate them, so its meter is ``min(1, T1, P1, MN, CS)``: still sound, never below the torch
meter or the golden (which are a minimum over more sound bounds; registry row ``MS``:
``kernel=None``).

Chi-square moment. ``G = 2^46`` keeps each ``s`` term below ``2^92`` and the sum of up to ``2^31``
of them finite in fp32 (an ``inf`` times a zero rescale factor would be NaN). No term is capped
when ``c'_max <= SECOND_C_LIMIT = 31`` (``e^31 - 1 < 2^45``, whatever the ``expm1`` error); a row
with a larger ``c'`` reports CS = ``inf`` (T1 and MN still hold it). Logit rounding: with
``p~_t <= p'_t e^{delta_t + delta_max}`` (below) and ``e^{delta} expm1(c)^2 <= expm1(c + delta)^2``
(``delta >= 0``), ``E_p~[expm1(c)^2] <= e^{delta_max} s/l``; independently ``E_p~[expm1(c)^2] <=
expm1(D) (A - 1)``, and the smaller of the two is kept. The ``s`` terms carry the ``k`` terms' errors
plus one more ``expm1``-type factor and one more product; every ``g`` in the ``k`` analysis below
becomes ``g^2``.

Rounding budget (``u = 2^-24``, ``eps_exp`` from ``witcert.core.rounding.exp_relative_error``)
------------------------------------------------------------------------------------
Logit rounding. ``|s'_t - s_t| <= delta_t = sm_scale kappa_dot sum_i |q_i k_i|`` with
``kappa_dot`` twice ``(2 d + 8) 2^-53``: the fp64 dot (any order, at most ``d + 1`` roundings on
the path of a product: the product itself, which is exact for fp16/fp32 keys and may round once
for dequantized INT8 keys, and the adds), the fp64 scale product and the fp64 rounding of
``1/sqrt(d)`` (``sm_scale`` is read from an fp64 tensor and taken as the exact multiplier of the
exact logits); the fp32 ``sum |q||k|`` (``|k|`` rounded to fp32 once) falls short by at most ``(d + 1) u``
relative, far less than the factor two kept, plus what underflow loses: below ``2^-126`` per
product and per partial sum (a GPU may flush subnormals), covered by adding ``d 2^-125``
(``DOT_FLOOR``) before the fp64 product with ``sm_scale kappa_dot``, which is then rounded up to
fp32 (``kernels/radius.py``). With ``p'`` the softmax of the kernel's logits and ``p~`` the exact one,
``p~_t <= p'_t e^{delta_t + delta_max}``, so ``A <= e^{delta_max} sum_t p'_t e^{c_t + delta_t}``:
the kernel accumulates with ``c'_t >= c_t + delta_t`` and here
``A - 1 <= expm1(delta_max) + e^{delta_max} k/l`` and ``1 - A- <= delta_max + j/l``.

Radii (``kernels/radius.py``). ``c_t`` is computed in fp64 from the exact fp64 images of the
query, witness and scales (squares and products of fp32-range values neither underflow nor
overflow in fp64), so its relative error is a count of roundings for every query magnitude:
Tier A, band sums of ``2P`` exact squares, a sqrt, ``B`` products and ``B - 1`` additions, the
scale product: below ``(2P + B + 4) 2^-53``, ``kappa_c`` is twice that; Tier B below
``(d + 24) 2^-53`` (``kernels/packed_keys.py``), ``kappa_b`` is twice that. Both are far below
``2^-23`` (checked), which the fp32 round-up (``x (1 + 2^-21)`` then the cast, with floor
``2^-126``) covers: the fp32 ``c_t`` is never below the exact radius and above it by at most
``RADIUS_EXCESS`` relative (or is the floor ``2^-126``).

Exponent arguments. Each term's exponent is off by at most ``4.001 u |y_t|``: the fp32 cast of
``y_t`` (fp64 subtraction below ``2^-53 |y_t|``), the ``log2 e`` product inside ``exp``, and, for
all rescalings together (online max within a split, then ``r_i = e^{m_i - M}`` in stage 2),
twice ``u`` times a telescoping sum of max increments, itself at most ``|y_t|``. Weighted by the
terms: ``sum_t e^{y_t} |y_t| = l E_p'|y| <= l ln S`` (``E_p'[m - s'] = H(p') - ln l <= ln S``),
so the relative error from exponents is at most ``a_l = 4.1 u ln S`` for ``l``, and for ``k``
and ``j`` either ``a_rel = 4.1 u 88`` relative (normal-range terms have ``|y| <= 88``) or
``4.1 u g(c'_max) l ln S`` absolute, whichever is smaller.

Assumption (as ``witcert.core.rounding``): one fp32 ``exp`` is within ``EXP_ULPS`` ulps (the CPU
interpreter's numpy ``exp`` is; on CUDA ``tl.exp`` is ``ex2.approx`` of ``y log2 e``, whose
argument product is the ``log2 e`` term above -- the ulp bound of ``ex2.approx`` is assumed,
not measured here).

Everything else is a per-term relative error: ``exp`` of ``y`` and of each of the at most
``blocks_per_split + 1`` rescale factors (``eps_exp + u`` each, products included), the
``expm1``-type factor of ``k``/``j`` (``kernels/expm1.py``) and its product, and the summation
tree of depth ``(block_n - 1) + blocks_per_split + num_splits`` (``u`` per level, Higham Thm 4.4).
Terms that land below the normal range are off by at most ``2 tiny`` each, times ``g(c'_max)``.

Overflow. ``c'`` is capped at ``C_CAP = 64`` inside the exponent; any capped row reports the
trivial meter 1, which is also ``tanh(D/2)`` in fp64 there (``D > 63.9``), and a risk score
``inf``.
"""
import math
from dataclasses import dataclass

import torch
import triton.language as tl

from witcert.core import bounds, rounding

from .expm1 import expm1_relative_error

C_CAP = tl.constexpr(64.0)
C_CAP_VALUE = 64.0
SECOND_G_CAP = tl.constexpr(2.0**46)  # cap of the second factor of each s term (finite sums)
SECOND_C_LIMIT = 31.0  # c'_max at or below this: no s term was capped, CS holds
UNIT = 2.0**-24  # fp32 unit roundoff
ARG_ERROR = 4.1 * UNIT  # exponent error per unit |y_t| (4.001 u, rounded up with margin)
Y_NORMAL = 88.0  # |y| above which fp32 e^{y} is subnormal or zero
FP64_MARGIN = 1.0 + 64 * 2.0**-52  # covers the few fp64 roundings of this module
RADIUS_EXCESS = 2.0**-20  # fp32 radius <= exact (1 + this): 2^-21 + 2^-24 + kappa + products (kernels/radius.py)


@dataclass(frozen=True)
class KernelRounding:
    """The shape of the kernel's arithmetic that its a-priori rounding slack depends on (FP).

    Parameters
    ----------
    max_seq_len : int
        Longest row ``S``.
    block_n : int
        Tokens per inner block (summation tree width).
    num_splits : int
        Split-KV partitions.
    head_dim, bands : int
        ``d`` and ``B`` (the witness radius' rounding count).
    """

    max_seq_len: int
    block_n: int
    num_splits: int
    head_dim: int
    bands: int

    def __post_init__(self):
        for name in ("max_seq_len", "block_n", "num_splits", "head_dim", "bands"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.depth * UNIT > 2.0**-10:
            raise ValueError(f"summation depth {self.depth} is too deep for the fp32 budget")
        if max(self.kappa_c, self.kappa_b) > 2.0**-23:
            raise ValueError(f"head_dim {self.head_dim} is too large for the radius' fp32 round-up")

    @property
    def blocks_per_split(self) -> int:
        """Inner blocks of the longest split (each brings one online-max rescale)."""
        split_len = -(-self.max_seq_len // self.num_splits)
        return max(1, -(-split_len // self.block_n))

    @property
    def depth(self) -> int:
        """Depth of the summation tree of every accumulator."""
        return (self.block_n - 1) + self.blocks_per_split + self.num_splits

    @property
    def kappa_c(self) -> float:
        """Relative error bound of the fp64 witness radius ``c_t`` (twice the rounding count)."""
        band_width = self.head_dim // self.bands
        return 2 * (band_width + self.bands + 8) * 2.0**-53

    @property
    def kappa_dot(self) -> float:
        """``delta_t / (sm_scale sum|q||k|)``: the fp64 logit's rounding, with margin."""
        return (2 * self.head_dim + 8) * 2.0**-53 * 2

    @property
    def kappa_b(self) -> float:
        """Relative error bound of the fp64 Tier B radius (``kernels/packed_keys.py``): twice ``(d + 24) 2^-53``."""
        return 2 * (self.head_dim + 24) * 2.0**-53

    def mass_error(self) -> float:
        """Per-term relative error of ``l`` terms, exponent arguments aside."""
        eps_exp = rounding.exp_relative_error(torch.float32)
        rescales = self.blocks_per_split + 1
        return math.expm1((1 + rescales) * (eps_exp + UNIT) + self.depth * UNIT * (1 + 2.0**-9))

    def moment_error(self) -> float:
        """Per-term relative error of ``k`` and ``j`` terms, exponent arguments aside."""
        return self._times_factors(1)

    def second_error(self) -> float:
        """Per-term relative error of ``s`` terms (two ``expm1`` factors, two products), exponent arguments aside."""
        return self._times_factors(2)

    def _times_factors(self, factors: int) -> float:
        """``l``'s per-term error compounded with ``factors`` ``expm1``-type factors and their products."""
        eps_exp = rounding.exp_relative_error(torch.float32)
        g_error = expm1_relative_error(UNIT, eps_exp)
        return math.expm1(math.log1p(self.mass_error()) + factors * (g_error + UNIT))


@dataclass(frozen=True)
class Certificate:
    """The kernel's certificate per (batch, query head).

    Attributes
    ----------
    meter : Tensor (batch, Hq), fp32
        ``min(1, e-form, two-sided, tanh(D/2), chi-square)`` (no MS), never below the
        exact-arithmetic value of itself nor of the full meter.
    risk : Tensor (batch, Hq), fp64
        Raw e-form ``1/2 (A^2 - 1)`` upper bound; ``inf`` when the radius was capped.
    a_minus_one : Tensor (batch, Hq), fp64
        Upper bound on ``A - 1`` (T1).
    one_minus_a_minus : Tensor (batch, Hq), fp64
        Upper bound on ``1 - A-`` (P1).
    second_moment : Tensor (batch, Hq), fp64
        Upper bound on ``sum p~ expm1(c)^2`` (CS); ``inf`` where ``c'_max > SECOND_C_LIMIT``.
    c_max : Tensor (batch, Hq), fp64
        ``D = max_t c_t`` (rounded up).
    """

    meter: torch.Tensor
    risk: torch.Tensor
    a_minus_one: torch.Tensor
    one_minus_a_minus: torch.Tensor
    second_moment: torch.Tensor
    c_max: torch.Tensor


def certificate_from_moments(l, k, j, s, c_max, cp_max, delta_max, seq_lens, shape: KernelRounding) -> Certificate:
    """fp64 certificate from the merged fp32 accumulators (all (batch, Hq) fp64 tensors).

    ``seq_lens`` (batch, 1) gives each row's ``S`` (for ``ln S`` and the underflow slack).
    """
    n = seq_lens.to(torch.float64)
    log_n = torch.log(n) * FP64_MARGIN
    tiny = torch.finfo(torch.float32).tiny
    rho_l, rho_k, rho_s = shape.mass_error(), shape.moment_error(), shape.second_error()
    a_l = ARG_ERROR * log_n
    a_rel = math.expm1(ARG_ERROR * Y_NORMAL)

    under_l = 4 * n * tiny
    l_lo = (l / ((1 + rho_l) * (1 + a_l)) - under_l) / FP64_MARGIN
    l_hi = (l / ((1 - rho_l) * (1 - a_l)) + under_l) * FP64_MARGIN

    def moment_hi(acc, g_max, rho=rho_k):
        under = 4 * n * tiny * torch.clamp(g_max, min=1.0)
        relative = (acc / (1 - rho) + under) / (1 - a_rel)
        absolute = acc / (1 - rho) + ARG_ERROR * g_max * l_hi * log_n + under
        return torch.minimum(relative, absolute) * FP64_MARGIN

    capped = cp_max >= C_CAP_VALUE
    cp = torch.clamp(cp_max, max=C_CAP_VALUE)
    grow = torch.expm1(cp)
    k_hi = moment_hi(k, grow) / l_lo * FP64_MARGIN
    j_hi = moment_hi(j, -torch.expm1(-cp)) / l_lo * FP64_MARGIN
    g_max = grow * FP64_MARGIN
    second_hi = moment_hi(s, g_max * g_max, rho_s) / l_lo * FP64_MARGIN
    # logit rounding: A <= e^{delta_max} (1 + k/l), A- >= e^{-delta_max} (1 - j/l)
    k_hi = (torch.expm1(delta_max) + torch.exp(delta_max) * k_hi) * FP64_MARGIN
    j_hi = torch.clamp((delta_max + j_hi) * FP64_MARGIN, max=1.0)
    # E[expm1(c)^2] <= min(e^{delta_max} s/l, expm1(D) (A - 1)); inf where a term may have been capped
    second_hi = torch.minimum(torch.exp(delta_max) * second_hi, g_max * k_hi) * FP64_MARGIN
    second_hi = torch.where(cp_max <= SECOND_C_LIMIT, second_hi, torch.full_like(second_hi, math.inf))

    enclosure = bounds.Enclosure(k_hi, j_hi, rounding.sub_down(1.0, j_hi).clamp(min=0.0), c_max,
                                 second_hi)  # A- from below; no MS (split=None)
    eform = enclosure.eform()
    best = torch.where(capped, torch.ones_like(eform), enclosure.meter().clamp(min=0.0))
    risk = torch.where(capped, torch.full_like(eform, math.inf), eform)
    return Certificate(
        meter=rounding.round_up_to(best, torch.float32),
        risk=risk,
        a_minus_one=k_hi,
        one_minus_a_minus=j_hi,
        second_moment=second_hi,
        c_max=c_max,
    )

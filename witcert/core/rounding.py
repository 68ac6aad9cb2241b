"""Sound enclosures of floating-point results, over the whole range of each dtype (registry key ``FP``).

Every reported bound must be at least the exact-arithmetic value, subnormals included. Two layers:

**Working-dtype terms.** The meter's moments are sums of non-negative per-token terms that the
code computes in the working dtype (fp32, as a kernel would, or fp64). A computed term
``tau^_t = exp(e^_t) f^_t`` (exponent ``e^_t`` off by at most ``err_t``, a factor ``0 <= f <= 2``)
encloses the exact one as :class:`Terms` does::

    exact_t in [tau^_t (1 - rho_t) - under_t,  tau^_t (1 + rho_t) + under_t]

* ``rho_t`` (:func:`term_relative_error`): exp/expm1 rounding and the exponent's error;
* ``under_t``: a term that lands below the normal range is off by at most ``U = 2 tiny``
  absolutely (exp is accurate to a few subnormal ulps there, and the exact term is below
  ``tiny f`` once the whole exponent interval ``e^ + err`` is). Only while that interval reaches
  the normal range can the exponent error scale it: then ``under_t = U (1 + rho_t)``.
  ``under_t`` is *absolute*: a term multiplied by a large factor must carry it through the
  product (:func:`term_upper`) -- an underflowed mass ``e^y = 0`` times ``e^{30}`` is not negligible;
* the accumulation of ``S`` non-negative terms in *any* order: relative error at most
  ``gamma_{S-1} = (S-1)u / (1 - (S-1)u)`` (Higham, *Accuracy and Stability*, Thm. 4.4 applies to
  every summation tree, and to the subnormal range too: an addition that underflows is exact).

Assumption, checked by ``tests/test_meter.py::test_exp_accuracy_assumption`` (fp32) and
``tests/test_underflow.py`` (fp64, against mpmath): ``exp``, ``expm1`` and ``tanh`` are accurate to ``EXP_ULPS`` ulps
(torch CPU uses SLEEF/glibc at <= 1 ulp; CUDA's ``expf`` <= 2 ulps).

**Directed fp64 arithmetic.** Enclosures are combined in fp64 by one-sided operations
(:func:`add_up`, :func:`mul_down`, ...): an IEEE operation is correctly rounded, so the float just
above (below) its result bounds the exact result from above (below), in the normal and the
subnormal range alike. (A relative inflation ``x (1 + k u)`` cannot lift a subnormal ``x``: it
rounds back to ``x``; that is how ``tanh(D/2)`` once reported 0 for ``D = 2^-1074``.) libm results
are moved by ``EXP_ULPS`` ulps of their own binade (:func:`ulps_up`).
"""
import math
from dataclasses import dataclass

import torch

EXP_ULPS = 4  # assumed worst-case ulps of exp / expm1 / tanh in the working dtype
FP64_SLACK = 2.0**-48  # relative slack of a few fp64 roundings in a normal-range budget (term_relative_error)
SUBNORMAL_STEP = 2.0**-1074  # spacing of fp64 below the normal range (and its smallest positive value)
_INF = math.inf


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = 2^-p`` for a ``p``-bit significand: 2^-24 (fp32), 2^-53 (fp64)."""
    return torch.finfo(dtype).eps / 2


def exp_relative_error(dtype: torch.dtype) -> float:
    """Relative error bound of one exp/expm1 evaluation: ``EXP_ULPS`` ulps, an ulp being <= 2u."""
    return EXP_ULPS * 2 * unit_roundoff(dtype)


def series_expm1_relative_error(u: float, eps_exp: float) -> float:
    """Relative error bound of the fp32 ``e^x - 1`` / ``1 - e^{-x}`` (``x >= 0``) of ``kernels/expm1.py`` and
    ``witcert.fastpath.budgeted_pass``: a degree-8 Horner polynomial below ``1/2``, ``exp`` above.

    ``u`` the unit roundoff, ``eps_exp`` the relative error of one ``exp``.

    * ``x <= 1/2``: truncation below ``x^8/9! < 1.1e-8 < u`` (relative, since ``e^x - 1 >= 0.79 x``
      and ``1 - e^{-x} >= 0.79 x``). Horner step ``1 +- z`` with ``z = (x/k) poly <= 1/3`` takes
      3 roundings in ``z`` (the constant ``1/k``, two products) and one in the sum, and damps the
      inherited error by ``z/(1 -+ z) <= 1/2``, so every level stays below ``8 u``; the final
      product adds one: below ``10 u`` (kept with a factor two). FMA contraction removes roundings only.
    * ``x > 1/2``: ``e^x - 1 >= 0.64``: ``(eps_exp e^x + u e^x) / (e^x - 1) <= 2.6 (eps_exp + u)``;
      ``1 - e^{-x} >= 0.39``: ``(eps_exp e^{-x} + u) / (1 - e^{-x}) <= 1.6 eps_exp + 2.6 u``.
    """
    return max(20.0 * u, 2.6 * (eps_exp + u) + u)


def summation_gamma(n_terms: int, dtype: torch.dtype) -> float:
    """``gamma_{n-1}`` (rounded up): relative error bound for summing ``n`` non-negative terms in any order."""
    nu = max(n_terms - 1, 0) * unit_roundoff(dtype)  # exact: an integer times a power of two
    if nu >= 0.5:
        raise ValueError(f"{n_terms} tokens are too many for a sound {dtype} sum (need (S-1)u < 1/2)")
    return math.nextafter(nu / (1 - nu), _INF)


def underflow_error(dtype: torch.dtype, factor: float = 2.0) -> float:
    """``U = factor tiny`` (``2 tiny`` by default): absolute error of one computed term ``e^{e} f``
    (``0 <= f <= factor``) that lands below the normal range."""
    return factor * torch.finfo(dtype).tiny


def exponent_reach(dtype: torch.dtype) -> float:
    """``max(-log tiny, log max) + 1``: a term ``e^{e} f`` whose computed exponent is beyond ``-reach``
    is below the normal range (exact and computed, for any exponent error up to 1/2), and one beyond
    ``+reach`` overflowed. 89.7 (fp32), 710.8 (fp64)."""
    info = torch.finfo(dtype)
    return max(-math.log(info.tiny), math.log(info.max)) + 1.0


def term_relative_error(exponent_error: torch.Tensor, n_ops: int, dtype: torch.dtype) -> torch.Tensor:
    """``rho_t`` for a term ``exp(e^_t) * r`` whose exponent is off by at most ``exponent_error``.

    ``n_ops`` counts the elementary exp/expm1 evaluations and products that round the term;
    each contributes at most ``exp_relative_error`` (products: ``u``, smaller). Uses
    ``(1+a)(1+b) <= e^{a+b}`` so that ``|exact/computed - 1| <= expm1(sum)``. (The budget's
    own fp64 roundings are relative: it is a sum of normal values of at least ``n_ops 8u``.)
    """
    budget = exponent_error + n_ops * exp_relative_error(dtype)
    if bool((budget <= 1).all()):  # expm1(b) <= b (1 + b) on [0, 1]: a multiply-add, not an expm1 pass
        return budget * (1 + budget) * (1 + FP64_SLACK)
    return torch.expm1(budget) * (1 + FP64_SLACK)


# ----------------------------------------------------------------------------- directed fp64 arithmetic


_LIMITS: dict = {}


def _limit(x: torch.Tensor, sign: float) -> torch.Tensor:
    """A cached 0-dim ``sign * inf`` of ``x``'s dtype and device (``nextafter``'s direction); made anew inside a
    compiled graph (a constant there: a graph that filled the cache would be guarded on its contents)."""
    if torch.compiler.is_compiling():
        return torch.full((), sign * _INF, dtype=x.dtype, device=x.device)
    key = (x.dtype, x.device, sign)
    if key not in _LIMITS:
        _LIMITS[key] = torch.full((), sign * _INF, dtype=x.dtype, device=x.device)
    return _LIMITS[key]


def next_up(x: torch.Tensor) -> torch.Tensor:
    """The next float above ``x`` (``inf`` stays ``inf``): an upper bound on one correctly rounded result."""
    if x.dtype in HALF_DTYPES:
        return _half_step(x, 1.0)
    return torch.nextafter(x, _limit(x, 1.0))


def next_down(x: torch.Tensor) -> torch.Tensor:
    """The next float below ``x``: a lower bound on one correctly rounded result."""
    if x.dtype in HALF_DTYPES:
        return _half_step(x, -1.0)
    return torch.nextafter(x, _limit(x, -1.0))


HALF_DTYPES = (torch.float16, torch.bfloat16)


def _half_step(x: torch.Tensor, direction: float) -> torch.Tensor:
    """``nextafter(x, direction * inf)`` for fp16/bf16 by stepping the 16-bit pattern: ``torch.compile``'s
    ``nextafter`` on half types steps in fp32 and rounds back to ``x`` (measured on this torch: wrong for
    about 80% of fp16 and every bf16 value), which made a compiled round-up round down.
    Sign-magnitude patterns: ``+1`` moves a non-negative value up, ``-1`` a negative one (``-0`` is taken as
    ``+0``); ``+-inf`` in its own direction and NaN are kept."""
    y = x + 0.0  # -0 -> +0
    bits = y.view(torch.int16)
    if direction > 0:
        stepped = torch.where(y >= 0, bits + 1, bits - 1)
    else:
        stepped = torch.where(y > 0, bits - 1, torch.where(y == 0, torch.full_like(bits, -32767), bits + 1))
    stepped = stepped.to(torch.int16).view(x.dtype)
    return torch.where(torch.isnan(x) | (x == direction * _INF), x, stepped)


def _tensor(a, like: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a
    return torch.tensor(a, dtype=torch.float64 if like is None else like.dtype, device=None if like is None else like.device)


def _pair(a, b):
    """``a, b`` with at least one a tensor (any other real becomes a Python float: no tensor is built for it)."""
    a = a if isinstance(a, torch.Tensor) else float(a)
    b = b if isinstance(b, torch.Tensor) else float(b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a, b
    return _tensor(a), b


def _where_zero(zero, value: torch.Tensor) -> torch.Tensor:
    """``value`` with 0 where ``zero`` (a bool tensor, or a Python bool for a number operand)."""
    if zero is True:
        return torch.zeros_like(value)
    if zero is False:
        return value
    return value.masked_fill(zero, 0.0)


def _is_zero(x):
    return x == 0 if isinstance(x, torch.Tensor) else bool(x == 0)


def _either_zero(a, b):
    za, zb = _is_zero(a), _is_zero(b)
    if za is True or zb is True:
        return True
    if za is False:
        return zb
    return za if zb is False else za | zb


def add_up(a, b) -> torch.Tensor:
    """``>= a + b`` (exact inputs)."""
    a, b = _pair(a, b)
    return next_up(a + b)


def add_down(a, b) -> torch.Tensor:
    """``<= a + b``."""
    a, b = _pair(a, b)
    return next_down(a + b)


def sub_down(a, b) -> torch.Tensor:
    """``<= a - b``."""
    a, b = _pair(a, b)
    return next_down(a - b)


def mul_up(a, b) -> torch.Tensor:
    """``>= a b`` for ``a, b >= 0``; exactly 0 when a factor is 0 (a zero term carries no weight, even an infinite one)."""
    a, b = _pair(a, b)
    return _where_zero(_either_zero(a, b), next_up(a * b))


def mul_down(a, b) -> torch.Tensor:
    """``<= a b`` for ``a, b >= 0``, never below 0; exactly 0 when a factor is 0."""
    a, b = _pair(a, b)
    return _where_zero(_either_zero(a, b), next_down(a * b).clamp_(min=0.0))


def div_up(a, b) -> torch.Tensor:
    """``>= a / b`` for ``a >= 0, b > 0``; exactly 0 when ``a`` is 0."""
    a, b = _pair(a, b)
    return _where_zero(_is_zero(a), next_up(a / b))


def div_down(a, b) -> torch.Tensor:
    """``<= a / b`` for ``a >= 0, b > 0``, never below 0."""
    a, b = _pair(a, b)
    return _where_zero(_is_zero(a), next_down(a / b).clamp_(min=0.0))


def _spacing(x: torch.Tensor) -> torch.Tensor:
    """Spacing of the floats just above ``|x|`` (>= the spacing below): ``2^-1074`` in the subnormal range."""
    mag = x.abs()
    return torch.where(torch.isfinite(mag), next_up(mag) - mag, torch.zeros_like(mag))  # exact difference


def ulps_up(x: torch.Tensor, ulps: int = EXP_ULPS) -> torch.Tensor:
    """``>=`` every real within ``ulps`` ulps (of its own binade) of ``x``: a libm result's exact value.

    The exact value may sit one binade above ``x``, where an ulp is twice as large: ``2 ulps`` spacings.
    """
    return next_up(x + (2 * ulps) * _spacing(x))


def ulps_down(x: torch.Tensor, ulps: int = EXP_ULPS) -> torch.Tensor:
    """``<=`` every real within ``ulps`` ulps of ``x`` (see :func:`ulps_up`)."""
    return next_down(x - (2 * ulps) * _spacing(x))


def sqrt_up(x: torch.Tensor) -> torch.Tensor:
    """``>= sqrt(x)`` for fp64 ``x >= 0`` (IEEE sqrt is correctly rounded: one step up covers it)."""
    return torch.where(x == 0, torch.zeros_like(x), next_up(torch.sqrt(x)))


def expm1_up(x: torch.Tensor) -> torch.Tensor:
    """``>= expm1(x)`` for fp64 ``x >= 0``; exactly 0 at ``x = 0``."""
    return torch.where(x == 0, torch.zeros_like(x), ulps_up(torch.expm1(x)))


def tanh_up(x: torch.Tensor) -> torch.Tensor:
    """``>= tanh(x)`` for fp64 ``x >= 0``: ``tanh(x) <= min(x, 1)`` keeps it tight where tanh is the identity."""
    return torch.minimum(x, ulps_up(torch.tanh(x))).clamp_(max=1.0)


def sum_up(values: torch.Tensor) -> torch.Tensor:
    """``>=`` the exact sum of non-negative fp64 ``values`` (..., n) -> (...) (fp64 sum, any order)."""
    n = values.shape[-1]
    return mul_up(values.sum(-1), 1 + summation_gamma(n + 1, torch.float64))


def up(x: torch.Tensor, n_ops: int = 4) -> torch.Tensor:
    """Inflate a non-negative fp64 result of ``n_ops`` roundings whose errors no later operation amplifies.

    Relative slack ``n_ops FP64_SLACK`` for the normal range, then ``n_ops`` ulps more, which is what
    lifts a subnormal result (each rounding there is off by half a ``2^-1074`` step). Where a
    later operation multiplies or divides, use the directed operations instead.
    """
    return ulps_up(x * (1 + n_ops * FP64_SLACK), n_ops)


# ----------------------------------------------------------------------------- working-dtype terms


@dataclass(frozen=True)
class Terms:
    """Computed non-negative per-token terms and what encloses the exact ones (see the module doc).

    ``values`` (..., S) in the working dtype; ``rho`` and ``under`` fp64, broadcastable to ``values``:
    per token (..., S), per row (..., 1) or a scalar. ``exact_t in [values (1 - rho) - under,
    values (1 + rho) + under]``.
    """

    values: torch.Tensor
    rho: torch.Tensor | float
    under: torch.Tensor | float

    @classmethod
    def of_exp(cls, values, exponent, exponent_error, n_ops: int, live=None, factor: float = 2.0) -> "Terms":
        """Terms ``exp(exponent) f`` (``0 <= f <= factor``) from ``n_ops`` roundings, exponent off by ``exponent_error``.

        ``live`` (bool, optional; ``None``: every token) marks the tokens whose exact term may be
        non-zero (masked tokens are exactly 0: no underflow slack there). While every ``rho <= 1``
        the slack is ``2U`` per live term (``>= U (1 + rho)``), a scalar when ``live`` is ``None``.
        """
        dtype = values.dtype
        rho = term_relative_error(exponent_error, n_ops, dtype)
        unit = underflow_error(dtype, factor)
        if bool((rho <= 1).all()):  # the usual case: U (1 + rho) <= 2U for every term, one scalar
            under = 2 * unit if live is None else live.to(torch.float64) * (2 * unit)
            return cls(values, rho, under)
        # may the exact exponent reach the normal range? (-1: margin for this comparison's rounding)
        reaches = exponent.double() + exponent_error > math.log(torch.finfo(dtype).tiny) - 1
        under = unit * torch.where(reaches, 1 + rho, torch.ones_like(rho))
        if live is not None:
            under = torch.where(live, under, torch.zeros_like(under))
        return cls(values, rho, under)

    @classmethod
    def of_exp_rows(cls, values, row_exponent_error: torch.Tensor, n_ops: int, factor: float = 2.0) -> "Terms":
        """Terms ``exp(e_t) f_t`` (``0 <= f <= factor``) whose exponent is off by at most ``row_exponent_error``
        (..., 1) for every token of its row with ``|e_t| <= exponent_reach(dtype)``.

        One relative error per row: a token whose computed exponent lies beyond the reach is below
        the normal range whatever its error (``reach`` exceeds ``-log tiny`` by a margin) and so is
        covered by the underflow slack, ``2 U`` per term (``>= U (1 + rho)`` while ``rho <= 1``).
        A row with ``rho > 1`` gets ``inf`` for both (a term computed as 0 may then be in the normal
        range: ``U (1 + rho)`` is what bounds it): its sums are ``inf``, never wrong. No per-token fp64 pass.
        """
        dtype = values.dtype
        budget = row_exponent_error.double() + n_ops * exp_relative_error(dtype)
        rho = budget * (1 + budget) * (1 + FP64_SLACK)  # >= expm1(budget) while budget <= 1 (else rho > 1)
        within = rho <= 1
        inf = torch.full_like(rho, _INF)
        return cls(values, torch.where(within, rho, inf), torch.where(within, 2 * underflow_error(dtype, factor), inf))

    def upper(self) -> torch.Tensor:
        """Per-term fp64 upper bounds ``values (1 + rho) + under`` (..., S): for a term about to be
        multiplied by a large factor, whose underflow must not vanish."""
        return add_up(mul_up(self.values.double(), add_up(1.0, self.rho)), self.under)

    def sums(self, computed: torch.Tensor) -> "Sums":
        """The :class:`Sums` of subsets of these terms whose working-dtype sums the code computed as ``computed`` (..., K)."""
        n = self.values.shape[-1]
        under = _under_sum(self.values, self.under).unsqueeze(-1)  # (..., 1): covers every subset
        if _per_token(self.rho, self.values):
            return Sums(computed, n, 0.0, add_up(_weighted_error(self.values, self.rho).unsqueeze(-1), under))
        return Sums(computed, n, self.rho, under)


def _per_token(rho, values: torch.Tensor) -> bool:
    return isinstance(rho, torch.Tensor) and rho.dim() > 0 and rho.shape[-1] != 1 and values.shape[-1] != 1


@dataclass(frozen=True)
class Sums:
    """Working-dtype sums of subsets of non-negative terms (..., K), and what encloses the exact ones.

    ``computed`` is what the code computed: any summation tree (scatter into buckets, then running
    sums over the buckets, included) of at most ``n_terms`` computed terms, so within
    ``gamma_{n_terms + K}`` of the exact sum of those computed terms (an addition to an exact zero
    is exact). Each computed term is within ``rho`` (fp64, broadcastable: per row or a scalar)
    relatively of its exact term, and the terms together are off by at most ``absolute`` more
    (fp64 (..., 1) or a scalar: the underflow slack of all the terms, plus their per-token relative
    errors when those differ token by token -- a bound for every subset).
    """

    computed: torch.Tensor
    n_terms: int
    rho: torch.Tensor | float
    absolute: torch.Tensor | float

    def _gamma(self) -> float:
        return summation_gamma(self.n_terms + self.computed.shape[-1], self.computed.dtype)

    def upper(self) -> torch.Tensor:
        """fp64 (..., K) ``>=`` the exact sum of each subset's true terms; ``inf`` where the sum overflowed."""
        computed = self.computed.double()
        sum_hat = div_up(computed, math.nextafter(1 - self._gamma(), 0.0))  # >= sum of the computed terms
        return add_up(add_up(sum_hat, mul_up(sum_hat, self.rho)), self.absolute)

    def lower(self) -> torch.Tensor:
        """fp64 (..., K) ``<=`` the exact sum of each subset's true terms, ``>= 0``."""
        computed = self.computed.double()
        sum_hat = div_down(computed, math.nextafter(1 + self._gamma(), _INF))  # <= sum of the computed terms
        high = div_up(computed, math.nextafter(1 - self._gamma(), 0.0))
        relative = mul_up(high, self.rho)  # 0 where the sum is 0, even against rho = inf
        lower = sub_down(sub_down(sum_hat, relative), self.absolute)
        return lower.clamp(min=0.0).nan_to_num(nan=0.0)


def _weighted_error(terms: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """``>= sum_t rho_t tau^_t`` in fp64, with zero terms contributing nothing (even if rho is inf).

    Each product rounds by a relative ``u`` or, below the normal range, half a ``2^-1074`` step:
    the sum is inflated by ``gamma_n`` and ``n`` steps.
    """
    weighted = (terms.double() * rho).nan_to_num_(nan=0.0)  # 0 * inf (an empty term) counts 0
    n = terms.shape[-1]
    return add_up(mul_up(weighted.sum(-1), 1 + summation_gamma(n + 2, torch.float64)), n * SUBNORMAL_STEP)


def _under_sum(terms: torch.Tensor, under) -> torch.Tensor:
    """``>= sum_t under_t`` (fp64; a scalar or per-row ``under`` counts once per term)."""
    if isinstance(under, torch.Tensor) and under.dim() and under.shape[-1] != 1:
        return sum_up(under.expand(terms.shape))
    n = float(terms.shape[-1])
    if isinstance(under, torch.Tensor):
        return mul_up(under.double().expand(*terms.shape[:-1], 1).squeeze(-1), n)
    return torch.full(terms.shape[:-1], n * float(under), dtype=torch.float64)  # n U: exact


def _as_terms(terms, rho, under) -> Terms:
    if isinstance(terms, Terms):
        return terms
    return Terms(terms, rho, underflow_error(terms.dtype) if under is None else under)


def sum_upper(terms, rho=None, under=None) -> torch.Tensor:
    """fp64 upper bound on the exact sum of the true terms behind ``terms`` (..., S) -> (...).

    ``terms`` is a :class:`Terms`, or computed values with their ``rho`` (``under`` defaults to
    ``U`` per term). The sum is the one the code actually does, in the working dtype.
    """
    t = _as_terms(terms, rho, under)
    return t.sums(t.values.sum(-1, keepdim=True)).upper().squeeze(-1)


def sum_lower(terms, rho=None, under=None) -> torch.Tensor:
    """fp64 lower bound (>= 0) on the exact sum of the true terms behind ``terms`` (..., S) -> (...)."""
    t = _as_terms(terms, rho, under)
    return t.sums(t.values.sum(-1, keepdim=True)).lower().squeeze(-1)


def round_up_to(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast an fp64 upper bound to ``dtype`` without ever rounding it down (subnormal targets included)."""
    y = x64.to(dtype)
    if dtype == torch.float64:
        return y
    below = y.double() < x64
    return torch.where(below, next_up(y), y)

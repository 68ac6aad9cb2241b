"""Tier B certificate: per-token logit-error bounds for the dithered INT8 cache.

Registry keys: "L2" (uniform MGF), "L2v" (proxy = variance), "L3" (request budget), "TB"
(radius), "DB" (deterministic branch with per-element rounding; Lean
``WitCert.abs_logit_error_le_deterministic``, and ``WitCert.abs_logit_error_le_probabilistic`` for
the composition ``u_t + beta_t + rho_t``). Spec mirror: ``witcert.spec.dither``.

For one (layer, kv_head, query) with query ``q`` (post-RoPE, in the frame the keys were
quantized in) and softmax scale ``sm`` (default ``1/sqrt(d)``), the logit error of token
``t`` is ``eps_t = sm sum_c q_c (x^_c - x_c)``. With the quantizer of
``witcert.tier_b.quantizer`` (exact nearest code, centred 24-bit dither grid, step ``g = 2^-24``):

* ``s (n - xi) - x = s (mu + X)`` with ``|mu| <= g/2`` deterministic and ``X`` the centred
  residual: a full-period ``2^24``-point arithmetic progression of step ``g`` (independent
  across elements under the Philox modelling assumption). Its MGF is
  ``sinh(lam/2) / (N sinh(lam/(2N))) <= sinh(lam/2)/(lam/2) <= exp(lam^2/24)`` (Lemma 2
  and ``N sinh(y/N) >= y``), so ``sm sum_c q_c s_c X_c`` is sub-Gaussian with proxy
  ``v_t = sm^2 sum_c q_c^2 s_c^2 / 12``.
* ``u_t = sqrt(2 v_t log(2 S / delta_loc))``: with probability ``>= 1 - delta_loc`` jointly
  over the ``S`` tokens (two-sided tail + union bound), ``|random part| <= u_t``.
* grid offset slack ``beta_t = sm sum_c |q_c| s_c g/2`` (the mean ``mu``);
* ``Delta_t = sm sum_c |q_c| s_c / 2``: always valid, since ``|s (n - xi) - x| <= s/2`` exactly;
* dequantization slack ``rho_t = sm sum_c |q_c| e_c`` for the keys attention actually reads,
  in its dtype ``D`` (``key_dtype``; registry "DB"), from the per-element rounding bound

  ``e_c = s_c (Q + 1/2)(2u + u^2) + u_D (1 + u)^2 m_c + [m_c > 0] eta_D/2``,  ``u = 2^-24``,
  ``m_c = s_c (|n_c| + 1/2) >= |y_c|``, ``y_c = s_c (n_c - xi_c)`` the exact dequantized value.

  The first term covers a kernel computing ``z = fl(s * fl(n - xi))`` in fp32 (two roundings,
  ``|n - xi| <= Q + 1/2``; no fp32 subnormal is reachable: ``s >= 2^-24`` and
  ``|n - xi| >= 2^-25`` give ``|y| >= 2^-49`` when ``y != 0``). The rest is the final cast to a
  ``D`` narrower than fp32: ``|fl_D(z) - z| <= u_D |z| + eta_D/2`` for every finite result
  (half an ulp is ``<= u_D |z|`` in the normal range and ``eta_D/2``, half the subnormal
  spacing, below it), with ``|z| <= (1 + u)^2 |y|``. fp16: ``u_D = 2^-11``,
  ``eta_D/2 = 2^-25``; bf16: ``u_D = 2^-8``, ``eta_D/2 = 2^-134``; fp32 and fp64: no final-cast
  term (the fp32 chain ends in fp32, and fp32 values are exact in fp64). The reference
  ``DitheredInt8.dequantize`` rounds the exact ``y`` once to ``D``: inside the same bound. An
  element whose ``(1 + u)^2 m_c`` reaches ``D``'s overflow threshold (fp16: 65520) may round
  to inf: ``e_c = inf``, the trivial bound (``dequantize`` raises there). Outlier channels
  (fp16 values, ``s_c = 0``) pass through the final cast too: ``m_c = |x16_c|`` for bf16, and
  nothing for fp16, fp32 and fp64, where an fp16 value is exact.
  With a half-precision model ``e_c`` matters: a bf16 cast alone can add ``0.5 s_c`` at
  ``|n_c| = Q``, so ``s_c/2`` without it is below the real error (up to 1.9x observed);
* outlier slack ``o_t = sm sum_{c outlier} |q_c| (2^-11/(1 - 2^-11) |x16_c| + 2^-25)``:
  fp16 storage of a non-fp16 input (0 when the input was fp16).

Per-token bound handed to the meter: ``c_t = min(u_t + beta_t, Delta_t) + rho_t + o_t``
(a per-token minimum of bounds valid on the same event). Request budget (Lemma 3):
``delta_loc = delta_req / (L H T)`` makes every (layer, head, step) hold jointly with
probability ``>= 1 - delta_req``.

Scope: NON-ADAPTIVE queries only (prefill, teacher forcing, fixed trajectories): the query
and the keys must not depend on the dither. In live generation the query depends on earlier
sampled tokens, which depend on the dither; there the adaptive-safe Tier A witness (or
``Delta_t``, which holds for every query) is the certificate.

Rounding: every quantity is computed in fp64 from exact fp64 images of ``q``, the fp16
scales and the fp16 outliers; a sum of ``d`` non-negative products, a log, a sqrt and a few
additions have relative error below ``(d + 10) 2^-53`` (also when, with per-group scales, the
sums are regrouped as group sums of ``|q|`` and ``q^2`` dotted with the scales; the final-cast
term's ``m_c`` is exact, an 11-bit scale times a 9-bit ``|n| + 1/2``, and ``e_c`` adds two
roundings before its ``d``-term dot); the result is
inflated by ``1 + (d + 16) 2^-52`` and cast to fp32 rounding up. The default ``sm = 1/sqrt(d)`` is the
fp64 quotient (within 2 ulps of the real value); that inflation covers it too.

Not covered here: rounding in the attention kernel's own ``q . x^`` accumulation (the meter's
scores are taken as given), and the Philox modelling assumption (distinct counters behave
as independent uniform words).
"""
import math
from dataclasses import dataclass

import torch

from witcert.tier_b.dither import GRID_STEP
from witcert.tier_b.quantizer import Q_LEVELS
from witcert.tier_b.packed_store import PackedStore
from witcert.core.rounding import round_up_to
from witcert.tier_a.witness import check_head_pairing

FP32_UNIT = 2.0 ** -24
DEQUANT_FACTOR = (Q_LEVELS + 0.5) * (2 * FP32_UNIT + FP32_UNIT**2)  # fp32 chain part of rho / (sm sum |q| s)
FP16_UNIT = 2.0 ** -11
FP16_ABS_FLOOR = 2.0 ** -25  # half the smallest fp16 subnormal


@dataclass(frozen=True)
class KeyCast:
    """The final cast of a dequantized key to a dtype narrower than fp32 (see the module docstring).

    ``|fl(z) - z| <= unit |z| + half_subnormal`` for every finite result; ``|z| >= overflow``
    may round to inf.
    """

    unit: float  # u_D = 2^-p for a p-bit significand
    half_subnormal: float  # eta_D / 2, half the smallest positive subnormal
    overflow: float  # max finite + half an ulp: at or above it, round-to-nearest gives inf


# dtype attention reads the keys in -> its final cast after the fp32 chain (None: no extra rounding)
KEY_CASTS = {
    torch.float64: None,
    torch.float32: None,
    torch.float16: KeyCast(2.0**-11, 2.0**-25, 2.0**16 * (1 - 2.0**-12)),
    torch.bfloat16: KeyCast(2.0**-8, 2.0**-134, 2.0**128 * (1 - 2.0**-9)),
}
CHAIN_GROWTH = (1 + FP32_UNIT) ** 2  # |z| <= (1 + u)^2 |y| after the fp32 chain (exact in fp64)


def delta_local(delta_req: float, n_layers: int, n_heads: int, n_steps: int) -> float:
    """Per-(layer, head, step) failure budget ``delta_req / (L H T)`` (Lemma 3, "L3")."""
    if not 0 < delta_req < 1:
        raise ValueError(f"delta_req: expected a probability in (0, 1), got {delta_req!r}")
    for name, n in (("n_layers", n_layers), ("n_heads", n_heads), ("n_steps", n_steps)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}: expected a positive int, got {n!r}")
    return delta_req / (n_layers * n_heads * n_steps)


@dataclass(frozen=True)
class TierBTerms:
    """Per-token pieces (*lead, Hq, Tq, S) in fp64, before rounding up (see module docstring)."""

    u: torch.Tensor  # sub-Gaussian radius u_t
    beta: torch.Tensor  # grid-offset slack
    delta: torch.Tensor  # deterministic Delta_t
    rho: torch.Tensor  # dequantization rounding slack, in the dtype the keys are read in
    outlier: torch.Tensor  # fp16 outlier storage slack

    def combined(self, mode: str = "min") -> torch.Tensor:
        """``min(u + beta, Delta) + rho + o`` ("min"), or only the "u" or "delta" branch."""
        if mode == "min":
            core = torch.minimum(self.u + self.beta, self.delta)
        elif mode == "u":
            core = self.u + self.beta
        elif mode == "delta":
            core = self.delta
        else:
            raise ValueError(f"mode: expected 'min', 'u' or 'delta', got {mode!r}")
        return core + self.rho + self.outlier


def _check_query(q: torch.Tensor, store: PackedStore) -> tuple[torch.Tensor, int, int]:
    """``q`` (*lead, Hq, Tq, d) as fp64 folded to (*lead, Hkv, G Tq, d), with ``(Hkv, G)``.

    The head axes are named by position: ``q``'s query heads (axis -3) against the store's kv heads
    (axis -3), the same leading dims, ``Hq`` a multiple of ``Hkv`` (query head ``h`` reads kv head
    ``h // G``). Any other pairing raises instead of broadcasting.
    """
    if not isinstance(q, torch.Tensor) or not torch.is_floating_point(q):
        raise ValueError("q: expected a float tensor (*lead, Hq, Tq, d)")
    if not torch.isfinite(q).all():
        raise ValueError("q: contains NaN or Inf")
    if q.shape[-1] != store.layout.head_dim:
        raise ValueError(f"q: head dim {q.shape[-1]} differs from the store's {store.layout.head_dim}")
    hkv, groups = check_head_pairing(q.shape, store.payload.shape, "q", "store")
    folded = q.to(torch.float64).reshape(*q.shape[:-3], hkv, groups * q.shape[-2], q.shape[-1])
    return _lift_tiny(folded), hkv, groups


TINY_QUERY = 2.0**-500  # |q_c| below this would let fp64 squares and products fall into subnormals


def _lift_tiny(q64: torch.Tensor) -> torch.Tensor:
    """Raise nonzero ``|q_c| < TINY_QUERY`` to ``TINY_QUERY`` (sign kept).

    Every term of the bound grows with ``|q_c|``, so a larger ``|q_c|`` keeps it an upper bound,
    and no square or product below can then underflow (fp64 subnormals would void the relative
    rounding budget). Queries held in fp32/fp16/bf16 never reach this range.
    """
    small = (q64 != 0) & (q64.abs() < TINY_QUERY)
    return torch.where(small, torch.copysign(torch.full_like(q64, TINY_QUERY), q64), q64)


def outlier_error_bound(store: PackedStore) -> torch.Tensor:
    """Per-element bound (*lead, H, S, d) on ``|fp16(x) - x|`` on outlier channels, 0 elsewhere."""
    bound = torch.zeros(store.shape, dtype=torch.float64)
    if store.layout.outlier_pairs == 0 or store.source_dtype == torch.float16:
        return bound
    per_outlier = store.outliers.to(torch.float64).abs() * (FP16_UNIT / (1 - FP16_UNIT)) + FP16_ABS_FLOOR
    return bound.scatter(-1, store.outlier_channels(), per_outlier)


def _check_key_dtype(key_dtype) -> KeyCast | None:
    if key_dtype not in KEY_CASTS:
        raise ValueError(f"key_dtype: expected one of float16, bfloat16, float32, float64 (the dtype attention "
                         f"reads the dequantized keys in), got {key_dtype!r}")
    return KEY_CASTS[key_dtype]


def key_cast_error_bound(store: PackedStore, key_dtype: torch.dtype) -> torch.Tensor | None:
    """Per-element bound (*lead, H, S, d) on the final cast of ``x^`` to ``key_dtype`` ("DB").

    ``u_D (1 + u)^2 m_c + [m_c > 0] eta_D/2`` with ``m_c = s_c (|n_c| + 1/2)`` (``|x16_c|`` on
    bf16 outlier channels), ``inf`` where ``(1 + u)^2 m_c`` reaches the overflow threshold; ``None``
    for fp32 and fp64 keys, which need no term beyond the fp32 chain (module docstring).
    """
    cast = _check_key_dtype(key_dtype)
    if cast is None:
        return None
    magnitude = store.scale_per_element() * (store.payload.to(torch.float64).abs() + 0.5)  # 0 on outliers
    if store.layout.outlier_pairs and key_dtype != torch.float16:  # fp16 outliers are exact in fp16
        magnitude = magnitude.scatter(-1, store.outlier_channels(), store.outliers.to(torch.float64).abs())
    grown = magnitude * CHAIN_GROWTH
    bound = grown * cast.unit + torch.where(magnitude > 0, cast.half_subnormal, 0.0)
    return bound.masked_fill(grown >= cast.overflow, math.inf)


def _abs_dot(abs_q: torch.Tensor, per_element: torch.Tensor) -> torch.Tensor:
    """``sum_c |q_c| e_c`` (*lead, H, Tq, S) with ``0 * inf = 0``: inf only where a nonzero ``q_c`` meets it."""
    infinite = torch.isinf(per_element)
    finite_sum = abs_q @ per_element.masked_fill(infinite, 0.0).transpose(-1, -2)
    if not infinite.any():
        return finite_sum
    hit = ((abs_q > 0).to(torch.float64) @ infinite.to(torch.float64).transpose(-1, -2)) > 0
    return finite_sum.masked_fill(hit, math.inf)


def shares_group_scales(store: PackedStore) -> bool:
    """Whether every token's channels share per-group scales: token-group or token layout, no outliers."""
    return store.layout.granularity in ("token-group", "token") and store.layout.outlier_pairs == 0


def _grouped_sums(q64: torch.Tensor, store: PackedStore) -> tuple[torch.Tensor, ...]:
    """``sum_c |q_c| s_c``, ``sum_c q_c^2 s_c^2`` and the (zero) outlier sum, (*lead, H, Tq, S).

    With per-group scales (``token`` is one group of ``d``), ``sum_c |q_c| s_{g(c)} =
    sum_g s_g sum_{c in g} |q_c|``: group sums of ``|q|`` and ``q^2`` first, then a ``d/Gc``-length
    dot per token against the stored scales, instead of ``d``-length dots over an (S, d) scale
    tensor. Same non-negative terms, regrouped: the computed value is within
    ``gamma_{Gc-1} + gamma_{d/Gc} + 2u <= gamma_d + 2u`` (``Gc + d/Gc <= d + 1``) of the exact sum,
    the budget the per-element path has, so the module's ``1 + (d + 16) 2^-52`` still covers it.
    """
    n_groups = store.scales.shape[-1]  # d/Gc (token-group) or 1 (token)
    groups = q64.unflatten(-1, (n_groups, -1))  # (*lead, H, Tq, d/Gc, Gc)
    s = store.scales.to(torch.float64)  # (*lead, H, S, d/Gc)
    l1 = groups.abs().sum(-1) @ s.transpose(-1, -2)  # (*lead, H, Tq, S)
    sq = (groups * groups).sum(-1) @ (s * s).transpose(-1, -2)
    return l1, sq, torch.zeros_like(l1)


def _per_element_sums(q64: torch.Tensor, store: PackedStore) -> tuple[torch.Tensor, ...]:
    """The sums of :func:`_grouped_sums` over a per-element scale tensor (any layout, outliers)."""
    scale = store.scale_per_element()  # (*lead, H, S, d), 0 on outliers
    abs_q = q64.abs()
    l1 = abs_q @ scale.transpose(-1, -2)  # (*lead, H, Tq, S)
    sq = (q64 * q64) @ (scale * scale).transpose(-1, -2)
    return l1, sq, abs_q @ outlier_error_bound(store).transpose(-1, -2)


def check_tier_b_inputs(q: torch.Tensor, store: PackedStore, delta_loc: float, sm_scale: float | None,
                        n_tokens: int | None) -> tuple[torch.Tensor, float, int]:
    """The checked inputs of the Tier B bound: ``(q64, sm, n)``, ``q64`` the folded fp64 query
    (*lead, Hkv, G Tq, d) of :func:`_check_query` (tiny entries lifted), ``sm`` the softmax scale
    (default ``1/sqrt(d)``), ``n`` the union size (default the store's ``S``)."""
    if not 0 < delta_loc < 1:
        raise ValueError(f"delta_loc: expected a probability in (0, 1), got {delta_loc!r}")
    q64, _, _ = _check_query(q, store)
    sm = 1 / math.sqrt(store.layout.head_dim) if sm_scale is None else float(sm_scale)
    if not sm > 0 or not math.isfinite(sm):
        raise ValueError(f"sm_scale: expected a positive finite float, got {sm_scale!r}")
    n_union = store.n_tokens if n_tokens is None else n_tokens
    if isinstance(n_union, bool) or not isinstance(n_union, int) or n_union < store.n_tokens:
        raise ValueError(f"n_tokens: expected an int >= the store's {store.n_tokens} tokens (the union bound "
                         f"covers every token the bound is used for), got {n_tokens!r}")
    return q64, sm, n_union


def tier_b_terms(q: torch.Tensor, store: PackedStore, delta_loc: float, sm_scale: float | None = None,
                 n_tokens: int | None = None, key_dtype: torch.dtype = torch.float32) -> TierBTerms:
    """The fp64 pieces of the Tier B bound (Lemma 2, Theorem 3, deterministic branch: "L2", "TB", "DB").

    ``q`` (*lead, Hq, Tq, d): ``Hq`` query heads against the store's (*lead, Hkv, S, d) kv heads,
    same leading dims, ``Hq`` a multiple of ``Hkv`` (GQA inside; any other pairing raises);
    ``delta_loc`` the per-(layer, head, step) budget (``delta_local``); ``n_tokens`` the union size
    (default: the store's ``S``); ``key_dtype`` the dtype attention reads the dequantized keys in
    (the ``dtype`` given to ``DitheredInt8.dequantize``, whose default is fp32). Returns terms
    shaped (*lead, Hq, Tq, S).
    """
    q64, sm, n_union = check_tier_b_inputs(q, store, delta_loc, sm_scale, n_tokens)  # (*lead, Hkv, G Tq, d)
    cast_bound = key_cast_error_bound(store, key_dtype)
    sums = _grouped_sums(q64, store) if shares_group_scales(store) else _per_element_sums(q64, store)
    l1_sum, sq_sum, outlier_sum = sums  # (*lead, H, Tq, S) each
    l1 = sm * l1_sum
    variance = sm**2 * sq_sum / 12
    u = torch.sqrt(2 * variance * math.log(2 * n_union / delta_loc))
    rho = l1 * DEQUANT_FACTOR
    if cast_bound is not None:
        rho = rho + sm * _abs_dot(q64.abs(), cast_bound)
    per_query_head = q.shape[:-1] + (store.payload.shape[-2],)  # (*lead, Hq, Tq, S)
    parts = (u, l1 * (GRID_STEP / 2), l1 / 2, rho, sm * outlier_sum)
    return TierBTerms(*(t.reshape(per_query_head) for t in parts))


def radius_u(q, store, delta_loc, sm_scale=None) -> torch.Tensor:
    """``u_t`` alone (fp64, not rounded up): the sub-Gaussian radius of Theorem 3 ("TB")."""
    return tier_b_terms(q, store, delta_loc, sm_scale).u


def deterministic_delta(q, store, sm_scale=None) -> torch.Tensor:
    """``Delta_t = sm sum_c |q_c| s_c / 2`` alone (fp64, not rounded up): the exact-arithmetic part of "DB"."""
    return tier_b_terms(q, store, 0.5, sm_scale).delta


def deterministic_branch(q, store, sm_scale=None, key_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``Delta_t + rho_t + o_t = sm sum_c |q_c| (s_c/2 + e_c)`` (fp64, not rounded up; registry "DB").

    The deterministic branch of the keys read in ``key_dtype``: valid for every query, adaptive
    ones included (Lean ``WitCert.abs_logit_error_le_deterministic``; ``e_c`` gathers the
    dequantization rounding and the outlier storage error, see the module docstring).
    """
    return tier_b_terms(q, store, 0.5, sm_scale, key_dtype=key_dtype).combined("delta")


def tier_b_logit_bound(q: torch.Tensor, store: PackedStore, delta_loc: float, sm_scale: float | None = None,
                       mode: str = "min", n_tokens: int | None = None,
                       key_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token logit-error bound ``c`` (fp32, rounded up) for ``witcert.meter`` ("TB", "L3", "DB").

    ``q`` (*lead, Hq, Tq, d) query heads against the store's (*lead, Hkv, S, d) kv heads (see
    :func:`tier_b_terms`); returns (*lead, Hq, Tq, S).
    ``c_t = min(u_t + beta_t, Delta_t) + rho_t + o_t`` (``mode="min"``); ``mode="u"`` or
    ``"delta"`` keeps one branch (for benchmarks). Holds for all ``S`` tokens jointly with
    probability ``>= 1 - delta_loc`` over the dither, for a query chosen without looking at
    the dither (non-adaptive scope; the ``"delta"`` branch holds for every query).
    ``key_dtype`` must be the dtype attention reads the dequantized keys in (default fp32, as
    ``DitheredInt8.dequantize``): a model running in fp16 or bf16 passes its dtype.
    ``c`` bounds the logit error in exact arithmetic; logits a runtime computes in floating point
    need :func:`witcert.score_rounding_bound` added before :func:`witcert.meter` is called on them.
    """
    terms = tier_b_terms(q, store, delta_loc, sm_scale, n_tokens, key_dtype)
    c64 = terms.combined(mode) * (1 + (store.layout.head_dim + 16) * 2.0**-52)
    return round_up_to(c64, torch.float32)

"""Tier B per-token bound ``c_t`` in fp32 for the fast path (TB, L2, L3, DB under FP).

:func:`witcert.tier_b_logit_bound` forms ``c_t = min(u_t + beta_t, Delta_t) + rho_t + o_t`` in fp64
from ``d``-length dots per token. Where every token's channels share per-group scales (the
``token-group`` and ``token`` layouts without outlier channels) and attention reads the keys in
fp32 or fp64 (no final-cast term in ``rho``), every piece is a multiple of two group dots::

    l_t = sum_g s_{t,g} a_g,   a_g >= sm sum_{c in g} |q_c|
    U_t = sum_g s_{t,g}^2 b_g, b_g >= sm^2 log(2 n / delta) / 6 sum_{c in g} q_c^2
    c_t = min(sqrt(U_t) + 2^-25 l_t, l_t / 2) + F l_t     ("min": u_t = sqrt(U_t), beta_t = 2^-25 l_t)
    c_t = l_t / 2 + F l_t                                ("delta": the branch valid for every query)

(``F`` = ``DEQUANT_FACTOR``, ``s`` the fp16 scales), evaluated here in fp32 -- one compiled pass
with ``WITCERT_COMPILE=1`` -- and enclosed a priori (``u = 2^-24``, ``n_g`` groups):

* ``a_g``, ``b_g``: fp64 from the library's checked fp64 query (tiny entries lifted, no fp64
  subnormal), relative error far below ``2^-40``, then :func:`fp32_up`, lifted to at least
  ``2^-100`` and ``2^-78``: every product with a positive fp16 scale (``>= 2^-24``, its square
  ``>= 2^-48`` exact in fp32) is a normal fp32 number, so the dots are within ``gamma_{n_g + 1}``
  relative (Higham Thm 3.1, any order, FMA or not; ``s s b`` has two roundings);
* ``sqrt`` halves that and adds one rounding; ``2^-25 l``, ``l / 2``, ``F l``, the two additions:
  one rounding each, or an absolute ``2^-150`` where a product is subnormal; ``F`` itself is
  rounded to fp32 (one more); ``min`` adds nothing;
* so the computed ``c~ >= c (1 - gamma_{n_g + 1})(1 - u)^5 - 3 2^-150``, and
  ``fl(fl(c~ (1 + (n_g + 8) 2^-23)) + 2^-126)`` is above ``c``. A token with every scale 0 has
  ``l~ = 0`` exactly and ``c = 0``; it stays 0.

A query row with a ``b_g`` beyond fp32 (entries near ``1e19``) gets ``u_t = inf``: the ``Delta`` branch
holds (sound, looser); one with an ``a_g`` beyond fp32 gets ``c = inf`` (the trivial bound), never the
NaN of ``inf * 0`` (:func:`~witcert.fastpath.radius.split_overflow`). Other layouts, key dtypes and ``mode="u"`` take
:func:`witcert.tier_b_logit_bound` (same checks, same shapes).
"""
import math

import torch

from witcert.fastpath.budgeted_pass import TINY, fp32_up
from witcert.fastpath.compiled import pick
from witcert.fastpath.radius import split_overflow
from witcert.tier_b.certificate import (DEQUANT_FACTOR, check_tier_b_inputs, shares_group_scales,
                                        tier_b_logit_bound)
from witcert.tier_b.dither import GRID_STEP
from witcert.tier_b.packed_store import PackedStore

_L1_FLOOR = 2.0**-100  # a_g lifted to this: a_g s >= 2^-124 for any positive fp16 scale
_SQ_FLOOR = 2.0**-78  # b_g lifted to this: b_g s^2 >= 2^-126
_FAST_KEY_DTYPES = (torch.float32, torch.float64)  # no final-cast term in rho


def tier_b_kernel(a: torch.Tensor, b: torch.Tensor, scales_t: torch.Tensor, deterministic: bool) -> torch.Tensor:
    """fp32 ``c`` (..., Q, S) from fp32 group sums ``a``, ``b`` (..., Q, n_g) (lifted, see the module doc) and the
    fp16 scales transposed, (..., n_g, S) contiguous; every result above the exact bound. No host synchronisation."""
    s = scales_t.float()
    a, a_overflow = split_overflow(a, _L1_FLOOR)
    l1 = group_dot(a, s)
    core = 0.5 * l1
    if not deterministic:
        b, b_overflow = split_overflow(b, _SQ_FLOOR)
        square = group_dot(b, s * s) + b_overflow  # u = inf on such a row: Delta holds
        core = torch.minimum(torch.sqrt(square) + GRID_STEP / 2 * l1, core)
    c = core + DEQUANT_FACTOR * l1
    lift = 1.0 + (scales_t.shape[-2] + 8) * 2.0**-23
    return torch.where(l1 == 0, torch.zeros_like(c), c * lift + TINY) + a_overflow


def group_dot(x: torch.Tensor, y_t: torch.Tensor) -> torch.Tensor:
    """``sum_g x[..., q, g] y_t[..., g, t]`` (..., Q, S), unrolled over the few groups: each step runs along the
    contiguous token axis (a BLAS call or a strided reduction measured 3x slower for ``n_g = 2``)."""
    out = x[..., :, None, 0] * y_t[..., None, 0, :]
    for g in range(1, x.shape[-1]):
        out = out + x[..., :, None, g] * y_t[..., None, g, :]
    return out


def probe() -> tuple:
    """Arguments that compile :func:`tier_b_kernel` (sizes >= 2; two groups)."""
    return torch.ones(1, 2, 2), torch.ones(1, 2, 2), torch.ones(1, 2, 3, dtype=torch.float16), False


def fast_tier_b_logit_bound(q: torch.Tensor, store: PackedStore, delta_loc: float, sm_scale: float | None = None,
                            mode: str = "min", n_tokens: int | None = None,
                            key_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`witcert.tier_b_logit_bound` (same arguments, checks and shape (*lead, Hq, Tq, S)) from one fp32
    pass where the layout and ``key_dtype`` allow (module doc); never below the exact bound."""
    return fast_tier_b_of_chunks(q, [store], delta_loc, sm_scale, mode, n_tokens, key_dtype)


def fast_tier_b_of_chunks(q: torch.Tensor, stores: list, delta_loc: float, sm_scale: float | None = None,
                          mode: str = "min", n_tokens: int | None = None,
                          key_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The bound over the written chunks of one cache (each a :class:`PackedStore` of the same heads, in write
    order), concatenated along ``S``; ``n_tokens`` defaults to their total. The bound needs only the scales
    on the fast layouts, so every chunk is one pass: their scales are joined, not their payloads."""
    if not stores:
        raise ValueError("stores: expected at least one written chunk")
    n_union = sum(store.n_tokens for store in stores) if n_tokens is None else n_tokens
    if not all(fast_layout(store, mode, key_dtype) for store in stores):
        return torch.cat([tier_b_logit_bound(q, store, delta_loc, sm_scale, mode, n_union, key_dtype)
                          for store in stores], dim=-1)
    a, b, scales_t = kernel_inputs(q, stores, delta_loc, sm_scale, n_union)
    c = pick(tier_b_kernel, probe)(a, b, scales_t, mode == "delta")
    return c.reshape(*q.shape[:-1], scales_t.shape[-1])


def kernel_inputs(q: torch.Tensor, stores: list, delta_loc: float, sm_scale: float | None,
                  n_union: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tier_b_kernel`'s ``(a, b, scales_t)`` for the written chunks ``stores`` of one cache (fast layouts:
    :func:`fast_layout`), after :func:`witcert.tier_b_logit_bound`'s checks; ``a``, ``b`` (*lead, Hkv, G Tq, n_g)."""
    for store in stores[1:]:  # one cache: same layout and heads, only S differs
        if store.layout != stores[0].layout or store.scales.shape[:-2] != stores[0].scales.shape[:-2]:
            raise ValueError("stores: expected the chunks of one cache (same layout and heads)")
    scales_t = torch.cat([store.scales.transpose(-1, -2) for store in stores], dim=-1)  # (*lead, H, n_g, S), one copy
    q64, sm, n_union = check_tier_b_inputs(q, stores[0], delta_loc, sm_scale, n_union)  # (*lead, Hkv, G Tq, d)
    a, b = group_sums(q64, scales_t.shape[-2], sm, math.log(2 * n_union / delta_loc))
    return a, b, scales_t


def fast_layout(store: PackedStore, mode: str, key_dtype: torch.dtype) -> bool:
    """Whether this module's pass serves ``store`` read as ``key_dtype`` in ``mode`` (else the fp64 library bound)."""
    return mode in ("min", "delta") and shares_group_scales(store) and key_dtype in _FAST_KEY_DTYPES


def group_sums(q64: torch.Tensor, n_groups: int, sm: float, log_term: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``a_g >= sm sum |q_c|`` and ``b_g >= sm^2 log_term / 6 sum q_c^2`` over each scale group, lifted."""
    groups = q64.unflatten(-1, (n_groups, -1))  # (..., Q, n_g, Gc)
    a = fp32_up(groups.abs().sum(-1) * sm)
    b = fp32_up((groups * groups).sum(-1) * (sm * sm * log_term / 6))
    return torch.clamp(a, min=_L1_FLOOR), torch.clamp(b, min=_SQ_FLOOR)

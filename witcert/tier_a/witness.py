"""Tier A band-norm witness: store ``w_{t,b} >= ||r_{t,b}||``, read ``c_t`` (Lemma 1, Theorem 2).

Write time (:func:`witness_of`): ``r_t = k^_t - k_t``; ``w_{t,b}`` is the band norm of ``r_t``
stored in fp16 **rounded up** (a witness rounded to nearest can fall below the norm and is
unsound). Which keys: by default the keys attention reads (post-RoPE, exactly as computed), and
the witness is that residual's band norm. Lemma 1 (``L1``) makes the band norms of a pre-RoPE
residual position-invariant in exact arithmetic only: a rotation computed in fp16/bf16/fp32
rounds the exact and the compressed key differently (massive channels: macroscopically). A
witness stored before RoPE must carry that rounding: ``witness_of(k, k_hat, layout,
rope_dtype=...)`` stores ``(1 + eta) ||r_b|| + sqrt(2) kappa (1 + eta) (||k_b|| + ||k^_b||) +
2 sqrt(2P) alpha0`` (``L1fp``, :mod:`witcert.tier_a.rotary`), which bounds the rotated residual at every
position and is still position-invariant.

Read time (:func:`logit_bound`): ``c_t = sm_scale * sum_b ||q_b|| w_{t,b} >= |q . r_t| sm_scale``
by Cauchy-Schwarz per band (Theorem 2, ``T2``), rounded up to the output dtype.

Rounding (why the results are >= the exact real values)
------------------------------------------------------
Norms are computed in fp64 after scaling each band by its max-abs entry (no overflow or
underflow in the squares). For ``n`` terms the fp64 relative error of a norm is below
``(n + 10) u`` with ``u = 2^-53`` (subtraction, scaling, squares, any-order summation
``gamma_{n-1}``, sqrt, rescale); we inflate by ``1 + (n + 16) 2^-52``, which covers it with a
factor two to spare, then round to the storage dtype and step up one ulp (``nextafter``
toward ``+inf``) wherever the cast landed below. Overflow gives ``inf``: the trivial bound.

Layout: a witness is indexed ``(..., S, B)`` and stored **band-major** (:func:`band_major`: each
band's ``S`` entries contiguous), so the per-token band dot of the fast path reads every band as
one contiguous run (measured 3x faster than reading 16-entry token rows at S = 32k on the CPU).
The stores keep that layout when they append tokens (:func:`cat_tokens`); any layout is accepted.
"""
import math

import torch

from witcert.tier_a.bands import BandLayout, _check_last_dim
from witcert.tier_a.rotary import ROPE_DTYPES, rounded_rotation_witness
from witcert.core.norms import norms_upper_fp64
from witcert.core.rounding import round_up_to

_U = 2.0**-52  # twice the fp64 unit roundoff: the margin unit for every inflation here


def witness_of(
    k: torch.Tensor, k_hat: torch.Tensor, layout: BandLayout, rope_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Sound fp16 band witness of the residual ``k_hat - k`` (``L1``/``L1fp``, Theorem 2 ``T2``).

    Parameters
    ----------
    k, k_hat : Tensor (..., S, d)
        Exact and reconstructed keys (any float dtype; same shape). Without ``rope_dtype``:
        the keys attention reads (post-RoPE, as computed). With ``rope_dtype``: the keys
        before RoPE, exactly the values the rotation takes as input.
    layout : BandLayout
        Bands of whole pairs under the model's pair convention.
    rope_dtype : {None, torch.float16, torch.bfloat16, torch.float32, torch.float64}
        ``None`` (default): no rotation follows; the witness is the residual's band norm.
        Otherwise the coarsest dtype the RoPE applied after this witness rounds to (its
        arithmetic or its result; the model dtype for HF Llama, ``x.dtype`` for
        :func:`witcert.apply_rope`): the witness then bounds the residual of the *rotated* keys
        at every position (``L1fp``, assumptions (A1)-(A3) in :mod:`witcert.tier_a.rotary`).

    Returns
    -------
    w : Tensor (..., S, B), float16
        ``w[..., t, b] >= ||(k_hat - k)[..., t, band b]||`` exactly (real arithmetic on the
        given floating values), with ``rope_dtype`` ``>=`` the band norm of the residual after
        the rounded rotation; never rounded down; ``inf`` when the bound exceeds fp16 range
        (or the rotation may overflow ``rope_dtype``).
    """
    _check_layout(layout)
    _check_key_pair(k, k_hat, layout)
    if rope_dtype is not None and rope_dtype not in ROPE_DTYPES:
        raise ValueError(f"rope_dtype must be None or one of {ROPE_DTYPES}, got {rope_dtype!r}")
    if rope_dtype is None:
        return residual_witness(k, k_hat, layout)
    k64, k_hat64 = k.to(torch.float64), k_hat.to(torch.float64)
    norms = _band_norms_upper_fp64(k_hat64 - k64, layout)  # (..., S, B)
    k_norms = _band_norms_upper_fp64(k64, layout)
    k_hat_norms = _band_norms_upper_fp64(k_hat64, layout)
    norms = rounded_rotation_witness(norms, k_norms, k_hat_norms, layout.pairs_per_band, rope_dtype)
    return band_major(round_up_to(norms, torch.float16))


def residual_witness(k: torch.Tensor, k_hat: torch.Tensor, layout: BandLayout) -> torch.Tensor:
    """:func:`witness_of` without rotation on checked keys: the fp16 upper band norms of ``k_hat - k``
    (fp64 difference, exact for inputs up to fp32), bands as ``layout`` splits them."""
    residual = k_hat.to(torch.float64) - k.to(torch.float64)
    return band_major(round_up_to(norms_upper_fp64(layout.split(residual)), torch.float16))


def band_major(w: torch.Tensor) -> torch.Tensor:
    """``w`` (..., S, B), the same values, with each band's ``S`` entries contiguous in memory (a copy only
    when they are not): the layout the fast band dot reads (:mod:`witcert.fastpath.radius`). One token's
    witness (B,) is returned as is."""
    if w.dim() < 2:
        return w
    bands_first = w.transpose(-1, -2)
    return w if bands_first.is_contiguous() else bands_first.contiguous().transpose(-1, -2)


def cat_tokens(*parts: torch.Tensor) -> torch.Tensor:
    """Witnesses (..., S_i, B) joined along the token axis into one :func:`band_major` witness."""
    return torch.cat([w.transpose(-1, -2) for w in parts], dim=-1).transpose(-1, -2)


def logit_bound(q: torch.Tensor, w: torch.Tensor, layout: BandLayout, sm_scale: float | None = None) -> torch.Tensor:
    """Per-token logit error bound ``c_t = sm_scale sum_b ||q_b|| w_{t,b}`` (Theorem 2, ``T2``).

    The head axes are named by position and checked: query heads against kv heads, GQA inside.

    Parameters
    ----------
    q : Tensor (..., Hq, Tq, d)
        Queries of ``Hq`` query heads, ``Tq`` each, in the frame attention uses (post-RoPE, as
        computed); fp16/bf16/fp32/fp64. One query of one head is ``(1, 1, d)``.
    w : Tensor (..., Hkv, S, B)
        Witnesses from :func:`witness_of` of ``Hkv`` kv heads (any float dtype, ``>= 0``, ``inf``
        allowed), with the same leading dims ``...`` as ``q`` (no broadcasting). Query head ``h``
        reads kv head ``h // (Hq / Hkv)`` (HF ``repeat_kv`` order); ``Hq`` must be a multiple of
        ``Hkv``. ``w`` from the keys attention reads, or from the keys before RoPE with
        ``rope_dtype`` (``L1fp``).
    layout : BandLayout
    sm_scale : float, optional
        Softmax scale, taken as the exact real multiplier. Default: ``1/sqrt(d)`` rounded up
        (two ulps above the fp64 quotient, which covers its two roundings).

    Returns
    -------
    c : Tensor (..., Hq, Tq, S)
        fp64 for fp64 ``q``, fp32 otherwise; ``>=`` the exact real value of
        ``sm_scale sum_b ||q_b|| w_b`` (and so ``>= |eps_t|``, the logit error in exact
        arithmetic); ``inf`` on overflow.

    Raises
    ------
    ValueError
        On a rank below 3, ranks or leading dims that differ, or ``Hq`` not a multiple of
        ``Hkv``: a pairing of heads that is not spelled out is refused, never broadcast.

    Notes
    -----
    ``c`` bounds the error of logits computed in exact arithmetic. Logits a runtime computes in
    floating point (bf16/fp16 scores, fp32 accumulation) differ from those by their rounding:
    add :func:`witcert.score_rounding_bound` (:mod:`witcert.tier_a.score_rounding`) to ``c`` before calling
    :func:`witcert.meter` on them.
    """
    hkv, groups = check_logit_bound_inputs(q, w, layout)
    scale = _resolve_scale(sm_scale, layout.head_dim)
    q_norms = _band_norms_upper_fp64(q.to(torch.float64), layout)  # (..., Hq, Tq, B), already inflated
    # c grows with every ||q_b||: lifting tiny nonzero norms keeps an upper bound and keeps the
    # fp64 products against fp16 witnesses (>= 2^-24) out of subnormals (fp32 queries never get here)
    q_norms = torch.where(q_norms > 0, q_norms.clamp(min=2.0**-500), q_norms)
    lead, tq = q.shape[:-3], q.shape[-2]
    q_norms = q_norms.reshape(*lead, hkv, groups * tq, layout.bands)  # each kv head's G query heads, folded
    c = _band_dot(q_norms, w.to(torch.float64)) * scale  # (..., Hkv, G Tq, S)
    # One B-term fp64 dot of non-negative terms in any order (BLAS blocking, FMA or not) is
    # within gamma_B ~ B 2^-53 relative of the exact value; the scale multiply adds one rounding
    # and this inflation one more: B + 2 roundings < (B + 4) 2^-52 <= (B + 8) 2^-52 (margin 2x).
    c = c * (1.0 + (layout.bands + 8) * _U)
    out_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return round_up_to(c, out_dtype).reshape(*q.shape[:-1], w.shape[-2])  # (..., Hq, Tq, S)


def check_logit_bound_inputs(q: torch.Tensor, w: torch.Tensor, layout: BandLayout) -> tuple[int, int]:
    """:func:`logit_bound`'s checks (``ValueError`` naming the argument); returns ``(Hkv, G)``."""
    _check_layout(layout)
    _check_last_dim(q, layout.head_dim, "q")
    _check_finite_float(q, "q")
    _check_witness(w, layout)
    return check_head_pairing(q.shape, w.shape, "q", "w")


def check_head_pairing(q_shape, kv_shape, q_name: str, kv_name: str) -> tuple[int, int]:
    """``(Hkv, G)`` for queries ``(..., Hq, Tq, d)`` against a kv-head tensor ``(..., Hkv, S, x)``.

    Refuses (``ValueError``) every shape whose pairing of heads would have to be guessed: a rank
    below 3, ranks or leading dims that differ (no broadcasting), ``Hq`` not a multiple of
    ``Hkv``. A query tensor ``(H, Tq, d)`` against ``(H, S, B)`` pairs head ``h`` with head
    ``h``; it can never pair ``w``'s head axis with ``q``'s query axis.
    """
    q_shape, kv_shape = tuple(q_shape), tuple(kv_shape)
    if len(q_shape) < 3:
        raise ValueError(f"{q_name} must be (..., Hq, Tq, d) with explicit query-head and query axes, got shape "
                         f"{q_shape}; one query of one head is (1, 1, d)")
    if len(kv_shape) != len(q_shape) or kv_shape[:-3] != q_shape[:-3]:
        raise ValueError(f"{kv_name} must be (..., Hkv, S, .) with the same leading dims as {q_name} "
                         f"(..., Hq, Tq, d): got {q_name} {q_shape} and {kv_name} {kv_shape} (no broadcasting: "
                         "give every axis explicitly)")
    hq, hkv = q_shape[-3], kv_shape[-3]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads Hq={hq} ({q_name} axis -3) must be a multiple of kv heads Hkv={hkv} "
                         f"({kv_name} axis -3)")
    return hkv, hq // hkv


def _band_dot(q_norms: torch.Tensor, w64: torch.Tensor) -> torch.Tensor:
    """``sum_b q_norms[..., i, b] w64[..., t, b]`` (..., Q, B) x (..., S, B) -> (..., Q, S), ``0 * inf = 0``.

    One batched fp64 matmul (``q_norms`` (..., Q, B) against ``w64`` (..., S, B): the queries of
    one kv head, GQA group folded in, form the matrix dimension; no (..., Q, S, B) product). A zero band norm or a zero
    witness contributes exactly 0 even against ``inf`` (the band's logit error is then 0); a matmul
    may turn ``0 * inf`` into NaN, so that rare case falls back to the elementwise sum.
    """
    c = q_norms @ w64.transpose(-1, -2)  # (..., Q, S)
    if not torch.isnan(c).any():
        return c
    terms = q_norms.unsqueeze(-2) * w64.unsqueeze(-3)  # (..., Q, S, B)
    terms = torch.where((q_norms.unsqueeze(-2) == 0) | (w64.unsqueeze(-3) == 0), torch.zeros_like(terms), terms)
    return terms.sum(dim=-1)


def _band_norms_upper_fp64(x64: torch.Tensor, layout: BandLayout) -> torch.Tensor:
    """fp64 band norms of fp64 ``x`` (..., d) -> (..., B), each >= the exact band norm."""
    return norms_upper_fp64(layout.split(x64))  # (..., B)


def _resolve_scale(sm_scale: float | None, head_dim: int) -> float:
    """The softmax scale as an exact real multiplier (the default rounded up)."""
    if sm_scale is None:
        # fl(1/fl(sqrt d)) is within 2 u of 1/sqrt(d); two ulps up cover it
        up = math.nextafter(math.nextafter(1.0 / math.sqrt(head_dim), math.inf), math.inf)
        return up
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise ValueError(f"sm_scale must be a positive float, got {sm_scale!r}")
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be finite and > 0, got {sm_scale!r}")
    return float(sm_scale)


def _check_layout(layout) -> None:
    if not isinstance(layout, BandLayout):
        raise ValueError(f"layout must be a BandLayout, got {type(layout).__name__}")


def _check_finite_float(x: torch.Tensor, name: str, finite: bool = True) -> None:
    """A floating tensor, and (when ``finite``: two host reads) free of NaN and Inf."""
    if not torch.is_floating_point(x):
        raise ValueError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    if not finite:
        return
    if torch.isnan(x).any():
        raise ValueError(f"{name} contains NaN")
    if torch.isinf(x).any():
        raise ValueError(f"{name} contains Inf")


def _check_key_pair(k: torch.Tensor, k_hat: torch.Tensor, layout: BandLayout, finite: bool = True) -> None:
    _check_last_dim(k, layout.head_dim, "k")
    _check_last_dim(k_hat, layout.head_dim, "k_hat")
    if k.shape != k_hat.shape:
        raise ValueError(f"k_hat shape {tuple(k_hat.shape)} differs from k shape {tuple(k.shape)}")
    _check_finite_float(k, "k", finite)
    _check_finite_float(k_hat, "k_hat", finite)


def _check_witness(w: torch.Tensor, layout: BandLayout) -> None:
    if not isinstance(w, torch.Tensor) or not torch.is_floating_point(w):
        raise ValueError("w must be a floating tensor (..., S, B)")
    if w.dim() < 2 or w.shape[-1] != layout.bands:
        raise ValueError(f"w must have shape (..., S, B={layout.bands}), got {tuple(w.shape)}")
    if not (w >= 0).all():  # one pass: NaN compares False too
        if torch.isnan(w).any():
            raise ValueError("w contains NaN")
        raise ValueError("w contains negative entries (a witness is a norm)")

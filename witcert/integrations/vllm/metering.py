"""Tier A meter of one decode query over the keys vLLM stored (Theorem 2 ``T2``, meter ``T1``).

For each decode token (one per request in the step): the query ``q`` (post-RoPE, as the kernel received it), the
stored keys read back ``k^`` and their witnesses ``w >= ||k^_b - k_b||`` (written when each key
entered the cache) give per-token logit bounds ``c_t = scale sum_b ||q_b|| w_{t,b}`` and the
meter over the compressed logits. The meter bounds the TV between attention (real arithmetic,
vLLM's softmax scale) over the exact post-RoPE keys and over the stored keys, for every query:
Tier A is adaptive-safe, so generated queries need no independence assumption.

The compressed logits are formed here in fp64; ``score_slack`` adds the rounding of that dot
product to ``c`` (the same slack the observatory uses), so the meter is a bound against the
exact real logits. The kernel's own fp32/bf16 arithmetic is outside what is metered.
"""
import math
from dataclasses import dataclass

import torch

from witcert.core.metering import meter, risk_score
from witcert.tier_a.witness import logit_bound

_U64 = 2.0**-53


@dataclass(frozen=True)
class DecodeCells:
    """Per (decode row, query head) results of one layer's step: each ``(R, Hq)``, fp64.

    ``risk`` (the raw e-form) and ``true_tv`` (fp64 TV against the exact keys, shadow mode) are
    ``None`` unless asked for.
    """

    meter: torch.Tensor
    risk: torch.Tensor | None = None
    true_tv: torch.Tensor | None = None


def meter_decode(q, k_hat, w, lengths, layout, scale: float, k_exact=None, with_risk: bool = False,
                 tier_b=None) -> DecodeCells:
    """Meter every query head of ``R`` decode tokens at once (Theorem 2 ``T2``, meter ``T1``/``P1``/``MN``).

    Parameters
    ----------
    q : Tensor (R, Hq, d)
        The decode queries, post-RoPE. Query head ``h`` reads kv head ``h // G`` (vLLM's order).
    k_hat : Tensor (R, Hkv, S, d), fp64
        Stored keys as the kernel reads them (:func:`.layout.decode`), zero-padded past each
        row's length.
    w : Tensor (R, Hkv, S, B)
        Witnesses ``w[r, h, t, b] >= ||(k^ - k)[r, h, t, band b]||`` (fp16, rounded up).
    lengths : LongTensor (R,)
        Tokens each row attends (its own included); positions beyond are masked out.
    layout : witcert.BandLayout
    scale : float
        The softmax scale, the exact multiplier of both logits.
    k_exact : Tensor (R, Hkv, S, d), optional
        The exact post-RoPE keys (shadow mode): also return the true TV.
    with_risk : bool
        Also return the raw risk score (for the per-cell log).
    tier_b : TierBKeys, optional
        The dithered cache's codes and scales of the same tokens: the per-token bound becomes
        ``min(Tier A, Tier B deterministic branch DB)``.
    """
    scores, c = decode_terms(q, k_hat, w, lengths, layout, scale, tier_b)
    rows, hq = q.shape[:2]
    bound = meter(scores, c).reshape(rows, hq)
    risk = risk_score(scores, c).reshape(rows, hq) if with_risk else None
    true_tv = None if k_exact is None else true_tv_of(q, k_exact, scores, lengths, scale)
    return DecodeCells(meter=bound, risk=risk, true_tv=true_tv)


@dataclass(frozen=True)
class TierBKeys:
    """Tier B side data of ``R`` rows of stored keys: ``codes`` (R, Hkv, S, d) int8, ``scales``
    (R, Hkv, S, d/Gc) fp16, ``valid`` (R, Hkv, S) bool (the token was stored by the dithered
    cache and read back unchanged), ``key_dtype`` the dtype the cache holds the keys in."""

    codes: torch.Tensor
    scales: torch.Tensor
    valid: torch.Tensor
    key_dtype: torch.dtype
    group: int = 32


def decode_terms(q, k_hat, w, lengths, layout, scale: float, tier_b: TierBKeys | None = None):
    """The compressed logits and per-token bounds of every cell: ``(scores, c)``, each (R, Hq, S) fp64.

    ``scores = scale q . k^`` in fp64 (``-inf`` past a row's length); ``c`` the Tier A bound
    (``T2``, :func:`witcert.tier_a.witness.logit_bound`), or its per-token minimum with the Tier B
    deterministic branch (``DB``) where ``tier_b`` is valid, plus the fp64 score rounding
    (:func:`score_slack`), so that ``|scores - exact logits| <= c`` in real arithmetic.
    """
    rows, hq, d = q.shape
    hkv, s = k_hat.shape[1], k_hat.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {hkv}")
    qg = q.to(torch.float64).reshape(rows, hkv, hq // hkv, 1, d)  # (R, Hkv, G, 1, d)
    keep = (torch.arange(s) < lengths.view(-1, 1)).view(rows, 1, 1, 1, s)
    c = logit_bound(qg.reshape(rows, hq, 1, d), w, layout, scale).view(rows, hkv, hq // hkv, 1, s)  # fp64
    if tier_b is not None and bool(tier_b.valid.any()):
        c = torch.minimum(c, _tier_b_bound(q, tier_b, scale).view(rows, hkv, hq // hkv, 1, s))
    c = (c + score_slack(qg, k_hat, scale)).masked_fill(~keep, 0.0)
    scores = (scale * _dot(qg, k_hat)).masked_fill(~keep, -math.inf)
    return scores.reshape(rows, hq, s), c.reshape(rows, hq, s)


def _tier_b_bound(q, tier_b: TierBKeys, scale: float) -> torch.Tensor:
    """The deterministic branch ``DB`` per token, (R, Hq, 1, S) fp64 (``inf`` where not valid).

    ``witcert.tier_b_logit_bound(mode="delta")``: ``sm sum_c |q_c| (s_c/2 + e_c)``, valid for
    every query (adaptive decode included), fp32 rounded up.
    """
    from witcert.tier_b.certificate import tier_b_logit_bound
    from witcert.tier_b.packed_store import PackedStore, StoreLayout

    rows, hkv, s, d = tier_b.codes.shape
    valid = tier_b.valid
    codes = tier_b.codes.masked_fill(~valid.unsqueeze(-1), 0)
    scales = tier_b.scales.masked_fill(~valid.unsqueeze(-1), 0.0)
    store = PackedStore(StoreLayout("token-group", d, tier_b.group), codes.contiguous(), scales.contiguous(),
                        torch.zeros(rows, hkv, s, 0, dtype=torch.float16), source_dtype=tier_b.key_dtype)
    bound = tier_b_logit_bound(q.unsqueeze(-2), store, 0.5, scale, mode="delta", key_dtype=tier_b.key_dtype)
    groups = q.shape[1] // hkv
    invalid = (~valid).repeat_interleave(groups, dim=1).unsqueeze(-2)  # (R, Hq, 1, S)
    return bound.to(torch.float64).masked_fill(invalid, math.inf)


def true_tv_of(q, k_exact, scores, lengths, scale: float) -> torch.Tensor:
    """fp64 TV between softmax over the exact keys and over ``scores`` (R, Hq, S): (R, Hq)."""
    rows, hq, d = q.shape
    hkv, s = k_exact.shape[1], k_exact.shape[2]
    qg = q.to(torch.float64).reshape(rows, hkv, hq // hkv, 1, d)
    keep = (torch.arange(s) < lengths.view(-1, 1)).view(rows, 1, s)
    exact = (scale * _dot(qg, k_exact.to(torch.float64))).reshape(rows, hq, s).masked_fill(~keep, -math.inf)
    diff = torch.softmax(exact, dim=-1) - torch.softmax(scores, dim=-1)
    return 0.5 * diff.abs().sum(-1)


def score_slack(qg: torch.Tensor, k_hat: torch.Tensor, scale: float) -> torch.Tensor:
    """``delta_t >= |fl(scale q . k^_t) - scale q . k^_t|`` for the fp64 scores: (R, Hkv, G, 1, S).

    A d-term fp64 dot product errs by at most ``gamma_d sum_i |q_i k_i|`` (any order), the
    scale multiply by one more rounding; ``sum_i |q_i k_i|`` is itself computed in fp64 (within
    ``gamma_d``). ``2 gamma_{d+2} / (1 - gamma_d)`` covers all of it with a factor two to spare
    (including the rounding of this product, far below the margin).
    """
    d = qg.shape[-1]
    gamma = (d + 2) * _U64 / (1 - (d + 2) * _U64)
    return (2 * gamma * scale / (1 - gamma)) * _dot(qg.abs(), k_hat.abs())


def _dot(qg: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``qg . k_t`` for (R, Hkv, G, 1, d) x (R, Hkv, S, d) -> (R, Hkv, G, 1, S), fp64.

    One matmul per (row, kv head) over its G query heads: broadcasting ``k`` over G instead
    would copy every key G times (measured 5x slower at S = 730).
    """
    rows, hkv, groups, _, d = qg.shape
    return (qg.reshape(rows, hkv, groups, d) @ k.transpose(-1, -2)).unsqueeze(-2)

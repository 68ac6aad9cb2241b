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


def meter_decode(q, k_hat, w, lengths, layout, scale: float, k_exact=None, with_risk: bool = False) -> DecodeCells:
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
    """
    rows, hq, d = q.shape
    hkv, s = k_hat.shape[1], k_hat.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {hkv}")
    qg = q.to(torch.float64).reshape(rows, hkv, hq // hkv, 1, d)  # (R, Hkv, G, 1, d)
    keep = (torch.arange(s) < lengths.view(-1, 1)).view(rows, 1, 1, 1, s)
    c = logit_bound(qg.reshape(rows, hq, 1, d), w, layout, scale).view(rows, hkv, hq // hkv, 1, s)  # fp64
    c = (c + score_slack(qg, k_hat, scale)).masked_fill(~keep, 0.0)
    scores = (scale * _dot(qg, k_hat)).masked_fill(~keep, -math.inf)
    bound = meter(scores, c).reshape(rows, hq)
    risk = risk_score(scores, c).reshape(rows, hq) if with_risk else None
    true_tv = None
    if k_exact is not None:
        exact = scale * _dot(qg, k_exact.to(torch.float64))
        diff = torch.softmax(exact.masked_fill(~keep, -math.inf), dim=-1) - torch.softmax(scores, dim=-1)
        true_tv = (0.5 * diff.abs().sum(-1)).reshape(rows, hq)
    return DecodeCells(meter=bound, risk=risk, true_tv=true_tv)


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

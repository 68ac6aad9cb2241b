"""Per-cell measurement: meter, risk score and true TV for every (query head, query) of one layer call.

A *cell* is one (layer, query head, query position) -- at decode time one (layer, head, step).
For the queries of one forward call this module forms, in fp64:

- exact logits ``l = q.k sm_scale`` and compressed logits ``l~ = q.k^ sm_scale`` (masked: ``-inf``);
- per-token bounds ``c_t >= |l~_t - l_t|`` from the stored certificate (Tier A: Theorem 2, ``T2``);
- the meter ``min(1, T1, P1, MN)`` and the raw risk score (T1) from :func:`witcert.meter`;
- the true ``TV(softmax(l), softmax(l~))`` against the exact shadow (observatory mode);
- the exact attention output, which the gate substitutes for the cells it repairs.

fp64 is the arithmetic of record: the meter bounds the TV of the exact-arithmetic attention
over the stored floats, and the true TV is measured the same way. The model itself runs the
attention in fp32; the fp32-vs-fp64 gap (~1e-7) is not part of what is certified.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from witcert.meter import meter, risk_score


@dataclass(frozen=True)
class CellBatch:
    """Measurements of the cells of one layer call; every tensor is (B, Hq, Tq) on the CPU."""

    layer: int
    positions: torch.Tensor  # (Tq,) absolute query positions (the decode step for Tq = 1)
    meter: torch.Tensor
    risk: torch.Tensor
    true_tv: torch.Tensor  # NaN when the exact shadow was not consulted
    c_max: torch.Tensor  # max_t c_t over visible tokens
    repaired: torch.Tensor  # bool: the gate replaced this cell by exact attention

    def __post_init__(self):
        shape = self.meter.shape
        for name in ("risk", "true_tv", "c_max", "repaired"):
            if getattr(self, name).shape != shape:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected {tuple(shape)}")
        if self.positions.shape != shape[-1:]:
            raise ValueError(f"positions must be ({shape[-1]},), got {tuple(self.positions.shape)}")


@dataclass(frozen=True)
class CellMath:
    """fp64 intermediates of one call, grouped for GQA: (B, Hkv, G, Tq, ...)."""

    meter: torch.Tensor  # (B, Hkv, G, Tq)
    risk: torch.Tensor
    true_tv: torch.Tensor
    c_max: torch.Tensor
    exact_output: torch.Tensor  # (B, Hkv, G, Tq, d)


def visible_mask(attention_mask, batch: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """Boolean (B|1, 1|Hq, Tq, S) mask of the keys each query may see.

    ``None`` means causal with the queries at the end of the cache (the stock sdpa path's
    ``is_causal``; for one query every key is visible). Float masks are additive: entries at
    or below half the dtype's minimum count as masked.
    """
    if attention_mask is None:
        rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
        return (torch.arange(kv_len, device=device)[None, :] <= rows)[None, None]
    if attention_mask.dtype == torch.bool:
        return attention_mask[..., :kv_len]
    return attention_mask[..., :kv_len] > torch.finfo(attention_mask.dtype).min / 2


def measure(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_hat: torch.Tensor,
    logit_bound_fn,
    visible: torch.Tensor,
    scale: float,
    with_truth: bool = True,
) -> CellMath:
    """Meter, risk and (optionally) true TV for every query of one call (T1, P1, MN via ``meter``).

    Parameters
    ----------
    query : (B, Hq, Tq, d) post-RoPE queries.
    key, value : (B, Hkv, S, d) exact cache (the shadow).
    k_hat : (B, Hkv, S, d) stored reconstruction of the keys.
    logit_bound_fn : callable ``q5 (B, Hkv, G, Tq, d) -> c (B, Hkv, G, Tq, S)``, ``c >= |eps|``.
    visible : bool mask broadcastable to (B, Hq, Tq, S).
    scale : the softmax scale (exact real multiplier).
    """
    b, hq, tq, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    groups = hq // hkv
    q5 = query.to(torch.float64).reshape(b, hkv, groups, tq, d)  # (B, Hkv, G, Tq, d)
    mask5 = visible.expand(b, hq, tq, s).reshape(b, hkv, groups, tq, s)
    k_hat5 = k_hat.to(torch.float64)[:, :, None]  # (B, Hkv, 1, S, d)
    scores_hat = (q5 @ k_hat5.transpose(-1, -2)) * scale  # (B, Hkv, G, Tq, S)
    scores_hat = scores_hat.masked_fill(~mask5, -torch.inf)
    c = logit_bound_fn(q5)  # (B, Hkv, G, Tq, S)
    c = torch.where(mask5, c, torch.zeros_like(c))
    m = meter(scores_hat, c)
    r = risk_score(scores_hat, c)
    c_max = c.amax(dim=-1)
    k5 = key.to(torch.float64)[:, :, None]
    scores = ((q5 @ k5.transpose(-1, -2)) * scale).masked_fill(~mask5, -torch.inf)
    p = torch.softmax(scores, dim=-1)
    exact_output = p @ value.to(torch.float64)[:, :, None]  # (B, Hkv, G, Tq, d)
    if with_truth:
        p_hat = torch.softmax(scores_hat, dim=-1)
        true_tv = 0.5 * (p - p_hat).abs().sum(dim=-1)
    else:
        true_tv = torch.full_like(m, torch.nan, dtype=torch.float64)
    return CellMath(meter=m, risk=r, true_tv=true_tv, c_max=c_max, exact_output=exact_output)


def flatten_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, G, Tq, ...) -> (B, Hq, Tq, ...) with query head ``h = kv * G + g`` (HF order)."""
    return x.flatten(1, 2)

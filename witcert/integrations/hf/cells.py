"""Per-cell measurement and repair for one layer call of a real model.

A *cell* is one (layer, query head, query position); at decode time one (layer, head, step).
For the queries of one forward call, :func:`measure` runs :func:`witcert.observe` (Tier A:
band witness ``L1``/``T2``, meter ``T1``/``P1``/``MN``, value-side output bound, joint pass)
on the exact shadow and the stored reconstruction, per batch element, in fp64, and keeps the
compressed and exact logits the gate needs. :func:`gated_output` runs a :class:`witcert.Gate`
(block-level page-in from the exact shadow; the Gate is vectorized over cells) and
recomputes the attention output of every fired cell over the repaired cache.

fp64 is the arithmetic of record (see :mod:`witcert.observe` for the score-rounding slack):
the meter bounds the TV of exact-arithmetic attention over the stored floats (the keys attention
reads, in the model's dtype: every rounding between the store and those floats is inside the
per-token bounds), and the true TV is measured the same way. The model's own attention kernel
rounds its scores in the model's dtype; that gap is not part of what is certified.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from witcert.core import values
from witcert.gate.policy import Gate
from witcert.core.metering import meter, risk_score
from witcert.tier_a.observation import observe

_FIELDS = ("meter", "risk", "true_tv", "output_bound", "true_output_error", "joint", "c_max", "repaired")


@dataclass(frozen=True)
class CellBatch:
    """Measurements of the cells of one layer call; every tensor is (B, Hq, Tq) on the CPU.

    ``true_tv``/``true_output_error`` are NaN when the exact shadow was not consulted;
    ``repaired`` marks the cells the gate fired on (their output was recomputed).
    """

    layer: int
    positions: torch.Tensor  # (Tq,) absolute query positions (the decode step for Tq = 1)
    meter: torch.Tensor
    risk: torch.Tensor
    true_tv: torch.Tensor
    output_bound: torch.Tensor
    true_output_error: torch.Tensor
    joint: torch.Tensor  # bool: pass_K and pass_V
    c_max: torch.Tensor  # max_t c_t over visible tokens
    repaired: torch.Tensor
    extra: dict = field(default_factory=dict)  # name -> (B, Hq, Tq), e.g. Tier B meters at other deltas
    seed: int | None = None  # Philox seed of the dithered cache (None: no dither), for replay
    requests: tuple[int, ...] | None = None  # request id of each batch row's dither stream

    def __post_init__(self):
        shape = self.meter.shape
        for name in _FIELDS[1:]:
            if getattr(self, name).shape != shape:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected {tuple(shape)}")
        for name, t in self.extra.items():
            if t.shape != shape:
                raise ValueError(f"extra[{name!r}] has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if self.positions.shape != shape[-1:]:
            raise ValueError(f"positions must be ({shape[-1]},), got {tuple(self.positions.shape)}")
        if (self.seed is None) != (self.requests is None) or (self.requests is not None and len(self.requests) != shape[0]):
            raise ValueError(f"seed and requests go together, one request per batch row ({shape[0]}), "
                             f"got seed={self.seed!r}, requests={self.requests!r}")


@dataclass(frozen=True)
class CallMath:
    """fp64 quantities of one call, (B, Hq, Tq, ...); logits are ``-inf`` where masked."""

    cells: dict  # field name -> (B, Hq, Tq) tensor
    value_term: torch.Tensor  # (B, Hq, Tq) bound on sum_t p~_t rho_t
    v_norm_max: torch.Tensor  # (B, Hq, Tq)
    c: torch.Tensor  # (B, Hq, Tq, S) per-token logit bounds (score rounding included)
    scores_hat: torch.Tensor  # (B, Hq, Tq, S) compressed logits
    scores: torch.Tensor  # (B, Hq, Tq, S) exact logits


def visible_mask(attention_mask, q_len: int, kv_len: int, device) -> torch.Tensor:
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


def measure(query, key, value, k_hat, v_hat, visible, scale, scheme, layout, exact=True) -> CallMath:
    """Tier A observation of every (query head, query) of one call (``T1``, ``T2``, value side).

    ``query`` (B, Hq, Tq, d) post-RoPE; ``key``/``value`` (B, Hkv, S, d) the exact shadow;
    ``k_hat``/``v_hat`` the stored reconstruction; ``visible`` bool, broadcastable to
    (B, Hq, Tq, S).
    """
    b, hq, tq, _ = query.shape
    s = key.shape[-2]
    groups = hq // key.shape[1]
    mask = visible.expand(b, hq, tq, s)
    per_batch = []
    for i in range(b):
        obs = observe(
            query[i], key[i], value[i], scheme, layout, sm_scale=scale, exact=exact,
            mask=mask[i], k_hat=k_hat[i], v_hat=v_hat[i],
        )
        per_batch.append(obs)
    q64 = query.to(torch.float64)
    scores_hat = _logits(q64, k_hat, groups, scale).masked_fill(~mask, -torch.inf)
    scores = _logits(q64, key, groups, scale).masked_fill(~mask, -torch.inf)
    c = torch.stack([o.c for o in per_batch])  # (B, Hq, Tq, S)
    c = torch.where(mask, c, torch.zeros_like(c))
    nan = torch.full((hq, tq), torch.nan, dtype=torch.float64)
    cells = {
        "meter": torch.stack([o.meter for o in per_batch]),
        "risk": torch.stack([o.risk for o in per_batch]),
        "true_tv": torch.stack([o.true_tv if o.true_tv is not None else nan for o in per_batch]),
        "output_bound": torch.stack([o.output_bound for o in per_batch]),
        "true_output_error": torch.stack(
            [o.true_output_error if o.true_output_error is not None else nan for o in per_batch]
        ),
        "joint": torch.stack([o.joint for o in per_batch]),
        "c_max": c.amax(dim=-1),
    }
    return CallMath(
        cells=cells,
        value_term=torch.stack([o.value_term for o in per_batch]),
        v_norm_max=torch.stack([o.v_norm_max for o in per_batch]),
        c=c, scores_hat=scores_hat, scores=scores,
    )


def tighten_with_tier_b(math: CallMath, query, store, delta_loc: float, scale: float, adaptive: bool,
                        tau_k: float = 0.2, tau_v: float = 0.05) -> CallMath:
    """Per-token minimum of the Tier A bound and the Tier B bound of a dithered store (``TB``, ``L3``).

    ``c_t = min(c_t^A, c_t^B + score rounding)``: both hold on the Tier B event, so their minimum
    does. Non-adaptive queries (``adaptive=False``: prefill, teacher-forced probes) use
    ``min(u_t + beta_t, Delta_t) + rho_t``; adaptive ones (greedy decode) only the deterministic
    branch ``Delta_t + rho_t`` ("DB"), which holds for every query. ``rho_t`` covers the rounding
    of the dequantized keys to ``store.k_hat``'s dtype, the keys attention reads (an fp16 or bf16
    model rounds far more than the ``s/2`` of ``Delta_t`` leaves room for). The meter, risk,
    output bound and joint pass are recomputed from the tightened ``c``.

    Why a teacher-forced probe is in scope on a real model: the layer-``l`` query and keys are
    functions of the exact prefill and of the dither of layers ``< l`` only (the counter holds
    the layer, and under the Philox modelling assumption distinct streams are independent), so
    conditionally on those the layer-``l`` dither is independent of the query. Greedy decoding
    feeds back tokens chosen through every layer's dither, so there only ``Delta_t`` is used.
    """
    from witcert.tier_a.observation import score_rounding
    from witcert.tier_b.certificate import tier_b_logit_bound

    b, hq, tq, d = query.shape
    hkv = store.k_hat.shape[1]
    groups = hq // hkv
    s = store.k_hat.shape[-2]
    q4 = query.to(torch.float64).reshape(b, hkv, groups * tq, d)  # GQA group folded into the query axis
    mode = "delta" if adaptive else "min"
    parts = [tier_b_logit_bound(q4, chunk, delta_loc, sm_scale=scale, mode=mode, n_tokens=s, key_dtype=store.k_hat.dtype)
             for chunk in store.key_stores]
    c_b = torch.cat(parts, dim=-1).to(torch.float64).reshape(b, hq, tq, s)
    slack = torch.stack([
        score_rounding(query[i].to(torch.float64).reshape(hkv, groups, tq, d), store.k_hat[i].to(torch.float64), scale)
        for i in range(b)
    ]).reshape(b, hq, tq, s)
    c = torch.minimum(math.c, (c_b + slack) * (1 + 2.0**-50))  # the sum rounds once in fp64
    c = torch.where(torch.isneginf(math.scores_hat), torch.zeros_like(c), c)
    m = meter(math.scores_hat, c)
    bound = values.output_bound(m, math.value_term, math.v_norm_max)
    passes = values.joint_pass(m, math.value_term, math.v_norm_max, tau_k, tau_v)
    cells = dict(math.cells, meter=m, risk=risk_score(math.scores_hat, c), output_bound=bound,
                 joint=passes.joint, c_max=c.amax(dim=-1))
    return CallMath(cells=cells, value_term=math.value_term, v_norm_max=math.v_norm_max,
                    c=c, scores_hat=math.scores_hat, scores=math.scores)


def _logits(q64, keys, groups, scale):
    """(B, Hq, Tq, d) x (B, Hkv, S, d) -> (B, Hq, Tq, S) in fp64, query head ``h`` reading kv ``h // G``."""
    k64 = keys.to(torch.float64).repeat_interleave(groups, dim=1)  # (B, Hq, S, d)
    return (q64 @ k64.transpose(-1, -2)) * scale


def _block_tokens(paged: torch.Tensor, block_size: int, n_tokens: int) -> torch.Tensor:
    """(..., n_blocks) block flags -> (..., S) token flags."""
    return paged.repeat_interleave(block_size, dim=-1)[..., :n_tokens]


def gated_output(math: CallMath, gate: Gate, value, v_hat, output):
    """Gate every cell and recompute the output of fired cells over the repaired cache.

    The policy is :class:`witcert.Gate`'s own (one implementation), fed the exact logits of the
    exact shadow (the model's own cache, which holds the real keys and values); a repaired token
    reads its exact key and exact value. Returns
    ``(output, fired, paged)``: ``output`` (B, Tq, Hq, d) like transformers' attention output,
    ``fired`` (B, Hq, Tq) bool, ``paged`` (B, Hq, Tq) the fraction of visible tokens paged in
    (masked tokens of a paged block are not counted).
    """
    result = gate(math.scores_hat, math.c, exact=math.scores)  # vectorized over cells, 0 bytes moved
    scores_after, fired = result.scores, result.fired
    seen = ~torch.isneginf(math.scores_hat)  # (B, Hq, Tq, S)
    repaired = _block_tokens(result.paged, gate.block_size, seen.shape[-1]).to(seen.device) & seen
    paged = repaired.sum(-1) / seen.sum(-1).clamp(min=1)
    if not fired.any():
        return output, fired, paged
    groups = math.c.shape[1] // value.shape[1]
    v64 = value.to(torch.float64).repeat_interleave(groups, dim=1)  # (B, Hq, S, d)
    vh64 = v_hat.to(torch.float64).repeat_interleave(groups, dim=1)
    p = torch.softmax(scores_after, dim=-1)  # (B, Hq, Tq, S) over the repaired logits
    y = p @ vh64 + (p * repaired) @ (v64 - vh64)  # exact values on repaired tokens
    y = y.transpose(1, 2).to(output.dtype)  # (B, Tq, Hq, d)
    return torch.where(fired.transpose(1, 2)[..., None], y, output), fired, paged

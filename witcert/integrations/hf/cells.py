"""Per-cell measurement and repair for one attention call of a monitored model.

A *cell* is one (batch row, layer, query head, query position); at decode time one (request,
layer, head, step). For the queries of one call, :func:`measure` runs
:func:`witcert.tier_a.observation.observe_stored` once over the whole batch (Tier A: band witness
``L1``/``T2`` stored at write time, meter ``T1``/``P1``/``MN``, value-side output bound, joint
pass), with the true TV when the store keeps the exact keys. :func:`tighten_with_tier_b` takes
the per-token minimum with the Tier B bound of a dithered store. :func:`gated_output` runs a
:class:`witcert.Gate` (block-level page-in, vectorized over cells) with the exact logits in
memory, or through a :class:`witcert.gate.repair.LayerPager` over a verified backing store
when the exact cache is not kept, and recomputes the attention output of every fired cell.

What is certified: the meter bounds the TV of exact-arithmetic attention over the stored
floats (the keys attention reads, in the model's dtype: every rounding between the store and
those floats is inside the per-token bounds), with the fp64 logits' rounding included
(:func:`witcert.score_rounding_bound`); the true TV is measured the same way. The model's own
attention kernel rounds its scores in the model's dtype; that gap is not part of what is
certified here (a caller metering a runtime's own logits adds ``score_rounding_bound``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from witcert.core import rounding, values
from witcert.core.metering import meter
from witcert.fastpath.fused import lean_cells
from witcert.fastpath.tier_b_radius import fast_tier_b_of_chunks
from witcert.gate.policy import Gate
from witcert.gate.repair import LayerPager
from witcert.tier_a.observation import observe_stored
from witcert.tier_a.score_rounding import bias_rounding_bound, score_rounding_bound

FIELDS = ("meter", "risk", "true_tv", "output_bound", "true_output_error", "joint", "c_max", "repaired")
TIERS = ("A", "B")


@dataclass(frozen=True)
class CellBatch:
    """Measurements of the cells of one layer call; every tensor is (B, Hq, Tq) on the CPU.

    ``true_tv``/``true_output_error`` are NaN when the exact keys were not kept; every field is
    NaN on a row whose query sees no token (left padding inside a multi-token chunk);
    ``repaired`` marks the cells the gate fired on (their output was recomputed). ``tier`` is
    the certificate actually used (``"A"``, or ``"B"`` for the dithered cache with the Tier A
    minimum); ``adaptive`` says Tier B used only its deterministic branch (the queries may depend
    on the dither: inside ``generate``, or not declared non-adaptive); ``tier_b_delta`` is the
    per-cell failure probability of Tier B's probabilistic branch where it was used (``delta_loc``
    of a non-adaptive Tier B call), 0 where every radius is deterministic.
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
    requests: tuple[int, ...]  # the request id of each batch row
    tier: str = "A"
    adaptive: bool = True
    extra: dict = field(default_factory=dict)  # name -> (B, Hq, Tq), e.g. Tier B meters at other deltas
    seed: int | None = None  # Philox seed of a dithered cache (None: no dither), for replay
    tier_b_delta: float = 0.0  # failure probability of Tier B's probabilistic branch per cell (0: not used)

    def __post_init__(self):
        shape = self.meter.shape
        for name in FIELDS[1:]:
            if getattr(self, name).shape != shape:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected {tuple(shape)}")
        for name, t in self.extra.items():
            if t.shape != shape:
                raise ValueError(f"extra[{name!r}] has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if self.positions.shape != shape[-1:]:
            raise ValueError(f"positions must be ({shape[-1]},), got {tuple(self.positions.shape)}")
        if len(self.requests) != shape[0]:
            raise ValueError(f"requests must name each of the {shape[0]} batch rows, got {self.requests!r}")
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS} (the tier used, never 'auto'), got {self.tier!r}")
        if self.tier == "B" and self.seed is None:
            raise ValueError("a Tier B batch must record the dither seed of its cache (replay)")
        if not 0.0 <= self.tier_b_delta < 1.0 or (self.tier_b_delta and self.tier != "B"):
            raise ValueError(f"tier_b_delta must lie in [0, 1) and be 0 outside Tier B, got {self.tier_b_delta!r}")


@dataclass(frozen=True)
class CallMath:
    """fp64 quantities of one call, (B, Hq, Tq, ...); logits are ``-inf`` where masked."""

    cells: dict  # field name -> (B, Hq, Tq) tensor
    value_term: torch.Tensor  # (B, Hq, Tq) bound on sum_t p~_t rho_t
    v_norm_max: torch.Tensor  # (B, Hq, Tq)
    c: torch.Tensor  # (B, Hq, Tq, S) per-token logit bounds (score rounding included), 0 where masked
    scores_hat: torch.Tensor  # (B, Hq, Tq, S) compressed logits (the additive bias included)
    blank: torch.Tensor  # (B, Hq, Tq) bool: rows that see no token (reported as NaN)
    any_blank: bool = True  # whether ``blank`` has a True entry (read once, in :func:`measure`)
    bias: torch.Tensor | None = None  # (B|1, Hq|1, Tq, S) fp64 additive term of both logits (None: none)


def mask_terms(attention_mask, q_len: int, kv_len: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(visible, bias)`` of the mask attention applies: bool (B|1, 1|Hq, Tq, S) keys each query may
    see, and the fp64 additive term of its logits on them (``None``: none, the common case).

    ``None`` means causal with the queries at the end of the cache (for one query every key is
    visible). A bool mask hides keys. A float mask is added to the scores (sdpa's ``attn_mask``):
    entries at or below half the dtype's minimum (or ``-inf``) count as masked, as transformers'
    own masks use the minimum; every other value (``-1e9``, a soft bias) enters both the exact and
    the compressed logits (:func:`measure`). NaN or ``+inf`` entries raise.
    """
    if attention_mask is None:
        rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
        return (torch.arange(kv_len, device=device)[None, :] <= rows)[None, None], None
    if attention_mask.dim() < 2 or attention_mask.shape[-2] not in (1, q_len) or attention_mask.shape[-1] < kv_len:
        raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} is not (..., {q_len}|1, >= {kv_len}): "
                         f"the mask of {q_len} queries over {kv_len} keys")
    mask = attention_mask[..., :kv_len]
    if mask.dtype == torch.bool:
        return mask, None
    if not torch.is_floating_point(mask):
        raise ValueError(f"attention_mask must be bool or floating, got {mask.dtype}")
    if torch.isnan(mask).any() or torch.isposinf(mask).any():
        raise ValueError("attention_mask contains NaN or +inf (an additive mask must be finite or -inf)")
    visible = mask > torch.finfo(mask.dtype).min / 2
    bias = torch.where(visible, mask, torch.zeros_like(mask))
    return visible, (bias.to(torch.float64) if bias.any() else None)


def measure(query, store, read: tuple, visible, scale: float, layout, truth: bool = True, fused: bool = True,
            bias: torch.Tensor | None = None, query_read: torch.Tensor | None = None) -> CallMath:
    """Tier A observation of every (row, query head, query) of one call, in one batched pass.

    ``query`` (B, Hq, Tq, d) post-RoPE; ``store`` the layer's
    :class:`~witcert.integrations.hf.compressed_cache.LayerStore`; ``read`` the keys and values
    attention read (B, Hkv, S, d); ``visible`` bool, broadcastable to (B, Hq, Tq, S); ``truth``:
    also the true TV, when the store keeps the exact keys; ``fused``: the fast path's cells
    (:func:`~witcert.tier_a.observation.observe_stored`), else the full eager meter; ``bias`` the fp64
    additive term of both logits (:func:`mask_terms`), broadcastable to (B, Hq, Tq, S); ``query_read`` the query
    the attention kernel read when it quantizes the query (``QR``; ``None``: it read ``query``).
    """
    k_hat, v_hat = read
    b, hq, tq, _ = query.shape
    visible = visible.to(query.device)
    blank = (~visible.any(-1)).expand(b, hq, tq)  # from the mask as given: its broadcast rows once
    any_blank = bool(blank.any())
    mask = visible  # observe_stored broadcasts it to (B, Hq, Tq, S)
    if any_blank:  # measured as if every token were visible, then reported as NaN (and never gated)
        mask = visible | blank[..., None]
    exact = store.exact() if truth else None
    obs = observe_stored(query, store.stored(k_hat), layout, scale, mask=mask,
                         truth=None if exact is None else (*exact, v_hat), fused=fused, bias=bias, q_read=query_read)
    c = obs.c.masked_fill(blank[..., None], 0.0) if any_blank else obs.c  # 0 on masked tokens already
    nan = torch.full_like(obs.meter, torch.nan)
    cells = {
        "meter": obs.meter, "risk": obs.risk, "true_tv": nan if obs.true_tv is None else obs.true_tv,
        "output_bound": obs.output_bound,
        "true_output_error": nan if obs.true_output_error is None else obs.true_output_error,
        "joint": obs.joint, "c_max": c.amax(dim=-1),
    }
    return CallMath(cells=cells, value_term=obs.value_term, v_norm_max=obs.v_norm_max, c=c, scores_hat=obs.scores,
                    blank=blank, any_blank=any_blank, bias=bias)


def score_slack(query, k_hat, scale: float) -> torch.Tensor:
    """The fp64 logits' rounding (:func:`witcert.score_rounding_bound`), (B, Hq, Tq, S): one per call,
    shared by every Tier B tightening of it (it does not depend on ``delta_loc``)."""
    return score_rounding_bound(query.to(torch.float64), k_hat.to(torch.float64), scale,
                                score_dtype=torch.float64, accumulate_dtype=torch.float64)


def tighten_with_tier_b(math: CallMath, query, key_stores: list, k_hat, delta_loc: float, scale: float,
                        adaptive: bool, tau_k: float = 0.2, tau_v: float = 0.05,
                        slack: torch.Tensor | None = None) -> CallMath:
    """Per-token minimum of the Tier A bound and the Tier B bound of a dithered store (``TB``, ``L3``, ``DB``).

    ``key_stores``: the :class:`~witcert.tier_b.packed_store.PackedStore` of each written chunk
    (B, Hkv, T_i, d), in order; ``k_hat`` the keys attention read (their dtype is the
    ``key_dtype`` of the bound). ``c_t = min(c_t^A, c_t^B + score rounding)``: both hold on the
    Tier B event, so their minimum does. Non-adaptive queries (``adaptive=False``: prefill,
    teacher-forced probes a caller declared non-adaptive) use ``min(u_t + beta_t, Delta_t) +
    rho_t``; adaptive ones (anything inside ``generate``) only the deterministic branch ``Delta_t
    + rho_t`` ("DB"), which holds for every query. ``rho_t`` covers the rounding of the
    dequantized keys to ``k_hat``'s dtype (an fp16 or bf16 model rounds far more than the
    ``s/2`` of ``Delta_t`` leaves room for). The meter, risk, output bound and joint pass are
    recomputed from the tightened ``c`` (the fused pass, :mod:`witcert.fastpath`).

    Why a teacher-forced probe is in scope on a real model: the layer-``l`` query and keys are
    functions of the exact prefill and of the dither of layers ``< l`` only (the counter holds
    the layer, and under the Philox modelling assumption distinct streams are independent), so
    conditionally on those the layer-``l`` dither is independent of the query. Greedy decoding
    feeds back tokens chosen through every layer's dither, so there only ``Delta_t`` is used.
    ``slack``: :func:`score_slack` of this call, when the caller tightens it more than once.
    """
    mode = "delta" if adaptive else "min"
    c_b = fast_tier_b_of_chunks(query, key_stores, delta_loc, scale, mode, k_hat.shape[-2], k_hat.dtype).double()
    slack = score_slack(query, k_hat, scale) if slack is None else slack
    if math.bias is not None:  # scores_hat holds the bias: its fp64 addition rounds once more
        slack = rounding.add_up(slack, bias_rounding_bound(math.scores_hat))
    c = torch.minimum(math.c, rounding.add_up(c_b, slack))
    c = torch.where(torch.isneginf(math.scores_hat) | math.blank[..., None], torch.zeros_like(c), c)
    lean = lean_cells(math.scores_hat, c, checked=True)  # valid by construction: one fused pass, no re-checks
    m = lean.meter
    bound = values.output_bound(m, math.value_term, math.v_norm_max)
    passes = values.joint_pass(m, math.value_term, math.v_norm_max, tau_k, tau_v)
    cells = dict(math.cells, meter=m, risk=lean.risk, output_bound=bound,
                 joint=passes.joint, c_max=c.amax(dim=-1))
    return CallMath(cells=cells, value_term=math.value_term, v_norm_max=math.v_norm_max, c=c,
                    scores_hat=math.scores_hat, blank=math.blank, any_blank=math.any_blank, bias=math.bias)


def exact_logits(query, keys, scale: float, scores_hat, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 logits (B, Hq, Tq, S) of ``query`` against ``keys`` (B, Hkv, S, d), plus ``bias`` (the additive
    term of :func:`mask_terms`, as ``scores_hat`` holds it), ``-inf`` where ``scores_hat`` is."""
    b, hq, tq, d = query.shape
    hkv = keys.shape[1]
    q64 = query.to(torch.float64).reshape(b, hkv, hq // hkv * tq, d)
    logits = ((q64 @ keys.to(torch.float64).transpose(-1, -2)) * scale).reshape(scores_hat.shape)
    if bias is not None:
        logits = logits + bias
    return logits.masked_fill(torch.isneginf(scores_hat), -torch.inf)


def _block_tokens(paged: torch.Tensor, block_size: int, n_tokens: int) -> torch.Tensor:
    """(..., n_blocks) block flags -> (..., S) token flags."""
    return paged.repeat_interleave(block_size, dim=-1)[..., :n_tokens]


@dataclass(frozen=True)
class Repair:
    """What :func:`gated_output` did to the cells of one call; every field but ``output`` is (B, Hq, Tq).

    ``meter_after`` bounds the TV between exact attention and attention over the repaired cache
    (Theorem 1, ``T1``: recomputed on the repaired logits and bounds, never predicted; the cell's
    own meter where the gate did not fire); ``true_tv_after`` is that TV measured against the
    exact logits (NaN when they are not in memory).
    """

    output: torch.Tensor  # (B, Tq, Hq, d)
    fired: torch.Tensor  # bool
    paged: torch.Tensor  # fraction of visible tokens paged in
    bytes: torch.Tensor  # bytes newly paged in
    meter_after: torch.Tensor
    true_tv_after: torch.Tensor


def gated_output(math: CallMath, gate: Gate, v_hat, output, *, exact: tuple | None = None,
                 paging: tuple | None = None) -> Repair:
    """Gate every cell and recompute the output of fired cells over the repaired cache.

    The policy is :class:`witcert.Gate`'s own (one implementation). Its source of exact data is
    either ``exact=(exact_logits, exact_values)`` held in memory (the store's exact shadow; no
    bytes move) or ``paging=(repairer, stream, query, scale)``: a
    :class:`witcert.gate.repair.LayerPager` over the verified backing store (content-checked
    page-ins, repair cache, telemetry), whose exact values are written into a copy of ``v_hat``.
    A repaired token reads its exact key and exact value. Returns a :class:`Repair`: ``output``
    (B, Tq, Hq, d) like transformers' attention output, ``fired`` (B, Hq, Tq) bool, ``paged``
    the fraction of visible tokens paged in (masked tokens of a paged block are not counted),
    ``bytes`` the bytes newly paged in, and each cell's meter and true TV after repair.
    """
    if (exact is None) == (paging is None):
        raise ValueError("give exactly one of exact=(logits, values) and paging=(repairer, stream, query, scale)")
    if exact is not None:
        exact_scores, exact_values = exact
        result = gate(math.scores_hat, math.c, exact=exact_scores)  # vectorized over cells, 0 bytes moved
    else:
        repairer, stream, query, scale = paging
        exact_values = v_hat.clone()  # the pager writes each paged block's exact values here
        pager = LayerPager(repairer, stream, query.to(torch.float64), scale, group=query.shape[1] // v_hat.shape[1],
                           v_cache=exact_values)
        result = gate(math.scores_hat, math.c, pager=pager)
    scores_after, fired = result.scores, result.fired
    seen = ~torch.isneginf(math.scores_hat)  # (B, Hq, Tq, S)
    repaired = _block_tokens(result.paged, gate.block_size, seen.shape[-1]).to(seen.device) & seen
    paged = repaired.sum(-1) / seen.sum(-1).clamp(min=1)
    meter_after = _meter_after(math, gate, result)
    true_tv_after = _true_tv_after(math, fired, scores_after, None if exact is None else exact[0])
    output = _repaired_output(math, v_hat, exact_values, scores_after, repaired, fired, output)
    return Repair(output, fired, paged, result.bytes, meter_after, true_tv_after)


def _repaired_output(math: CallMath, v_hat, exact_values, scores_after, repaired, fired, output):
    """The attention output of fired cells over the repaired logits, exact values on repaired tokens."""
    if not fired.any():
        return output
    groups = math.c.shape[1] // v_hat.shape[1]
    b, h, t = fired.nonzero(as_tuple=True)  # the fired cells only: the others keep the model's output
    kv = (h // groups).to(v_hat.device)
    b_dev = b.to(v_hat.device)
    vh64 = v_hat[b_dev, kv].to(torch.float64)  # (F, S, d)
    v64 = exact_values[b_dev, kv].to(device=v_hat.device, dtype=torch.float64)
    p = torch.softmax(scores_after[b, h, t], dim=-1)[:, None, :]  # (F, 1, S) over the repaired logits
    y = (p @ vh64 + (p * repaired[b, h, t][:, None, :]) @ (v64 - vh64))[:, 0]  # exact values on repaired tokens
    out = output.clone()
    out[b.to(out.device), t.to(out.device), h.to(out.device)] = y.to(device=out.device, dtype=out.dtype)
    return out


def spot_gated_output(math: CallMath, gate: Gate, spot, query, exact_keys, scale: float, radii, spot_bound, v_hat,
                      output, *, exact: tuple | None = None, paging: tuple | None = None, step: int | None = None,
                      layers: int = 1, reads: tuple | None = None) -> tuple[Repair, dict]:
    """:func:`gated_output` with the spot-certified gate (:mod:`witcert.spot.gate`), in either mode.

    ``exact=(exact_logits, exact_values)`` in memory (validation) or ``paging=(repairer, stream, query, scale)``
    over the verified backing store (production), as :func:`gated_output`; ``exact_keys`` what the gate's
    checks read (the exact cache or a :class:`~witcert.spot.gather.BackedKeys`); ``reads`` the check's exact reads
    before repair (:meth:`~witcert.spot.cells.SpotSettings.apply` ``keep_reads``), carried into the gate's re-checks.
    Returns the :class:`Repair`
    and, per cell, the failure probability the gate's checks spent (``added_delta``), their number
    (``spot_gate_checks``), the exact keys they read (``spot_gate_keys``) and those keys' bytes
    (``spot_gate_bytes``; the pages' bytes are the repair's ``bytes``).
    """
    from witcert.spot.gate import spot_gated

    if (exact is None) == (paging is None):
        raise ValueError("give exactly one of exact=(logits, values) and paging=(repairer, stream, query, scale)")
    if exact is not None:
        exact_scores, exact_values = exact
        source = gate.page_source(math.scores_hat, math.c.dtype, exact=exact_scores)
    else:
        repairer, stream, paging_query, paging_scale = paging
        exact_scores, exact_values = None, v_hat.clone()  # the pager writes each paged block's exact values here
        pager = LayerPager(repairer, stream, paging_query.to(torch.float64), paging_scale,
                           group=paging_query.shape[1] // v_hat.shape[1], v_cache=exact_values)
        source = gate.page_source(math.scores_hat, math.c.dtype, pager=pager)
    result = spot_gated(math, gate, spot, query, exact_keys, scale, radii, spot_bound, source, step=step,
                        layers=layers, reads=reads)
    seen = ~torch.isneginf(math.scores_hat)
    paged = result.repaired.sum(-1) / seen.sum(-1).clamp(min=1)
    true_tv_after = _true_tv_after(math, result.fired, result.scores, exact_scores)
    output = _repaired_output(math, v_hat, exact_values, result.scores, result.repaired, result.fired, output)
    counts = {"added_delta": result.delta, "spot_gate_checks": result.checks, "spot_gate_keys": result.keys,
              "spot_gate_bytes": result.check_bytes}
    return Repair(output, result.fired, paged, result.page_bytes, result.meter_after, true_tv_after), counts


def _meter_after(math: CallMath, gate: Gate, result) -> torch.Tensor:
    """The meter of every cell after repair: the gate's recomputed meter where it fired (certified
    regime), ``witcert.meter`` on the repaired logits and bounds for a risk-ranked gate, else the
    cell's own meter (its attention did not change)."""
    after = math.cells["meter"].clone()
    fired = result.fired
    if fired.any():
        repaired = result.after[fired] if result.certified else meter(result.scores[fired], result.c[fired])
        after[fired] = repaired.to(after.dtype)
    return after


def _true_tv_after(math: CallMath, fired, scores_after, exact_scores) -> torch.Tensor:
    """TV between attention over the exact logits and over the repaired ones ``scores_after`` (NaN without
    the exact logits in memory); the cell's own true TV where the gate did not fire."""
    before = math.cells["true_tv"]
    if exact_scores is None:
        return torch.full_like(before, torch.nan)
    if not fired.any():
        return before.clone()
    p = torch.softmax(exact_scores[fired], dim=-1)
    p_after = torch.softmax(scores_after[fired].to(torch.float64), dim=-1)
    after = before.clone()
    after[fired] = (0.5 * (p - p_after).abs().sum(-1)).to(after.dtype)
    return after

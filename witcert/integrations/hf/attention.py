"""The ``"witcert"`` attention: the one attention path of every monitored model (the monitor and the observatory).

Registered through transformers' ``AttentionInterface`` (pinned: transformers 5.23), the function
receives post-RoPE queries and what the cache layer returned: with a monitored cache
(:mod:`witcert.integrations.hf.cache_layer`) that is the store's reconstruction, so the model
really runs on the compressed cache (the first forward pass of a request, the prefill, attends
over its exact in-flight keys as a serving engine does; they are compressed for later reads).
For every later query, per (row, layer, query head, query):

1. the meter from the real post-RoPE query and the stored witness (Tier A: T1/P1/MN over
   Theorem 2's ``c_t``), with the true TV when the store keeps the exact keys;
2. for the dithered cache, the per-token minimum with the Tier B bound: its probabilistic branch
   only where the caller declared the queries non-adaptive, the deterministic branch otherwise
   (always inside ``generate``);
3. with a :class:`witcert.Gate`, every cell over its threshold is repaired by paging exact
   blocks in (from the exact shadow, or from the verified host backing store when the exact
   cache is not kept) until its meter is below ``tau`` (certified when ``tau < 1``), and its
   output is recomputed over the repaired cache.

The function finds the call's settings and cache in :data:`_ACTIVE` (pushed by
:class:`witcert.integrations.hf.monitoring.Monitor` around each forward call; per thread, so two
threads each running their own monitored model never see each other's calls). Without one it
*is* the stock sdpa path (same call, same mask), so a model switched to ``"witcert"`` with
nothing active gives bit-identical logits. Works for any model whose attention modules use
transformers' attention interface and cache layers (Llama, Qwen2, Mistral, Cohere, GLM, ...).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.integrations.sdpa_attention import create_position_bias_mask, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from witcert.audit.cells import CellSet
from witcert.audit.exact import group_keys, true_tv_bounds
from witcert.gate.policy import Gate
from witcert.integrations.hf import cells
from witcert.integrations.hf.cache_layer import MonitoredLayer
from witcert.integrations.hf.sampling import MeterSampling, selection
from witcert.spot.cells import SpotSettings
from witcert.spot.gather import BackedKeys
from witcert.tier_a.bands import BandLayout

ATTN_NAME = "witcert"
# score terms a model may pass that sdpa (the "witcert" attention) would silently drop: refused, never ignored
_DROPPED_SCORE_TERMS = ("s_aux", "sinks", "softcap")


class _ActiveScopes(threading.local):
    """The forward calls in progress on the current thread, innermost last (a list per thread: a
    thread's attention calls read only the scopes its own monitored forward calls pushed)."""

    def __init__(self):
        self.stack: list[CallScope] = []

    def append(self, scope: "CallScope") -> None:
        self.stack.append(scope)

    def pop(self) -> "CallScope":
        return self.stack.pop()

    def __getitem__(self, index: int) -> "CallScope":
        return self.stack[index]

    def __len__(self) -> int:
        return len(self.stack)


_ACTIVE = _ActiveScopes()


@dataclass
class CallScope:
    """What the attention function needs for one forward call of a monitored model.

    ``cache`` is the call's ``past_key_values`` and ``layers`` the monitored layers the monitor
    installed in it (``None``: the call has no cache, every key it attends is exact and in flight,
    nothing is measured); ``rows`` the request id of each batch row; ``record`` receives every
    :class:`~witcert.integrations.hf.cells.CellBatch`.
    """

    layout: BandLayout
    tier: str  # "A" or "B"
    adaptive: bool  # Tier B: deterministic branch only
    truth: bool  # compute the true TV (the store keeps the exact keys)
    record: object  # callable(CellBatch)
    cache: object = None
    layers: list | None = None
    rows: tuple[int, ...] = ()
    seed: int | None = None  # the dither seed of a dithered cache
    gate: Gate | None = None
    repairer: object = None  # witcert.gate.repair.Repairer over the host backing store (exact cache not kept)
    delta_loc: float = 1e-7
    delta_sweep: dict = field(default_factory=dict)  # column name -> delta_loc: extra Tier B meters
    tau_k: float = 0.2
    tau_v: float = 0.05
    fused: bool = True  # the fast path's fused cells (min(1, T1, P1, MN, CS, MS)); False: the full eager meter
    spot: object = None  # witcert.spot.cells.SpotSettings: spot-check the cells above its tau
    spot_step: int | None = None  # the request's metered decode step (a request budget's spot_delta spends by it)
    spot_pending: object = None  # witcert.spot.deferred.PendingChecks: no gate, the call's checks run at its end
    backing: object = None  # witcert.gate.backing_store.BackingStore: exact keys when the exact cache is not kept
    sample: MeterSampling | None = None  # sampled metering (None: every cell)
    pending: object = None  # witcert.integrations.hf.pending.PendingCells: meter the call later (None: now)
    audit: object = None  # witcert.audit.AuditedRequest: meter the audit's picked cells only (None: no audit)
    query_format: object = None  # witcert.tier_a.query_radius.QueryFormat: the kernel reads q' (None: q)

    def layer(self, index: int) -> MonitoredLayer:
        """The cache's layer ``index``; raises unless it is the monitored layer the monitor installed."""
        current = self.cache.layers
        layer = current[index] if 0 <= index < len(current) else None
        if layer is None or index >= len(self.layers) or layer is not self.layers[index]:
            raise ValueError(f"cache layer {index} is a {type(layer).__name__}, not the monitored layer "
                             "witcert.monitor installed: WitCert attention refuses a cache whose exact writes it "
                             "has not seen (a quantized or replaced layer)")
        return layer


def register() -> None:
    """Register ``"witcert"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_NAME, witcert_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def witcert_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention function (signature of transformers' ``sdpa_attention_forward``)."""
    scope = _ACTIVE[-1] if _ACTIVE else None
    if scope is None or scope.layers is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    layer = scope.layer(module.layer_idx)
    if layer.read_exact:  # the prefill attends over its exact in-flight keys: nothing compressed is read
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if layer.last_read is None or key is not layer.last_read[0] or value is not layer.last_read[1]:
        raise RuntimeError(f"layer {module.layer_idx}: attention received keys that are not the monitored cache's "
                           "(the model did not write them through past_key_values.update)")
    if torch.compiler.is_compiling():
        raise RuntimeError("witcert.monitor: the monitored model is being compiled (torch.compile); run it eagerly "
                           "(WITCERT_COMPILE=1 compiles the meter's own passes)")
    if dropout:
        raise ValueError(f"dropout={dropout!r}: attention with dropout (a model in training mode) is random, the meter "
                         "covers eval-mode attention (call model.eval())")
    scores_mask = _scores_mask(module, query, key, attention_mask, kwargs)
    if scope.audit is not None:  # the request's step 1, fixed by the generation before any pick
        scope.audit.start(key.shape[-2] - query.shape[-2])
    kernel_query = query if scope.query_format is None else scope.query_format.read(query).to(query.dtype)
    output, weights = sdpa_attention_forward(module, kernel_query, key, value, attention_mask, scaling=scaling,
                                             dropout=dropout, **kwargs)
    scale = float(module.scaling if scaling is None else scaling)
    if scope.pending is not None and scope.pending.defer(module.layer_idx, query, scores_mask, key.shape[-2], scale,
                                                         scope.adaptive):
        return output, weights  # metered at the request's next flush (witcert.integrations.hf.pending)
    output, batch = attend(scope, layer, query, (key, value), scores_mask, scale, output)
    scope.record(batch)
    return output, weights


def _scores_mask(module, query, key, attention_mask, kwargs: dict) -> torch.Tensor | None:
    """The mask ``sdpa_attention_forward`` applies to this call's scores, formed from the same inputs as it
    forms it: a bool mask, or a float mask it adds (a ``position_bias`` folded in by transformers' own
    ``create_position_bias_mask``, in the model's dtype, bit for bit), or ``None`` for causal attention with
    the queries at the end of the cache (:func:`cells.mask_terms`' reading of ``None``). What it cannot
    express raises, naming the argument."""
    for name in _DROPPED_SCORE_TERMS:
        if kwargs.get(name) is not None:
            raise ValueError(f"the model passes {name!r} to its attention: sdpa, which the 'witcert' attention "
                             "runs, does not apply it, so the monitored model would not compute what it was built to")
    if isinstance(kwargs.get("cache"), PagedAttentionCache):
        raise ValueError("cache: a paged attention cache (continuous batching) is not a cache witcert.monitor adopts")
    q_len, kv_len = query.shape[-2], key.shape[-2]
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    causal = q_len > 1 and attention_mask is None and causal  # as sdpa decides it
    if causal and kv_len > q_len:
        raise ValueError(f"attention_mask=None with is_causal over {kv_len} cached keys and {q_len} queries: sdpa "
                         "would attend the first keys only (its causal mask is upper-left); pass the model's mask")
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        return create_position_bias_mask(position_bias, attention_mask, causal, query, key)
    if attention_mask is None and not causal and q_len > 1:  # every key visible to every query
        return torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device)[None, None]
    return attention_mask  # None: causal (kv_len == q_len) or one query, which sees every key: causal at the end


def attend(scope: CallScope, layer: MonitoredLayer, query, read: tuple | None, attention_mask, scale: float, output,
           spans: list[tuple[int, int]] | None = None):
    """Meter (and gate) every cell of one call; returns the (repaired) output and its :class:`CellBatch`.

    ``attention_mask`` is what sdpa applies to the scores (:func:`_scores_mask`): keys it hides are
    masked for the meter too, values it adds enter both logits (:func:`cells.mask_terms`). ``spans``: the
    ``(first, end)`` query positions of each call the queries come from, in order (default: one call, the
    last ``Tq`` tokens read; deferred runs of calls, :mod:`witcert.integrations.hf.pending`, give theirs).
    ``read`` ``None``: the store's keys and values, read only where a cell is metered (a production store decodes
    its whole history at a read; the store is then an append-only one, with ``kv_heads``)."""
    store = layer.store
    b, hq, tq, _ = query.shape
    s = store.length if read is None else read[0].shape[-2]
    spans = [(s - tq, s)] if spans is None else spans
    positions = torch.cat([torch.arange(first, end) for first, end in spans])
    kv_heads = store.kv_heads if read is None else read[0].shape[1]
    chosen = _metered_cells(scope, layer.layer_idx, spans, positions, (b, hq, tq), kv_heads)
    if chosen is not None and chosen.empty:  # sampled metering or an audit: no cell of these calls is metered
        return output, _unmetered(scope, layer, (b, hq, tq), positions)
    read = store.read() if read is None else read
    if scope.backing is not None and hasattr(store, "write_backing"):  # its rows are read below (checks, repairs)
        store.write_backing()
    visible, bias = cells.mask_terms(attention_mask, tq, s, query.device)
    # the query the kernel read (QR): the model's attention ran with it; the exact reference keeps `query`
    query_read = None if scope.query_format is None else scope.query_format.read(query)
    if chosen is not None:  # sampled metering (every kv head) or the audit's cells (witcert.audit.cells)
        query, query_read, visible, bias = (None if x is None else chosen.pick(x)
                                            for x in (query, query_read, visible, bias))
    exact_audit = None
    if scope.audit is not None and scope.audit.settings.exact:  # the picked cells' true TVs (witcert.audit.exact)
        exact_audit = _exact_audit_columns(scope, layer, chosen, query, query_read, read[0], visible, bias, scale)
        if scope.sample is None:  # nothing else is metered: no meter, no witness read
            return output, _unmetered(scope, layer, (b, hq, tq), positions,
                                      {name: chosen.spread(t) for name, t in exact_audit.items()})
    if bias is not None and scope.gate is not None and not scope.truth:
        raise ValueError("attention_mask: an additive mask with soft values (or a position_bias) and a production "
                         "gate (keep_exact=False): the backing store's page-ins do not carry the bias; use "
                         "keep_exact=True or a bool / minimum-value mask")
    math = cells.measure(query, store, read, visible, scale, scope.layout, truth=scope.truth, fused=scope.fused,
                         bias=bias, query_read=query_read)
    extra = {}
    deterministic = math  # Tier A's radii hold for every query; Tier B's probabilistic branch only on its event
    deterministic_c = math.c
    if scope.tier == "B":
        key_stores = [store.codec.packed_store(p) for p in store.key_chunks]
        slack = cells.score_slack(query, read[0], scale)  # independent of delta: once per call
        for name, loc in scope.delta_sweep.items():
            swept = cells.tighten_with_tier_b(math, query, key_stores, read[0], loc, scale, scope.adaptive,
                                              scope.tau_k, scope.tau_v, slack=slack)
            extra[name] = swept.cells["meter"].cpu()
        math = cells.tighten_with_tier_b(math, query, key_stores, read[0], scope.delta_loc, scale, scope.adaptive,
                                         scope.tau_k, scope.tau_v, slack=slack)
    if scope.spot is not None:  # witcert.spot.cells: reported meter = min(meter, spot bound), one batched check
        spot_keys = store.exact()[0] if scope.truth else BackedKeys(scope.backing, layer.layer_idx, s)
        radii = math.c if scope.tier == "A" or scope.adaptive else deterministic_c  # spot_delta is then the whole story
        if scope.spot_pending is not None:  # nothing fed back (no gate): checked with every layer at the call's end
            math, spot_extra = scope.spot_pending.add(math, query, spot_keys, scale, radii, len(scope.layers))
        else:
            # with a gate, the check's exact reads are carried into the gate's re-checks of the cells it repairs
            math, spot_extra, *spot_reads = scope.spot.apply(
                math, query, spot_keys, scale, scope.tau_k, scope.tau_v, radii=radii, step=scope.spot_step,
                layers=len(scope.layers), keep_reads=scope.gate is not None)
        extra.update(spot_extra)
    audit_checks = None
    if exact_audit is not None:  # with sampled metering: the sampled cells metered, the picked ones bounded exactly
        extra.update({name: t for name, t in exact_audit.items() if name != "true_tv"})
    elif scope.audit is not None:  # witcert.audit: bound and flag the picked cells with what holds for every query
        audited = deterministic if scope.tier == "B" and not scope.adaptive else math
        audit_columns, audit_checks = _audit_columns(scope, layer, chosen, audited, query, positions, scale)
        extra.update(audit_columns)
    blank = math.blank.cpu() if math.any_blank else None
    fired = torch.zeros_like(math.cells["meter"], dtype=torch.bool)
    if scope.gate is not None:
        if scope.truth:
            exact_k, exact_v = store.exact()
            source = dict(exact=(cells.exact_logits(query, exact_k, scale, math.scores_hat, math.bias), exact_v))
        else:
            source = dict(paging=(scope.repairer, layer.layer_idx, query, scale))
        if scope.spot is not None:  # the spot-certified gate (witcert.spot.gate), validation or production
            repair, counts = cells.spot_gated_output(math, scope.gate, scope.spot, query, spot_keys, scale, radii,
                                                     extra["spot_bound"], read[1], output, step=scope.spot_step,
                                                     layers=len(scope.layers), reads=spot_reads[0], **source)
            extra["spot_delta"] = extra["spot_delta"] + counts.pop("added_delta")
            extra.update(counts)
        else:
            repair = cells.gated_output(math, scope.gate, read[1], output, **source)
        output, fired = repair.output, repair.fired
        extra["paged_fraction"] = repair.paged.cpu()
        extra["bytes_paged"] = repair.bytes.to(torch.float64).cpu()
        extra["meter_after"] = _reported(repair.meter_after, blank)
        extra["true_tv_after"] = _reported(repair.true_tv_after, blank)
    fields = {name: _reported(t, blank) for name, t in math.cells.items()}
    fields["repaired"] = fired.cpu()
    if scope.sample is not None or scope.audit is not None:
        extra = {name: _reported(t, blank) for name, t in extra.items()}
        if chosen is not None:
            fields, extra = ({name: chosen.spread(t) for name, t in part.items()} for part in (fields, extra))
        extra["metered"] = torch.ones((b, hq, tq), dtype=torch.bool) if chosen is None else chosen.metered(b)
    batch = cells.CellBatch(
        layer=layer.layer_idx, positions=positions, requests=scope.rows,
        tier=scope.tier, adaptive=scope.adaptive, extra=extra, seed=scope.seed,
        tier_b_delta=scope.delta_loc if scope.tier == "B" and not scope.adaptive else 0.0,
        **fields,
    )
    if scope.spot is not None and scope.spot_pending is not None:
        scope.spot_pending.attach(spot_extra, batch)
    if audit_checks is not None:  # its checked cells' columns are written when the flush or the call ends
        audit_checks.batch = batch
    return output, batch


def _metered_cells(scope: CallScope, layer_idx: int, spans: list, positions: torch.Tensor, shape: tuple,
                   kv_heads: int):
    """The cells a pass meters: ``None`` (every one), sampled metering's ``Selection``, or with an audit the
    :class:`~witcert.audit.cells.CellSet` of the audit's picks and the sampled cells."""
    b, hq, tq = shape
    chosen = None if scope.sample is None else selection(scope.sample, layer_idx, spans, hq, kv_heads)
    if scope.audit is None:
        return chosen
    picked = scope.audit.picks(layer_idx, positions)
    sampled = None if scope.sample is None else (
        torch.ones(shape, dtype=torch.bool) if chosen is None else chosen.metered(b))
    return CellSet.of(picked, kv_heads, sampled)


def _audit_columns(scope: CallScope, layer: MonitoredLayer, chosen: CellSet, math, query, positions, scale) -> tuple:
    """``(columns, checked)``: the audit's columns of a pass (:class:`witcert.audit.bounding.PickedBounds`), on the
    gathered cells, and its checked cells pending their batched check (``None``: none).

    ``math`` holds a meter and radii valid for every query; exact keys come from the exact cache, or in
    production from the request's host backing store, read for the checked cells only."""
    s = math.scores_hat.shape[-1]

    def checks(at):
        keys = layer.store.exact()[0] if scope.truth else BackedKeys(scope.backing, layer.layer_idx, s)
        return SpotSettings.cells(math, query, keys, scale, at)

    bounds, checked = scope.audit.bound(chosen.audited, positions[chosen.columns], math.cells["meter"],
                                        math.blank.cpu(), math.c, checks)
    if checked is not None:  # the checked cells' place on the call's (B, Hq, T) grid, where their batch holds them
        at = tuple(checked.at.T)
        checked.where = (at[0], chosen.heads[at], chosen.columns[at])
    return bounds.columns(), checked


def _exact_audit_columns(scope: CallScope, layer: MonitoredLayer, chosen: CellSet, query, query_read, read_keys,
                         visible, bias, scale: float) -> dict:
    """The audit's columns of a pass's gathered cells (B, Hkv, n), each picked cell bounded by its true TV
    (:mod:`witcert.audit.exact`), and with the exact cache kept their ``true_tv``: exact keys from the exact cache,
    or in production from the request's host backing store, the groups holding a picked cell read whole."""
    audited = chosen.audited & chosen.real
    keys = layer.store.exact()[0] if scope.truth else BackedKeys(scope.backing, layer.layer_idx,
                                                                 read_keys.shape[-2])
    exact_keys = group_keys(keys, audited.any(-1), read_keys.shape[-1])
    bound, tv, seen = true_tv_bounds(query, query_read, read_keys, exact_keys, visible, bias, scale)
    audited = audited & ~torch.isnan(bound)  # a cell that sees no token is not audited
    nan = torch.tensor(torch.nan, dtype=torch.float64)
    return {"audited": audited, "flagged": audited & (bound > scope.audit.settings.tau),
            "audit_bound": torch.where(audited, bound, nan), "audit_check_delta": torch.where(audited, 0.0, nan),
            "audit_keys": torch.where(audited, seen, nan),
            "true_tv": torch.where(audited, tv, nan) if scope.truth else torch.full_like(tv, torch.nan)}


def _unmetered(scope: CallScope, layer: MonitoredLayer, shape: tuple, positions: torch.Tensor,
               audit: dict | None = None) -> "cells.CellBatch":
    """The :class:`CellBatch` of a call sampled metering or the audit left out: every measurement NaN, ``metered``
    (and ``audited``, ``flagged``) False; ``audit``: the exact audit's columns (B, Hq, Tq) of its picked cells, their
    ``true_tv`` beside them."""
    nan = torch.full(shape, torch.nan, dtype=torch.float64)
    no = torch.zeros(shape, dtype=torch.bool)
    sweep = scope.delta_sweep if scope.tier == "B" else {}  # the columns a metered call of this tier has
    extra = {name: nan for name in sweep} | {"metered": no}
    if scope.audit is not None:
        extra |= {"audited": no, "flagged": no, "audit_bound": nan, "audit_check_delta": nan, "audit_keys": nan}
    audit = dict(audit or {})
    true_tv = audit.pop("true_tv", nan)
    return cells.CellBatch(
        layer=layer.layer_idx, positions=positions, requests=scope.rows, tier=scope.tier,
        adaptive=scope.adaptive, extra=extra | audit, seed=scope.seed, repaired=no, joint=no, true_tv=true_tv,
        **{name: nan for name in cells.FIELDS if name not in ("joint", "repaired", "true_tv")},
    )


def _reported(cell: torch.Tensor, blank: torch.Tensor | None) -> torch.Tensor:
    """One field of the call's cells as recorded: on the CPU, fp64 (bool fields as they are), NaN on the
    ``blank`` rows (``None``: no row is blank)."""
    cell = cell.cpu()
    if cell.dtype == torch.bool:
        return cell
    cell = cell.to(torch.float64)
    return cell if blank is None else torch.where(blank, torch.nan, cell)

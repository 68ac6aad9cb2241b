"""Deferred metering: a request's attention calls recorded as they run, metered later in one pass per layer.

Where the meter feeds nothing back into the model (Tier A, no gate), it need not run inside the step. :meth:`PendingCells.defer` records what a call's cells depend on: its post-RoPE
queries ``(B, Hq, Tq, d)``, the keys each query sees (the bool mask attention applied) and how many
tokens the store held. :meth:`PendingCells.flush` then meters every recorded call of a layer at once:
the queries of all calls as one multi-query call over the store, each query seeing exactly the keys
it saw (its mask row, with the tokens written after its call hidden), each cell at its own position.
One pass per layer per flush instead of one per step: the per-step cost of the monitor is then its
cache writes and reads. Sampled metering (:mod:`~witcert.integrations.hf.sampling`) picks the same
cells as in the step: its draw depends on each call's layer and positions alone; so does the request
audit (:mod:`witcert.audit`: a pick is a function of the cell and the audit's seed), whose spot checks
read the exact keys at the flush (the exact cache and the host backing store only append). So does the spot
certificate with a fixed ``spot_delta`` per cell (:mod:`witcert.spot.deferred`): a layer's cells above tau of
every recorded call are checked in one batch at the flush, their draws made after all their queries are fixed;
a key group (layer, row, kv head) then holds the cells of all those calls, so its history is read once for
all of them where that costs at most ``spot_keys`` keys per checked cell (:mod:`witcert.spot.groups`).

Why the cells are the same: the store is append-only (``append_only``, :class:`~witcert.integrations.hf.
compressed_cache.CompressedLayer`): the first ``s`` tokens it holds at a flush, their stored form and
their witnesses, are bit for bit what a read at length ``s`` gave, so a cell metered at the flush is the
cell metered in its step (up to the order of the fp64 logits' sums, which the rounding bound covers).
A store whose tokens change after they are written (transformers' quantized caches re-quantize their
residual) is metered in its step. Calls with an additive soft mask are metered in their step too.

The monitor flushes a request at the end of ``generate``, every :data:`FLUSH_CALLS` forward calls, when
its results are read and when its block closes: results are never read with cells missing.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch

from witcert.integrations.hf import cells

FLUSH_CALLS = 64  # forward calls a request records before it is metered (bounds the queries held)


@dataclass(frozen=True)
class _Call:
    query: torch.Tensor  # (B, Hq, Tq, d) as attention received it (a copy)
    visible: torch.Tensor | None  # bool (B|1, 1|Hq, Tq, s): the keys each query saw (a copy); None: causal
    length: int  # s: tokens the store held (the call's queries are its last Tq)
    scale: float
    adaptive: bool

    @property
    def span(self) -> tuple[int, int]:
        """``(first, end)``: the positions of the call's queries."""
        return self.length - self.query.shape[-2], self.length


class PendingCells:
    """The calls of one request (one monitored cache) awaiting their meter.

    ``scope`` is a :class:`~witcert.integrations.hf.attention.CallScope` of the request (its settings:
    layout, truth, rows, record); ``layers`` its monitored layers; ``waiting()`` is called whenever a call is
    recorded while none was (the owner then knows the request has cells to meter).
    """

    def __init__(self, scope, layers: list, waiting=lambda: None):
        self.scope = scope
        self.layers = layers
        self.waiting = waiting
        self._calls: dict[int, list[_Call]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Calls recorded on the busiest layer (the forward calls since the last flush)."""
        return max((len(calls) for calls in self._calls.values()), default=0)

    def defer(self, layer_idx: int, query: torch.Tensor, attention_mask, length: int, scale: float,
              adaptive: bool) -> bool:
        """Record one call (``attention_mask`` as attention applied it); ``False`` when it must be metered now."""
        visible = None  # no mask: causal, each query sees the keys up to its own position (built at the flush)
        if attention_mask is not None:
            visible, bias = cells.mask_terms(attention_mask, query.shape[-2], length, query.device)
            if bias is not None:  # a soft additive mask: metered in its step (its bias is not recorded)
                return False
        # copies: a caller may write its next step into the same buffers (an in-place query workspace, a
        # preallocated mask), and the cells metered later must be those of the attention served now
        call = _Call(query.detach().clone(), None if visible is None else visible.clone(), length, scale, adaptive)
        with self._lock:
            first = not self._calls
            self._calls.setdefault(layer_idx, []).append(call)
        if first:
            self.waiting()
        return True

    def flush(self) -> None:
        """Meter every recorded call, one pass per layer (and per run of calls with the same settings)."""
        with self._lock:
            recorded, self._calls = self._calls, {}
        with torch.no_grad():  # a flush may run after generate's no_grad block (and a graph per grad mode is waste)
            spot = self.scope.spot
            checks = None if spot is None else spot.pending(self.scope.tau_k, self.scope.tau_v, None)
            self._meter(recorded, checks)
            if self.scope.audit is not None:  # the audit's checks of every layer's picked cells, in one batch
                self.scope.audit.run_checks()

    def _meter(self, recorded: dict, spot_checks=None) -> None:
        from witcert.integrations.hf.attention import attend

        for layer_idx in sorted(recorded):
            layer = self.layers[layer_idx]
            with layer.store.lock:  # a thread still writing this request waits: one length for read and witness
                for run in _runs(recorded[layer_idx]):
                    query, visible = _folded(run, layer.store.length)
                    scope = dataclasses.replace(self.scope, adaptive=run[0].adaptive, spot_pending=spot_checks)
                    _, batch = attend(scope, layer, query, None, visible, run[0].scale, None,  # read if metered
                                      spans=[call.span for call in run])
                    scope.record(batch)
                if spot_checks is not None:  # the layer's cells above tau of every recorded call, in one batch (one
                    spot_checks.run()  # layer at a time: a flush holds up to FLUSH_CALLS calls' logits per layer)


def _runs(calls: list[_Call]) -> list[list[_Call]]:
    """Consecutive calls with the same scale, settings and batch shape (each run is metered as one call)."""
    runs: list[list[_Call]] = []
    for call in calls:
        last = runs[-1][-1] if runs else None
        if last is not None and (last.scale, last.adaptive, last.query.shape[:2]) == (
                call.scale, call.adaptive, call.query.shape[:2]):
            runs[-1].append(call)
        else:
            runs.append([call])
    return runs


def _folded(run: list[_Call], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's queries (B, Hq, T, d) and their visibility over the ``length`` tokens held now (keys written after
    a call hidden from it)."""
    query = run[0].query if len(run) == 1 else torch.cat([c.query for c in run], dim=-2)
    positions = torch.cat([torch.arange(*call.span) for call in run])
    causal = torch.arange(length) <= positions[:, None]  # (T, length): what a query with no mask sees
    masks = [None if c.visible is None else c.visible.reshape((1,) * (4 - c.visible.dim()) + tuple(c.visible.shape))
             for c in run]  # 4-D
    if all(m is None for m in masks):
        return query, causal[None, None]
    rows = query.shape[0] if any(m is not None and m.shape[0] > 1 for m in masks) else 1
    heads = query.shape[1] if any(m is not None and m.shape[1] > 1 for m in masks) else 1
    visible = causal.expand(rows, heads, -1, -1).clone()
    start = 0
    for call, mask in zip(run, masks):
        tq = call.query.shape[-2]
        if mask is not None:
            visible[:, :, start:start + tq] = False
            visible[:, :, start:start + tq, :call.length] = mask
        start += tq
    return query, visible

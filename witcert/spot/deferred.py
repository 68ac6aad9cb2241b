"""The spot checks of one forward call, run together when the call ends (registry SCO, SCR).

Without a gate the spot check feeds nothing back into the model: its bound only enters the recorded
cells. So the monitor need not check each layer's cells inside that layer's attention call; it records
them here (:meth:`PendingChecks.add`: the cells' logits, radii and exact-logit source, and the recorded
:class:`~witcert.integrations.hf.cells.CellBatch` they belong to) and checks every layer's cells in one
:func:`witcert.spot.check_cells` call at the end of the forward call (:meth:`PendingChecks.run`), which
then writes ``min(meter, spot bound)``, the output bound, the joint pass and the spot columns into the
recorded cells. One check of a whole decode step's cells (SmolLM2: 30 layers x 9 heads) instead of
thirty of nine: the per-call work of the batched check is shared by thirty times more cells. The draws
are still made after every query of the call is fixed. With deferred metering
(:mod:`witcert.integrations.hf.pending`, a fixed delta per cell) one :class:`PendingChecks` collects a
layer's cells of every call metered at a request's flush, and runs once per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from witcert.core import values
from witcert.spot.batched import check_cells


@dataclass
class _Layer:
    """One layer call's checked cells: where they sit in the recorded batch and what the check needs."""

    at: torch.Tensor  # (M, 3) row, query head, query
    scores: torch.Tensor  # (M, S) fp64
    radii: torch.Tensor  # (M, S) fp64
    source: object  # KeyGather of the M cells
    value_term: torch.Tensor  # (M,) fp64
    v_norm_max: torch.Tensor  # (M,) fp64
    extra: dict  # the columns of the batch, filled at run()
    batch: object = None  # the recorded CellBatch, attached once recorded


@dataclass
class PendingChecks:
    """The checked cells of one forward call, layer by layer, until :meth:`run`."""

    spot: object  # witcert.spot.cells.SpotSettings
    tau_k: float
    tau_v: float
    step: int | None = None
    cells: int = 1  # cells of one request this call may check (layers x query heads x queries)
    layers: list = field(default_factory=list)

    def add(self, math, query, exact_keys, scale: float, radii, model_layers: int) -> tuple[object, dict]:
        """Record one layer call's cells above ``tau`` (:meth:`witcert.spot.cells.SpotSettings.apply`'s arguments);
        returns ``(math unchanged, extra columns)`` with the spot columns to be filled by :meth:`run`."""
        before = math.cells["meter"]
        checked = (before > self.spot.tau) & ~math.blank
        shape = before.shape
        extra = {"meter_before_spot": torch.where(math.blank.cpu(), torch.nan, before.cpu().to(torch.float64)),
                 "spot_bound": torch.full(shape, torch.nan, dtype=torch.float64)}
        extra.update({name: torch.zeros(shape, dtype=torch.float64)
                      for name in ("spot_keys", "spot_bytes", "spot_rounds", "spot_delta")})
        at = checked.cpu().nonzero()
        if at.numel():
            scores, source = self.spot.cells(math, query, exact_keys, scale, at)
            where = tuple(at.T.to(before.device))
            self.layers.append(_Layer(at, scores, radii.detach()[checked].cpu().to(torch.float64), source,
                                      math.value_term[where].cpu().to(torch.float64),
                                      math.v_norm_max[where].cpu().to(torch.float64), extra))
            self.cells = model_layers * shape[1] * shape[2]
        return math, extra

    def attach(self, extra: dict, batch) -> None:
        """The recorded batch whose ``extra`` columns these are (its meter is rewritten by :meth:`run`)."""
        for layer in self.layers:
            if layer.extra is extra:
                layer.batch = batch

    def run(self) -> None:
        """Check every recorded cell at once and write the results into the recorded batches."""
        pending, self.layers = self.layers, []
        if not pending:
            return
        spot = self.spot
        delta = spot.cell_delta(self.step, self.cells) * spot.check_share()
        source = _Layers([layer.source for layer in pending])
        result = check_cells(torch.cat([layer.scores for layer in pending]), torch.cat([layer.radii for layer in pending]),
                             source, keys=spot.keys, delta=delta, tau=spot.tau if spot.adaptive else None,
                             generator=spot.randomness.generator, split=spot.split, read_groups=True)
        first = 0
        for layer in pending:
            part = slice(first, first + layer.at.shape[0])
            first = part.stop
            _write(layer, result.bound[part], result, part, self.tau_k, self.tau_v)


def _write(layer: _Layer, bound: torch.Tensor, result, part: slice, tau_k: float, tau_v: float) -> None:
    """The spot columns of one layer's cells and their reported meter, output bound and joint pass."""
    where = tuple(layer.at.T)
    extra = layer.extra
    extra["spot_bound"][where] = bound
    for name, value in (("spot_keys", result.keys_read[part]), ("spot_bytes", layer.source.bytes_read),
                        ("spot_rounds", result.rounds[part]), ("spot_delta", result.delta[part])):
        extra[name][where] = value.to(torch.float64)
    batch = layer.batch
    if batch is None:
        return
    meter = torch.minimum(batch.meter[where], bound)
    batch.meter[where] = meter
    batch.output_bound[where] = values.output_bound(meter, layer.value_term, layer.v_norm_max).to(torch.float64)
    batch.joint[where] = values.joint_pass(meter, layer.value_term, layer.v_norm_max, tau_k, tau_v).joint


class _Layers:
    """One exact-logit source over several layers' cells, stacked in order (each layer's own gather).

    Each cell's key group is ``(layer, row, kv head)``, numbered ``layer * stride + row * kv heads + kv head``
    (:mod:`witcert.spot.groups`)."""

    def __init__(self, sources: list):
        self.sources = sources
        self.starts = torch.cumsum(torch.tensor([0] + [s.q.shape[0] for s in sources]), 0)
        own = [s.groups for s in sources]
        stride = max([int(g.max()) + 1 for g in own if g.numel()], default=1)
        self.groups = torch.cat([g + index * stride for index, g in enumerate(own)]) if own else \
            torch.zeros(0, dtype=torch.int64)

    def logits(self, cells: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Each layer's pairs from its own source, in one pass over the pairs ordered by layer (no mask per layer)."""
        layer = torch.searchsorted(self.starts, cells, right=True) - 1
        order = torch.argsort(layer, stable=True)
        counts = torch.bincount(layer, minlength=len(self.sources)).tolist()
        local = (cells - self.starts[layer])[order]
        parts = [self.sources[index].logits(at, some) for index, (at, some) in
                 enumerate(zip(local.split(counts), tokens[order].split(counts))) if at.numel()]
        out = torch.empty(cells.numel(), dtype=torch.float64)
        out[order] = torch.cat(parts) if parts else out[:0]
        return out

    def dense_logits(self, cells: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        """``(M, S)`` exact logits of ``cells`` at ``wanted`` (:meth:`witcert.spot.gather.KeyGather.dense_logits`),
        each layer's cells from its own source."""
        out = torch.zeros(wanted.shape, dtype=torch.float64)
        layer = torch.searchsorted(self.starts, cells, right=True) - 1
        for index in torch.unique(layer).tolist():
            at = (layer == index).nonzero().reshape(-1)
            out[at] = self.sources[index].dense_logits(cells[at] - self.starts[index], wanted[at])
        return out

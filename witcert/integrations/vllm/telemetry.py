"""Engine-side aggregation of metered cells; published as a JSON snapshot for ``/metrics``.

vLLM runs the model in an engine process and serves ``/metrics`` from the API server process,
so each engine process writes its aggregate to ``<metrics_dir>/witcert-<pid>.json`` (atomic
rename) after each step; :mod:`.prometheus` merges the live files at scrape time. One JSON line
per cell goes to ``<jsonl>.<pid>`` when asked.

Each layer of a step queues its cells (:meth:`Telemetry.queue`, a :class:`CellBatch`); the step's cells are
folded in once, after its last layer (:meth:`Telemetry.fold`), with a few tensor operations for the whole
step rather than a few per (request, layer).

Every cell says which kind of bound it carries: ``proved`` (a deterministic bound: Tier A's witness, Tier B's
deterministic branch) or ``probabilistic`` (a bound holding with probability ``1 - delta``, labelled with its
``delta``: a cell whose bound a spot check lowered, :mod:`.spot`). A cell an operator's sampling left
out (:mod:`.sampling`) is *unmetered*: counted, never certified.
"""
import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .audit import Ledger

# histogram upper edges of the meter (Prometheus ``le``); 1.0 is the trivial bound
METER_BUCKETS = (0.0, 1e-6, 1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.5, 0.999999, 1.0)
PROVED = "proved"  # the kinds of bound a cell carries (label ``bound``)
PROBABILISTIC = "probabilistic"

SCHEME_COUNTS = ("cells", "certified", "raw_certified", "saturated", "shadow_cells", "shadow_violations",
                 "gated_cells", "fired", "unreachable", "unmetered")
SCHEME_SUMS = ("meter_sum", "raw_meter_sum")
SCHEME_MAXIMA = ("max_true_tv", "max_meter")
GATE_COUNTS = ("blocks_repaired", "slots_repaired", "bytes_paged", "repair_rounds", "shadow_repair_checked",
               "shadow_repair_mismatches", "tokens_gated", "tokens_paged", "spot_cells", "spot_keys", "spot_bytes")


def _scheme_stats() -> dict:
    return {**{k: 0 for k in SCHEME_COUNTS}, **{k: 0.0 for k in SCHEME_SUMS + SCHEME_MAXIMA}}


@dataclass(frozen=True)
class CellBatch:
    """One layer's cells of one step: ``R`` query rows (a request's query token each) x ``Hq`` query heads.

    ``meter`` (R, Hq) fp64: the bound on the attention served (after repair where the gate acted), NaN on a
    cell the operator's sampling left out; ``raw_meter`` before the gate (``None``: the same); ``true_tv`` /
    ``raw_true_tv`` the shadow's fp64 truth (``None`` without the shadow); ``requests``, ``schemes``,
    ``gated`` (R,) per row; ``positions`` (R,) the query token's position (its step: it attends
    ``position + 1`` tokens); ``risk`` (R, Hq) the raw e-form (``None`` unless a cell log is kept); ``repaired``
    (R,) whether the gate repaired the row's cells (``None``: none was).
    """

    layer: int
    requests: list
    schemes: list
    gated: list
    positions: list
    meter: torch.Tensor
    raw_meter: torch.Tensor | None = None
    true_tv: torch.Tensor | None = None
    raw_true_tv: torch.Tensor | None = None
    risk: torch.Tensor | None = None
    repaired: list | None = None
    bound: str = PROVED
    delta: float | None = None  # a probabilistic bound's failure probability per cell


@dataclass
class Telemetry:
    """Running aggregate of one engine process (cells = (request, layer, query head, step)).

    A cell's *meter* is the bound on the attention the engine served: after repair when the
    gate acted on it, else as metered. ``raw`` figures are before the gate.
    """

    tau: float
    max_requests: int = 64
    shadow: bool = False
    gate: bool = False
    cells: int = 0
    certified: int = 0
    saturated: int = 0
    unmetered: int = 0
    meter_sum: float = 0.0
    bucket_counts: list = field(default_factory=lambda: [0] * len(METER_BUCKETS))
    layer_max: dict = field(default_factory=dict)
    request_max: OrderedDict = field(default_factory=OrderedDict)
    bounds: dict = field(default_factory=lambda: {PROVED: 0, PROBABILISTIC: 0})
    deltas: dict = field(default_factory=dict)  # delta -> probabilistic cells at that delta
    shadow_cells: int = 0
    shadow_violations: int = 0
    shadow_max_true_tv: float = 0.0
    shadow_max_output_gap: float = 0.0
    shadow_max_output_gap_ratio: float = 0.0
    selftest: dict = field(default_factory=dict)
    schemes: dict = field(default_factory=dict)  # scheme -> counts of its cells (see SCHEME_COUNTS)
    gate_counts: dict = field(default_factory=lambda: {k: 0 for k in GATE_COUNTS})
    prefill_tokens: int = 0  # prefill query tokens (not metered)
    prefill_tokens_lossy: int = 0  # ... of them, attending keys stored lossy in an earlier step
    pending: list = field(default_factory=list)  # CellBatch queued by this step's layers
    audit: Ledger = field(default_factory=Ledger)  # request audits: running tallies, finished verdicts (.audit)

    def queue(self, batch: CellBatch) -> None:
        """Queue one layer's cells; :meth:`fold` adds them in."""
        self.pending.append(batch)

    def fold(self) -> None:
        """Fold the queued cells in (once per step)."""
        batches, self.pending = self.pending, []
        for bound, delta in dict.fromkeys((b.bound, b.delta) for b in batches):
            self._fold([b for b in batches if (b.bound, b.delta) == (bound, delta)], bound, delta)

    def add_unmetered(self, layer: int, requests: list, schemes: list, heads: int) -> None:
        """Count one layer's query tokens that nothing meters (``requests``, ``schemes`` per token, ``heads`` cells
        each) as :meth:`fold` counts an all-NaN :class:`CellBatch`, without building one: an unmetered layer-step
        costs a few integer additions."""
        self.unmetered += len(requests) * heads
        for name in schemes:
            stats = self.schemes.get(name)
            if stats is None:
                stats = self.schemes[name] = _scheme_stats()
            stats["unmetered"] += heads
        self.layer_max.setdefault(layer, 0.0)
        for request in requests:
            self.request_max[request] = self.request_max.pop(request, 0.0)
        while len(self.request_max) > self.max_requests:
            self.request_max.popitem(last=False)

    def add(self, request: str, layer: int, meter: torch.Tensor, true_tv: torch.Tensor | None = None, *,
            scheme: str = "none", raw_meter: torch.Tensor | None = None, raw_true_tv: torch.Tensor | None = None,
            gated: bool = False) -> None:
        """Fold one (request, layer, step)'s per-head meters (and shadow true TVs) in at once.

        ``meter``/``true_tv`` describe the attention served; ``raw_meter``/``raw_true_tv`` the
        cache before the gate repaired it (default: the same); ``gated`` whether the gate
        watched this request.
        """
        def row(x):
            return None if x is None else x.reshape(1, -1)

        self._fold([CellBatch(layer, [request], [scheme], [gated], [0], row(meter), row(raw_meter), row(true_tv),
                              row(raw_true_tv), repaired=[raw_meter is not None])], PROVED)

    def _fold(self, batches: list, bound: str, delta: float | None = None) -> None:
        if not batches:
            return
        heads = batches[0].meter.shape[-1]
        meter = torch.cat([b.meter.reshape(-1, heads) for b in batches]).double()
        raw = torch.cat([(b.meter if b.raw_meter is None else b.raw_meter).reshape(-1, heads) for b in batches]).double()
        requests = [r for b in batches for r in b.requests]
        schemes = [s for b in batches for s in b.schemes]
        gated = torch.tensor([g for b in batches for g in b.gated], dtype=torch.bool)
        layers = [b.layer for b in batches for _ in b.requests]
        metered = ~torch.isnan(meter)
        served = torch.where(metered, meter, 0.0)
        raw = torch.where(metered, raw, 0.0)
        n = int(metered.sum())
        self.cells += n
        self.unmetered += metered.numel() - n
        self.bounds[bound] = self.bounds.get(bound, 0) + n
        if delta is not None:
            self.deltas[repr(delta)] = self.deltas.get(repr(delta), 0) + n
        certified = (served <= self.tau) & metered
        self.certified += int(certified.sum())
        self.saturated += int(((served >= 1.0) & metered).sum())
        self.meter_sum += float(served.sum())
        buckets = torch.bucketize(served[metered], torch.tensor(METER_BUCKETS, dtype=torch.float64))
        for i, count in enumerate(torch.bincount(buckets.clamp(max=len(METER_BUCKETS) - 1),
                                                 minlength=len(METER_BUCKETS)).tolist()):
            self.bucket_counts[i] += count
        worst = served.amax(-1).tolist()  # per row (0 where nothing was metered)
        for layer, request, value in zip(layers, requests, worst):
            self.layer_max[layer] = max(self.layer_max.get(layer, 0.0), value)
            self.request_max[request] = max(self.request_max.pop(request, 0.0), value)
        while len(self.request_max) > self.max_requests:
            self.request_max.popitem(last=False)
        true_tv = None if batches[0].true_tv is None else torch.cat([b.true_tv.reshape(-1, heads) for b in batches])
        violations = top = None
        if true_tv is not None:  # served cells above their bound, and repaired cells' bound before the repair
            true_tv = true_tv.double()
            raw_tv = torch.cat([(b.true_tv if b.raw_true_tv is None else b.raw_true_tv).reshape(-1, heads)
                                for b in batches]).double()
            repaired = torch.tensor([x for b in batches for x in (b.repaired or [False] * len(b.requests))],
                                    dtype=torch.bool).unsqueeze(-1)
            violations = ((true_tv > served) & metered).long() + ((raw_tv > raw) & metered & repaired).long()
            top = torch.maximum(torch.where(metered, true_tv, 0.0), torch.where(metered & repaired, raw_tv, 0.0))
            self.shadow_cells += n
            self.shadow_violations += int(violations.sum())
            self.shadow_max_true_tv = max(self.shadow_max_true_tv, float(top.max()))
        for name in dict.fromkeys(schemes):
            rows = torch.tensor([s == name for s in schemes], dtype=torch.bool)
            self._fold_scheme(name, rows, metered, served, raw, gated, violations, None if true_tv is None else top)

    def _fold_scheme(self, name, rows, metered, served, raw, gated, violations, top) -> None:
        stats = self.schemes.setdefault(name, _scheme_stats())
        m = metered[rows]
        s, r = served[rows], raw[rows]
        stats["cells"] += int(m.sum())
        stats["unmetered"] += m.numel() - int(m.sum())
        stats["certified"] += int(((s <= self.tau) & m).sum())
        stats["raw_certified"] += int(((r <= self.tau) & m).sum())
        stats["saturated"] += int(((s >= 1.0) & m).sum())
        stats["meter_sum"] += float(s.sum())
        stats["raw_meter_sum"] += float(r.sum())
        stats["max_meter"] = max(stats["max_meter"], float(s.max()) if s.numel() else 0.0)
        g = gated[rows].unsqueeze(-1) & m
        stats["gated_cells"] += int(g.sum())
        stats["fired"] += int(((r > self.tau) & g).sum())
        stats["unreachable"] += int(((r > self.tau) & (s > self.tau) & g).sum())
        if violations is not None:
            stats["shadow_cells"] += int(m.sum())
            stats["shadow_violations"] += int(violations[rows].sum())
            stats["max_true_tv"] = max(stats["max_true_tv"], float(top[rows].max()) if m.numel() else 0.0)

    def add_output_gap(self, gap: float, allowance: float) -> None:
        """Largest |kernel output - attention recomputed from the read-back cache| (shadow), absolute and over
        ``allowance``, what the kernel's own rounding in the model dtype can explain (above 1: the kernel
        attended other keys or values than the plugin read back)."""
        self.shadow_max_output_gap = max(self.shadow_max_output_gap, gap)
        ratio = gap / allowance if allowance > 0 else (0.0 if gap == 0 else math.inf)
        self.shadow_max_output_gap_ratio = max(self.shadow_max_output_gap_ratio, ratio)

    def count(self, name: str, value: int = 1) -> None:
        """Add to a gate counter (:data:`GATE_COUNTS`)."""
        self.gate_counts[name] += int(value)

    def snapshot(self) -> dict:
        """A JSON-ready copy of the aggregate (the queued cells folded in first)."""
        if self.pending:
            self.fold()
        return {
            "pid": os.getpid(), "tau": self.tau, "shadow": self.shadow, "gate": self.gate, "cells": self.cells,
            "certified": self.certified, "saturated": self.saturated, "unmetered": self.unmetered,
            "meter_sum": self.meter_sum, "bounds": dict(self.bounds), "deltas": dict(self.deltas),
            "buckets": list(METER_BUCKETS), "bucket_counts": list(self.bucket_counts),
            "layer_max": {str(k): v for k, v in self.layer_max.items()},
            "request_max": dict(self.request_max),
            "shadow_cells": self.shadow_cells, "shadow_violations": self.shadow_violations,
            "shadow_max_true_tv": self.shadow_max_true_tv,
            "shadow_max_output_gap": self.shadow_max_output_gap,
            "shadow_max_output_gap_ratio": self.shadow_max_output_gap_ratio, "selftest": dict(self.selftest),
            "schemes": {k: dict(v) for k, v in self.schemes.items()}, "gate_counts": dict(self.gate_counts),
            "prefill_tokens": self.prefill_tokens, "prefill_tokens_lossy": self.prefill_tokens_lossy,
            "audit": self.audit.snapshot(),
        }

    def log_line(self) -> str:
        """The aggregate as one log line in the style of vLLM's own ("Engine 000: ..."): metered cells by the kind of
        bound they carry (proved; probabilistic, per ``delta``), unmetered cells, coverage at ``tau``, saturated
        cells, and with the shadow its violations."""
        deltas = "".join(f", delta={d}: {n}" for d, n in sorted(self.deltas.items()))
        line = (f"WitCert: Metered cells: {self.cells} (proved: {self.bounds.get(PROVED, 0)}, probabilistic: "
                f"{self.bounds.get(PROBABILISTIC, 0)}{deltas}), Unmetered cells: {self.unmetered}, "
                f"Certified at tau={self.tau:g}: {100.0 * self.certified / self.cells if self.cells else 100.0:.1f}%, "
                f"Saturated cells: {self.saturated}")
        if self.shadow:
            line += f", Shadow violations: {self.shadow_violations} of {self.shadow_cells}"
        return line

    def publish(self, directory: str | None) -> None:
        """Write the snapshot to ``<directory>/witcert-<pid>.json`` atomically."""
        if not directory:
            return
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"witcert-{os.getpid()}.json")
        tmp = path + ".tmp"
        text = json.dumps(self.snapshot())  # one C-encoded string (json.dump streams through the Python encoder)
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)


class CellLog:
    """One JSON line per metered cell, appended to ``<path>.<pid>`` (flushed each step)."""

    def __init__(self, path: str):
        self.path = f"{path}.{os.getpid()}"
        self._lines = []

    def add_batch(self, batch: CellBatch, head_offset: int = 0) -> None:
        """Queue one line per metered cell of ``batch`` (its ``risk`` is required)."""
        repaired = batch.repaired or [False] * len(batch.requests)
        for i, request in enumerate(batch.requests):
            def row(x, keep=True):
                return None if x is None or not keep else x[i]
            self.add(request, batch.layer, batch.positions[i], batch.positions[i] + 1, batch.meter[i], batch.risk[i],
                     row(batch.true_tv), scheme=batch.schemes[i], head_offset=head_offset,
                     raw_meter=row(batch.raw_meter, repaired[i]), raw_true_tv=row(batch.raw_true_tv, repaired[i]),
                     bound=batch.bound)

    def add(self, request: str, layer: int, step: int, tokens: int, meter, risk, true_tv=None, *,
            scheme: str = "none", head_offset: int = 0, raw_meter=None, raw_true_tv=None, bound: str = PROVED) -> None:
        """Queue one line per metered query head of a (request, layer, step): meter, risk (and true TV).

        Heads are numbered model-wide (``head_offset``: this worker's first query head under
        tensor parallelism). With the gate, ``meter``/``true_tv`` are after repair and
        ``meter_raw``/``true_tv_raw`` before it (written only where the gate repaired). ``bound`` says
        which kind of bound the meter is (``proved``, or ``probabilistic``). A head left out by the
        operator's sampling (NaN meter) has no line.
        """
        n = len(meter)
        tv = [None] * n if true_tv is None else true_tv.tolist()
        raw = [None] * n if raw_meter is None else raw_meter.tolist()
        raw_tv = [None] * n if raw_true_tv is None else raw_true_tv.tolist()
        for head, (m, r, t, rm, rt) in enumerate(zip(meter.tolist(), risk.tolist(), tv, raw, raw_tv)):
            if math.isnan(m):
                continue
            row = {"request": request, "layer": layer, "head": head_offset + head, "step": step, "tokens": tokens,
                   "scheme": scheme, "bound": bound, "meter": m, "risk": r if math.isfinite(r) else "inf"}
            if t is not None:
                row["true_tv"] = t
            if rm is not None:
                row["meter_raw"] = rm
                if rt is not None:
                    row["true_tv_raw"] = rt
            self._lines.append(json.dumps(row))

    def flush(self) -> None:
        if self._lines:
            with open(self.path, "a") as f:
                f.write("\n".join(self._lines) + "\n")
            self._lines.clear()

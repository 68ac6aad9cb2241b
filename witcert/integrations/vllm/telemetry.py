"""Engine-side aggregation of metered cells; published as a JSON snapshot for ``/metrics``.

vLLM runs the model in an engine process and serves ``/metrics`` from the API server process,
so each engine process writes its aggregate to ``<metrics_dir>/witcert-<pid>.json`` (atomic
rename) after each step; :mod:`.prometheus` merges the live files at scrape time. One JSON line
per cell goes to ``<jsonl>.<pid>`` when asked.
"""
import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

# histogram upper edges of the meter (Prometheus ``le``); 1.0 is the trivial bound
METER_BUCKETS = (0.0, 1e-6, 1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.5, 0.999999, 1.0)


SCHEME_COUNTS = ("cells", "certified", "raw_certified", "saturated", "shadow_cells", "shadow_violations",
                 "gated_cells", "fired", "unreachable")
SCHEME_SUMS = ("meter_sum", "raw_meter_sum")
SCHEME_MAXIMA = ("max_true_tv", "max_meter")
GATE_COUNTS = ("blocks_repaired", "slots_repaired", "bytes_paged", "repair_rounds", "shadow_repair_checked",
               "shadow_repair_mismatches")


def _scheme_stats() -> dict:
    return {**{k: 0 for k in SCHEME_COUNTS}, **{k: 0.0 for k in SCHEME_SUMS + SCHEME_MAXIMA}}


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
    meter_sum: float = 0.0
    bucket_counts: list = field(default_factory=lambda: [0] * len(METER_BUCKETS))
    layer_max: dict = field(default_factory=dict)
    request_max: OrderedDict = field(default_factory=OrderedDict)
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

    def add(self, request: str, layer: int, meter: torch.Tensor, true_tv: torch.Tensor | None = None, *,
            scheme: str = "none", raw_meter: torch.Tensor | None = None, raw_true_tv: torch.Tensor | None = None,
            gated: bool = False) -> None:
        """Fold one (request, layer, step)'s per-head meters (and shadow true TVs) in.

        ``meter``/``true_tv`` describe the attention served; ``raw_meter``/``raw_true_tv`` the
        cache before the gate repaired it (default: the same); ``gated`` whether the gate
        watched this request.
        """
        values = meter.tolist()
        raw = values if raw_meter is None else raw_meter.tolist()
        self.cells += len(values)
        self.certified += sum(v <= self.tau for v in values)
        self.saturated += sum(v >= 1.0 for v in values)
        self.meter_sum += sum(values)
        for v in values:
            self.bucket_counts[_bucket(v)] += 1
        worst = max(values)
        self.layer_max[layer] = max(self.layer_max.get(layer, 0.0), worst)
        self.request_max[request] = max(self.request_max.pop(request, 0.0), worst)
        while len(self.request_max) > self.max_requests:
            self.request_max.popitem(last=False)
        stats = self.schemes.setdefault(scheme, _scheme_stats())
        stats["cells"] += len(values)
        stats["certified"] += sum(v <= self.tau for v in values)
        stats["raw_certified"] += sum(v <= self.tau for v in raw)
        stats["saturated"] += sum(v >= 1.0 for v in values)
        stats["meter_sum"] += sum(values)
        stats["raw_meter_sum"] += sum(raw)
        stats["max_meter"] = max(stats["max_meter"], worst)
        if gated:
            stats["gated_cells"] += len(values)
            stats["fired"] += sum(v > self.tau for v in raw)
            stats["unreachable"] += sum(r > self.tau and v > self.tau for r, v in zip(raw, values))
        if true_tv is not None:
            violations = int((true_tv > meter).sum())
            if raw_true_tv is not None and raw_meter is not None:
                violations += int((raw_true_tv > raw_meter).sum())
            self.shadow_cells += len(values)
            self.shadow_violations += violations
            top = float(true_tv.max()) if raw_true_tv is None else max(float(true_tv.max()), float(raw_true_tv.max()))
            self.shadow_max_true_tv = max(self.shadow_max_true_tv, top)
            stats["shadow_cells"] += len(values)
            stats["shadow_violations"] += violations
            stats["max_true_tv"] = max(stats["max_true_tv"], top)

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
        """A JSON-ready copy of the aggregate."""
        return {
            "pid": os.getpid(), "tau": self.tau, "shadow": self.shadow, "gate": self.gate, "cells": self.cells,
            "certified": self.certified, "saturated": self.saturated, "meter_sum": self.meter_sum,
            "buckets": list(METER_BUCKETS), "bucket_counts": list(self.bucket_counts),
            "layer_max": {str(k): v for k, v in self.layer_max.items()},
            "request_max": dict(self.request_max),
            "shadow_cells": self.shadow_cells, "shadow_violations": self.shadow_violations,
            "shadow_max_true_tv": self.shadow_max_true_tv,
            "shadow_max_output_gap": self.shadow_max_output_gap,
            "shadow_max_output_gap_ratio": self.shadow_max_output_gap_ratio, "selftest": dict(self.selftest),
            "schemes": {k: dict(v) for k, v in self.schemes.items()}, "gate_counts": dict(self.gate_counts),
            "prefill_tokens": self.prefill_tokens, "prefill_tokens_lossy": self.prefill_tokens_lossy,
        }

    def publish(self, directory: str | None) -> None:
        """Write the snapshot to ``<directory>/witcert-<pid>.json`` atomically."""
        if not directory:
            return
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"witcert-{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.snapshot(), f)
        os.replace(tmp, path)


class CellLog:
    """One JSON line per metered cell, appended to ``<path>.<pid>`` (flushed each step)."""

    def __init__(self, path: str):
        self.path = f"{path}.{os.getpid()}"
        self._lines = []

    def add(self, request: str, layer: int, step: int, tokens: int, meter, risk, true_tv=None, *,
            scheme: str = "none", head_offset: int = 0, raw_meter=None, raw_true_tv=None) -> None:
        """Queue one line per query head of a (request, layer, step): meter, risk (and true TV).

        Heads are numbered model-wide (``head_offset``: this worker's first query head under
        tensor parallelism). With the gate, ``meter``/``true_tv`` are after repair and
        ``meter_raw``/``true_tv_raw`` before it (written only where the gate repaired).
        """
        n = len(meter)
        tv = [None] * n if true_tv is None else true_tv.tolist()
        raw = [None] * n if raw_meter is None else raw_meter.tolist()
        raw_tv = [None] * n if raw_true_tv is None else raw_true_tv.tolist()
        for head, (m, r, t, rm, rt) in enumerate(zip(meter.tolist(), risk.tolist(), tv, raw, raw_tv)):
            row = {"request": request, "layer": layer, "head": head_offset + head, "step": step, "tokens": tokens,
                   "scheme": scheme, "meter": m, "risk": r if math.isfinite(r) else "inf"}
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


def _bucket(value: float) -> int:
    for i, edge in enumerate(METER_BUCKETS):
        if value <= edge:
            return i
    return len(METER_BUCKETS) - 1

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


@dataclass
class Telemetry:
    """Running aggregate of one engine process (cells = (request, layer, query head, step))."""

    tau: float
    max_requests: int = 64
    shadow: bool = False
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
    selftest: dict = field(default_factory=dict)

    def add(self, request: str, layer: int, meter: torch.Tensor, true_tv: torch.Tensor | None = None) -> None:
        """Fold one (request, layer, step)'s per-head meters (and shadow true TVs) in."""
        values = meter.tolist()
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
        if true_tv is not None:
            self.shadow_cells += len(values)
            self.shadow_violations += int((true_tv > meter).sum())
            self.shadow_max_true_tv = max(self.shadow_max_true_tv, float(true_tv.max()))

    def add_output_gap(self, gap: float) -> None:
        """Largest |kernel output - attention recomputed from the read-back cache| (shadow)."""
        self.shadow_max_output_gap = max(self.shadow_max_output_gap, gap)

    def snapshot(self) -> dict:
        """A JSON-ready copy of the aggregate."""
        return {
            "pid": os.getpid(), "tau": self.tau, "shadow": self.shadow, "cells": self.cells,
            "certified": self.certified, "saturated": self.saturated, "meter_sum": self.meter_sum,
            "buckets": list(METER_BUCKETS), "bucket_counts": list(self.bucket_counts),
            "layer_max": {str(k): v for k, v in self.layer_max.items()},
            "request_max": dict(self.request_max),
            "shadow_cells": self.shadow_cells, "shadow_violations": self.shadow_violations,
            "shadow_max_true_tv": self.shadow_max_true_tv,
            "shadow_max_output_gap": self.shadow_max_output_gap, "selftest": dict(self.selftest),
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

    def add(self, request: str, layer: int, step: int, tokens: int, meter, risk, true_tv=None) -> None:
        """Queue one line per query head of a (request, layer, step): meter, risk (and true TV)."""
        tv = [None] * len(meter) if true_tv is None else true_tv.tolist()
        for head, (m, r, t) in enumerate(zip(meter.tolist(), risk.tolist(), tv)):
            row = {"request": request, "layer": layer, "head": head, "step": step, "tokens": tokens,
                   "meter": m, "risk": r if math.isfinite(r) else "inf"}
            if t is not None:
                row["true_tv"] = t
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

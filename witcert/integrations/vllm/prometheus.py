"""WitCert series on vLLM's own ``/metrics``: a collector merging the engines' snapshots.

Registered in every process that loads the plugin; it reads ``witcert-<pid>.json`` of the live
engine processes (:mod:`.telemetry`) at scrape time, so the API server reports what its engine
processes metered. Several engine processes (tensor/data parallel) merge by sum (counts) and
max (worst meters).
"""
import glob
import json
import os

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


class WitCertCollector:
    """Prometheus collector of the WitCert series (names start with ``witcert_``)."""

    def __init__(self, directory: str):
        self.directory = directory

    def collect(self):
        snaps = read_snapshots(self.directory)
        merged = merge(snaps)
        tau = str(merged["tau"])
        yield _counter("witcert_cells", "Metered cells (request, layer, query head, decode step).", merged["cells"])
        fraction = GaugeMetricFamily("witcert_certified_fraction",
                                     "Fraction of metered cells whose meter (proved TV bound) is <= tau.",
                                     labels=["tau"])
        fraction.add_metric([tau], merged["certified"] / merged["cells"] if merged["cells"] else 1.0)
        yield fraction
        yield _counter("witcert_saturated_cells", "Cells whose meter is the trivial bound 1.", merged["saturated"])
        hist = HistogramMetricFamily("witcert_meter", "Per-cell meter: proved upper bound on attention TV.")
        cumulative, buckets = 0, []
        for edge, count in zip(merged["buckets"], merged["bucket_counts"]):
            cumulative += count
            buckets.append((repr(float(edge)), cumulative))
        buckets.append(("+Inf", cumulative))
        hist.add_metric([], buckets, sum_value=merged["meter_sum"])
        yield hist
        yield _labelled("witcert_layer_max_meter", "Worst meter seen per layer.", "layer", merged["layer_max"])
        yield _labelled("witcert_request_max_meter", "Worst meter of each recent request.", "request",
                        merged["request_max"])
        yield GaugeMetricFamily("witcert_engines", "Engine processes publishing WitCert meters.", value=len(snaps))
        if merged["shadow"]:
            yield _counter("witcert_shadow_cells", "Cells checked against the exact shadow keys.", merged["shadow_cells"])
            yield _counter("witcert_shadow_violations",
                           "Cells whose true TV exceeded the meter (must stay 0).", merged["shadow_violations"])
            yield GaugeMetricFamily("witcert_shadow_max_true_tv", "Largest true TV seen (shadow).",
                                    value=merged["shadow_max_true_tv"])
            yield GaugeMetricFamily("witcert_shadow_max_output_gap",
                                    "Largest |kernel output - attention recomputed from the read-back cache|.",
                                    value=merged["shadow_max_output_gap"])


def read_snapshots(directory: str) -> list[dict]:
    """Snapshots of the engine processes that are still alive (stale files are skipped)."""
    snaps = []
    for path in sorted(glob.glob(os.path.join(directory, "witcert-*.json"))):
        try:
            with open(path) as f:
                snap = json.load(f)
        except (OSError, ValueError):
            continue  # being replaced right now, or gone
        if _alive(snap.get("pid", -1)):
            snaps.append(snap)
    return snaps


def merge(snaps: list[dict]) -> dict:
    """Sum the counts and take the max of the worst meters over engine processes."""
    from .telemetry import METER_BUCKETS

    out = {"tau": snaps[0]["tau"] if snaps else None, "shadow": any(s["shadow"] for s in snaps),
           "buckets": list(METER_BUCKETS), "bucket_counts": [0] * len(METER_BUCKETS), "layer_max": {},
           "request_max": {}}
    for key in ("cells", "certified", "saturated", "meter_sum", "shadow_cells", "shadow_violations"):
        out[key] = sum(s[key] for s in snaps)
    for key in ("shadow_max_true_tv", "shadow_max_output_gap"):
        out[key] = max((s[key] for s in snaps), default=0.0)
    for s in snaps:
        out["bucket_counts"] = [a + b for a, b in zip(out["bucket_counts"], s["bucket_counts"])]
        for key in ("layer_max", "request_max"):
            for name, value in s[key].items():
                out[key][name] = max(out[key].get(name, 0.0), value)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(int(pid), 0)
    except PermissionError:
        return True  # alive, owned by another user
    except (OSError, ValueError):
        return False
    return True


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _labelled(name: str, doc: str, label: str, values: dict) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items(), key=lambda kv: str(kv[0])):
        family.add_metric([str(key)], value)
    return family

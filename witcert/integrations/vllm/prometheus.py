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
        by_bound = CounterMetricFamily("witcert_cells_by_bound",
                                       "Metered cells by the kind of bound their meter is: proved (deterministic), "
                                       "or probabilistic (holding with probability 1 - delta, label delta).",
                                       labels=["bound", "delta"])
        by_bound.add_metric(["proved", ""], merged["bounds"].get("proved", 0))
        for delta, count in sorted(merged["deltas"].items()):
            by_bound.add_metric(["probabilistic", delta], count)
        yield by_bound
        yield _counter("witcert_unmetered_cells",
                       "Cells left out by the operator's sampled metering (never certified).", merged["unmetered"])
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
        yield from _scheme_series(merged)
        yield from _audit_series(merged["audit"])
        if merged["gate"]:
            counts = merged["gate_counts"]
            yield _counter("witcert_gate_blocks_repaired",
                           "Blocks (request, layer, token block) whose exact keys and values the gate wrote back.",
                           counts["blocks_repaired"])
            yield _counter("witcert_gate_slots_repaired", "Cache slots made exact by the gate.", counts["slots_repaired"])
            yield _counter("witcert_gate_bytes_paged",
                           "Bytes paged in from the content-checked exact store (keys and values).", counts["bytes_paged"])
            yield _counter("witcert_gate_rounds", "Repair rounds (write back, recompute attention, re-meter).",
                           counts["repair_rounds"])
            yield _counter("witcert_gate_tokens_gated", "Tokens attended by gated decode cells' rows (per layer and "
                           "step): the denominator of the fraction of tokens paged.", counts["tokens_gated"])
            yield _counter("witcert_gate_tokens_paged", "Tokens whose exact keys and values the gate paged in.",
                           counts["tokens_paged"])
            yield _counter("witcert_spot_cells", "Cells spot-checked (witcert_certificate 'spot'), before and after "
                           "repair.", counts["spot_cells"])
            yield _counter("witcert_spot_keys", "Exact keys the spot checks read (distinct per checked cell).",
                           counts["spot_keys"])
            yield _counter("witcert_spot_bytes", "Bytes of exact key rows the spot checks read from the exact store "
                           "(apart from the gate's bytes paged).", counts["spot_bytes"])
        yield _counter("witcert_prefill_tokens", "Prefill query tokens (not metered).", merged["prefill_tokens"])
        yield _counter("witcert_prefill_tokens_lossy",
                       "Prefill query tokens that attended keys stored lossy in an earlier step (not metered).",
                       merged["prefill_tokens_lossy"])
        if merged["shadow"]:
            yield _counter("witcert_shadow_cells", "Cells checked against the exact shadow keys.", merged["shadow_cells"])
            yield _counter("witcert_shadow_violations",
                           "Cells whose true TV exceeded the meter (must stay 0).", merged["shadow_violations"])
            yield GaugeMetricFamily("witcert_shadow_max_true_tv", "Largest true TV seen (shadow).",
                                    value=merged["shadow_max_true_tv"])
            yield GaugeMetricFamily("witcert_shadow_max_output_gap",
                                    "Largest |kernel output - attention recomputed from the read-back cache|.",
                                    value=merged["shadow_max_output_gap"])
            yield GaugeMetricFamily("witcert_shadow_max_output_gap_ratio",
                                    "Largest output gap over what the kernel's rounding in the model dtype allows "
                                    "(above 1: the kernel attended other keys or values than the plugin read).",
                                    value=merged["shadow_max_output_gap_ratio"])
            if merged["gate"]:
                yield _counter("witcert_shadow_repair_checked",
                               "Repaired slots whose read-back was compared with the exact shadow key.",
                               merged["gate_counts"]["shadow_repair_checked"])
                yield _counter("witcert_shadow_repair_mismatches",
                               "Repaired slots whose read-back differs from the exact shadow key (must stay 0).",
                               merged["gate_counts"]["shadow_repair_mismatches"])


def _scheme_series(merged: dict):
    """Per-scheme series (label ``scheme``): cells, coverage before and after the gate, shadow checks."""
    tau = str(merged["tau"])
    per = merged["schemes"]
    cells = CounterMetricFamily("witcert_scheme_cells", "Metered cells per scheme.", labels=["scheme"])
    served = GaugeMetricFamily("witcert_scheme_certified_fraction",
                               "Fraction of a scheme's cells whose served meter is <= tau (after repair).",
                               labels=["scheme", "tau"])
    raw = GaugeMetricFamily("witcert_scheme_raw_certified_fraction",
                            "Fraction of a scheme's cells whose meter before the gate is <= tau.", labels=["scheme", "tau"])
    mean = GaugeMetricFamily("witcert_scheme_mean_meter", "Mean served meter of a scheme's cells.", labels=["scheme"])
    fired = CounterMetricFamily("witcert_scheme_gate_fired_cells", "Gated cells whose meter before repair was > tau.",
                                labels=["scheme"])
    unreachable = CounterMetricFamily("witcert_scheme_gate_unreachable_cells",
                                      "Gated cells still > tau after repair.", labels=["scheme"])
    violations = CounterMetricFamily("witcert_scheme_shadow_violations",
                                     "Shadow checks of a scheme's cells with true TV > meter (must stay 0).",
                                     labels=["scheme"])
    top = GaugeMetricFamily("witcert_scheme_shadow_max_true_tv", "Largest true TV of a scheme's cells (shadow).",
                            labels=["scheme"])
    for name in sorted(per):
        s = per[name]
        n = s["cells"]
        cells.add_metric([name], n)
        served.add_metric([name, tau], s["certified"] / n if n else 1.0)
        raw.add_metric([name, tau], s["raw_certified"] / n if n else 1.0)
        mean.add_metric([name], s["meter_sum"] / n if n else 0.0)
        fired.add_metric([name], s["fired"])
        unreachable.add_metric([name], s["unreachable"])
        if merged["shadow"]:
            violations.add_metric([name], s["shadow_violations"])
            top.add_metric([name], s["max_true_tv"])
    yield from (cells, served, raw, mean)
    if merged["gate"]:
        yield from (fired, unreachable)
    if merged["shadow"]:
        yield from (violations, top)


def _audit_series(audit: dict):
    """The request audit's series (:mod:`.audit`), labelled with the statement's ``tau`` and ``delta``: finished
    audited requests, those with a flagged cell, picked and flagged cells, the distribution of ``fraction_upper``
    (with probability at least ``1 - delta``, at most that fraction of a request's cells has TV above ``tau``)."""
    from .audit import FRACTION_BUCKETS

    labels = ["tau", "delta"]
    requests = CounterMetricFamily("witcert_audit_requests", "Finished requests with a request audit.", labels=labels)
    flagged = CounterMetricFamily("witcert_audit_flagged_requests",
                                  "Audited requests with at least one flagged cell (picked, meter above tau).",
                                  labels=labels)
    picked = CounterMetricFamily("witcert_audit_picked_cells", "Cells the audits picked (and metered).", labels=labels)
    flags = CounterMetricFamily("witcert_audit_flagged_cells", "Picked cells whose meter exceeded tau.", labels=labels)
    hist = HistogramMetricFamily("witcert_audit_fraction_upper",
                                 "Per audited request: the fraction of its cells that, with probability at least "
                                 "1 - delta, bounds the fraction with attention TV above tau.", labels=labels)
    shadow = CounterMetricFamily("witcert_audit_shadow_violations",
                                 "Audited requests whose true count of cells above tau (exact shadow) exceeded "
                                 "M_upper (at most a delta fraction of requests; 0 expected at small delta).",
                                 labels=labels)
    any_shadow = False
    for label, stats in sorted(audit["by_level"].items()):
        values = label.split("|")
        requests.add_metric(values, stats["requests"])
        flagged.add_metric(values, stats["flagged_requests"])
        picked.add_metric(values, stats["picked_cells"])
        flags.add_metric(values, stats["flagged_cells"])
        cumulative, buckets = 0, []
        for edge, count in zip(FRACTION_BUCKETS, stats["fraction_counts"]):
            cumulative += count
            buckets.append((repr(float(edge)), cumulative))
        buckets.append(("+Inf", cumulative))
        hist.add_metric(values, buckets, sum_value=stats["fraction_sum"])
        if stats["shadow_requests"]:
            any_shadow = True
            shadow.add_metric(values, stats["shadow_violations"])
    yield from (requests, flagged, picked, flags, hist)
    if any_shadow:
        yield shadow


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
    """Sum the counts and take the max of the worst meters over engine processes (tensor
    parallel workers each meter their own query heads, so their cells add up)."""
    from .audit import merge as merge_audits
    from .telemetry import GATE_COUNTS, METER_BUCKETS, SCHEME_MAXIMA, _scheme_stats

    out = {"tau": snaps[0]["tau"] if snaps else None, "shadow": any(s["shadow"] for s in snaps),
           "gate": any(s.get("gate", False) for s in snaps),
           "buckets": list(METER_BUCKETS), "bucket_counts": [0] * len(METER_BUCKETS), "layer_max": {},
           "request_max": {}, "schemes": {}, "gate_counts": {k: 0 for k in GATE_COUNTS}}
    for key in ("cells", "certified", "saturated", "unmetered", "meter_sum", "shadow_cells", "shadow_violations",
                "prefill_tokens", "prefill_tokens_lossy"):
        out[key] = sum(s.get(key, 0) for s in snaps)
    for key in ("bounds", "deltas"):  # proved / probabilistic cells; probabilistic cells per delta
        out[key] = {}
        for s in snaps:
            for name, count in s.get(key, {}).items():
                out[key][name] = out[key].get(name, 0) + count
    for s in snaps:
        for name, stats in s.get("schemes", {}).items():
            into = out["schemes"].setdefault(name, _scheme_stats())
            for key, value in stats.items():
                into[key] = max(into[key], value) if key in SCHEME_MAXIMA else into[key] + value
        for key, value in s.get("gate_counts", {}).items():
            out["gate_counts"][key] += value
    out["audit"] = merge_audits(snaps)
    for key in ("shadow_max_true_tv", "shadow_max_output_gap", "shadow_max_output_gap_ratio"):
        out[key] = max((s.get(key, 0.0) for s in snaps), default=0.0)
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

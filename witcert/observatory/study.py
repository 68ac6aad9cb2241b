"""The paper's two empirical results, reproduced on a real model: gated repair, and cross-layer accumulation.

1. **Repair study.** A passkey family (several depths, 1-4 keyed passkeys, one asked) is
   answered by the uncompressed model, by the model on each raw compressed cache, and on each
   cache gated by :class:`witcert.Gate` (certified ``tau < 1`` and risk-ranked ``tau >= 1``; on request,
   the spot-certified gate of :mod:`witcert.spot.gate`).
   Per configuration: exact-match accuracy with its exact binomial interval, the paired
   difference against uncompressed on the same cases (Newcombe interval, exact McNemar test),
   how many cells the gate fired on and how much it paged.
2. **Layer sweep.** For an aggressive scheme, one layer at a time is compressed (every other
   layer holds its exact tokens), then each contiguous third, then all layers; the accuracy
   and its paired difference per configuration, the mean meter over the compressed layers'
   cells, and the count of single layers whose compression alone loses accuracy (McNemar
   ``p < 0.05``), next to the all-layer loss.

Protocol (the observatory's, :mod:`witcert.observatory.runner`): the context is prefilled
exactly, then the question (the probe chunk) and the greedy answer attend over the compressed
cache under :func:`witcert.monitor` with the exact shadow kept, so every metered cell also gets
its true TV. The exact prefill of a batch of cases is computed once and shared by every
configuration (:func:`witcert.integrations.hf.cache_layer.adopt` compresses an exact prefix as
the store's first write, exactly as a monitored prefill would). Cases run in batches of equal
length: shorter prompts are left-filled with newline tokens (attended, not masked).
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from witcert.gate.policy import Gate
from witcert.integrations.hf.cache_layer import MonitoredLayer
from witcert.integrations.hf.codecs import codec_for
from witcert.integrations.hf.monitoring import Monitor
from witcert.observatory import stats, workloads
from witcert.observatory.study_config import QUICK, StudyConfig  # noqa: F401 (QUICK: the --quick run)
from witcert.tier_a.witness_code import WitnessCode

UNCOMPRESSED = "uncompressed"
KEY_COUNTS = (1, 2, 3, 4)
DEPTHS = tuple(float(d) for d in np.linspace(0.05, 0.95, 10))
ALPHA = 0.05  # the paired test's level for "this configuration loses accuracy"


@dataclass(frozen=True)
class Configuration:
    """One way of answering every case: a scheme on some layers, maybe gated (``scheme=None``: uncompressed)."""

    name: str
    study: str  # "repair" or "sweep"
    scheme: str | None = None
    layers: tuple[int, ...] | None = None  # compressed layers (None: all)
    gate: Gate | None = None
    certificate: str = "deterministic"  # "spot": the spot-certified gate (witcert.spot.gate)


@dataclass
class Tally:
    """What one configuration measured, accumulated batch by batch."""

    outcomes: list = field(default_factory=list)  # per case: exact-match correct
    cells: int = 0
    violations: int = 0  # cells with true TV above the meter (must stay 0)
    unchecked: int = 0  # metered cells without a true TV (must stay 0: the exact shadow is kept)
    max_excess: float = -np.inf  # max over cells of true TV - meter
    meter_sum: float = 0.0  # over the compressed layers' cells
    meter_cells: int = 0
    fired: int = 0
    paged_sum: float = 0.0  # sum over cells of the fraction of visible tokens paged in
    paged_bytes: float = 0.0  # K+V bytes of the paged tokens, summed over query-head cells
    spot_keys: float = 0.0  # exact keys read by spot checks (before and during repair), summed over cells
    violations_after: int = 0  # gated cells with true TV after repair above meter_after (must stay 0)
    wall_s: float = 0.0


def needle_family(tokenizer, count: int, context_tokens: int, seed: int = 0) -> list:
    """``count`` passkey cases: depths x key counts (1-4) x replicas, keys varying fastest.

    Each (replica, depth, keys) gets its own seed, hence its own codes, key names and scattered
    depths (:func:`witcert.observatory.workloads.needle_cases`).
    """
    cases, replica = [], 0
    while len(cases) < count:
        for d, depth in enumerate(DEPTHS):
            for keys in KEY_COUNTS:
                case_seed = seed * 1_000_003 + replica * 1000 + d * 10 + keys
                cases += workloads.needle_cases(tokenizer, context_tokens, depths=(depth,), keys=(keys,), seed=case_seed)
        replica += 1
    return cases[:count]


def configurations(config: StudyConfig, n_layers: int) -> list[Configuration]:
    """Uncompressed, then per repair scheme raw / certified gate / risk-ranked gate, then the sweep."""
    out = [Configuration(UNCOMPRESSED, "repair")]
    for scheme in config.schemes:
        out.append(Configuration(scheme, "repair", scheme))
        if scheme in config.gated_schemes:
            out.append(Configuration(f"{scheme} gated tau={config.tau_certified:g}", "repair", scheme,
                                     gate=Gate(tau=config.tau_certified)))
        if scheme in config.spot_gated_schemes:
            out.append(Configuration(f"{scheme} spot-gated tau={config.tau_certified:g}", "repair", scheme,
                                     gate=Gate(tau=config.tau_certified), certificate="spot"))
        if scheme in config.risk_schemes:
            out.append(Configuration(f"{scheme} gated tau={config.tau_risk:g}", "repair", scheme,
                                     gate=Gate(tau=config.tau_risk)))
    thirds = np.array_split(np.arange(n_layers), 3)
    singles = sweep_layers(config, n_layers)
    for scheme in config.sweep_schemes:
        out += [Configuration(f"{scheme} layer {i}", "sweep", scheme, layers=(i,)) for i in singles]
        out += [Configuration(f"{scheme} layers {t[0]}-{t[-1]}", "sweep", scheme, layers=tuple(int(i) for i in t))
                for t in thirds if len(t)]  # all layers: the repair study's raw row
    return out


def sweep_layers(config: StudyConfig, n_layers: int) -> list[int]:
    """The single layers the sweep compresses one at a time (negative indices count from the last)."""
    if config.sweep_layers is None:
        return list(range(n_layers))
    layers = sorted({i % n_layers for i in config.sweep_layers if -n_layers <= i < n_layers})
    if len(layers) != len(set(config.sweep_layers)):
        raise ValueError(f"sweep_layers {config.sweep_layers} must be distinct layers of the model's {n_layers}")
    return layers


class _LayerSubsetMonitor(Monitor):
    """A monitor that compresses only ``layers``; every other layer holds its exact tokens.

    An exact layer stores through the identity codec and is read like the prefill, over its
    exact tokens by the stock attention path: its TV is 0, nothing to meter (and metering it
    would cost as much as metering a compressed layer). The compressed layers are metered as
    under :class:`Monitor`.
    """

    def __init__(self, model, scheme, layers, **kwargs):
        super().__init__(model, scheme, **kwargs)
        self.compressed_layers = frozenset(layers)
        self._identity = codec_for(_identity, packed=False)

    def _store(self, index, record, backing):
        store = super()._store(index, record, backing)
        if index in self.compressed_layers:
            return store
        # the exact layer's witness is stored (zero: nothing is lost); the identity codec declares no error bound
        # from which a derived witness could be formed
        return dataclasses.replace(store, codec=self._identity, witness_code=WitnessCode())

    def _live_of(self, cache, batch):
        live = super()._live_of(cache, batch)
        for index, layer in enumerate(live.layers):
            if index not in self.compressed_layers and type(layer) is MonitoredLayer:
                layer.__class__ = _ExactReadLayer
        return live


class _ExactReadLayer(MonitoredLayer):
    """A monitored layer over exact tokens (identity codec): every read is an exact read, as in the prefill."""

    def update(self, key_states, value_states, *args, **kwargs):
        read = super().update(key_states, value_states, *args, **kwargs)
        self.read_exact = True
        return read


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class Batch:
    """Cases of equal prompt length: ``prefix`` (B, T - P) prefilled exactly, ``probe`` (B, P) read compressed."""

    cases: tuple
    prefix: torch.Tensor
    probe: torch.Tensor


def make_batches(tokenizer, cases, size: int, probe_tokens: int | None = None) -> list[Batch]:
    """Batches of ``size`` cases; each prompt (context + question) left-filled with newlines to the batch's length.

    The probe is the last ``probe_tokens`` prompt tokens; ``None``: the longest question of the
    batch, so every question is read over the compressed cache.
    """
    filler = tokenizer("\n", add_special_tokens=False).input_ids[-1]
    batches = []
    for start in range(0, len(cases), size):
        group = cases[start:start + size]
        prompts, probe_len = [], 0
        for case in group:
            question = tokenizer(case.question, add_special_tokens=False).input_ids
            prompts.append(tokenizer(case.context).input_ids + question)
            probe_len = max(probe_len, len(question))
        length = max(len(p) for p in prompts)
        probe_len = probe_len if probe_tokens is None else min(probe_tokens, length - 1)
        ids = torch.tensor([[filler] * (length - len(p)) + p for p in prompts])
        batches.append(Batch(tuple(group), ids[:, :-probe_len], ids[:, -probe_len:]))
    return batches


def exact_prefill(model, batch: Batch) -> DynamicCache:
    """The exact cache of the batch's prefix (stock attention; only the last logits computed)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(batch.prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def answer(model, tokenizer, batch: Batch, cache, new_tokens: int, monitor: Monitor | None = None) -> list[bool]:
    """Feed the probe on ``cache`` (then decode greedily); per case, whether the answer matches.

    Under ``monitor`` the probe is declared non-adaptive (given text), the greedy steps are not.
    """
    scope = monitor.non_adaptive() if monitor is not None else torch.no_grad()
    with torch.no_grad():
        with scope:
            logits = model(batch.probe, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        tokens = [logits.argmax(-1)]
        for _ in range(new_tokens - 1):
            logits = model(tokens[-1][:, None], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            tokens.append(logits.argmax(-1))
    generated = torch.stack(tokens, dim=1)
    return [case.score(tokenizer.decode(row)) for case, row in zip(batch.cases, generated.tolist())]


def run_configuration(model, tokenizer, batch: Batch, prefix: DynamicCache, conf: Configuration,
                      config: StudyConfig, tally: Tally):
    """Answer the batch under ``conf``, add its outcomes and cells to ``tally``; returns the cell table (or None)."""
    start = time.perf_counter()
    cache = copy.deepcopy(prefix)
    table = None
    if conf.scheme is None:
        tally.outcomes += answer(model, tokenizer, batch, cache, config.new_tokens)
    else:
        kwargs = dict(gate=conf.gate, keep_exact=True, bands=config.bands, meter="full",  # the tightest certificate
                      certificate=conf.certificate, spot_keys=config.spot_keys)
        monitor = (Monitor(model, conf.scheme, **kwargs) if conf.layers is None
                   else _LayerSubsetMonitor(model, conf.scheme, conf.layers, **kwargs))
        with monitor:
            tally.outcomes += answer(model, tokenizer, batch, cache, config.new_tokens, monitor)
        table = monitor.table()
        _add_cells(tally, table, monitor, conf, model)
    tally.wall_s += time.perf_counter() - start
    return table


def _add_cells(tally: Tally, table, monitor: Monitor, conf: Configuration, model) -> None:
    meter, tv = table["meter"], table["true_tv"]
    known = ~np.isnan(tv)
    tally.cells += len(table)
    tally.unchecked += int(np.sum(~known))
    tally.violations += int(np.sum(tv[known] > meter[known]))  # per cell, against that cell's own meter
    if known.any():
        tally.max_excess = max(tally.max_excess, float(np.max(tv[known] - meter[known])))
    compressed = np.ones(len(table), dtype=bool) if conf.layers is None else np.isin(table["layer"], conf.layers)
    tally.meter_sum += float(np.sum(meter[compressed]))
    tally.meter_cells += int(np.sum(compressed))
    tally.fired += int(np.sum(table["repaired"]))
    if "paged_fraction" in table.columns:
        visible = table["pos"] + 1  # causal: a query at position p sees p + 1 tokens
        token_bytes = 2 * monitor.layout.head_dim * next(model.parameters()).element_size()
        tally.paged_sum += float(np.sum(table["paged_fraction"]))
        tally.paged_bytes += float(np.sum(table["paged_fraction"] * visible)) * token_bytes
    if "meter_after" in table.columns:
        tally.violations_after += int(np.sum(table["true_tv_after"] > table["meter_after"]))
    for column in ("spot_keys", "spot_gate_keys"):
        if column in table.columns:
            tally.spot_keys += float(np.nansum(table[column]))


def run_study(loaded, config: StudyConfig, progress=None, cells_sink=None) -> dict:
    """Run every configuration on every case; returns the report (see :func:`summarize`).

    ``progress(done, total, label)`` is called after each (batch, configuration);
    ``cells_sink(name, table)``, if given, receives every configuration's cell table (tests).
    """
    model, tokenizer = loaded.model, loaded.tokenizer
    start = time.perf_counter()
    cases = needle_family(tokenizer, config.cases, config.context_tokens, config.seed)
    batches = make_batches(tokenizer, cases, config.batch, config.probe_tokens)
    confs = configurations(config, model.config.num_hidden_layers)
    tallies = {c.name: Tally() for c in confs}
    total = sum(len([c for c in confs if _runs(c, i, config)]) for i in range(len(batches)))
    done = 0
    for b, batch in enumerate(batches):
        prefix = exact_prefill(model, batch)
        for conf in confs:
            if not _runs(conf, b, config):
                continue
            table = run_configuration(model, tokenizer, batch, prefix, conf, config, tallies[conf.name])
            if cells_sink is not None and table is not None:
                cells_sink(conf.name, table)
            done += 1
            if progress is not None:
                progress(done, total, conf.name)
    return summarize(confs, tallies, config, model.config.num_hidden_layers, loaded.source,
                     time.perf_counter() - start)


def _runs(conf: Configuration, batch_index: int, config: StudyConfig) -> bool:
    """Repair configurations answer every batch; sweep ones the batches of the first ``sweep_cases``."""
    return conf.study == "repair" or batch_index * config.batch < config.sweep_cases


def summarize(confs, tallies: dict, config: StudyConfig, n_layers: int, source: str, wall_s: float) -> dict:
    """The report: every configuration's row, the two studies' tables, the soundness totals."""
    reference = np.array(tallies[UNCOMPRESSED].outcomes, dtype=bool)
    rows = {c.name: _row(c, tallies[c.name], reference) for c in confs}
    repair = [rows[c.name] for c in confs if c.study == "repair"]
    sweep = {}
    for scheme in config.sweep_schemes:
        n = config.sweep_cases
        base = rows[UNCOMPRESSED] if n == config.cases else _row(confs[0], tallies[UNCOMPRESSED], reference, n)
        singles = [rows[f"{scheme} layer {i}"] for i in sweep_layers(config, n_layers)]
        thirds = [rows[c.name] for c in confs if c.scheme == scheme and c.layers is not None and len(c.layers) > 1]
        everything = _row(next(c for c in confs if c.scheme == scheme and c.layers is None and c.gate is None),
                          tallies[scheme], reference, n)
        losses = [r for r in singles if r["paired"]["diff"] < 0 and r["paired"]["p_mcnemar"] < ALPHA]
        sweep[scheme] = {"cases": n, "uncompressed": base, "single_layers": singles, "thirds": thirds,
                         "all_layers": everything, "single_layer_losses": len(losses),
                         "single_layer_losses_bonferroni": sum(r["paired"]["p_mcnemar"] < ALPHA / len(singles)
                                                               for r in losses)}
    metered = [t for t in tallies.values() if t.cells]
    return {
        "model": source, "date": time.strftime("%Y-%m-%d", time.gmtime()), "wall_s": wall_s,
        "config": _config_dict(config), "layers": n_layers,
        "intervals": {"level": stats.LEVEL, "accuracy": "exact binomial (Clopper-Pearson)",
                      "paired_difference": "Newcombe hybrid score (method 10, from Wilson intervals)",
                      "paired_test": "exact McNemar (two-sided binomial test of the discordant pairs)"},
        "repair": repair, "sweep": sweep,
        "soundness": {"cells": sum(t.cells for t in metered), "violations": sum(t.violations for t in metered),
                      "unchecked": sum(t.unchecked for t in metered),
                      "violations_after_repair": sum(t.violations_after for t in metered),
                      "max_true_tv_minus_meter": max((t.max_excess for t in metered), default=float("nan"))},
    }


def _row(conf: Configuration, tally: Tally, reference: np.ndarray, n: int | None = None) -> dict:
    """One configuration's row; ``n``: restricted to the first ``n`` cases (the sweep's subset)."""
    outcomes = np.array(tally.outcomes, dtype=bool)
    n = len(outcomes) if n is None else n
    outcomes, ref = outcomes[:n], reference[:n]
    low, high = stats.accuracy_interval(int(outcomes.sum()), n)
    row = {"name": conf.name, "scheme": conf.scheme, "layers": None if conf.layers is None else list(conf.layers),
           "gate": None if conf.gate is None else {"tau": conf.gate.tau, "mode": conf.gate.mode,
                                                   "certificate": conf.certificate},
           "cases": n, "correct": int(outcomes.sum()), "accuracy": float(outcomes.mean()), "low": low, "high": high,
           "paired": stats.paired_difference(outcomes, ref), "cells": tally.cells, "violations": tally.violations,
           "unchecked": tally.unchecked, "wall_s": tally.wall_s, "outcomes": [int(x) for x in outcomes]}
    if tally.cells:
        row["mean_meter"] = tally.meter_sum / max(tally.meter_cells, 1)
        row["max_true_tv_minus_meter"] = tally.max_excess
        row["fired"] = tally.fired / tally.cells
        if conf.gate is not None:
            row["paged_fraction"] = tally.paged_sum / tally.cells
            row["paged_bytes_per_case"] = tally.paged_bytes / len(tally.outcomes)
            row["violations_after_repair"] = tally.violations_after
        if conf.certificate == "spot":
            row["spot_keys_per_cell"] = tally.spot_keys / tally.cells
    return row


def _config_dict(config: StudyConfig) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}

"""The request audit in the plugin (registry AU): a per-request statement from a few randomly picked cells.

A request asks for it in ``SamplingParams.extra_args`` (over the OpenAI API ``vllm_xargs``):
``witcert_audit_rate`` (in (0, 1]; set: the audit is on), ``witcert_audit_tau`` (in (0, 1), default 0.2),
``witcert_audit_delta`` (in (0, 1), default 1e-3), ``witcert_audit_seed`` (replay only; by default a
secret seed from the operating system's cryptographic source). The settings are :class:`witcert.Audit`.

What the audit does here is :mod:`witcert.audit`'s, reused as is: which cells are picked
(:func:`witcert.audit.row_picks.picked_rows`: Philox keyed by the request's seed and the cell's layer,
query head and position, never by a query; every audited request of a step in one call), and the
verdict from the running counts (:func:`witcert.audit.counts.requests_of_counts`: the binomial limit,
the interval and :class:`witcert.audit.RequestAudit`, as :func:`witcert.audit.requests_of` forms them).
The plugin meters only the picked cells (a layer's pass runs for a row only where one of its heads is
picked; the other cells are counted *unmetered*), and flags a picked cell when its meter exceeds ``tau``. The meter is a
proved bound, so a picked cell with TV above ``tau`` is always flagged: the flagged count is at least
``Binomial(M, rate)`` with no check that can fail (``WitCert.measure_auditUpper_exact_le``'s hypothesis, as for the
exact audit of :mod:`witcert.audit.exact`), and the limit is taken at the settings' ``delta_sampling``: the whole
``delta`` for the default ``keys=None``. (The transformers integration bounds a picked cell by its true TV from exact
keys; the plugin reads no exact keys for the audit, so its flags rest on the meter: sound, looser where the meter
saturates.)

The population ``N`` of a request is its decode cells: (layer, query head, query position) of every
query token past the prompt (decode and speculative verification steps); prefill is not metered.
A request's verdict is formed when it finishes (vLLM's ``finished_req_ids``, or the engine going idle)
and goes to the log (one line per request), the snapshot and the Prometheus series
(:mod:`.prometheus`). With the exact shadow, every cell's true TV is counted too, and a request whose
true count above ``tau`` exceeds ``M_upper`` is an audit violation (must stay 0 at the default delta).
"""
import logging
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from witcert.audit import Audit, RequestAudit
from witcert.audit.counts import requests_of_counts
from witcert.audit.row_picks import picked_rows

RATE, TAU, DELTA, SEED = "witcert_audit_rate", "witcert_audit_tau", "witcert_audit_delta", "witcert_audit_seed"
KEYS = (RATE, TAU, DELTA, SEED)
FRACTION_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
"""Histogram upper edges of ``fraction_upper`` (Prometheus ``le``)."""
RECENT = 64  # verdicts kept in the snapshot

logger = logging.getLogger("vllm.witcert")


def audit_of(extra: dict) -> Audit | None:
    """The request's :class:`witcert.Audit` from its ``extra_args`` (``None``: no ``witcert_audit_rate``); a
    ``ValueError`` naming the key on a bad value. The seed is drawn here when the request gives none."""
    if extra.get(RATE) in (None, ""):
        for key in (TAU, DELTA, SEED):
            if extra.get(key) not in (None, ""):
                raise ValueError(f"{key} needs {RATE} (the audit is on only with a pick rate)")
        return None
    values = {name: _number(key, extra.get(key)) for name, key in (("rate", RATE), ("tau", TAU), ("delta", DELTA))}
    seed = extra.get(SEED)
    if seed in (None, ""):
        seed = secrets.randbits(63)
    elif isinstance(seed, str) and seed.strip().isdigit():
        seed = int(seed)
    try:
        return Audit(**{k: v for k, v in values.items() if v is not None}, seed=seed)
    except ValueError as err:
        name = str(err).split(" ", 1)[0]
        key = {"rate": RATE, "tau": TAU, "delta": DELTA, "seed": SEED}.get(name)
        raise ValueError(str(err).replace(name, key, 1) if key else str(err)) from None


def _number(key: str, value):
    if value in (None, ""):
        return None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{key} must be a number, got {value!r}") from None
    return value


def cell_picks(audit: Audit, layers: int, heads: int, positions: list, head_offset: int = 0) -> torch.Tensor:
    """bool (L, Hq, T): the picked cells of one request at query ``positions`` in every layer, for this worker's
    query heads ``head_offset .. head_offset + heads - 1`` (head numbers model-wide: the same picks under
    tensor parallelism). The request's own seed keys the picks, so its id in the counter is 0."""
    return step_picks([audit], layers, heads, [positions], head_offset)[:, 0]


def step_picks(audits: list, layers: int, heads: int, positions: list, head_offset: int = 0) -> torch.Tensor:
    """bool (L, B, Hq, T): :func:`cell_picks` of ``B`` requests (``audits[b]`` at query ``positions[b]``, T each) in
    one Philox call (:func:`witcert.audit.row_picks.picked_rows`: bit-identical to each request's own)."""
    out = picked_rows([a.seed for a in audits], [a.rate for a in audits], [0] * len(audits), range(layers),
                      head_offset + heads, torch.as_tensor(positions, dtype=torch.int64).reshape(len(audits), -1))
    return out[:, :, head_offset:]


class PickBlocks:
    """:func:`step_picks` for decode steps, each request's picks drawn :data:`BLOCK` positions at a time.

    A cell's pick is a function of the request's seed and rate and of the cell's layer, head and position alone
    (:func:`witcert.audit.row_picks.picked_rows`), so drawing the next positions early changes no pick; one Philox
    call over a block costs about what one over a single step does (its fixed cost is a few hundred small tensor
    operations). Blocks are kept for the most recent :data:`KEPT` requests."""

    BLOCK = 32
    KEPT = 1024

    def __init__(self):
        self.blocks = OrderedDict()  # (seed, rate, layers, heads, head offset) -> (first position, (L, Hq, BLOCK))

    def step(self, audits: list, layers: int, heads: int, positions: list, head_offset: int = 0) -> torch.Tensor:
        """bool (L, B, Hq, T), equal to ``step_picks(audits, layers, heads, positions, head_offset)``."""
        keys = [(a.seed, a.rate, layers, heads, head_offset) for a in audits]
        if any(len(p) != 1 for p in positions) or len(set(keys)) < len(keys):  # several query tokens, or two rows
            return step_picks(audits, layers, heads, positions, head_offset)  # of one seed: drawn as asked
        missing = {k: p[0] for k, p in zip(keys, positions) if not self._covers(k, p[0])}
        if missing:
            audit_of = dict(zip(keys, audits))
            drawn = step_picks([audit_of[k] for k in missing], layers, heads,
                               [range(p, p + self.BLOCK) for p in missing.values()], head_offset)
            for b, (key, first) in enumerate(missing.items()):
                self.blocks[key] = (first, drawn[:, b])
                self.blocks.move_to_end(key)
            while len(self.blocks) > self.KEPT:
                self.blocks.popitem(last=False)
        return torch.stack([self.blocks[k][1][:, :, p[0] - self.blocks[k][0]] for k, p in zip(keys, positions)],
                           dim=1).unsqueeze(-1)

    def _covers(self, key: tuple, position: int) -> bool:
        block = self.blocks.get(key)
        return block is not None and 0 <= position - block[0] < self.BLOCK


@dataclass
class Tally:
    """One running request's audit counts: ``cells`` (N), ``picked``, the flagged cells ``(layer, head, pos)``;
    with the shadow, ``truth_cells`` whose true TV is known and ``true_above`` of them above ``tau``."""

    audit: Audit
    cells: int = 0
    picked: int = 0
    flagged: list = field(default_factory=list)
    truth_cells: int = 0
    true_above: int = 0

    def add(self, layer: int, position: int, picks: torch.Tensor, meter: torch.Tensor, true_tv, head_offset: int):
        """One (layer, query token)'s heads: ``picks`` (Hq,) bool, ``meter`` (Hq,) (a picked cell's is metered),
        ``true_tv`` (Hq,) or ``None``."""
        self.add_counts(picks.numel(), int(picks.sum()),
                        [(layer, head_offset + h, position)
                         for h in (picks & (meter > self.audit.tau)).nonzero().flatten().tolist()],
                        None if true_tv is None or bool(torch.isnan(true_tv).any())
                        else int((true_tv > self.audit.tau).sum()))

    def add_counts(self, cells: int, picked: int, flagged: list, true_above: int | None) -> None:
        """Add ``cells`` cells, ``picked`` of them picked, the ``flagged`` ones, and (``None``: unknown) how many of
        them have true TV above ``tau``."""
        self.cells += cells
        self.picked += picked
        self.flagged.extend(flagged)
        if true_above is not None:
            self.truth_cells += cells
            self.true_above += true_above

    def verdict(self, number: int) -> RequestAudit:
        """The request's statement, from its counts (:func:`witcert.audit.counts.requests_of_counts`)."""
        verdict, = requests_of_counts([number], [self.cells], [self.picked], [len(self.flagged)], [self.flagged],
                                      self.audit, self.audit.seed)
        return verdict


def _label(audit: Audit) -> str:
    return f"{audit.tau!r}|{audit.delta!r}"


@dataclass
class Ledger:
    """Audits of one engine process: running tallies by request id, and the finished requests' aggregate per
    ``(tau, delta)`` (``by_level``), with the most recent verdicts."""

    open: dict = field(default_factory=dict)
    by_level: dict = field(default_factory=dict)
    recent: OrderedDict = field(default_factory=OrderedDict)
    finished: int = 0

    def tally(self, request: str, audit: Audit) -> Tally:
        found = self.open.get(request)
        if found is None:
            found = self.open[request] = Tally(audit)
        return found

    def add_rows(self, requests: list, audits: list, layer: int, positions: list, picks: torch.Tensor,
                 meter: torch.Tensor, true_tv: torch.Tensor | None, head_offset: int) -> None:
        """One layer's audited query tokens at once: row ``i`` is request ``requests[i]`` (audited under ``audits[i]``)
        at ``positions[i]``; ``picks``, ``meter``, ``true_tv`` (n, Hq)."""
        tau = torch.tensor([a.tau for a in audits], dtype=torch.float64).unsqueeze(-1)
        over = (picks & (meter > tau)).nonzero().tolist()
        picked = picks.sum(-1).tolist()
        above = [None] * len(requests)
        if true_tv is not None:
            known = ~torch.isnan(true_tv).any(-1)
            counts = (true_tv > tau).sum(-1)
            above = [int(c) if k else None for c, k in zip(counts.tolist(), known.tolist())]
        flagged = [[] for _ in requests]
        for i, h in over:
            flagged[i].append((layer, head_offset + h, positions[i]))
        for i, request in enumerate(requests):
            self.tally(request, audits[i]).add_counts(picks.shape[-1], picked[i], flagged[i], above[i])

    def add_unpicked(self, requests: list, audits: list, cells: int) -> None:
        """Query tokens of one layer with no picked cell: ``cells`` (its query heads) each, nothing picked or known."""
        for request, audit in zip(requests, audits):
            self.tally(request, audit).add_counts(cells, 0, [], None)

    def finish(self, requests) -> list:
        """Form the verdicts of ``requests`` (ids; those without an audit are skipped), log one line each."""
        out = []
        for request in requests:
            tally = self.open.pop(request, None)
            if tally is None or not tally.cells:
                continue
            self.finished += 1
            verdict = tally.verdict(self.finished)
            stats = self.by_level.setdefault(_label(tally.audit), _level_stats())
            stats["requests"] += 1
            stats["flagged_requests"] += verdict.flagged > 0
            stats["cells"] += verdict.N
            stats["picked_cells"] += verdict.picked
            stats["flagged_cells"] += verdict.flagged
            stats["fraction_sum"] += verdict.fraction_upper
            bucket = int(np.searchsorted(FRACTION_BUCKETS, verdict.fraction_upper, side="left"))
            stats["fraction_counts"][min(bucket, len(FRACTION_BUCKETS) - 1)] += 1
            record = dict(verdict.as_dict(), request_id=request)
            if tally.truth_cells == tally.cells:
                stats["shadow_requests"] += 1
                violated = tally.true_above > verdict.M_upper
                stats["shadow_violations"] += violated
                record.update(true_above=tally.true_above, true_fraction=tally.true_above / tally.cells)
            self.recent[request] = record
            while len(self.recent) > RECENT:
                self.recent.popitem(last=False)
            logger.info("WitCert audit %s: %s (tau=%g, delta=%g)", request, verdict.line(), verdict.tau,
                        verdict.delta)
            out.append(record)
        return out

    def snapshot(self) -> dict:
        return {"finished": self.finished, "open": len(self.open),
                "by_level": {k: dict(v, fraction_counts=list(v["fraction_counts"])) for k, v in self.by_level.items()},
                "recent": dict(self.recent)}


def _level_stats() -> dict:
    return {"requests": 0, "flagged_requests": 0, "cells": 0, "picked_cells": 0, "flagged_cells": 0,
            "fraction_sum": 0.0, "fraction_counts": [0] * len(FRACTION_BUCKETS), "shadow_requests": 0,
            "shadow_violations": 0}


def merge(snaps: list) -> dict:
    """The audit parts of several engine processes' snapshots, summed per ``(tau, delta)``."""
    out = {"finished": 0, "by_level": {}, "recent": {}}
    for snap in snaps:
        part = snap.get("audit") or {}
        out["finished"] += part.get("finished", 0)
        out["recent"].update(part.get("recent", {}))
        for label, stats in part.get("by_level", {}).items():
            into = out["by_level"].setdefault(label, _level_stats())
            for key, value in stats.items():
                into[key] = [a + b for a, b in zip(into[key], value)] if key == "fraction_counts" else into[key] + value
    return out

"""``Monitor.summary()``: what a monitored run says, per layer, in words a first-time reader can use.

Every figure is explained where it is printed: the meter (an upper bound on the total variation
between attention over exact and over compressed keys: proved, or holding with probability at
least ``1 - delta`` where the spot check or Tier B's probabilistic branch gave it, counted per kind
from the cells' ``bound_kind`` column, :mod:`witcert.integrations.hf.bound_kind`), *certified* (meter <= tau),
*saturated* (meter >= 0.99: the bound says almost nothing), the true TV (measured against the exact cache
while it is kept), *violations* (true TV above the meter: must be 0). With a gate, each cell's
meter and true TV after repair, the fraction of cells the gate fired on and of visible tokens it
paged in. The riskiest layers and heads are ranked by :data:`witcert.integrations.hf.ranking.RANK_BY`,
the statistic measured to follow the true TV (``benchmarks/ranking.py``). Last, the bytes the caches held
(:class:`~witcert.integrations.hf.memory.MemoryReport`: the cache on the device, the backing store apart).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from witcert.integrations.hf import bound_kind, ranking

TOP = 6  # riskiest layers and heads listed
MEANING = ("The meter is a proved upper bound on how much attention moved: the total variation (TV)\n"
           "between attention over the exact keys and over the compressed keys, for one cell\n"
           "(request, layer, query head, step). 0: attention unchanged; 1: the bound says nothing.")
MEANING_MIXED = ("The meter is an upper bound on how much attention moved: the total variation (TV) between\n"
                 "attention over the exact and over the compressed keys, per cell (request, layer, query head,\n"
                 "step): proved, or holding with probability >= 1 - delta (see 'bounds' below).")
COLUMNS = ("certified: fraction of cells with meter <= tau (their TV is proved <= tau). saturated:\n"
           f"fraction with meter >= {ranking.SATURATED:g}. max true TV: the largest TV measured against the exact "
           "cache (n/a\n"
           "with keep_exact=False). violations: cells whose true TV exceeds their meter (must be 0).")
COLUMNS_MIXED = ("certified: fraction of cells with meter <= tau (TV <= tau: proved, or with probability\n"
                 ">= 1 - delta). prob.: fraction whose bound holds with probability >= 1 - delta. saturated:\n"
                 f"fraction with meter >= {ranking.SATURATED:g}. max true TV: the largest TV measured against the "
                 "exact cache\n(n/a with keep_exact=False). violations: cells whose true TV exceeds their meter "
                 "(must be 0).")
BOUNDS_PROVED = "bounds: {counts} (every cell's meter is a deterministic bound)."
BOUNDS_MIXED = ("bounds: {counts}.\n"
                "  proved: the deterministic meter; with probability >= 1 - delta: the spot check lowered the\n"
                "  meter, or Tier B's sub-Gaussian branch entered it (queries not chosen through the dither).")
READ_WHOLE = ("  {count:,d} checked cells saw no more keys than the check reads and read every one: their bound\n"
              "  is their exact TV (a short context), not a sign of how tight a sampled check is.")
GATE_COLUMNS = ("fired: fraction of cells the gate repaired (meter over tau). paged: mean fraction of a\n"
                "cell's visible tokens paged in exactly. cert. after / max TV after: the same figures after\n"
                "repair (meter recomputed on the repaired cache). violations count before and after repair.")
AUDIT_SHOWN = 8  # requests listed by the audit section (the rest: mon.audit())
AUDIT = ("request audit: each cell picked with probability {rate:g}; a picked cell is bounded by its true TV\n"
         "from its exact keys (keys=None), or by its meter, else a spot check (keys=k), and flagged above\n"
         "tau = {tau:g}. With probability at least 1 - delta = 1 - {delta:g} per request (probabilistic, not a\n"
         "proof): at most M_upper of its N cells have TV above tau. 'flagged if all audited': estimate and exact\n"
         "95% interval of the fraction the audit would flag.")
RANKING = (f"Riskiest layers and heads, by {ranking.RANK_BY} score. The risk score is the raw e-form\n"
           "behind the meter, not clamped at 1; of the statistics measured against the true TV it ranks\n"
           "layers and heads best (docs/results.md, 'Which layers are risky'). An order for triage, not a bound.")
RANKING_SPOT = ("With the spot check too: the deterministic risk score ranked spot-checked runs better than the\n"
                "mean spot bound did (the same measurement), so the ranking does not change with the certificate.")


def _fraction(mask: np.ndarray) -> float:
    return float(np.mean(mask)) if mask.size else float("nan")


def _max(x: np.ndarray) -> float:
    x = x[~np.isnan(x)]
    return float(x.max()) if x.size else float("nan")


def _violations(tv: np.ndarray, meter: np.ndarray) -> int | None:
    known = ~np.isnan(tv) & ~np.isnan(meter)
    return int(np.sum(tv[known] > meter[known])) if known.any() else None


def figures(cells, tau: float) -> dict:
    """The summary's figures of a group of cells (a layer, or every cell) at ``tau``.

    Keys: ``cells``, ``median_meter``, ``max_meter``, ``coverage`` (meter <= tau), ``saturated``,
    ``max_true_tv``, ``violations`` (``None`` without the exact cache), ``proved`` and ``probabilistic``
    (cells of each ``bound_kind``), ``prob_fraction`` (their share), ``max_delta`` (the largest
    ``bound_delta``), ``repaired`` (fraction the
    gate fired on), ``unmetered`` (cells sampled metering left out, when it was on) and, for a gated run, ``paged``, ``coverage_after``, ``max_meter_after``,
    ``max_true_tv_after``, ``violations_after``.
    """
    meter, tv = cells["meter"], cells["true_tv"]
    seen = ~np.isnan(meter)  # a blank row (left padding) sees no token
    bounds = bound_kind.counts(cells)
    row = {"cells": int(seen.sum()), "median_meter": float(np.median(meter[seen])) if seen.any() else float("nan"),
           "max_meter": _max(meter), "coverage": _fraction(meter[seen] <= tau),
           "saturated": _fraction(meter[seen] >= ranking.SATURATED), "max_true_tv": _max(tv),
           "violations": _violations(tv, meter), "repaired": _fraction(cells["repaired"][seen]),
           "proved": bounds.proved, "probabilistic": bounds.probabilistic, "max_delta": bounds.max_delta,
           "prob_fraction": bounds.probabilistic / bounds.cells if bounds.cells else float("nan")}
    if "metered" in cells.columns:  # sampled metering or the audit: the cells left out are counted, never certified
        row["unmetered"] = int(np.sum(~cells["metered"].astype(bool)))
    if "meter_after" in cells.columns:
        after, tv_after = cells["meter_after"], cells["true_tv_after"]
        row.update(paged=float(np.nanmean(cells["paged_fraction"][seen])) if seen.any() else float("nan"),
                   coverage_after=_fraction(after[seen] <= tau), max_meter_after=_max(after),
                   max_true_tv_after=_max(tv_after), violations_after=_violations(tv_after, after))
    return row


def _fmt(x, digits: int = 4) -> str:
    if x is None or x != x:
        return "n/a"
    return f"{x:.{digits}f}"


@dataclass(frozen=True)
class LayerSummary:
    """One row per layer (:func:`figures`), the same figures over every cell, and the riskiest layers and heads.

    ``str()`` prints them with what each column means. ``rows``: dicts with ``layer`` and the
    keys of :func:`figures`; ``total``: the figures of every cell; ``layers`` / ``heads``: the
    :data:`TOP` riskiest (:func:`witcert.integrations.hf.ranking.riskiest` rows, true TV beside
    the meter); ``bounds``: how many cells carry a proved bound and how many one that holds with
    probability ``1 - delta`` (:class:`~witcert.integrations.hf.bound_kind.BoundCounts`); ``spot``,
    ``spot_gate``, ``read_whole``: whether the spot check and the spot-certified gate ran, and how
    many checks read every key. The ranking stays :data:`~witcert.integrations.hf.ranking.RANK_BY`
    under the spot check (measured: :mod:`witcert.integrations.hf.ranking`).
    """

    rows: tuple  # of dicts
    tau: float
    tier: str
    total: dict | None = None
    layers: tuple = ()
    heads: tuple = ()
    spot: bool = False  # the spot check ran (certificate="spot")
    bounds: bound_kind.BoundCounts | None = None  # cells per bound kind (every cell)
    spot_gate: bool = False  # the spot-certified gate decided (its meter after repair may rest on a check)
    read_whole: int = 0  # spot-checked cells whose check read every key they see (bound = exact TV)
    memory: object = None  # witcert.integrations.hf.memory.MemoryReport: the cache and the backing store, in bytes
    audits: tuple = ()  # witcert.audit.RequestAudit per request, when the monitor audits

    @classmethod
    def of(cls, table, tau: float, tier: str, memory=None, audits: tuple = ()) -> "LayerSummary":
        if not len(table):
            return cls((), tau, tier, memory=memory)
        rows = tuple({"layer": int(layer), **figures(table.where(table["layer"] == layer), tau)}
                     for layer in np.unique(table["layer"]))
        return cls(rows, tau, tier, figures(table, tau), tuple(ranking.riskiest(table, ("layer",), TOP)),
                   tuple(ranking.riskiest(table, ("layer", "head"), TOP)), spot=ranking.SPOT_COLUMN in table.columns,
                   bounds=bound_kind.counts(table), spot_gate="spot_gate_checks" in table.columns,
                   read_whole=int(bound_kind.read_every_key(table).sum()), memory=memory,
                   audits=tuple(audits))

    @property
    def gated(self) -> bool:
        return bool(self.rows) and "coverage_after" in self.rows[0]

    @property
    def mixed(self) -> bool:
        """Some cell's bound holds with probability ``1 - delta`` rather than being proved."""
        return self.bounds is not None and self.bounds.probabilistic > 0

    def __str__(self) -> str:
        cells = self.total["cells"] if self.total else 0
        certificate = f"tier {self.tier}" + (" + spot check" if self.spot else "")
        lines = [f"WitCert summary: {certificate}, tau = {self.tau:g}, {cells:,d} cells",
                 MEANING_MIXED if self.mixed else MEANING, ""]
        if not self.rows:
            return "\n".join(lines + ["(no cell measured yet)"])
        lines += self._table() + [COLUMNS_MIXED if self.mixed else COLUMNS] + ([GATE_COLUMNS] if self.gated else [])
        lines += ["", (BOUNDS_MIXED if self.mixed else BOUNDS_PROVED).format(counts=self.bounds.describe())]
        if self.read_whole:
            lines.append(READ_WHOLE.format(count=self.read_whole))
        if "unmetered" in self.total:
            why = "the audit" if self.audits else "sampled metering"
            lines += ["", f"{why}: {self.total['unmetered']:,d} cells left unmetered (no bound, not counted "
                          "in 'cells' or 'certified'; their column 'metered' is False)"]
        if self.gated:
            t = self.total
            lines += ["", f"gate: fired on {t['repaired']:.1%} of cells, paged {t['paged']:.1%} of their "
                          "visible tokens",
                      f"  before repair: {t['coverage']:.1%} certified at tau, max true TV {_fmt(t['max_true_tv'])}",
                      f"  after repair:  {t['coverage_after']:.1%} certified at tau, max true TV "
                      f"{_fmt(t['max_true_tv_after'])}, max meter {_fmt(t['max_meter_after'])}"]
            if self.spot_gate:
                lines.append("  spot-certified gate: a meter after repair holds with probability >= 1 - spot_delta")
        lines += self._audit()
        lines += ["", RANKING] + ([RANKING_SPOT] if self.spot else []) + self._riskiest() + self._memory()
        return "\n".join(lines)

    def _memory(self) -> list[str]:
        if self.memory is None or not self.memory.total.exact_cache:
            return []
        return ["", "Memory (the cache on the device; the backing store, where there is one, apart):",
                *(f"  {line}" for line in self.memory.lines())]

    def _audit(self) -> list[str]:
        if not self.audits:
            return []
        first = self.audits[0]
        lines = ["", AUDIT.format(rate=first.rate, tau=first.tau, delta=first.delta)]
        lines += ["  " + audit.line() for audit in self.audits[:AUDIT_SHOWN]]
        if len(self.audits) > AUDIT_SHOWN:
            lines.append(f"  ... {len(self.audits) - AUDIT_SHOWN} more requests: mon.audit()")
        return lines

    def _table(self) -> list[str]:
        if self.gated:
            head = ["layer", "cells", "median meter", "certified", "max true TV", "fired", "paged", "cert. after",
                    "max TV after", "violations"]
            keys = ["layer", "cells", "median_meter", "coverage", "max_true_tv", "repaired", "paged",
                    "coverage_after", "max_true_tv_after", "violations"]
        else:
            head = ["layer", "cells", "median meter", "max meter", "certified", "saturated", "max true TV",
                    "violations"]
            keys = ["layer", "cells", "median_meter", "max_meter", "coverage", "saturated", "max_true_tv", "violations"]
        if self.mixed:  # which share of the cells is not proved, beside the certified fraction
            at = head.index("certified") + 1
            head.insert(at, "prob.")
            keys.insert(at, "prob_fraction")
        widths = [max(len(h), 5) for h in head]
        lines = [" ".join(h.rjust(w) for h, w in zip(head, widths))]
        for row in (*self.rows, {**self.total, "layer": "all"}):
            lines.append(" ".join(self._cell(row, key).rjust(w) for key, w in zip(keys, widths)))
        return lines

    @staticmethod
    def _cell(row: dict, key: str) -> str:
        value = row.get(key)
        if key == "violations":
            before, after = value, row.get("violations_after")
            return "n/a" if before is None else str(before + (after or 0))
        if key in ("layer", "cells"):
            return str(value)
        digits = 3 if key in ("coverage", "saturated", "repaired", "paged", "coverage_after", "prob_fraction") else 4
        return _fmt(value, digits)

    def _riskiest(self) -> list[str]:
        lines = []
        for label, rows in (("layer", self.layers), ("head", self.heads)):
            for r in rows:
                name = f"L{r['layer']}" + (f" H{r['head']}" if "head" in r else "")
                lines.append(f"  {label:<5} {name:<8} {ranking.RANK_BY} {r['score']:>8.2f}  "
                             f"mean meter {r['mean_meter']:.3f}  "
                             f"mean true TV {_fmt(r['mean_true_tv'])}  "
                             f"max true TV {_fmt(r['max_true_tv'])}")
        return lines

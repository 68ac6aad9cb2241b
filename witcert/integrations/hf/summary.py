"""``Monitor.summary()``: what a monitored run says, per layer, in words a first-time reader can use.

Every figure is explained where it is printed: the meter (a proved upper bound on the total
variation between attention over exact and over compressed keys), *certified* (meter <= tau),
*saturated* (meter >= 0.99: the bound says almost nothing), the true TV (measured against the exact cache
while it is kept), *violations* (true TV above the meter: must be 0). With a gate, each cell's
meter and true TV after repair, the fraction of cells the gate fired on and of visible tokens it
paged in. The riskiest layers and heads are ranked by :data:`witcert.integrations.hf.ranking.RANK_BY`,
the statistic measured to follow the true TV (``benchmarks/ranking.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from witcert.integrations.hf import ranking

TOP = 6  # riskiest layers and heads listed
MEANING = ("The meter is a proved upper bound on how much attention moved: the total variation (TV)\n"
           "between attention over the exact keys and over the compressed keys, for one cell\n"
           "(request, layer, query head, step). 0: attention unchanged; 1: the bound says nothing.")
COLUMNS = ("certified: fraction of cells with meter <= tau (their TV is proved <= tau). saturated:\n"
           f"fraction with meter >= {ranking.SATURATED:g}. max true TV: the largest TV measured against the exact "
           "cache (n/a\n"
           "with keep_exact=False). violations: cells whose true TV exceeds their meter (must be 0).")
GATE_COLUMNS = ("fired: fraction of cells the gate repaired (meter over tau). paged: mean fraction of a\n"
                "cell's visible tokens paged in exactly. cert. after / max TV after: the same figures after\n"
                "repair (meter recomputed on the repaired cache). violations count before and after repair.")
AUDIT_SHOWN = 8  # requests listed by the audit section (the rest: mon.audit())
AUDIT = ("request audit: each cell picked with probability {rate:g}, only picked cells metered; a picked cell is\n"
         "bounded by its meter, else by a spot check, and flagged above tau = {tau:g}. With probability at least\n"
         "1 - delta = 1 - {delta:g} per request (probabilistic, not a proof): at most M_upper of its N cells have\n"
         "TV above tau. 'flagged if all audited': estimate and exact 95% interval of the fraction the audit would flag.")
RANKING = (f"Riskiest layers and heads, by {ranking.RANK_BY} score. The risk score is the raw e-form\n"
           "behind the meter, not clamped at 1; of the statistics measured against the true TV it ranks\n"
           "layers and heads best (docs/results.md, 'Which layers are risky'). An order for triage, not a bound.")


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
    ``max_true_tv``, ``violations`` (``None`` without the exact cache), ``repaired`` (fraction the
    gate fired on), ``unmetered`` (cells sampled metering left out, when it was on) and, for a gated run, ``paged``, ``coverage_after``, ``max_meter_after``,
    ``max_true_tv_after``, ``violations_after``.
    """
    meter, tv = cells["meter"], cells["true_tv"]
    seen = ~np.isnan(meter)  # a blank row (left padding) sees no token
    row = {"cells": int(seen.sum()), "median_meter": float(np.median(meter[seen])) if seen.any() else float("nan"),
           "max_meter": _max(meter), "coverage": _fraction(meter[seen] <= tau),
           "saturated": _fraction(meter[seen] >= ranking.SATURATED), "max_true_tv": _max(tv),
           "violations": _violations(tv, meter), "repaired": _fraction(cells["repaired"][seen])}
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
    the meter).
    """

    rows: tuple  # of dicts
    tau: float
    tier: str
    total: dict | None = None
    layers: tuple = ()
    heads: tuple = ()
    audits: tuple = ()  # witcert.audit.RequestAudit per request, when the monitor audits

    @classmethod
    def of(cls, table, tau: float, tier: str, audits: tuple = ()) -> "LayerSummary":
        if not len(table):
            return cls((), tau, tier)
        rows = tuple({"layer": int(layer), **figures(table.where(table["layer"] == layer), tau)}
                     for layer in np.unique(table["layer"]))
        return cls(rows, tau, tier, figures(table, tau), tuple(ranking.riskiest(table, ("layer",), TOP)),
                   tuple(ranking.riskiest(table, ("layer", "head"), TOP)), tuple(audits))

    @property
    def gated(self) -> bool:
        return bool(self.rows) and "coverage_after" in self.rows[0]

    def __str__(self) -> str:
        cells = self.total["cells"] if self.total else 0
        lines = [f"WitCert summary: tier {self.tier}, tau = {self.tau:g}, {cells:,d} cells", MEANING, ""]
        if not self.rows:
            return "\n".join(lines + ["(no cell measured yet)"])
        lines += self._table() + [COLUMNS] + ([GATE_COLUMNS] if self.gated else [])
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
        lines += self._audit()
        lines += ["", RANKING] + self._riskiest()
        return "\n".join(lines)

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
        digits = 3 if key in ("coverage", "saturated", "repaired", "paged", "coverage_after") else 4
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

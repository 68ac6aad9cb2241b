"""Which bound a cell's meter is: *proved*, or holding with probability at least ``1 - delta``.

Every output of a monitored run (the summary, the JSONL lines, the plot, ``witcert observe``'s
table and report) reads the two label columns this module derives, in this one place, from the
columns the monitor records:

- ``bound_kind``: ``"proved"`` where the reported meter is a deterministic bound (Tier A's witness,
  Tier B's deterministic branch, a spot check that did not lower the meter: the minimum then
  *is* the deterministic meter, or one that read every key and spent no delta: its bound is the
  cell's TV evaluated in fp64 with its rounding enclosed); ``"probabilistic"`` where the meter rests on a statement that
  fails with a small probability: the spot check lowered it (``spot_bound < meter_before_spot``,
  :mod:`witcert.spot.cells`), or Tier B's sub-Gaussian branch entered its radius (a non-adaptive
  call of the dithered cache, ``adaptive`` False, ``tier_b_delta`` > 0); ``"none"`` where no cell
  was metered (a blank row, a cell sampled metering left out).
- ``bound_delta``: the failure probability of the cell's statement (0 for a proved bound, NaN for
  ``"none"``): the sum of the budgets of every probabilistic statement the reported value may rest
  on (``spot_delta``, which includes a spot-certified gate's checks, plus ``tier_b_delta``): a union
  bound (the reasoning of ``L3``), since the meter is a minimum of the two and fails only if one fails.

A probabilistic bound is still an upper bound on the true TV, on an event of probability at least
``1 - bound_delta`` (Tier B: queries that do not depend on the dither; the spot check: any query).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PROVED, PROBABILISTIC, NONE = "proved", "probabilistic", "none"
KIND, DELTA = "bound_kind", "bound_delta"


def _floats(columns, name: str, n: int) -> np.ndarray:
    return np.nan_to_num(np.asarray(columns[name], dtype=np.float64)) if name in columns else np.zeros(n)


def _spot_lowered(columns, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(checked, lowered)``: cells the spot check ran on, and those whose meter it lowered."""
    if "spot_bound" not in columns or "meter_before_spot" not in columns:
        return np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    spot = np.asarray(columns["spot_bound"], dtype=np.float64)
    checked = ~np.isnan(spot)
    return checked, checked & (spot < np.asarray(columns["meter_before_spot"], dtype=np.float64))


def _tier_b_budget(columns, n: int) -> np.ndarray:
    """Tier B's per-cell failure probability where its probabilistic branch was used (0 elsewhere)."""
    budget = _floats(columns, "tier_b_delta", n)
    if "adaptive" in columns:  # an adaptive call used the deterministic branch only
        budget = np.where(np.asarray(columns["adaptive"], dtype=bool), 0.0, budget)
    return budget


def label_columns(columns: dict) -> dict:
    """``{"bound_kind": (n,) str, "bound_delta": (n,) float}`` of a table's columns (see the module docstring).

    ``columns`` needs ``meter``; ``spot_bound``, ``meter_before_spot``, ``spot_delta``, ``adaptive``
    and ``tier_b_delta`` are read where present (a table without them is deterministic).
    """
    meter = np.asarray(columns["meter"], dtype=np.float64)
    n = len(meter)
    checked, lowered = _spot_lowered(columns, n)
    tier_b = _tier_b_budget(columns, n)
    spot_delta = np.where(checked, _floats(columns, "spot_delta", n), 0.0)
    # a check that read every key spent no delta (its bound is the cell's TV in fp64, deterministic)
    probabilistic = (lowered & (spot_delta > 0)) | (tier_b > 0)
    delta = spot_delta + tier_b  # a union: the meter is a minimum
    blank = np.isnan(meter)
    kind = np.where(blank, NONE, np.where(probabilistic, PROBABILISTIC, PROVED))
    return {KIND: kind.astype("<U13"), DELTA: np.where(blank, np.nan, np.where(probabilistic, delta, 0.0))}


def labels_of(table) -> tuple[np.ndarray, np.ndarray]:
    """``(bound_kind, bound_delta)`` of a :class:`~witcert.integrations.hf.telemetry.CellTable`: its own label
    columns, or :func:`label_columns` of its columns when it was built without them."""
    if KIND in table.columns and DELTA in table.columns:
        return np.asarray(table[KIND]), np.asarray(table[DELTA], dtype=np.float64)
    labels = label_columns(table.columns) if len(table) else {KIND: np.array([], "<U13"), DELTA: np.array([])}
    return labels[KIND], labels[DELTA]


@dataclass(frozen=True)
class BoundCounts:
    """How many of a table's metered cells carry each kind of bound, and the largest failure probability."""

    proved: int
    probabilistic: int
    max_delta: float  # over the probabilistic cells (0 when there is none)
    spot: int = 0  # probabilistic cells whose meter the spot check lowered
    tier_b: int = 0  # probabilistic cells of Tier B's sub-Gaussian branch

    @property
    def cells(self) -> int:
        return self.proved + self.probabilistic

    def describe(self) -> str:
        """``"370 proved, 3,950 hold with probability >= 1 - 1e-06 (spot check)"`` (the largest delta of any cell)."""
        if not self.probabilistic:
            return f"{self.proved:,d} proved"
        sources = [name for name, count in (("spot check", self.spot), ("Tier B", self.tier_b)) if count]
        return (f"{self.proved:,d} proved, {self.probabilistic:,d} hold with probability >= 1 - {self.max_delta:.2g} "
                f"({', '.join(sources)})")


def counts(table) -> BoundCounts:
    """The :class:`BoundCounts` of ``table`` (cells with kind ``"none"`` are not counted)."""
    kind, delta = labels_of(table)
    probabilistic = kind == PROBABILISTIC
    n = len(kind)
    _, lowered = _spot_lowered(table.columns, n) if n else (None, np.zeros(0, bool))
    tier_b = _tier_b_budget(table.columns, n) > 0 if n else np.zeros(0, bool)
    return BoundCounts(proved=int(np.sum(kind == PROVED)), probabilistic=int(probabilistic.sum()),
                       max_delta=float(delta[probabilistic].max()) if probabilistic.any() else 0.0,
                       spot=int(np.sum(probabilistic & lowered)), tier_b=int(np.sum(probabilistic & tier_b)))


def read_every_key(table) -> np.ndarray:
    """Spot-checked cells whose check read every key the query could see (bool per cell).

    A query at position ``p`` sees at most ``p + 1`` keys; a check that read that many read them
    all, so its bound is the cell's exact TV up to rounding (a prompt shorter than ``spot_keys``), and so did one
    that spent no delta (its key group read whole, :mod:`witcert.spot.groups`):
    on a plot it looks perfectly tight, and it says nothing about how tight a sampled check is.
    """
    if "spot_keys" not in table.columns or "spot_bound" not in table.columns or not len(table):
        return np.zeros(len(table), dtype=bool)
    checked = ~np.isnan(np.asarray(table["spot_bound"], np.float64))
    whole = np.asarray(table["spot_keys"], np.float64) >= np.asarray(table["pos"], np.float64) + 1
    if "spot_delta" in table.columns:  # a check that spent no delta read every key (its key group's, shared)
        whole |= np.asarray(table["spot_delta"], np.float64) == 0
    return checked & whole

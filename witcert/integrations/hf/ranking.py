"""Risk rankings of layers and heads: which statistic of a group's cells orders the groups like their true TV.

The meter is a proved bound per cell, but a poor *ranking* statistic where it saturates: at 4
bits and below most cells have meter 1, so the mean meter of a layer says little about how much
its attention really moved. The raw risk score (the unclamped e-form ``1/2 (A^2 - 1)``, no
guarantee above 1) keeps ordering cells past saturation; its logarithm (the log domain, where a
few overflowing cells do not swamp the mean) is what :data:`RANK_BY` uses. The choice is measured,
not assumed: ``benchmarks/ranking.py`` ranks the layers and heads of SmolLM2 by every statistic of
:data:`STATISTICS` and by their mean true TV (Spearman correlation and top-6 overlap; docs/results.md,
"Which layers are risky"). A ranking is a triage order, never a certificate: the per-cell meter
is the bound.

The spot check (``witcert.monitor(..., certificate="spot")``) records ``spot_bound`` on the cells
it checks; where a table has that column, :data:`STATISTICS` includes ``"mean spot bound"`` (its
mean over the checked cells), measured like the others by ``benchmarks/ranking.py --certificate spot``.
Under the spot check the ranking still uses :data:`RANK_BY`, the deterministic risk score: on
spot-checked runs it followed the true TV better than the mean spot bound did (mean Spearman
0.82 against 0.70, ``benchmarks/results/ranking-spot.json``, on the results page), and it ranks
every cell, the unchecked ones too. The spot bound is the per-cell statement; the ranking only
says where to look first.
"""
from __future__ import annotations

import numpy as np

SATURATED = 0.99  # a meter this close to 1 says almost nothing (the sub-1 terms keep it from reaching 1 exactly)
_LOG_FLOOR, _LOG_CEIL = 1e-300, 1e300  # log risk of an exact cell (0) or an overflowed one (inf) stays finite


def log_risk(risk: np.ndarray) -> np.ndarray:
    """``log`` of the raw risk score, clipped to a finite range (0 and ``inf`` have finite logs)."""
    return np.log(np.clip(np.nan_to_num(risk, nan=_LOG_FLOOR, posinf=_LOG_CEIL), _LOG_FLOOR, _LOG_CEIL))


def _mean_checked(x: np.ndarray) -> float:
    """Mean over the entries that are not NaN (the checked cells); 1 (no information) when none is."""
    x = x[~np.isnan(x)]
    return float(x.mean()) if x.size else 1.0


STATISTICS = {
    "mean meter": lambda cells: np.nanmean(cells["meter"]),
    "max meter": lambda cells: np.nanmax(cells["meter"]),
    "median meter": lambda cells: np.nanmedian(cells["meter"]),
    "fraction saturated": lambda cells: np.mean(cells["meter"] >= SATURATED),
    "mean raw risk": lambda cells: np.nanmean(np.nan_to_num(cells["risk"], posinf=_LOG_CEIL)),
    "mean log risk": lambda cells: np.mean(log_risk(cells["risk"])),
    "median log risk": lambda cells: np.median(log_risk(cells["risk"])),
    "mean log c_max": lambda cells: np.mean(np.log(np.clip(np.nan_to_num(cells["c_max"], nan=0.0), _LOG_FLOOR, None))),
    # the spot check's bound (column SPOT_COLUMN, NaN on unchecked cells), used only where a table has it
    "mean spot bound": lambda cells: _mean_checked(cells[SPOT_COLUMN]),
}
SPOT_COLUMN = "spot_bound"

RANK_BY = "mean log risk"  # the measured best (benchmarks/ranking.py); a key of STATISTICS


def available(table) -> list[str]:
    """The names of :data:`STATISTICS` that ``table``'s columns allow (the spot estimate only where recorded)."""
    return [name for name in STATISTICS if name != "mean spot bound" or SPOT_COLUMN in table.columns]


def groups(table, by: tuple[str, ...]) -> tuple[np.ndarray, list]:
    """The distinct values of the ``by`` columns, (groups, len(by)) ints, and each group's cells (a table each)."""
    keys = np.stack([table[name].astype(np.int64) for name in by], axis=1)
    values, inverse = np.unique(keys, axis=0, return_inverse=True)
    return values, [table.where(inverse.reshape(-1) == index) for index in range(len(values))]


def group_rows(table, by: tuple[str, ...]) -> list[dict]:
    """One row per group of cells with equal ``by`` columns (``("layer",)`` or ``("layer", "head")``).

    Each row: the ``by`` values, ``cells``, the ranking statistic ``score`` (:data:`RANK_BY`),
    ``mean_meter``, ``max_meter``, ``saturated`` (fraction of cells with meter >= :data:`SATURATED`),
    and the true TV's ``mean_true_tv`` and ``max_true_tv`` (NaN without the exact cache).
    """
    table = table.where(~np.isnan(table["meter"])) if len(table) else table  # blank rows see no token
    if not len(table):
        return []
    rows = []
    for values, cells in zip(*groups(table, by)):
        tv = cells["true_tv"][~np.isnan(cells["true_tv"])]
        rows.append({**{name: int(v) for name, v in zip(by, values)}, "cells": len(cells),
                     "score": float(STATISTICS[RANK_BY](cells)),
                     "mean_meter": float(np.nanmean(cells["meter"])), "max_meter": float(np.nanmax(cells["meter"])),
                     "saturated": float(np.mean(cells["meter"] >= SATURATED)),
                     "mean_true_tv": float(tv.mean()) if tv.size else float("nan"),
                     "max_true_tv": float(tv.max()) if tv.size else float("nan")})
    return rows


def riskiest(table, by: tuple[str, ...], top: int | None = None) -> list[dict]:
    """The :func:`group_rows` of ``table`` in decreasing :data:`RANK_BY` order (the first ``top``)."""
    rows = sorted(group_rows(table, by), key=lambda row: -row["score"])
    return rows if top is None else rows[:top]

"""Per-request audit results from counts (registry AU): ``N``, picked, flagged and the flagged cells per request.

:func:`requests_of` reads one row per cell; a serving integration keeps counts instead
(a running request's cells number in the millions). Both give the same statement: the exact binomial upper
limit :func:`~witcert.audit.limit.upper_limit` at ``delta_s`` and the interval
:func:`~witcert.audit.limit.flagged_interval`, at the exact pick probability
:func:`~witcert.audit.picks.pick_probability`; :func:`requests_of_counts` is the one place they are formed.
"""
from __future__ import annotations

import numpy as np

from witcert.audit.limit import LEVEL, flagged_interval, upper_limit
from witcert.audit.picks import pick_probability
from witcert.audit.report import COLUMNS, RequestAudit
from witcert.audit.settings import Audit


def requests_of_counts(requests, cells, picked, flagged, flagged_cells, settings: Audit,
                       seed: int | None = None) -> tuple[RequestAudit, ...]:
    """One :class:`RequestAudit` per request from its counts (``WitCert.measure_auditUpper_lt_le``'s statement).

    Parameters
    ----------
    requests : sequence of int
        The requests' numbers (``RequestAudit.request``).
    cells, picked, flagged : sequences of int
        Per request: its cells ``N``, how many were picked, how many of the picked were flagged.
    flagged_cells : sequence of sequences of ``(layer, head, pos)``
        Per request, its flagged cells (as many as ``flagged``).
    settings : Audit
        The settings the cells were audited under (its rate, ``delta_sampling``, ``tau``, ``delta``).
    seed : int or None
        Replays the picks (recorded as is).
    """
    n = np.asarray(cells, dtype=np.int64).reshape(-1)
    picks = np.asarray(picked, dtype=np.int64).reshape(-1)
    flags = np.asarray(flagged, dtype=np.int64).reshape(-1)
    if not (len(requests) == n.size == picks.size == flags.size == len(flagged_cells)):
        raise ValueError("requests, cells, picked, flagged, flagged_cells: one entry per request each, got lengths "
                         f"{[len(requests), n.size, picks.size, flags.size, len(flagged_cells)]}")
    if n.size and (bool((flags > picks).any()) or bool((picks > n).any()) or int(flags.min()) < 0):
        raise ValueError("flagged, picked, cells: need 0 <= flagged <= picked <= cells per request")
    if [len(c) for c in flagged_cells] != flags.tolist():
        raise ValueError("flagged_cells: each request needs exactly `flagged` cells")
    if not n.size:
        return ()
    rate = pick_probability(settings.rate)  # the exact probability a cell is picked with (within 2^-32 of the rate)
    m_upper = upper_limit(flags, n, rate, settings.delta_sampling)
    estimate, low, high = flagged_interval(flags, n, rate, LEVEL)
    return tuple(
        RequestAudit(request=int(requests[i]), N=int(n[i]), picked=int(picks[i]), flagged=int(flags[i]),
                     M_upper=int(m_upper[i]), fraction_upper=float(m_upper[i] / n[i]) if n[i] else 0.0,
                     tau=settings.tau, delta=settings.delta, rate=settings.rate, estimate=float(estimate[i]),
                     interval=(float(low[i]), float(high[i])), level=LEVEL,
                     flagged_cells=tuple(tuple(int(v) for v in cell) for cell in flagged_cells[i]), seed=seed)
        for i in range(n.size))


def requests_of(columns, settings: Audit, seed: int | None = None) -> tuple[RequestAudit, ...]:
    """One :class:`RequestAudit` per request with at least one cell, in request order.

    ``columns``: a mapping with the :data:`COLUMNS` arrays (a :class:`~witcert.integrations.hf.telemetry.CellTable`
    or its ``columns``); ``settings`` the :class:`~witcert.audit.settings.Audit` the cells were audited under. The
    binomial limits use the exact pick probability :func:`~witcert.audit.picks.pick_probability` (the law of the
    picks, ``WitCert.measure_auditUpper_lt_le``'s hypothesis), within ``2^-32`` of ``settings.rate``.
    """
    missing = [name for name in COLUMNS if name not in columns]
    if missing:
        raise ValueError(f"columns: the cells carry no audit columns {missing} (was the monitor given audit=?)")
    request = np.asarray(columns["request"]).astype(np.int64)
    if not request.size:
        return ()
    ids, of = np.unique(request, return_inverse=True)
    audited = np.asarray(columns["audited"]).astype(bool)
    flagged = np.asarray(columns["flagged"]).astype(bool) & audited
    n = np.bincount(of, minlength=ids.size)
    picks = np.bincount(of, weights=audited, minlength=ids.size).astype(np.int64)
    flags = np.bincount(of, weights=flagged, minlength=ids.size).astype(np.int64)
    where = np.flatnonzero(flagged)
    cells = np.stack([np.asarray(columns[name])[where].astype(np.int64) for name in ("layer", "head", "pos")], -1)
    owner = of[where]
    return requests_of_counts(ids.tolist(), n, picks, flags, [cells[owner == i].tolist() for i in range(ids.size)],
                              settings, seed)

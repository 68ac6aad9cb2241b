"""Bound and flag the picked cells of one metering pass (registry AU, with SCO for the spot check).

A picked cell's bound is its deterministic meter where that certifies (``<= tau``: its TV is then
proved ``<= tau``, no randomness), else ``min(meter, spot bound)`` with a spot check at the cell's
``delta_c`` (:mod:`witcert.audit.budget`); it is *flagged* when the bound exceeds ``tau``. On the
event that none of these checks fails, a picked cell whose TV exceeds ``tau`` has a bound above
``tau`` and is flagged: the event the binomial limit (:mod:`witcert.audit.limit`) needs.

:func:`spot_bounds` is the one place the audit calls the spot check: the batched form
(:func:`witcert.spot.check_cells`), up to ``keys`` exact keys each in rounds that stop at a bound ``<= tau``
(:mod:`witcert.spot.rounds`, registry SCR: the rounds split the cell's ``delta_c``; a cell that sees at most a
round's budget is read whole: its true TV, no failure probability). The cells over one key history (a layer, row
and kv head: the query heads over a kv head, the picked steps of a flush) are read whole together where that history
is at most ``keys`` per checked cell of the group (:mod:`witcert.spot.groups`): one dense read of exact keys instead
of rounds of draws, each cell's true TV rounded up, no failure probability. The audit feeds nothing back into the model,
so a pass records its checked cells (:class:`PendingChecks`) and every layer's are checked in one call
when the flush or the forward call ends, as :mod:`witcert.spot.deferred` does for the spot certificate:
one batched check per flush instead of one per layer.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from witcert.spot.batched import check_cells
from witcert.spot.deferred import _Layers as StackedSources


def spot_bounds(scores: torch.Tensor, radii: torch.Tensor, source, deltas: torch.Tensor, keys: int, tau: float,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(bounds, keys read, delta spent)`` (K,) fp64 of the spot checks of ``K`` cells (registry SCO).

    ``scores``/``radii`` (K, S) the cells' compressed logits and per-token radii; ``source`` their exact logits
    (:mod:`witcert.spot.gather`: ``source.logits(cells, tokens)``); ``deltas`` (K,) each check's failure
    probability; ``keys`` the most exact keys each may read; ``tau`` where a cell stops reading (its flag's
    threshold); ``generator`` the audit's own randomness.
    """
    result = check_cells(scores, radii, source, keys=keys, delta=deltas, tau=tau, generator=generator,
                         read_groups=True)
    return result.bound, result.keys_read.to(torch.float64), result.delta


@dataclass(frozen=True)
class PickedBounds:
    """The audit's columns of one pass, (B, H, T) each: ``audited`` (bool, a picked cell that sees a token),
    ``flagged`` (bool, its bound exceeds ``tau``), ``audit_bound`` (NaN where not audited), ``audit_check_delta``
    (the failure probability its spot check spent; 0 where the meter certified or the check read every key, NaN
    where not audited) and ``audit_keys`` (exact keys its check read)."""

    audited: torch.Tensor
    flagged: torch.Tensor
    audit_bound: torch.Tensor
    audit_delta: torch.Tensor
    audit_keys: torch.Tensor

    def columns(self) -> dict:
        return {"audited": self.audited, "flagged": self.flagged, "audit_bound": self.audit_bound,
                "audit_check_delta": self.audit_delta, "audit_keys": self.audit_keys}


@dataclass
class _Checked:
    """One pass's checked cells until :meth:`PendingChecks.run`: their logits, radii, exact-logit source, each
    check's ``delta_c`` and deterministic meter, and where they sit in the recorded batch."""

    at: torch.Tensor  # (K, 3) the cells in the pass's gathered (B, Hkv, n) grid
    scores: torch.Tensor  # (K, S)
    radii: torch.Tensor  # (K, S)
    source: object
    deltas: torch.Tensor  # (K,)
    meter: torch.Tensor  # (K,)
    where: tuple | None = None  # (rows, heads, columns) of the cells in the batch's (B, Hq, T) grid
    batch: object = None  # the recorded CellBatch (its audit columns are written by run())


@dataclass
class PendingChecks:
    """The checked cells of a request's passes, checked together by :meth:`run` (the flush's or call's end)."""

    parts: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, part: _Checked) -> _Checked:
        with self.lock:
            self.parts.append(part)
        return part

    def run(self, keys: int, tau: float, generator: torch.Generator) -> None:
        """Check every recorded cell at once and write bound, flag, delta spent and keys read into its batch."""
        with self.lock:
            parts, self.parts = [p for p in self.parts if p.batch is not None], [p for p in self.parts
                                                                                 if p.batch is None]
        if not parts:
            return
        spot, read, spent = spot_bounds(torch.cat([p.scores for p in parts]), torch.cat([p.radii for p in parts]),
                                        StackedSources([p.source for p in parts]),
                                        torch.cat([p.deltas for p in parts]), keys, tau, generator)
        first = 0
        for part in parts:
            at = slice(first, first + part.meter.numel())
            first = at.stop
            bound = torch.minimum(part.meter, spot[at])
            columns = part.batch.extra
            columns["audit_bound"][part.where] = bound
            columns["flagged"][part.where] = bound > tau
            columns["audit_check_delta"][part.where] = spent[at]
            columns["audit_keys"][part.where] = read[at]


def bound_picked(picked: torch.Tensor, meter: torch.Tensor, blank: torch.Tensor, radii: torch.Tensor,
                 deltas: torch.Tensor, checks: Callable[[torch.Tensor], tuple], tau: float,
                 pending: PendingChecks) -> tuple[PickedBounds, _Checked | None]:
    """Bound and flag the ``picked`` cells of a pass (see the module docstring); the cells whose meter exceeds
    ``tau`` are recorded in ``pending`` (returned, to be told their batch) and stand at their meter, flagged,
    until :meth:`PendingChecks.run` writes their checked bounds.

    ``picked``, ``blank`` bool and ``meter`` (B, H, T): the pass's picks, rows that see no token and the
    deterministic meter (valid for every query); ``radii`` (B, H, T, S); ``deltas`` (B, H, T) each cell's
    ``delta_c``; ``checks(at)`` the compressed logits ``(M, S)`` and exact-logit source of the cells ``at``
    (M, 3) (:meth:`witcert.spot.cells.SpotSettings.cells`).
    """
    meter = meter.detach().cpu().to(torch.float64)
    audited = (picked & ~blank).cpu()
    checked = audited & ~(meter <= tau)
    bound = torch.where(audited, meter, torch.nan)
    delta_used = torch.where(audited, 0.0, torch.nan).to(torch.float64)
    keys_read = torch.zeros(meter.shape, dtype=torch.float64)
    part = None
    at = checked.nonzero()  # (M, 3)
    if at.numel():
        where = tuple(at.T)
        scores, source = checks(at)
        part = pending.add(_Checked(at, scores, radii.detach()[checked.to(radii.device)].cpu().to(torch.float64), source,
                                    deltas[where].to(torch.float64), meter[where]))
    return PickedBounds(audited, audited & (bound > tau), bound, delta_used, keys_read), part

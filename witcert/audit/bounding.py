"""Bound and flag the picked cells of one metering pass (registry AU, with SCO for the spot check).

A picked cell's bound is its deterministic meter where that certifies (``<= tau``: its TV is then
proved ``<= tau``, no randomness), else ``min(meter, spot bound)`` with a spot check at the cell's
``delta_c`` (:mod:`witcert.audit.budget`); it is *flagged* when the bound exceeds ``tau``. On the
event that none of these checks fails, a picked cell whose TV exceeds ``tau`` has a bound above
``tau`` and is flagged: the event the binomial limit (:mod:`witcert.audit.limit`) needs.

:func:`spot_bounds` is the one place the audit calls the spot check: today the one-cell API
(:func:`witcert.spot.spot_check` through a :class:`~witcert.spot.cells.ExactReaders`), cell by cell.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from witcert.spot.one_sided import spot_check


def spot_bounds(scores: torch.Tensor, radii: torch.Tensor, readers, cells: list[tuple[int, int, int]],
                deltas: list[float], keys: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bounds, keys read)`` (K,) fp64 of the spot checks of ``cells`` (registry SCO).

    ``scores``/``radii`` (B, H, T, S) the compressed logits and per-token radii of the pass; ``readers`` its
    :class:`~witcert.spot.cells.ExactReaders` (``readers.cell(b, h, t)``); ``deltas`` each check's failure
    probability; ``keys`` the exact keys each may read; ``generator`` the audit's own randomness.
    """
    bounds = torch.empty(len(cells), dtype=torch.float64)
    keys_read = torch.zeros(len(cells), dtype=torch.float64)
    for i, ((b, h, t), delta) in enumerate(zip(cells, deltas)):
        result = spot_check(scores[b, h, t], radii[b, h, t], readers.cell(b, h, t), keys=keys, delta=delta,
                            generator=generator)
        bounds[i], keys_read[i] = result.bound, result.keys_read
    return bounds, keys_read


@dataclass(frozen=True)
class PickedBounds:
    """The audit's columns of one pass, (B, H, T) each: ``audited`` (bool, a picked cell that sees a token),
    ``flagged`` (bool, its bound exceeds ``tau``), ``audit_bound`` (NaN where not audited), ``audit_check_delta``
    (the failure probability of its spot check; 0 where the meter certified, NaN where not audited) and
    ``audit_keys`` (exact keys its check read)."""

    audited: torch.Tensor
    flagged: torch.Tensor
    audit_bound: torch.Tensor
    audit_delta: torch.Tensor
    audit_keys: torch.Tensor

    def columns(self) -> dict:
        return {"audited": self.audited, "flagged": self.flagged, "audit_bound": self.audit_bound,
                "audit_check_delta": self.audit_delta, "audit_keys": self.audit_keys}


def bound_picked(picked: torch.Tensor, meter: torch.Tensor, blank: torch.Tensor, scores: torch.Tensor,
                 radii: torch.Tensor, deltas: torch.Tensor, readers: Callable[[], object], tau: float, keys: int,
                 generator: torch.Generator) -> PickedBounds:
    """Bound and flag the ``picked`` cells of a pass (see the module docstring).

    ``picked``, ``blank`` bool and ``meter`` (B, H, T): the pass's picks, rows that see no token and the
    deterministic meter (valid for every query); ``scores``, ``radii`` (B, H, T, S); ``deltas`` (B, H, T) each
    cell's ``delta_c``; ``readers()`` builds the pass's exact-key readers (called only when a check runs).
    """
    meter = meter.detach().cpu().to(torch.float64)
    audited = (picked & ~blank).cpu()
    checked = audited & ~(meter <= tau)
    bound = torch.where(audited, meter, torch.nan)
    delta_used = torch.where(audited, 0.0, torch.nan).to(torch.float64)
    keys_read = torch.zeros(meter.shape, dtype=torch.float64)
    cells = [tuple(cell) for cell in checked.nonzero().tolist()]
    if cells:
        wanted = [float(deltas[cell]) for cell in cells]
        spot, read = spot_bounds(scores.detach().cpu(), radii.detach().cpu(), readers(), cells, wanted, keys,
                                 generator)
        where = checked.nonzero(as_tuple=True)
        bound[where] = torch.minimum(meter[where], spot)
        delta_used[where] = torch.tensor(wanted, dtype=torch.float64)
        keys_read[where] = read
    return PickedBounds(audited, audited & (bound > tau), bound, delta_used, keys_read)

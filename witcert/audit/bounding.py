"""Bound and flag the picked cells of one metering pass (registry AU, with SCO for the spot check).

A picked cell's bound is its deterministic meter where that certifies (``<= tau``: its TV is then
proved ``<= tau``, no randomness), else ``min(meter, spot bound)`` with a spot check at the cell's
``delta_c`` (:mod:`witcert.audit.budget`); it is *flagged* when the bound exceeds ``tau``. On the
event that none of these checks fails, a picked cell whose TV exceeds ``tau`` has a bound above
``tau`` and is flagged: the event the binomial limit (:mod:`witcert.audit.limit`) needs.

:func:`spot_bounds` is the one place the audit calls the spot check: the batched form
(:func:`witcert.spot.check_cells`), every checked cell of the pass at once, one round of ``keys`` exact keys
each (a cell that sees at most ``keys`` tokens is read whole: its true TV, no failure probability).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from witcert.spot.batched import check_cells


def spot_bounds(scores: torch.Tensor, radii: torch.Tensor, source, deltas: torch.Tensor, keys: int,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(bounds, keys read, delta spent)`` (K,) fp64 of the spot checks of ``K`` cells (registry SCO).

    ``scores``/``radii`` (K, S) the cells' compressed logits and per-token radii; ``source`` their exact logits
    (:mod:`witcert.spot.gather`: ``source.logits(cells, tokens)``); ``deltas`` (K,) each check's failure
    probability; ``keys`` the exact keys each may read; ``generator`` the audit's own randomness.
    """
    result = check_cells(scores, radii, source, keys=keys, delta=deltas, generator=generator)
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


def bound_picked(picked: torch.Tensor, meter: torch.Tensor, blank: torch.Tensor, radii: torch.Tensor,
                 deltas: torch.Tensor, checks: Callable[[torch.Tensor], tuple], tau: float, keys: int,
                 generator: torch.Generator) -> PickedBounds:
    """Bound and flag the ``picked`` cells of a pass (see the module docstring).

    ``picked``, ``blank`` bool and ``meter`` (B, H, T): the pass's picks, rows that see no token and the
    deterministic meter (valid for every query); ``radii`` (B, H, T, S); ``deltas`` (B, H, T) each cell's
    ``delta_c``; ``checks(at)`` the compressed logits ``(M, S)`` and exact-logit source of the cells ``at``
    (M, 3) (called only when a check runs; :meth:`witcert.spot.cells.SpotSettings.cells`).
    """
    meter = meter.detach().cpu().to(torch.float64)
    audited = (picked & ~blank).cpu()
    checked = audited & ~(meter <= tau)
    bound = torch.where(audited, meter, torch.nan)
    delta_used = torch.where(audited, 0.0, torch.nan).to(torch.float64)
    keys_read = torch.zeros(meter.shape, dtype=torch.float64)
    at = checked.nonzero()  # (M, 3)
    if at.numel():
        where = tuple(at.T)
        scores, source = checks(at)
        spot, read, spent = spot_bounds(scores, radii.detach()[checked.to(radii.device)].cpu(), source,
                                        deltas[where].to(torch.float64), keys, generator)
        bound[where] = torch.minimum(meter[where], spot)
        delta_used[where], keys_read[where] = spent, read
    return PickedBounds(audited, audited & (bound > tau), bound, delta_used, keys_read)

"""The spot-check budget of an audited request (registry AU, SCD; spec ``witcert.spec.audit.check_delta``).

The statement's failure probability is ``delta_s + sum_cells P(picked) delta_c(cell)``: a cell's check
can only fail if the cell was picked, and the union runs over the picked cells. ``N``, and so the
expected number of picks ``r N``, is known only when an open-ended request ends, so the budget is
fixed per step instead: the cells at step ``k >= 1`` of the request (its ``k``-th query position
metered) share ``delta_spot 6 / (pi^2 k^2)`` (:func:`witcert.spot.delta_at_step`,
``WitCert.sum_step_allocation_le``), ``L Hq`` cells per step and request row, so each picked cell's
check runs at::

    delta_c(k) = delta_spot 6 / (pi^2 k^2) / (L Hq) / r'

with ``r'`` the true pick probability (:func:`witcert.audit.picks.pick_probability`, at least ``r``).
Then ``sum_cells r' delta_c <= delta_spot`` however long the request runs, and the statement holds
at ``1 - delta_s - delta_spot = 1 - delta``. ``delta_c`` is capped at :data:`MAX_CHECK_DELTA` (a
smaller ``delta_c`` only spends less) and rounded down by a relative ``1e-12`` so the float sum
never passes ``delta_spot``.
"""
from __future__ import annotations

import torch

from witcert.spot.budget import delta_at_step

MAX_CHECK_DELTA = 0.5
"""Largest failure probability of one check (a tiny rate would otherwise ask for ``delta_c >= 1``)."""
ROUND_DOWN = 1 - 1e-12


def check_delta(delta_spot: float, step: int, cells_per_step: int, pick_probability: float) -> float:
    """``delta_c`` of a picked cell at ``step >= 1`` (see the module docstring)."""
    if not 0.0 < pick_probability <= 1.0:
        raise ValueError(f"pick_probability must lie in (0, 1], got {pick_probability!r}")
    share = delta_at_step(delta_spot, step, cells_per_step) / pick_probability
    return min(MAX_CHECK_DELTA, share * ROUND_DOWN)


def check_deltas(delta_spot: float, steps: torch.Tensor, cells_per_step: int, pick_probability: float) -> torch.Tensor:
    """:func:`check_delta` of each entry of ``steps`` (an int tensor, every entry ``>= 1``), fp64, same shape."""
    distinct = {int(k): check_delta(delta_spot, int(k), cells_per_step, pick_probability)
                for k in torch.unique(steps).tolist()}
    flat = torch.tensor([distinct[int(k)] for k in steps.reshape(-1).tolist()], dtype=torch.float64)
    return flat.reshape(steps.shape)

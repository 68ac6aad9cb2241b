"""The spot check's failure budget per cell, from a request-level ``delta_req`` (registry SCD, L3).

Cells known in advance share ``delta_req`` equally; an open-ended generation gives decode step
``k >= 1`` the share ``6 / (pi^2 k^2)`` (``sum_k 6/(pi^2 k^2) = 1``, ``WitCert.sum_step_allocation_le``),
split over the step's cells. By Lemma 3 the union over every cell stays within ``delta_req``.
:class:`RequestBudget` is that allocation as the monitor's ``spot_delta``.
"""
import math
from dataclasses import dataclass


def _check_probability(delta_req: float) -> None:
    if not 0 < delta_req < 1:
        raise ValueError(f"delta_req: expected a probability in (0, 1), got {delta_req!r}")


def _check_count(name: str, n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{name}: expected a positive int, got {n!r}")


def delta_per_cell(delta_req: float, n_cells: int) -> float:
    """``delta_req / n_cells``: every cell of the request is known in advance (spec ``delta_per_cell``)."""
    _check_probability(delta_req)
    _check_count("n_cells", n_cells)
    return delta_req / n_cells


def delta_at_step(delta_req: float, step: int, cells_per_step: int) -> float:
    """``delta_req 6 / (pi^2 k^2) / cells_per_step`` for decode step ``k = step >= 1`` (spec ``delta_at_step``)."""
    _check_probability(delta_req)
    _check_count("step", step)
    _check_count("cells_per_step", cells_per_step)
    return delta_req * 6 / (math.pi ** 2 * step ** 2) / cells_per_step


@dataclass(frozen=True)
class RequestBudget:
    """A request-level failure budget for the monitor's spot checks: ``spot_delta=RequestBudget(delta_req)``.

    Called with the request's metered decode step ``k >= 1`` and the cells that step may check (layers x query
    heads x queries of one request), it returns each cell's share, :func:`delta_at_step`: by Lemma 3 every
    spot statement of the request, over any number of steps, fails with probability at most ``delta_req``.
    """

    delta_req: float

    def __post_init__(self):
        _check_probability(self.delta_req)

    def __call__(self, step: int, cells: int) -> float:
        return delta_at_step(self.delta_req, step, cells)

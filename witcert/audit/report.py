"""Per-request audit results from a monitor's cell columns (``mon.audit()``, the summary, a JSONL file).

Every cell a request's calls produced is one row of the cell table, picked or not, so a request's
``N`` is its row count, ``picked`` its rows with ``audited`` and ``flagged`` its rows with ``flagged``;
:func:`requests_of` needs nothing else, and a JSONL file of the cells (``mon.write_jsonl``) carries
the same columns. A row that sees no token (left padding inside a multi-token chunk) counts in
``N``: it has no attention to move, so it is never above ``tau``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from witcert.audit.settings import Audit

COLUMNS = ("request", "layer", "head", "pos", "audited", "flagged")
"""The cell columns :func:`requests_of` reads."""


@dataclass(frozen=True)
class RequestAudit:
    """What the audit says about one request (registry AU).

    With probability at least ``1 - delta``: at most ``M_upper`` of the request's ``N`` cells (layer, query
    head, step) have attention TV above ``tau``; ``fraction_upper = M_upper / N``. ``picked`` cells were
    bounded, ``flagged`` of them above ``tau`` (``flagged_cells``: their ``(layer, head, pos)``, ``pos`` the
    cell's query position). ``estimate`` and ``interval`` (at ``level``) describe the fraction of cells the
    audit would flag if it picked every cell: flags include cells whose bound is loose, so they estimate an
    upper side of the fraction above ``tau``, not the fraction itself. ``seed`` replays the picks.
    """

    request: int
    N: int
    picked: int
    flagged: int
    M_upper: int
    fraction_upper: float
    tau: float
    delta: float
    rate: float
    estimate: float
    interval: tuple[float, float]
    level: float
    flagged_cells: tuple[tuple[int, int, int], ...]
    seed: int | None = None

    def as_dict(self) -> dict:
        """A JSON-ready dict (``flagged_cells`` as lists)."""
        out = asdict(self)
        out["interval"] = list(self.interval)
        out["flagged_cells"] = [list(cell) for cell in self.flagged_cells]
        return out

    def line(self) -> str:
        """One line for a terminal."""
        low, high = self.interval
        return (f"request {self.request}: at most {self.fraction_upper:.3f} of {self.N:,d} cells above tau "
                f"(M_upper {self.M_upper:,d}; {self.picked:,d} picked, {self.flagged:,d} flagged; flagged if all "
                f"audited {self.estimate:.3f} [{low:.3f}, {high:.3f}])")

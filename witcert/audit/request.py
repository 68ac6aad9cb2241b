"""One request under audit while it runs: its picks, its steps' spot budget and its own spot randomness.

The integration creates one :class:`AuditedRequest` per monitored cache (its batch rows are its
requests) and hands it to every metering pass of that cache, in a step or at a deferred flush:

1. :meth:`AuditedRequest.start` at every attention call that reads the compressed cache: the first
   call's first query position is the request's step 1 (fixed by the generation before any pick);
2. :meth:`AuditedRequest.picks`: the pass's picked cells (:mod:`witcert.audit.picks`);
3. :meth:`AuditedRequest.bound`: bound and flag them (:mod:`witcert.audit.bounding`) at the
   ``delta_c`` of their steps (:mod:`witcert.audit.budget`).

Nothing here depends on another request: the picks are keyed by request id, the step count and the
spot generator are this object's own.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from witcert.audit.bounding import PendingChecks, PickedBounds, bound_picked
from witcert.audit.budget import check_deltas
from witcert.audit.picks import picked, pick_probability
from witcert.audit.settings import Audit


class AuditedRequest:
    """The audit of the requests ``rows`` (one monitored cache) of a model with ``layers`` layers and
    ``query_heads`` query heads, under ``settings`` and the monitor's audit ``seed``."""

    def __init__(self, settings: Audit, seed: int, rows: tuple[int, ...], layers: int, query_heads: int):
        self.settings, self.seed, self.rows = settings, seed, tuple(rows)
        self.cells_per_step = layers * query_heads  # cells of one request row at one query position
        self.layers, self.query_heads = layers, query_heads
        self.origin: int | None = None  # query position of step 1
        entropy = np.random.SeedSequence(entropy=seed, spawn_key=(self.rows[0],)).generate_state(2, np.uint32)
        self.generator = torch.Generator().manual_seed(int(entropy[0]) | (int(entropy[1]) & 0x7FFFFFFF) << 32)
        self._lock = threading.Lock()
        self._picks: tuple = (None, None)  # (positions key, picks of every layer): one Philox call per pass
        self.pending = PendingChecks()  # checked cells until run_checks (one batched check per flush or call)

    def start(self, first_position: int) -> None:
        """A call whose first query sits at ``first_position`` reads the compressed cache."""
        if self.origin is None:
            with self._lock:
                if self.origin is None:
                    self.origin = int(first_position)

    def picks(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """bool (B, Hq, T): the picked cells of ``layer`` at query ``positions`` (T,)."""
        key = tuple(positions.tolist())
        cached_key, cached = self._picks
        if cached_key != key:  # the first layer of a pass: every layer's picks at once
            cached = picked(self.seed, self.rows, range(self.layers), self.query_heads, positions, self.settings.rate)
            self._picks = (key, cached)
        return cached[layer]

    def deltas(self, positions: torch.Tensor) -> torch.Tensor:
        """fp64 ``delta_c`` of a picked cell at each query position (same shape)."""
        if self.origin is None:
            raise RuntimeError("an audited pass before its request's first call: AuditedRequest.start was not called")
        steps = positions.to(torch.int64) - self.origin + 1
        if steps.numel() and int(steps.min()) < 1:
            raise RuntimeError(f"query position {int(positions.min())} precedes the request's step 1 at {self.origin}")
        return check_deltas(self.settings.delta_spot, steps, self.cells_per_step, pick_probability(self.settings.rate))

    def bound(self, picked_cells: torch.Tensor, positions: torch.Tensor, meter: torch.Tensor, blank: torch.Tensor,
              radii: torch.Tensor, checks) -> tuple:
        """``(PickedBounds, checked part or None)``: bound and flag the picked cells of a pass: ``picked_cells``,
        ``meter``, ``blank`` and ``positions`` (each cell's query position) (B, H, T); ``radii`` (B, H, T, S);
        ``checks(at)`` the compressed logits and exact-logit source of the checked cells ``at``
        (:func:`witcert.audit.bounding.bound_picked`). The checks run at :meth:`run_checks`."""
        return bound_picked(picked_cells, meter, blank, radii, self.deltas(positions), checks, self.settings.tau,
                            self.pending)

    def run_checks(self) -> None:
        """Spot-check every checked cell recorded since the last call, in one batched check (the end of a flush or
        of a forward call), writing the results into the recorded batches."""
        self.pending.run(self.settings.keys, self.settings.tau, self.generator)

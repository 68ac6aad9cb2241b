"""The spot-certified gate: repair a cell only until its spot bound (or its meter) is ``<= tau`` (registry SCO, SCD, SCR).

The deterministic certified gate (:class:`witcert.Gate`) pages blocks in Lemma 4 order (``L4``:
largest ``X_j = sum_{t in j} p~_t (e^{c_t} - 1)`` first) until the meter recomputed on the
repaired logits is ``<= tau``; on caches where the witness saturates that is most of the context.
The spot-certified gate pages in the same order, one block per round for every cell still open, and
decides with the spot check as well:

- a cell whose spot bound (:class:`~witcert.spot.cells.SpotSettings`, before repair) is ``<= tau``
  is not repaired;
- any other cell over ``tau`` gets its blocks one at a time; after each the meter is recomputed on
  the repaired logits (paged tokens exact, radius the page's own rounding), and after 1, 2, 4, ...
  blocks the repaired cell is spot-checked (:func:`witcert.spot.check_cells`, all open cells at once),
  the ``i``-th check at ``delta_i = delta_g 6 / (pi^2 i^2)`` (``WitCert.sum_step_allocation_le``), where
  ``delta_g`` is the gate's share of the cell's ``delta`` (:data:`~witcert.spot.cells.GATE_SHARE`; the
  check before repair spent the rest). A re-check carries the exact logits the cell's check before repair
  and its earlier re-checks read (``reads``; ``carried`` of :func:`~witcert.spot.check_cells`): known from its
  first round, as a round knows what earlier rounds read, so it does not restart from nothing (most repaired cells
  then stop at their first re-check); they were fixed before
  its draws, so its statement holds conditionally on them at ``delta_i`` (registry SCR) and the split over the
  checks is unchanged. The repair stops at the first meter or check ``<= tau``, or
  when no block is left to page: it never pages more than the deterministic gate would.

A repaired cell's ``meter_after`` is the least of its recomputed meter and the spot bound that stopped
it; the cell's statements (before and after repair) fail with probability at most its ``delta``,
reported per cell. Both modes: the exact logits of paged blocks come from memory (validation,
``keep_exact=True``) or from the verified backing store through a
:class:`~witcert.gate.repair.LayerPager` (production), and the checks read their exact keys from the
same place; the bytes paged and the bytes the checks read are reported apart.
"""
from __future__ import annotations

import math as pymath
from dataclasses import dataclass

import torch

from witcert.gate.blocks import log_block_excess
from witcert.spot.batched import check_cells


@dataclass(frozen=True)
class SpotRepair:
    """What :func:`spot_gated` did, per cell (B, Hq, Tq) unless noted."""

    fired: torch.Tensor  # bool: the cell was over tau and not certified by the check before repair
    scores: torch.Tensor  # (B, Hq, Tq, S) logits after repair (exact on repaired tokens)
    repaired: torch.Tensor  # (B, Hq, Tq, S) bool
    meter_after: torch.Tensor
    delta: torch.Tensor  # fp64 failure probability the gate's checks spent
    checks: torch.Tensor  # fp64 checks run
    keys: torch.Tensor  # fp64 distinct exact keys the checks read (summed over checks)
    check_bytes: torch.Tensor  # fp64 bytes the checks read (exact key rows or verified blocks)
    page_bytes: torch.Tensor  # int64 bytes the repair paged in


def spot_gated(math, gate, spot, query, exact_keys, scale: float, radii, spot_bound, page_source,
               step: int | None = None, layers: int = 1, reads: tuple | None = None) -> SpotRepair:
    """The spot-certified gate over one call's cells (see the module docstring).

    ``math`` the call's :class:`~witcert.integrations.hf.cells.CallMath` (its meter the one reported before
    repair); ``spot`` its :class:`~witcert.spot.cells.SpotSettings`; ``query`` (B, Hq, Tq, d) and
    ``exact_keys`` (the exact cache or a :class:`~witcert.spot.gather.BackedKeys`) what the checks read;
    ``radii`` the radii the checks rely on; ``spot_bound`` (B, Hq, Tq) the bound before repair (NaN where
    unchecked; a cell it certified is not repaired: ``math``'s meter already holds it); ``page_source`` the gate's source of exact blocks (:meth:`witcert.Gate.page_source`: exact
    logits in memory, or the production pager); ``step``, ``layers`` as :meth:`SpotSettings.apply`; ``reads``
    the check's exact reads before repair, ``(at (M, 3), known (M, S), exact (M, S))`` (``keep_reads`` of
    :meth:`SpotSettings.apply`; ``None``: the re-checks start from what they read themselves).
    """
    shape, n_tokens = math.cells["meter"].shape, math.scores_hat.shape[-1]
    flat_scores = math.scores_hat.reshape(-1, n_tokens)
    flat_c = math.c.reshape(-1, n_tokens).to(flat_scores.dtype)
    # over tau after the check (math's meter is min(meter, spot bound)): a cell certified either way needs nothing
    fired = ~gate._within(math.cells["meter"]) & ~math.blank
    rows = fired.reshape(-1).nonzero().reshape(-1)
    work = _Open(gate, flat_scores[rows].clone(), flat_c[rows].clone(),
                 radii.reshape(-1, n_tokens)[rows].to(flat_scores.dtype).clone(), rows)
    if reads is not None:
        work.carry_checked(reads, shape)
    meter_after = math.cells["meter"].reshape(-1).clone()
    per_cell = {name: torch.zeros(rows.numel(), dtype=torch.float64) for name in ("delta", "checks", "keys", "bytes")}
    pages = torch.zeros(rows.numel(), dtype=torch.int64)
    gate_delta = spot.cell_delta(step, layers * shape[1] * shape[2]) * (1 - spot.check_share())
    at_cells = torch.stack(torch.unravel_index(rows, shape), dim=-1) if rows.numel() else torch.zeros(0, 3, dtype=torch.int64)
    length = 0
    while bool(work.open.any()):
        length += 1
        pages += work.page_next(page_source, length)
        open_ = work.open.nonzero().reshape(-1)
        exhausted = work.useful[open_] <= length
        # +inf where the meter is certainly over tau: not within, and a check that stops the cell gives min(., bound)
        # = its bound either way; a cell with no block left reports its value, so that one is always computed
        value = gate.value_unless_over(work.scores[open_], work.c[open_], keep=exhausted)
        within = gate._within(value)
        stopped = within.clone()
        after = value.to(torch.float64)
        if length & (length - 1) == 0:  # 1, 2, 4, ... blocks: spot-check the cells still over tau
            check = open_[~within]
            if check.numel():
                i = length.bit_length()  # the i-th check of these cells
                delta_i = gate_delta * 6 / (pymath.pi ** 2 * i * i)
                scores, source = spot.cells(math, query, exact_keys, scale, at_cells[check], rows=work.scores[check])
                result = check_cells(scores, work.radii[check], source, keys=spot.keys, delta=delta_i,
                                     tau=spot.tau if spot.adaptive else None, generator=spot.randomness.generator,
                                     split=spot.split, carried=work.carried(check), keep_reads=True)
                work.carry(check, result)
                for name, value_ in (("delta", result.delta), ("keys", result.keys_read.to(torch.float64)),
                                     ("bytes", source.bytes_read)):
                    per_cell[name][check] += value_
                per_cell["checks"][check] += 1
                accepted = result.bound <= gate.tau
                local = (~within).nonzero().reshape(-1)[accepted]
                stopped[local] = True
                after[local] = torch.minimum(after[local], result.bound[accepted])
        done = stopped | exhausted
        meter_after[rows[open_[done]]] = after[done].to(meter_after.dtype)
        work.open[open_[done]] = False
    scores_after = math.scores_hat.reshape(-1, n_tokens).clone()
    repaired = torch.zeros_like(scores_after, dtype=torch.bool)
    if rows.numel():
        scores_after[rows] = work.scores
        repaired[rows] = work.paged_tokens() & torch.isfinite(flat_scores[rows])
    full = {name: torch.zeros(shape, dtype=torch.float64).reshape(-1) for name in per_cell}
    for name, value_ in per_cell.items():
        full[name][rows] = value_
    page_bytes = torch.zeros(shape, dtype=torch.int64).reshape(-1)
    page_bytes[rows] = pages
    return SpotRepair(fired, scores_after.reshape(math.scores_hat.shape), repaired.reshape(math.scores_hat.shape),
                      meter_after.reshape(shape), full["delta"].reshape(shape), full["checks"].reshape(shape),
                      full["keys"].reshape(shape), full["bytes"].reshape(shape), page_bytes.reshape(shape))


class _Open:
    """The fired cells under repair: their logits and radii as blocks are paged, in the Lemma 4 order."""

    def __init__(self, gate, scores: torch.Tensor, c: torch.Tensor, radii: torch.Tensor, rows: torch.Tensor):
        self.gate, self.scores, self.c, self.radii, self.rows = gate, scores, c, radii, rows
        excess, self.order = log_block_excess(scores, c, gate.block_size).sort(dim=-1, descending=True, stable=True)
        self.useful = (excess > -pymath.inf).sum(-1)  # blocks each cell can page
        self.open = self.useful > 0
        self.paged = torch.zeros(rows.numel(), self.order.shape[-1] if rows.numel() else 0, dtype=torch.bool)
        self.known = torch.zeros(scores.shape, dtype=torch.bool, device="cpu")  # exact logits the checks read so far
        self.exact = torch.zeros(scores.shape, dtype=torch.float64, device="cpu")

    def carried(self, which: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact logits earlier checks of the cells ``which`` read: known in their next check (no re-read)."""
        return self.known[which], self.exact[which]

    def carry_checked(self, reads: tuple, shape: torch.Size) -> None:
        """Start from the exact logits the check before repair read, ``reads = (at (M, 3), known, exact)`` over the
        call's ``shape`` (B, Hq, Tq): every fired cell was checked (its meter was over tau before the check)."""
        at, known, exact = reads
        if known is None or not self.rows.numel():
            return
        flat = (at[:, 0] * shape[1] + at[:, 1]) * shape[2] + at[:, 2]
        slot = torch.full((shape.numel(),), -1, dtype=torch.int64)
        slot[flat] = torch.arange(flat.numel())
        local = slot[self.rows]
        held = local >= 0
        self.known[held] = known[local[held]].cpu()
        self.exact[held] = exact[local[held]].to(device="cpu", dtype=torch.float64)

    def carry(self, which: torch.Tensor, result) -> None:
        """Keep what a check of the cells ``which`` knew (:class:`~witcert.spot.batched.CellChecks`) for the next."""
        self.exact[which] = torch.where(result.known, result.exact, self.exact[which])
        self.known[which] |= result.known

    def page_next(self, source, length: int) -> torch.Tensor:
        """Page the ``length``-th block of every open cell: its tokens exact (radius: the page's rounding).
        Returns the bytes moved per cell."""
        moved = torch.zeros(self.rows.numel(), dtype=torch.int64)
        which = self.open.nonzero().reshape(-1)
        if not which.numel():
            return moved
        blocks = self.order[which, length - 1]
        moved[which] = self.gate.splice(self.scores, self.c, self.rows, blocks, which, source)
        self.paged[which, blocks] = True
        tokens = self.paged_tokens()
        self.radii = torch.where(tokens, self.c, self.radii)  # paged: the exact logit's own rounding
        return moved

    def paged_tokens(self) -> torch.Tensor:
        """(n, S) bool: tokens of the blocks paged so far."""
        n_tokens = self.scores.shape[-1]
        return self.paged.repeat_interleave(self.gate.block_size, dim=-1)[:, :n_tokens]

"""The spot-certified gate in the engine: repair only cells the spot check could not certify (SCO, SCR, T1, L4).

A spot row is a metered row of a request with ``witcert_certificate: "spot"`` (:mod:`.spot`). Before repair each
of its cells over ``tau`` is spot-checked (:mod:`.spot_check`) at ``delta (1 - GATE_SHARE)``; a cell whose
``min(meter, spot bound)`` is ``<= tau`` asks for no block (a request the gate does not watch spends the same
share: another request's repair in its step may rewrite slots it shares, a prefix, and it is checked again
after a repair round). The others are repaired in rounds: in round ``i`` (1, 2, ...) each open cell asks for
its ``2^(i-1)`` blocks of largest ``X_j = sum_{t in j} p~_t (e^{c_t} - 1)`` (Lemma 4 ``L4``, the deterministic
gate's order, over the cache as it is now), the union per row is written back, the step's attention recomputed
and metered again, and every spot cell still over ``tau`` is checked again at
``delta_i = delta GATE_SHARE 6 / (pi^2 i^2)`` (``WitCert.sum_step_allocation_le``: the re-checks together spend
at most the gate's share). The last round pages as the deterministic gate does (until the meter is
``<= tau``), so a cell the checks cannot certify ends where the meter-only gate would. Every reported bound
is of the cache it was computed on, so a cell certified before a repair of its row (which rewrites every kv
head of the repaired slots, and may rewrite a prefix other rows share) is checked again after it; a row no
repair touched keeps its bounds. Each cell's statements (before and after repair) fail together with
probability at most its ``delta``.
"""
import math
from dataclasses import dataclass

import torch

from witcert.gate.blocks import log_block_excess
from witcert.spot.cells import GATE_SHARE

from . import gate


@dataclass(frozen=True)
class SpotRows:
    """The spot rows of a step's active rows: ``pick`` (Rs,) their indices among the active rows, ``slots`` (Rs, S)
    each row's cache slot per position (-1 past its length), ``keys`` (Rs,) key budgets, ``delta`` (Rs,) fp64 each
    request's ``delta``, ``gated`` (Rs,) bool, ``valid`` (Rs, 1, M) bool the metered cells (``M = G Qmax``)."""

    pick: torch.Tensor
    slots: torch.Tensor
    keys: list
    delta: torch.Tensor
    gated: torch.Tensor
    valid: torch.Tensor

    def first_delta(self) -> torch.Tensor:
        """Each row's cells' failure probability for the check before repair (the rest is the re-checks')."""
        return self.delta * (1 - GATE_SHARE)

    def recheck_delta(self, i: int) -> torch.Tensor:
        """The ``i``-th re-check's (i >= 1) failure probability."""
        return self.delta * GATE_SHARE * 6 / (math.pi ** 2 * i * i)


def spot_rows(settings: list, active: list, chosen: list, slots: list, width: int, groups: int) -> SpotRows | None:
    """The :class:`SpotRows` of a step (``None``: no active row asked for the spot check): ``settings``, ``chosen``
    per metered row, ``active`` the metered rows in the pass, ``slots[k]`` active row ``k``'s slot per position (a
    LongTensor; only those of spot rows are read), ``width`` query tokens per row, ``groups`` query heads per kv
    head."""
    pick = [k for k, i in enumerate(active) if settings[i].spot is not None]
    if not pick:
        return None
    longest = max(slots[k].numel() for k in pick)
    table = torch.full((len(pick), longest), -1, dtype=torch.int64)
    for n, k in enumerate(pick):
        table[n, : slots[k].numel()] = slots[k]
    valid = torch.tensor([[bool(chosen[active[k]][j]) if j < len(chosen[active[k]]) else False
                           for _ in range(groups) for j in range(width)] for k in pick], dtype=torch.bool)
    spots = [settings[active[k]].spot for k in pick]
    return SpotRows(pick=torch.tensor(pick), slots=table, keys=[s.keys for s in spots],
                    delta=torch.tensor([s.delta for s in spots], dtype=torch.float64),
                    gated=torch.tensor([settings[active[k]].gate for k in pick]), valid=valid.unsqueeze(1))


def bounded(checker, rows: SpotRows, meter: torch.Tensor, q, view: dict, lengths, delta: torch.Tensor, layout,
            changed: torch.Tensor | None = None, earlier: torch.Tensor | None = None):
    """``(meter, lowered, checked)``: ``meter`` (Ra, Hkv, M) of the active rows with every spot cell over ``tau``
    checked and its bound ``min(meter, spot bound)``; ``lowered`` (Ra,) bool the rows a spot bound lowered;
    ``checked`` the :class:`~.spot_check.Checked` totals. After a repair round, ``changed`` (Rs,) bool the spot
    rows whose cache it rewrote: the others keep their ``earlier`` bounds (Ra, Hkv, M) (the attention they
    describe is unchanged) and are not checked again."""
    pick = rows.pick
    mine = meter[pick]
    if changed is not None:
        mine = torch.where(changed[:, None, None], mine, torch.minimum(mine, earlier[pick]))
    over = (mine > checker.tau) & rows.valid  # NaN compares False
    if changed is not None:
        over &= changed[:, None, None]
    every = pick.numel() == meter.shape[0] and bool((pick == torch.arange(pick.numel())).all())
    if not every:  # the spot rows alone (every active row, in order, is the usual case: no copy)
        view, q, lengths = {name: None if x is None else x[pick] for name, x in view.items()}, q[pick], lengths[pick]
    checked = checker.check(q, view, lengths, over, rows.slots, rows.keys, delta, layout)
    lower = ~torch.isnan(checked.bound) & (checked.bound < mine)
    out = meter.clone()
    out[pick] = torch.where(lower, checked.bound, mine)
    lowered = torch.zeros(meter.shape[0], dtype=torch.bool)
    lowered[pick] = lower.flatten(1).any(-1) | ((out[pick] < meter[pick]).flatten(1).any(-1))
    return out, lowered, checked


def changed_rows(rows: SpotRows, slots: torch.Tensor) -> torch.Tensor:
    """(Rs,) bool: the spot rows holding any of the rewritten ``slots`` (a prefix shared with a repaired row too)."""
    return torch.isin(rows.slots, slots).any(-1)


def plan(scores: torch.Tensor, c: torch.Tensor, open_: torch.Tensor, spot: torch.Tensor, blocks: int | None,
         tau: float, gate_block: int, pager: gate.Pager) -> gate.Plan:
    """A repair round's plan for the gated cells (Rg, Hq, S): ``open_`` (Rg, Hq) the cells over ``tau``, ``spot``
    (Rg,) the spot rows. Spot rows' open cells ask for their ``blocks`` largest blocks (``None``: as the
    deterministic gate, until the meter is ``<= tau``); other rows' open cells as the deterministic gate."""
    pager.n_tokens = scores.shape[-1]
    spot_cells = open_ & spot.unsqueeze(-1) if blocks is not None else torch.zeros_like(open_)
    certified = open_ & ~spot_cells
    pairs = set()
    if bool(certified.any()):  # a cell not open asks for nothing: radius 0 puts its meter at 0 for the planner
        pairs |= gate.picks(scores, torch.where(certified.unsqueeze(-1), c, 0.0), tau, gate_block, pager)
    if bool(spot_cells.any()):
        excess = log_block_excess(scores, c, gate_block).masked_fill(~spot_cells.unsqueeze(-1), -math.inf)
        top = excess.topk(min(blocks, excess.shape[-1]), dim=-1)
        wanted = torch.zeros_like(excess, dtype=torch.bool).scatter_(-1, top.indices, top.values > -math.inf)
        pairs |= {tuple(p) for p in wanted.any(dim=1).nonzero().tolist()}
    return gate.plan_of(pager, pairs)

"""Spot checks of many cells at once: every checked cell of one layer-step in one pass (registry SCO, SCB, SCR).

:func:`check_cells` runs the statistics of :func:`witcert.spot.spot_check` (the one-sided form, its rounds and
log-space weights; :mod:`witcert.spot.one_sided`, :mod:`witcert.spot.cell`) on ``N`` cells as tensors
``(N, S)``: each stage draws for every cell in one sampling call over the cells' weight matrix, reads the
exact logits of every new token at once (:mod:`witcert.spot.gather`: one gather of exact keys per kv head,
shared by the query heads over it), and bounds every cell's mean in one search over the grid
(:func:`witcert.spot.confidence.row_betting_upper`). Python loops run over rounds, stages and (for many cells) the
search's bisection steps,
never over cells or draws. Given the same draws a cell gets the bound the one-cell form gives it (the tests
replay one form's draws in the other); the draws are the caller's own randomness, made after the queries
are fixed.

Use::

    from witcert.spot import check_cells, TableLogits
    result = check_cells(scores, radii, TableLogits(exact_logits), keys=256, delta=1e-6, tau=0.2)
    result.bound, result.keys_read, result.delta   # (N,) each

With ``tau`` a cell reads keys in rounds (:mod:`witcert.spot.rounds`) and stops at its first bound ``<= tau``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from witcert.fastpath.compiled import pick
from witcert.gate.blocks import log_expm1
from witcert.spot.cell import (ABSOLUTE_SLACK, RANGE_TOLERANCE, RELATIVE_SLACK, TOKEN_SLACK, Z_FLOOR, check_keys,
                               checked_cells, exact_order, unit_ratio)
from witcert.spot.confidence import ONE_SIDED_CAP, row_betting_upper
from witcert.spot.one_sided import EXACT_SHARE, ROUNDING, SMALL, Z_KEYS_SHARE, Z_SHARE_OF_DELTA, exact_keys
from witcert.spot.groups import whole_groups
from witcert.spot.randomness import MultinomialSampler, draw_until_new, spot_randomness
from witcert.spot.rounds import DEFAULT_SPLIT, ROUND_GROWTH, schedule


@dataclass(frozen=True)
class CellChecks:
    """Results of :func:`check_cells`, each ``(N,)``.

    ``bound`` holds for its cell with probability ``>= 1 - delta`` (``delta`` what the rounds run spent; 0 for
    a cell read whole, whose bound is its true TV rounded up); ``keys_read`` distinct exact keys the cell read
    (in a key group read whole, its share of the group's reads); ``rounds`` rounds run; ``whole`` the cell was read whole; ``known`` and ``exact`` (with ``keep_reads``) the
    exact logits the check knew (read or carried), for a later check of the same cells (``carried``).
    """

    bound: torch.Tensor  # fp64
    keys_read: torch.Tensor  # int64
    delta: torch.Tensor  # fp64
    rounds: torch.Tensor  # int64
    whole: torch.Tensor  # bool
    known: torch.Tensor | None = None  # (N, S) bool: tokens whose exact logit the check knew at its end
    exact: torch.Tensor | None = None  # (N, S) fp64: those exact logits (0 elsewhere), to carry into a later check


def check_cells(scores, radii, source, *, keys: int, delta, tau: float | None = None,
                generator: torch.Generator | None = None, split: str = DEFAULT_SPLIT, sampler=None,
                exact_share: float = EXACT_SHARE, z_keys_share: float = Z_KEYS_SHARE,
                z_share: float = Z_SHARE_OF_DELTA, growth: int = ROUND_GROWTH, carried=None,
                keep_reads: bool = False, read_groups: bool = False) -> CellChecks:
    """Spot-check bounds on ``TV(p, p~)`` of ``N`` cells at once (registry SCO with SCB; rounds SCR).

    Parameters
    ----------
    scores : (N, S) tensor
        Compressed logits ``l~`` of each cell (``-inf`` masked; every finite one is visible).
    radii : (N, S) tensor
        Per-token bounds ``c >= |l~ - l|`` (checked on every token read).
    source : object
        ``source.logits(cells (M,), tokens (M,)) -> (M,)`` exact logits (:mod:`witcert.spot.gather`). Optional:
        ``source.groups`` (N,) int64, the cells' key groups (cells of a group attend the same exact keys: one
        layer, row and kv head; see ``read_groups``), and ``source.dense_logits(cells (M,), wanted (M, S) bool)
        -> (M, S)``, the exact logits of whole rows (used wherever a cell is read whole).
    keys : int
        Most distinct exact keys a cell may read.
    delta : float or (N,) tensor
        Each cell's failure probability (:mod:`witcert.spot.budget` turns a request budget into it).
    tau : float, optional
        Read in rounds, stopping at a bound ``<= tau`` (:mod:`witcert.spot.rounds`); ``None``: one round.
    generator : torch.Generator, optional
        The draws' randomness (default: a fresh one seeded from the operating system).
    split : str
        How ``delta`` divides over the rounds (:data:`witcert.spot.rounds.SPLITS`).
    growth : int
        Each round's key budget is ``growth`` times the last one's (:func:`witcert.spot.rounds.budgets`).
    sampler : optional
        Draws the tokens (default: a :class:`~witcert.spot.randomness.MultinomialSampler` of ``generator``).
    exact_share, z_keys_share, z_share : float
        Each round's split of keys and ``delta`` between the stages, as :func:`witcert.spot.spot_check`.
    carried : (known (N, S) bool, exact (N, S) fp64), optional
        Exact logits known before this check (an earlier check's ``known`` and ``exact`` of the same cells, e.g.
        the gate's re-checks of a repaired cell): known tokens from the first round on, as a round knows what
        earlier rounds read (registry SCR: fixed before this check's draws, so each round's statement holds
        conditionally on them). Each is checked against its radius; ``keys`` and ``keys_read`` count new reads. A
        cell whose every visible token is carried gets its true TV rounded up (``whole``, ``delta`` 0, one round,
        nothing read).
    keep_reads : bool
        Return what the check knew (``known``, ``exact``: a later check's ``carried``); ``None`` otherwise.
    read_groups : bool
        Read key groups whole where that fits the budget (:mod:`witcert.spot.groups`; needs ``source.groups``):
        a group whose history (the union of its cells' visible tokens not yet known) is at most ``keys`` per
        checked cell of the group is read before any round, and each of its cells gets its true TV rounded up,
        ``delta`` 0, ``whole``, one round, and ``keys_read`` its share of the group's reads, ``ceil(history /
        cells of the group)`` (the shares sum to at least the keys read, each ``<= keys``). Off by default:
        without it every cell reads on its own, as before.

    Returns
    -------
    CellChecks
    """
    s, c, delta = _checked(scores, radii, keys, delta, tau)
    if not (0 <= exact_share <= 1 and 0 <= z_keys_share <= 1 and 0 < z_share < 1):
        raise ValueError(f"exact_share, z_keys_share, z_share: expected shares in [0, 1] (z_share in (0, 1)), "
                         f"got {exact_share!r}, {z_keys_share!r}, {z_share!r}")
    if sampler is None:
        sampler = MultinomialSampler(spot_randomness().generator if generator is None else generator)
    cells = _Cells(s, c, source, sampler, (exact_share, z_keys_share, z_share), keys)
    n = s.shape[0]
    best, spent = torch.ones(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    rounds, whole = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.bool)
    active = torch.ones(n, dtype=torch.bool)
    if carried is not None:
        cells.carry(*carried)
        known_all = (~(cells.visible & ~cells.known).any(-1)).nonzero().reshape(-1)
        if known_all.numel():  # every visible exact logit carried in (a re-check): the true TV, nothing read, no delta
            best[known_all] = cells.whole(known_all)
            rounds[known_all], whole[known_all], active[known_all] = 1, True, False
    if read_groups and getattr(source, "groups", None) is not None:  # key groups read whole (witcert.spot.groups)
        grouped, shared = whole_groups(cells.visible & ~cells.known, source.groups, keys)
        done = grouped.nonzero().reshape(-1)
        if done.numel():
            best[done] = cells.whole(done)
            cells.count[done] = shared[done]
            rounds[done], whole[done], active[done] = 1, True, False
    for budget, share in schedule(keys, tau, split, growth):
        rows = active.nonzero().reshape(-1)
        if not rows.numel():
            break
        rounds[rows] += 1
        small = cells.n_visible[rows] <= budget  # read whole: the true TV, no draws, no delta
        if bool(small.any()):
            done = rows[small]
            best[done] = torch.minimum(best[done], cells.whole(done))
            whole[done], active[done] = True, False
        rows = rows[~small]
        if rows.numel():
            best[rows] = torch.minimum(best[rows], cells.round(rows, budget, share * delta[rows]))
            spent[rows] += share * delta[rows]
            if tau is not None:
                active[rows] = best[rows] > tau
    known, exact = (cells.known, torch.where(cells.known, s + cells.x, 0.0)) if keep_reads else (None, None)
    return CellChecks(best, cells.count.clone(), spent, rounds, whole, known, exact)


def _checked(scores, radii, keys: int, delta, tau) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_keys(keys)
    if tau is not None and not 0 <= tau < 1:
        raise ValueError(f"tau: expected a threshold in [0, 1) or None, got {tau!r}")
    s, c = checked_cells(scores, radii, 2)
    d = torch.as_tensor(delta, dtype=torch.float64).expand(s.shape[0]).clone()
    if not bool(((d > 0) & (d < 1)).all()):
        raise ValueError(f"delta: expected probabilities in (0, 1), got {delta!r}")
    return s, c, d


def _row_weights(log_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`witcert.spot.cell.sampling_weights` of every row: ``(totals (M,), weights (M, S))``, the weights
    ``e^{log w - max}`` and the total ``e^{max} sum(weights)`` (``inf`` on overflow, 0 for a row of none)."""
    top = log_weights.amax(-1, keepdim=True)
    finite = torch.isfinite(top)
    weights = torch.exp(log_weights - torch.where(finite, top, 0.0))  # a row of -inf: 0; of +inf: not used
    weights = torch.where(finite, weights, 0.0)
    total = torch.where(finite[:, 0], torch.exp(top[:, 0]) * weights.sum(-1),
                        torch.where(top[:, 0] == torch.inf, torch.inf, 0.0))
    return total, weights


def inflated_rows(value: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`witcert.spot.cell.inflated` of every row (``tokens``: each row's visible tokens, for a true TV)."""
    up = value if tokens is None else value + TOKEN_SLACK * tokens
    up = (up * (1 + RELATIVE_SLACK) + ABSOLUTE_SLACK).clamp(max=1.0)
    return torch.where(torch.isnan(value) | (value >= 1), 1.0, up)


def _outside(x: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """Where ``|l - l~| = |x|`` exceeds its radius beyond the check's tolerance (a radius that does not hold)."""
    return x.abs() > radius * (1 + RANGE_TOLERANCE) + ABSOLUTE_SLACK


def _radius_error(radius: float, cell: int, token: int) -> ValueError:
    return ValueError(f"radii: c = {radius!r} of cell {cell}, token {token} does not bound its logit error "
                      "(|l~ - l| > c): the spot check's ranges need a valid radius")


def _prepared(scores: torch.Tensor, c: torch.Tensor, visible: torch.Tensor | None = None,
              log_p: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """What no round changes, per (cell, token): ``visible``, ``log p~``, ``p~``, ``log(e^c - 1)``, ``e^{-c}``, the
    small radii (``e^c - 1 < SMALL``), per cell ``A- = E_p~ e^{-c}`` and ``A = E_p~ e^c`` (every term in log space),
    and each token's ``log p~ (e^c - 1)`` (``+inf`` for an infinite radius). ``visible`` and ``log_p``: those of
    ``scores`` where the caller formed them already (:class:`_Cells`: no second pass over the rows).

    ``log(e^c - 1)`` and the small radii are always eager, whatever ``WITCERT_COMPILE`` says: torch 2.13's inductor
    computes ``expm1(x)`` as ``exp(x) - 1``, so compiled, ``log(e^c - 1)`` came out ``-inf`` below ``c = 2^-54``
    (eager: ``log c``) and ``2e-5`` off at ``c = 1e-12``; the exact set's ranking of such tokens then fell to their
    index, not their contribution (other keys read than the one-cell form reads, on AVX-512 and AVX2 code alike).
    The rest is :func:`_row_sums`. It runs once per check."""
    visible = torch.isfinite(scores) if visible is None else visible
    log_p = _log_p(scores) if log_p is None else log_p
    log_u = log_expm1(c)
    p, e_minus, a_minus, a_plus, contribution = pick(_row_sums, _row_sums_probe)(log_p, c, visible, log_u)
    return visible, log_p, p, log_u, e_minus, torch.expm1(c) < SMALL, a_minus, a_plus, contribution


def _row_sums(log_p, c, visible, log_u) -> tuple[torch.Tensor, ...]:
    """``(p~, e^{-c}, A-, A, contribution)`` of every row from ``log p~``, ``c`` and ``log(e^c - 1)`` (see
    :func:`_prepared`): exps, sums and one addition, no ``expm1``. Tensors only: compiled with ``WITCERT_COMPILE=1``
    (the exps within their ulps, the sums in any order: inside ``ROUNDING``; the contribution, one addition, is
    the eager one bit for bit, so the exact set is ranked alike)."""
    a_minus = torch.exp(log_p - c).sum(-1)  # masked: exp(-inf) = 0
    a_plus = torch.exp(torch.where(visible, log_p + c, -torch.inf)).sum(-1)  # Z in [A-, A]
    contribution = torch.where(visible & torch.isinf(c), torch.inf, log_p + log_u)
    return torch.exp(log_p), torch.exp(-c), a_minus, a_plus, contribution


def _log_p(scores: torch.Tensor) -> torch.Tensor:
    """``log p~`` of every row (``-inf`` where masked): one expression, whether a round or a whole read forms it."""
    return scores - torch.logsumexp(scores, -1, keepdim=True)


def _z_weights(log_p, log_u, visible, known, small) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, weights)`` of every row: the sampling weights ``p~ (e^c - 1)`` on the sampled tokens (visible, not known,
    not small), in log space, and their total (:func:`_row_weights`). They need no exact logit, so the ``Z`` stage
    draws before its exact set is read and reads both at once. Tensors only: compiled with ``WITCERT_COMPILE=1``."""
    sampled = visible & ~known & ~small
    return _row_weights(torch.where(sampled, log_p + log_u, -torch.inf))


def _z_known(log_p, c, visible, known, small, x) -> torch.Tensor:
    """``z_known = sum_visible p~ e^{o}`` of every row, ``o = l - l~`` on known tokens, ``c`` on small unknown ones,
    0 on the sampled ones (masked: ``exp(-inf) = 0``). Tensors only: compiled with ``WITCERT_COMPILE=1``."""
    offset = torch.where(known, x, torch.where(small & visible, c, 0.0))
    return torch.exp(log_p + offset).sum(-1)


def _h_terms(p, e_minus, visible, known, x, z_upper) -> tuple[torch.Tensor, ...]:
    """``(total, H, weights, h)`` of every row of the one-sided stage: the known terms ``p~ (1 - W/Z_U)^+`` and the
    small ``p~ h`` (each at most ``h``), the sampling weights ``p~ h`` on the others and their total ``H``, and
    ``h = (1 - e^{-c} / Z_U)^+``. Tensors only: compiled with ``WITCERT_COMPILE=1``."""
    log_z = torch.log(z_upper)[:, None]
    h = (1 - e_minus / z_upper[:, None]).clamp_min(0)
    rest = visible & ~known
    small = rest & (h < SMALL)
    known_terms = torch.where(known, (1 - torch.exp(x - log_z)).clamp_min(0), 0.0)
    total = (p * torch.where(small, h, known_terms)).sum(-1)
    weights = torch.where(rest & ~small, p * h, 0.0)  # a term p~ h <= p~: the rounded p~ serves
    return total, weights.sum(-1), weights, h


def _row_sums_probe() -> tuple:
    f = torch.zeros(2, 3, dtype=torch.float64)
    return f, f, torch.ones(2, 3, dtype=torch.bool), f


def _z_weights_probe() -> tuple:
    f = torch.zeros(2, 3, dtype=torch.float64)
    b = torch.zeros(2, 3, dtype=torch.bool)
    return f, f, ~b, b, b


def _z_known_probe() -> tuple:
    f = torch.zeros(2, 3, dtype=torch.float64)
    b = torch.zeros(2, 3, dtype=torch.bool)
    return f, f, ~b, b, b, f


def _h_terms_probe() -> tuple:
    f = torch.full((2, 3), 0.5, dtype=torch.float64)
    b = torch.zeros(2, 3, dtype=torch.bool)
    return f, f, ~b, b, f, torch.ones(2, dtype=torch.float64)


class _Cells:
    """``N`` cells in log space (:class:`witcert.spot.cell.CellWeights` as rows) and the exact logits read so far.

    What no round changes is formed once: ``log p~`` with the cells, then at the first round ``p~``, ``log(e^c - 1)``,
    ``e^{-c}``, the small-radius tokens, ``A- = E_p~ e^{-c}`` and ``A = E_p~ e^c`` per row, and the ranking of the
    heaviest contributions (every round's exact set is a prefix of it).
    """

    def __init__(self, scores: torch.Tensor, c: torch.Tensor, source, sampler, shares: tuple, keys: int):
        self.scores, self.c, self.source, self.sampler, self.keys = scores, c, source, sampler, keys
        self.exact_share, self.z_keys_share, self.z_share = shares
        self.visible, self.log_p = torch.isfinite(scores), _log_p(scores)  # what a whole read needs too
        self.n_visible = self.visible.sum(-1)
        self.known = torch.zeros_like(self.visible)
        self.count = torch.zeros(scores.shape[0], dtype=torch.int64)  # known tokens per row (no pass over known)
        self.x = torch.zeros_like(scores)  # l - l~ where known

    @functools.cached_property
    def _round_terms(self) -> tuple:
        """What only a round reads (:func:`_prepared`; the exact set's ranking, every round's a prefix of it), formed
        at the first round: a check whose cells are all read whole (key groups, short histories) needs none."""
        _, _, p, log_u, e_minus, small, a_minus, a_plus, contribution = _prepared(self.scores, self.c, self.visible,
                                                                                  self.log_p)
        order = exact_order(contribution, self.visible, exact_keys(self.keys, self.exact_share))
        return p, log_u, e_minus, small, a_minus, a_plus, order

    p = property(lambda self: self._round_terms[0])
    log_u = property(lambda self: self._round_terms[1])
    e_minus = property(lambda self: self._round_terms[2])
    small = property(lambda self: self._round_terms[3])
    a_minus = property(lambda self: self._round_terms[4])
    a_plus = property(lambda self: self._round_terms[5])
    order = property(lambda self: self._round_terms[6])

    # -- reads -------------------------------------------------------------------------------------------------
    def carry(self, known: torch.Tensor, exact: torch.Tensor) -> None:
        """Exact logits ``exact`` of the ``known`` visible tokens, from an earlier check: known without a read (not
        counted in ``keys_read``), each checked against its radius as a read one is."""
        known = torch.as_tensor(known, dtype=torch.bool).cpu()
        exact = torch.as_tensor(exact).to(torch.float64).cpu()
        if known.shape != self.scores.shape or exact.shape != self.scores.shape:
            raise ValueError(f"carried: expected known and exact of shape {tuple(self.scores.shape)}, got "
                             f"{tuple(known.shape)} and {tuple(exact.shape)}")
        rows, tokens = (known & self.visible).nonzero().unbind(-1)
        self._checked_logits(rows, tokens, exact[rows, tokens])
        self.known[rows, tokens] = True

    def read(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Read the exact logits of the (cell, token) pairs not known yet (each once) and check their radii."""
        self.fetch(*self.mark(rows, tokens))

    def mark(self, rows: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mark the pairs not known yet known and count them, before their logits are read (:meth:`fetch`): what a
        stage draws depends on which tokens are known, never on their logits. Returns those pairs, each once."""
        n_tokens = self.scores.shape[1]
        fresh = ~self.known[rows, tokens]
        flat = torch.unique(rows[fresh] * n_tokens + tokens[fresh])
        rows, tokens = flat // n_tokens, flat % n_tokens
        self.known[rows, tokens] = True
        self.count.index_add_(0, rows, torch.ones_like(rows))  # each pair new (unique, not known before)
        return rows, tokens

    def fetch(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """The exact logits of marked pairs (:meth:`mark`), in one source call, each radius checked."""
        if not rows.numel():
            return
        logits = torch.as_tensor(self.source.logits(rows, tokens)).to(torch.float64).reshape(-1).cpu()
        if logits.numel() != rows.numel():
            raise ValueError(f"source: returned {logits.numel()} logits for {rows.numel()} tokens")
        self._checked_logits(rows, tokens, logits)

    def _checked_logits(self, rows: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """``x = l - l~`` of the pairs from their exact logits, each finite and within its radius."""
        if not bool(torch.isfinite(logits).all()):
            raise ValueError("source: returned a non-finite exact logit for a visible token")
        x = logits - self.scores[rows, tokens]
        radius = self.c[rows, tokens]
        bad = _outside(x, radius)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise _radius_error(float(radius[i]), int(rows[i]), int(tokens[i]))
        self.x[rows, tokens] = x

    def _read_rows(self, rows: torch.Tensor, fresh: torch.Tensor, dense) -> None:
        """The exact logits of the ``fresh`` (M, S) tokens of ``rows`` from ``dense(rows, fresh) -> (M, S)``, checked
        as :meth:`_checked_logits` checks them, in dense passes over the rows (no per-pair indexing)."""
        if not bool(fresh.any()):  # every token known (carried, or read by an earlier round): nothing to read
            return
        logits = torch.as_tensor(dense(rows, fresh)).to(torch.float64).cpu()
        if logits.shape != fresh.shape:
            raise ValueError(f"source: returned dense logits of shape {tuple(logits.shape)} for {tuple(fresh.shape)}")
        if not bool(torch.isfinite(logits[fresh]).all()):
            raise ValueError("source: returned a non-finite exact logit for a visible token")
        x = torch.where(fresh, logits - self.take(self.scores, rows), 0.0)
        radius = self.take(self.c, rows)
        bad = fresh & _outside(x, radius)
        if bool(bad.any()):
            i, t = bad.nonzero()[0].tolist()
            raise _radius_error(float(radius[i, t]), int(rows[i]), t)
        self.x[rows] = torch.where(fresh, x, self.take(self.x, rows))
        self.known[rows] = self.take(self.known, rows) | fresh
        self.count.index_add_(0, rows, fresh.sum(-1))

    def keys_read(self, rows: torch.Tensor) -> torch.Tensor:
        return self.count[rows]

    def take(self, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``values[rows]``, without a copy when ``rows`` is every row in order (the first round's usual case)."""
        return values if rows.numel() == values.shape[0] else values[rows]

    def draw(self, rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
             pending: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`witcert.spot.randomness.draw_until_new` of ``rows``, then their new tokens read, together with the
        ``pending`` marked pairs (:meth:`mark`) in one read."""
        draws, valid = draw_until_new(self.sampler, weights, counts, self.take(self.known, rows), cells=rows)
        self._fetch_all(pending, self.mark(rows[:, None].expand_as(draws)[valid], draws[valid]))
        return draws, valid

    def _fetch_all(self, *marked: tuple) -> None:
        """:meth:`fetch` of several groups of marked pairs at once (each group ``(rows, tokens)`` or empty)."""
        groups = [group for group in marked if group]
        if groups:
            self.fetch(torch.cat([g[0] for g in groups]), torch.cat([g[1] for g in groups]))

    # -- a round -----------------------------------------------------------------------------------------------
    def whole(self, rows: torch.Tensor) -> torch.Tensor:
        """Read every visible token of ``rows``: the true TV rounded up, (M,)."""
        visible = self.take(self.visible, rows)
        dense = getattr(self.source, "dense_logits", None)
        if dense is None:
            self.read(rows[:, None].expand_as(visible)[visible], visible.nonzero()[:, 1])
        else:  # whole rows: one matmul per key group, not per-pair gathers
            self._read_rows(rows, visible & ~self.take(self.known, rows), dense)
        log_p = self.take(self.log_p, rows)
        exact = torch.softmax(torch.where(visible, log_p + self.take(self.x, rows), -torch.inf), dim=-1)
        tv = (exact - torch.where(visible, torch.exp(log_p), 0.0)).abs().sum(-1) / 2
        return inflated_rows(tv, visible.sum(-1))

    def round(self, rows: torch.Tensor, budget: int, delta: torch.Tensor) -> torch.Tensor:
        """One round of :func:`witcert.spot.one_sided._round` for every row at the cumulative ``budget``: (M,) bounds."""
        exact = self._exact_set(rows, budget)
        z_upper = self._z_upper(rows, budget, self.z_share * delta, exact)
        bound = torch.ones(rows.numel(), dtype=torch.float64)
        resolved = (self.scores.shape[1] * Z_FLOOR <= z_upper) & (z_upper < torch.inf)
        if bool(resolved.any()):
            bound[resolved] = inflated_rows(self._one_sided(rows[resolved], budget, z_upper[resolved],
                                                        (1 - self.z_share) * delta[resolved]))
        return bound

    def _exact_set(self, rows: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The heaviest ``budget * exact_share`` contributions, at most the budget left of them unknown
        (:func:`witcert.spot.one_sided.exact_set_within`), marked known (:meth:`mark`): the pairs to read."""
        k_exact = exact_keys(budget, self.exact_share)
        candidates = self.order[rows, :k_exact]  # (M, k)
        inside = torch.arange(k_exact)[None, :] < self.n_visible[rows][:, None]
        fresh = ~self.known[rows[:, None], candidates] & inside
        room = budget - self.keys_read(rows)
        keep = fresh & (torch.cumsum(fresh, -1) <= room[:, None])
        return self.mark(rows[:, None].expand_as(candidates)[keep], candidates[keep])

    def _z_upper(self, rows: torch.Tensor, budget: int, delta_z: torch.Tensor, exact: tuple) -> torch.Tensor:
        """:func:`witcert.spot.one_sided._z_upper` of every row: ``Z_U`` (M,) (dense terms: :func:`_z_weights`,
        :func:`_z_known`); the ``exact`` set's pairs (marked) are read with the draws."""
        log_p, visible, small = self.take(self.log_p, rows), self.take(self.visible, rows), self.take(self.small, rows)
        g_total, weights = pick(_z_weights, _z_weights_probe)(log_p, self.take(self.log_u, rows), visible,
                                                             self.take(self.known, rows), small)
        a_minus, a_plus = self.a_minus[rows], self.a_plus[rows]
        z_keys = torch.round((budget - self.keys_read(rows)).to(torch.float64) * self.z_keys_share).to(torch.int64)
        drawn = (g_total > 0) & (g_total < torch.inf) & (z_keys > 0)
        if bool(drawn.any()):
            at = rows[drawn]
            draws, valid = self.draw(at, weights[drawn], z_keys[drawn], exact)
        else:
            self._fetch_all(exact)
        # the drawn tokens are not known in Z's sum (their share is the sampled mass G): only the exact set's are
        known = self.take(self.known, rows).clone()
        if bool(drawn.any()):
            known[drawn.nonzero().reshape(-1)[:, None].expand_as(draws)[valid], draws[valid]] = False
        z_known = pick(_z_known, _z_known_probe)(log_p, self.take(self.c, rows), visible, known, small,
                                                 self.take(self.x, rows))
        z_upper = torch.where(g_total == 0, z_known, a_plus)
        if bool(drawn.any()):
            c = self.c[at[:, None], draws]
            y = unit_ratio(self.x[at[:, None], draws], torch.expm1(c), log_expm1(c))
            upper = row_betting_upper((1 + y) / 2, valid, delta_z[drawn], z_keys[drawn].to(torch.float64),
                                      ONE_SIDED_CAP)
            g = g_total[drawn]
            z_upper[drawn] = z_known[drawn] + g * (2 * upper - 1) + g * ROUNDING
        return torch.maximum(torch.minimum(z_upper, a_plus), a_minus) * (1 + ROUNDING)

    def _one_sided(self, rows: torch.Tensor, budget: int, z_upper: torch.Tensor, delta_f: torch.Tensor) -> torch.Tensor:
        """:func:`witcert.spot.one_sided._one_sided_mean` of every row: the bound before rounding up (M,) (dense terms:
        :func:`_h_terms`)."""
        new_keys = budget - self.keys_read(rows)  # fixed before the stage's draws: predictable bets
        log_z = torch.log(z_upper)[:, None]
        total, h_total, weights, h = pick(_h_terms, _h_terms_probe)(
            self.take(self.p, rows), self.take(self.e_minus, rows), self.take(self.visible, rows),
            self.take(self.known, rows), self.take(self.x, rows), z_upper)
        bound = total + h_total  # no draws: E X <= 1
        drawn = (h_total > 0) & (new_keys >= 1)
        if bool(drawn.any()):
            at = rows[drawn]
            draws, valid = self.draw(at, weights[drawn], new_keys[drawn])
            term = (1 - torch.exp(self.x[at[:, None], draws] - log_z[drawn])).clamp_min(0)
            x = (term / h[drawn].gather(1, draws)).clamp(0.0, 1.0)  # <= 1 as W >= e^-c
            upper = row_betting_upper(x, valid, delta_f[drawn], new_keys[drawn].to(torch.float64), ONE_SIDED_CAP)
            bound[drawn] = total[drawn] + h_total[drawn] * (upper + ROUNDING)
        return bound

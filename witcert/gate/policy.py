"""Meter-driven gating with block-level repair (docs/design.md "Gating and repair").

A :class:`Gate` decides, per (layer, head) cell or per request, whether the compressed
attention is close enough to exact, and if not pages exact blocks in until it is.

Usage (the API is this small)::

    gate = witcert.Gate(tau=0.2)                      # certified: tau < 1
    result = gate(scores, c, pager=pager)             # scores, c: (..., S)
    result.label        # "certified (tau=0.2 < 1): ..." or "risk-ranked (tau=5 >= 1): no guarantee"
    result.unreachable  # cells still above tau once nothing is left to repair (the gate always returns)
    result.scores, result.c                           # after repair: exact logits, c = their error there
    result.blocks, result.bytes                       # per cell; result.bytes_paged in total

``scores`` are the compressed logits (scaled; ``-inf`` masks), ``c`` the per-token logit-error
bounds (Tier A); for a Tier B shared block radius pass ``radius=`` (..., n_blocks) instead.
``pager(cell, block) -> PageIn`` returns the exact logits of that block's tokens for that cell
and the bytes it moved; :class:`witcert.gate.repair.LayerPager` is the production pager (backing
store -> verified page-in -> persistent write-back, witness zeroed, repair cache, telemetry)::

    store = witcert.gate.backing_store.BackingStore(block_size=16)
    store.write(layer, k_exact, v_exact)              # on every cache write, (*lead, T, d)
    repairer = witcert.gate.repair.Repairer(store)                # one per request
    pager = witcert.gate.repair.LayerPager(repairer, layer, q, sm_scale, group=Hq // Hkv,
                               k_cache=k_hat, witness=w)   # q: (*cells, d), cells = scores.shape[:-1]
    result = witcert.Gate(0.2, block_size=16)(scores, c, pager=pager)
    repairer.telemetry[(layer, (b, kv_head))]         # page_ins, bytes, repaired_slots, cache_hits

When the exact logits are already in memory (a model's exact shadow, :mod:`witcert.integrations.hf.cells`),
pass them instead of a pager: ``gate(scores, c, exact=exact_scores)`` (no bytes moved).

Regimes (every result is labelled)
----------------------------------
- ``tau < 1``, certified: gates on ``witcert.meter`` (``min(1, T1, P1, MN)``). A cell reported
  ``reached`` has a meter, *recomputed on the repaired logits and bounds*, ``<= tau``: a proved
  bound on the TV between attention over exact keys and over the repaired cache (Theorem 1,
  ``T1``). Never inferred from the predicted drop.
- ``tau >= 1``, risk-ranked: gates on the raw e-form ``witcert.risk_score``; no guarantee, the
  raw score only ranks danger (the paper's ``tau = 5`` gate).

Repair policy
-------------
``repair="blocks"`` pages blocks in decreasing ``X_j = sum_{t in j} p~_t (e^{c_t} - 1)``
(:mod:`witcert.gate.blocks`, Lemma 4 ``L4``), recomputing ``p~``, ``X`` and the real meter after
every page-in, until the gated value is ``<= tau`` or nothing is left to repair (each block is
paged at most once per call; a cell still above ``tau`` then is flagged ``unreachable``). The policy is
vectorized over cells: each round pages one block in every cell still over ``tau`` (the
pager, if one is given, is still called once per (cell, block)); the result is the same as
repairing the cells one at a time, and ``pages`` lists them cell by cell. With ``exact=``
(nothing to fetch) the rounds are evaluated several at a time, with the same pages and result
(paging a block leaves the other blocks' order by ``X_j`` unchanged).
``repair="whole"`` pages every block with a positive ``X_j`` of a fired cell (the paper's
whole-head fallback; the traffic baseline). ``granularity="head"`` decides per cell;
``granularity="request"`` makes one decision for every cell of the call (fires all cells if
any cell exceeds ``tau``; pass one request's cells per call).
"""
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from witcert.core import rounding
from witcert.gate.blocks import block_tokens, expand_block_radius, log_block_excess
from witcert.core.metering import meter, risk_score
from witcert.core.checks import check_scores_and_bounds
from witcert.gate.meter_floor import surely_over

MODES = ("certified", "risk")
_PREFIX_ELEMENTS = 1 << 22  # candidate logits per gated-value call in Gate._repair_prefixes (memory cap)
GRANULARITIES = ("head", "request")
REPAIRS = ("blocks", "whole")


@dataclass(frozen=True)
class PageIn:
    """What a pager returns for one (cell, block).

    Attributes
    ----------
    logits : Tensor (n,)
        Exact logits of the block's ``n`` tokens for this cell, in the same scale as ``scores``
        (the logits attention now computes from the repaired, exact keys). When they are
        more precise than ``scores`` (fp64 for fp32 scores), the repaired tokens get ``c`` =
        the cast's rounding error instead of 0, so the meter stays sound.
    nbytes : int
        Bytes newly moved from the backing store (0 when served by the repair cache).
    error : float or Tensor (n,), optional
        A bound on ``|logits - exact logits|`` for logits that were themselves computed in
        floating point (:class:`witcert.gate.repair.LayerPager`'s fp64 dot products); default 0
        (logits exact as given). It is added to the repaired tokens' ``c``.
    """

    logits: torch.Tensor
    nbytes: int
    error: torch.Tensor | float = 0.0


Pager = Callable[[tuple, int], PageIn]


@dataclass(frozen=True)
class GateResult:
    """Outcome of one :class:`Gate` call. Tensors are indexed by cell (``scores.shape[:-1]``).

    Attributes
    ----------
    tau, mode : the gate's threshold and regime (``"certified"`` or ``"risk"``).
    before, after : Tensor (...)
        The gated value (meter if certified, raw risk score if risk) before and after repair;
        ``after`` is recomputed by ``witcert.meter`` / ``risk_score`` on the repaired inputs.
    fired : BoolTensor (...)   cells the gate acted on.
    reached : BoolTensor (...) ``after <= tau``.
    blocks : LongTensor (...)  blocks repaired per cell (cache hits included).
    bytes : LongTensor (...)   bytes newly paged in per cell.
    scores, c : Tensor (..., S)
        Logits and per-token bounds after repair (exact logits and ``c = 0`` on repaired tokens).
    pages : tuple of (cell, block)
        Every repair, cell by cell, each cell's pages in the order they were made.
    paged : BoolTensor (..., n_blocks)
        The blocks paged in, per cell.
    """

    tau: float
    mode: str
    before: torch.Tensor
    after: torch.Tensor
    fired: torch.Tensor
    reached: torch.Tensor
    unreachable: torch.Tensor
    blocks: torch.Tensor
    bytes: torch.Tensor
    scores: torch.Tensor
    c: torch.Tensor
    pages: tuple = field(default=(), repr=False)
    paged: torch.Tensor | None = field(default=None, repr=False)

    @property
    def certified(self) -> bool:
        """True for the certified regime (``tau < 1``): ``after <= tau`` is a proved TV bound."""
        return self.mode == "certified"

    @property
    def label(self) -> str:
        """The regime label that must accompany every gating number."""
        if self.certified:
            label = f"certified (tau={self.tau:g} < 1): meter <= tau is a proved TV bound"
        else:
            label = f"risk-ranked (tau={self.tau:g} >= 1): raw risk score, no guarantee"
        n_out = int(self.unreachable.sum())
        if n_out:
            label += f"; tau unreachable in {n_out} cell(s) after full repair (see `after`)"
        return label

    @property
    def bytes_paged(self) -> int:
        """Total bytes newly paged in by this call."""
        return int(self.bytes.sum())


@dataclass(frozen=True)
class Gate:
    """Meter-driven gate with block-level repair (docs/design.md "Gating and repair"; soundness from Theorem 1 ``T1``).

    Parameters
    ----------
    tau : float
        Threshold, finite and ``> 0``. ``0 < tau < 1``: certified; ``tau >= 1``: risk-ranked.
    mode : {"certified", "risk"}, optional
        Must agree with ``tau`` (inferred when omitted).
    granularity : {"head", "request"}
        Decide per cell, or once for all cells of the call.
    repair : {"blocks", "whole"}
        Greedy block page-in until below ``tau``, or every contributing block of a fired cell.
    block_size : int
        Tokens per block (default 16; must match the backing store's).
    """

    tau: float
    mode: str | None = None
    granularity: str = "head"
    repair: str = "blocks"
    block_size: int = 16

    def __post_init__(self):
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)) or math.isnan(self.tau):
            raise ValueError(f"tau must be a number, got {self.tau!r}")
        if self.tau <= 0 or math.isinf(self.tau):  # tau = 0 certifies only a lossless cache: refused, as the docs say
            raise ValueError(f"tau must be finite and > 0 (0 < tau < 1: certified; tau >= 1: risk-ranked), "
                             f"got {self.tau!r}")
        implied = "certified" if self.tau < 1 else "risk"
        if self.mode is None:
            object.__setattr__(self, "mode", implied)
        elif self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        elif self.mode != implied:
            raise ValueError(
                f"mode={self.mode!r} contradicts tau={self.tau}: certified gating needs tau < 1 "
                f"(the meter is clamped at 1), risk-ranked gating uses tau >= 1"
            )
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.repair not in REPAIRS:
            raise ValueError(f"repair must be one of {REPAIRS}, got {self.repair!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")

    def value(self, scores: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """The gated quantity: ``witcert.meter`` (certified) or ``witcert.risk_score`` (risk)."""
        return meter(scores, c) if self.mode == "certified" else risk_score(scores, c)

    def value_unless_over(self, scores: torch.Tensor, c: torch.Tensor,
                          keep: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`value` of rows (n, S), ``+inf`` (not ``<= tau``, the same decision) where the meter is certainly
        above ``tau`` (:func:`~witcert.gate.meter_floor.surely_over`; certified gating only): a repair loop asks
        only whether the value is ``<= tau`` yet. ``keep`` (n,) bool: rows whose value is needed whatever it is."""
        if self.mode != "certified" or not scores.shape[0]:
            return self.value(scores, c)
        open_ = ~surely_over(scores, c, self.tau)
        if keep is not None:
            open_ |= keep
        if bool(open_.all()):
            return self.value(scores, c)
        out = torch.full(scores.shape[:1], math.inf, dtype=scores.dtype, device=scores.device)
        if bool(open_.any()):
            out[open_] = self.value(scores[open_], c[open_])
        return out

    def __call__(self, scores, c=None, *, radius=None, pager: Pager | None = None, exact=None) -> GateResult:
        """Gate and repair, vectorized over cells.

        Parameters
        ----------
        scores : Tensor (..., S)
            Compressed logits, scaled; ``-inf`` masks a token.
        c : Tensor broadcastable to (..., S), optional
            Tier A per-token bounds (``>= 0``). Exactly one of ``c`` and ``radius``.
        radius : Tensor (..., n_blocks), optional
            Tier B shared radius per block of ``block_size`` tokens.
        pager : callable ``(cell, block) -> PageIn``, optional
            Source of exact logits, one block at a time (the backing store).
        exact : Tensor (..., S), optional
            Exact logits already in memory (a model's exact shadow): pages move no bytes.
            Exactly one of ``pager`` and ``exact``.

        Returns
        -------
        GateResult
        """
        scores, c = self._inputs(scores, c, radius)
        source = self.page_source(scores, c.dtype, pager, exact)
        before = self.value(scores, c)  # (...)
        over = ~self._within(before)
        fired = over.clone() if self.granularity == "head" else over.any().expand(over.shape).clone()
        n_tokens = scores.shape[-1]
        flat_scores = scores.reshape(-1, n_tokens).clone()  # (N, S)
        flat_c = c.reshape(-1, n_tokens).clone()
        if self.repair == "whole":
            rows = fired.reshape(-1).nonzero().flatten()
            pages = self._repair_whole(flat_scores, flat_c, rows, source)
        else:  # a fired cell already <= tau (request granularity) needs nothing
            rows = (fired & over).reshape(-1).nonzero().flatten()
            pages = self._repair_greedy(flat_scores, flat_c, rows, source)
        scores_after = flat_scores.reshape(scores.shape)
        c_after = flat_c.reshape(scores.shape)
        after = before.clone()
        if fired.any():  # recomputed on the repaired inputs, never predicted
            after[fired] = self.value(scores_after[fired], c_after[fired])
        return _result(self, before, after, fired, scores_after, c_after, pages, source)

    def _repair_greedy(self, scores: torch.Tensor, c: torch.Tensor, rows: torch.Tensor, source) -> "_Pages":
        """Greedy page-in (Lemma 4 ``L4`` order) on rows ``rows`` of (N, S) ``scores``/``c``, in place.

        One round pages, in every active row, the unpaged block with the largest ``X_j``
        (recomputed: ``p~`` moved), then recomputes the gated value on the repaired row; a row
        stops when that real value is ``<= tau`` or nothing is left to repair. A block is paged
        at most once per call: paging it again would return the same exact logits (and the same
        cast slack ``c``), so the loop ends after at most ``n_blocks`` rounds, ``tau`` reachable
        or not. The active rows are worked on as a compact copy. Exact logits already in memory
        take :meth:`_repair_prefixes` (the same result in fewer meter calls).
        """
        if isinstance(source, _ExactSource):
            return self._repair_prefixes(scores, c, rows, source)
        pages = _Pages()
        work_scores, work_c = scores[rows], c[rows]  # (n, S)
        n_blocks = -(-scores.shape[-1] // self.block_size)
        paged = torch.zeros(rows.numel(), n_blocks, dtype=torch.bool, device=scores.device)
        while rows.numel():
            excess = log_block_excess(work_scores, work_c, self.block_size).masked_fill(paged, -math.inf)
            best_x, best = excess.max(dim=-1)  # (n,)
            useful = best_x > -math.inf  # nothing left to repair (masked, exact or paged everywhere) otherwise
            moved = self.splice(work_scores, work_c, rows, best, useful, source)
            pages.add(rows[useful], best[useful], moved)
            paged[useful.nonzero().flatten(), best[useful]] = True
            still = useful.clone()
            if useful.any():  # the real gated value, recomputed on the repaired rows (where it may be <= tau)
                still[useful] = ~self._within(self.value_unless_over(work_scores[useful], work_c[useful]))
            done = ~still
            scores[rows[done]], c[rows[done]] = work_scores[done], work_c[done]
            rows, work_scores, work_c, paged = rows[still], work_scores[still], work_c[still], paged[still]
        return pages

    def _repair_prefixes(self, scores: torch.Tensor, c: torch.Tensor, rows: torch.Tensor,
                         source: "_ExactSource") -> "_Pages":
        """:meth:`_repair_greedy` over exact logits in memory: the same pages, several rounds per meter call.

        Paging a block rescales ``p~`` on every other block by one common factor, so the unpaged
        blocks keep their order by ``X_j``: round ``r`` of the greedy loop repairs the ``r``-block
        prefix of the initial order. Each row stops at the first prefix whose real gated value is
        ``<= tau`` or when its useful blocks run out (as the loop does); the prefixes are
        evaluated a growing chunk at a time, in one call of the gated value per chunk. Pages move
        no bytes, so evaluating a prefix a row never reaches costs only compute.
        """
        pages = _Pages()
        n, n_tokens = rows.numel(), scores.shape[-1]
        if not n:
            return pages
        work_scores, work_c = scores[rows], c[rows]  # (n, S)
        exact, slack = source.logits(rows)
        masked = torch.isneginf(work_scores)
        repaired_c = torch.where(masked, torch.zeros_like(slack), slack)
        sorted_x, order = log_block_excess(work_scores, work_c, self.block_size).sort(dim=-1, descending=True, stable=True)
        useful = (sorted_x > -math.inf).sum(-1)  # (n,) blocks each row can page
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
        token_rank = rank.repeat_interleave(self.block_size, dim=-1)[:, :n_tokens]  # (n, S): page order of its block
        nonfinite = ~masked & ~torch.isfinite(exact)  # an error only if a chosen prefix holds it, as in the loop
        exact = torch.where(nonfinite, work_scores, exact)
        final = useful.clone()  # prefix length per row; rows with nothing useful page nothing
        active = (useful > 0).nonzero().flatten()
        start, chunk = 0, 2
        while active.numel():
            width = max(1, min(chunk, _PREFIX_ELEMENTS // (active.numel() * n_tokens), int(useful[active].max()) - start))
            lengths = start + 1 + torch.arange(width)  # (m,) prefix lengths of this chunk
            page = token_rank[active, None, :] < lengths[None, :, None]  # (a, m, S)
            cand_scores = torch.where(page & ~masked[active, None], exact[active, None], work_scores[active, None])
            cand_c = torch.where(page, repaired_c[active, None], work_c[active, None])
            value = self.value_unless_over(cand_scores.reshape(-1, n_tokens),
                                           cand_c.reshape(-1, n_tokens)).reshape(-1, width)
            stop = (self._within(value) | (lengths[None, :] >= useful[active, None])) & (lengths[None, :] <= useful[active, None])
            stopped = stop.any(-1)
            final[active[stopped]] = lengths[stop.int().argmax(-1)[stopped]]
            active, start, chunk = active[~stopped], start + width, chunk * 2
        page = token_rank < final[:, None]
        hit = page & nonfinite
        if hit.any():  # the loop would have raised on paging this block
            row = int(hit.any(-1).nonzero()[0])
            block = int(order[row, token_rank[row][hit[row]].min()])
            raise ValueError(f"pager returned non-finite exact logits for block {block} of cell {source.cell(int(rows[row]))}")
        scores[rows] = torch.where(page & ~masked, exact, work_scores)
        c[rows] = torch.where(page, repaired_c, work_c)
        for step in range(int(final.max())):  # round by round, as the loop records them
            took = final > step
            pages.add(rows[took], order[took, step], torch.zeros(int(took.sum()), dtype=torch.int64))
        return pages

    def _within(self, value: torch.Tensor) -> torch.Tensor:
        """``value <= tau``, decided in fp64 where ``tau`` is exact (an fp32 comparison rounds ``tau``, maybe up)."""
        return value.double() <= self.tau

    def _repair_whole(self, scores: torch.Tensor, c: torch.Tensor, rows: torch.Tensor, source) -> "_Pages":
        """Page every block with a positive ``X_j`` of every fired row, at once, in place."""
        pages = _Pages()
        if not rows.numel():
            return pages
        work_scores, work_c = scores[rows], c[rows]  # (n, S)
        local, blocks = (log_block_excess(work_scores, work_c, self.block_size) > -math.inf).nonzero(as_tuple=True)
        moved = self.splice(work_scores, work_c, rows, blocks, local, source)
        pages.add(rows[local], blocks, moved)
        scores[rows], c[rows] = work_scores, work_c
        return pages

    def splice(self, scores, c, rows, blocks, which, source) -> torch.Tensor:
        """Splice exact logits of the requested blocks into (n, S) ``scores``; their ``c`` becomes 0.

        ``which`` selects the local rows that page (a bool mask with one block each, or one local
        row index per page); ``blocks`` the block of each. Masked tokens stay masked. Returns the
        bytes moved per page. ``c`` of a repaired token is the cast's rounding slack (0 unless
        the exact logits were more precise than ``scores``).
        """
        if which.dtype == torch.bool:
            which, blocks = which.nonzero().flatten(), blocks[which]
        if not which.numel():
            return torch.zeros(0, dtype=torch.int64)
        n_blocks = -(-scores.shape[-1] // self.block_size)
        chosen = torch.zeros(scores.shape[0], n_blocks, dtype=torch.bool, device=scores.device)
        chosen[which, blocks] = True
        page = chosen.repeat_interleave(self.block_size, dim=-1)[:, : scores.shape[-1]]  # (n, S)
        exact, slack, moved = source.fetch(rows, which, blocks)  # (n, S), (n, S), (pages,)
        masked = torch.isneginf(scores)
        live = page & ~masked
        bad = (live & ~torch.isfinite(exact)).any(dim=-1)
        if bad.any():
            row = int(bad.nonzero()[0])
            block = int(blocks[which == row][0])
            raise ValueError(f"pager returned non-finite exact logits for block {block} of cell {source.cell(int(rows[row]))}")
        scores.copy_(torch.where(live, exact, scores))
        c.copy_(torch.where(page, torch.where(masked, torch.zeros_like(slack), slack), c))
        return moved

    def page_source(self, scores, c_dtype, pager=None, exact=None):
        """Where repaired blocks' exact logits come from: ``exact`` logits in memory (0 bytes moved) or a ``pager``
        (one call per page); the source's ``fetch(rows, which, blocks)`` serves :meth:`splice`."""
        if (pager is None) == (exact is None):
            raise ValueError("give exactly one of pager (exact logits per block) and exact (exact logits (..., S))")
        if exact is not None:
            return _ExactSource(exact, scores, c_dtype)
        pager_blocks = getattr(pager, "block_size", self.block_size)
        if pager_blocks != self.block_size:
            raise ValueError(f"pager pages blocks of {pager_blocks} tokens; this gate's block_size is {self.block_size}")
        return _PagerSource(pager, scores.shape, self.block_size, scores.dtype, c_dtype)

    def _inputs(self, scores, c, radius) -> tuple[torch.Tensor, torch.Tensor]:
        if (c is None) == (radius is None):
            raise ValueError("give exactly one of c (Tier A, per token) and radius (Tier B, per block)")
        if radius is not None:
            n_tokens = scores.shape[-1] if isinstance(scores, torch.Tensor) and scores.dim() else 0
            c = expand_block_radius(radius, self.block_size, n_tokens)
        scores, c = check_scores_and_bounds(scores, c)
        return scores, c.contiguous()


class _Pages:
    """Pages made by one call, as flat (row, block, bytes) tensors gathered round by round."""

    def __init__(self):
        self.rows, self.blocks, self.bytes = [], [], []

    def add(self, rows: torch.Tensor, blocks: torch.Tensor, moved: torch.Tensor) -> None:
        self.rows.append(rows.cpu())
        self.blocks.append(blocks.cpu())
        self.bytes.append(moved.cpu())

    def ordered(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, blocks, bytes) by row, each row's pages in the order they were made."""
        if not self.rows:
            empty = torch.zeros(0, dtype=torch.int64)
            return empty, empty, empty
        rows, blocks, moved = torch.cat(self.rows), torch.cat(self.blocks), torch.cat(self.bytes)
        order = torch.sort(rows, stable=True).indices
        return rows[order], blocks[order], moved[order]


class _ExactSource:
    """Exact logits already in memory, (..., S) like ``scores``: every page moves 0 bytes."""

    def __init__(self, exact, scores: torch.Tensor, c_dtype: torch.dtype):
        if not isinstance(exact, torch.Tensor) or not torch.is_floating_point(exact):
            raise ValueError("exact must be a floating tensor (..., S) of exact logits")
        if exact.shape != scores.shape:
            raise ValueError(f"exact has shape {tuple(exact.shape)}, scores {tuple(scores.shape)}; they must agree")
        self.shape = scores.shape[:-1]
        flat = exact.reshape(-1, scores.shape[-1]).to(scores.device)
        self.exact = flat.to(scores.dtype)
        self.slack = None if flat.dtype == scores.dtype else _cast_slack(flat, self.exact, c_dtype)

    def logits(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact logits of rows ``rows`` (n, S) in the scores' dtype and their cast's rounding slack."""
        exact = self.exact[rows]
        return exact, torch.zeros_like(exact) if self.slack is None else self.slack[rows]

    def fetch(self, rows, which, blocks):
        return *self.logits(rows), torch.zeros(which.shape[0], dtype=torch.int64)

    def cell(self, row: int) -> tuple:
        return _cell(row, self.shape)


class _PagerSource:
    """A ``(cell, block) -> PageIn`` pager, called once per page."""

    def __init__(self, pager: Pager, shape: torch.Size, block_size: int, dtype: torch.dtype, c_dtype: torch.dtype):
        self.pager, self.shape, self.block_size = pager, shape[:-1], block_size
        self.n_tokens, self.dtype, self.c_dtype = shape[-1], dtype, c_dtype

    def fetch(self, rows, which, blocks):
        """The pages of one round: (n, S) exact logits and their slack, and the bytes per page. A pager with a
        ``pages(cells, blocks)`` method (:class:`witcert.gate.repair.LayerPager`) is asked once for all of them;
        the slack is formed once over every paged token (elementwise: the same values page by page)."""
        logits = torch.zeros(rows.shape[0], self.n_tokens, dtype=torch.float64, device=rows.device)
        error = torch.zeros_like(logits)
        moved = torch.zeros(which.shape[0], dtype=torch.int64)
        locals_, block_list = which.tolist(), blocks.tolist()
        cells = [self.cell(int(rows[local])) for local in locals_]
        pages = self._pages(cells, block_list)
        for i, (local, block, cell, page) in enumerate(zip(locals_, block_list, cells, pages)):
            tokens = block_tokens(block, self.block_size, self.n_tokens)
            if not isinstance(page, PageIn):
                raise ValueError(f"pager must return a PageIn, got {type(page).__name__}")
            page_logits = page.logits.reshape(-1)
            if page_logits.shape[0] != tokens.stop - tokens.start:
                raise ValueError(
                    f"pager returned {page_logits.shape[0]} logits for block {block} of cell {cell}; "
                    f"it holds {tokens.stop - tokens.start} tokens (do the gate's and the store's block sizes agree?)"
                )
            logits[local, tokens] = page_logits.to(device=logits.device, dtype=torch.float64)  # exact: fp64 holds any
            error[local, tokens] = _page_error(page, cell, block).to(logits.device)
            moved[i] = int(page.nbytes)
        exact = logits.to(self.dtype)
        return exact, _cast_slack(logits, exact, self.c_dtype, error), moved

    def _pages(self, cells: list, blocks: list) -> list:
        """The pager's answers for the (cell, block) pages, in one call when it pages in batches."""
        many = getattr(self.pager, "pages", None)
        if callable(many):
            pages = list(many(cells, blocks))
            if len(pages) != len(cells):
                raise ValueError(f"pager.pages returned {len(pages)} pages for {len(cells)} requests")
            return pages
        return [self.pager(cell, block) for cell, block in zip(cells, blocks)]

    def cell(self, row: int) -> tuple:
        return _cell(row, self.shape)


def _cell(row: int, shape: torch.Size) -> tuple:
    """Index tuple of flat row ``row`` in leading shape ``shape`` (``()`` for a single cell)."""
    return tuple(int(i) for i in np.unravel_index(row, tuple(shape))) if len(shape) else ()


def _result(gate: Gate, before, after, fired, scores, c, pages: _Pages, source) -> GateResult:
    rows, blocks, moved = pages.ordered()
    n_rows, n_blocks = fired.numel(), -(-scores.shape[-1] // gate.block_size)
    paged = torch.zeros(n_rows, n_blocks, dtype=torch.bool)
    paged[rows, blocks] = True
    return GateResult(
        tau=float(gate.tau),
        mode=gate.mode,
        before=before,
        after=after,
        fired=fired,
        reached=gate._within(after),
        unreachable=fired & ~gate._within(after),
        blocks=torch.bincount(rows, minlength=n_rows).reshape(fired.shape),
        bytes=torch.zeros(n_rows, dtype=torch.int64).index_add_(0, rows, moved).reshape(fired.shape),
        scores=scores,
        c=c,
        pages=tuple((source.cell(r), b) for r, b in zip(rows.tolist(), blocks.tolist())),
        paged=paged.reshape(fired.shape + (n_blocks,)),
    )


def _page_error(page: PageIn, cell: tuple, block: int) -> torch.Tensor:
    """The page's own logit error bound as an fp64 tensor (checked: >= 0, not NaN)."""
    error = torch.as_tensor(page.error, dtype=torch.float64)
    if torch.isnan(error).any() or (error < 0).any():
        raise ValueError(f"pager returned a negative or NaN logit error for block {block} of cell {cell}")
    return error


def _cast_slack(logits: torch.Tensor, cast: torch.Tensor, dtype: torch.dtype, error=0.0) -> torch.Tensor:
    """Bound on ``|cast - exact logits|`` in ``dtype``, rounded up: the repaired tokens' new ``c``.

    ``error`` bounds ``|logits - exact logits|`` (0: the pager's logits are exact). When a pager
    returns fp64 logits for fp32 scores, the cast rounds them too; this slack keeps the
    recomputed meter sound with respect to the exact logits. The fp64 difference of a value
    and its fp32 rounding is exact (Sterbenz); the sum with ``error`` and the final cast are
    rounded up.
    """
    slack = (cast.to(torch.float64) - logits.to(device=cast.device, dtype=torch.float64)).abs()
    slack = torch.nan_to_num(slack, nan=0.0)  # masked tokens (-inf - -inf): no mass, no bound needed
    error = torch.as_tensor(error, dtype=torch.float64, device=slack.device)
    if bool((error > 0).any()):
        slack = torch.where(error > 0, rounding.add_up(slack, error), slack)
    return rounding.round_up_to(slack, dtype)

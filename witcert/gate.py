"""Meter-driven gating with block-level repair (DESIGN.md §3).

A :class:`Gate` decides, per (layer, head) cell or per request, whether the compressed
attention is close enough to exact, and if not pages exact blocks in until it is.

Usage (the API is this small)::

    gate = witcert.Gate(tau=0.2)                      # certified: tau < 1
    result = gate(scores, c, pager=pager)             # scores, c: (..., S)
    result.label        # "certified (tau=0.2 < 1): ..." or "risk-ranked (tau=5 >= 1): no guarantee"
    result.scores, result.c                           # after repair: exact logits, c = 0 there
    result.blocks, result.bytes                       # per cell; result.bytes_paged in total

``scores`` are the compressed logits (scaled; ``-inf`` masks), ``c`` the per-token logit-error
bounds (Tier A); for a Tier B shared block radius pass ``radius=`` (..., n_blocks) instead.
``pager(cell, block) -> PageIn`` returns the exact logits of that block's tokens for that cell
and the bytes it moved; :class:`witcert.repair.LayerPager` is the production pager (backing
store -> verified page-in -> persistent write-back, witness zeroed, repair cache, telemetry)::

    store = witcert.BackingStore(block_size=16)
    store.write(layer, k_exact, v_exact)              # on every cache write, (*lead, T, d)
    repairer = witcert.Repairer(store)                # one per request
    pager = witcert.LayerPager(repairer, layer, q, sm_scale, group=Hq // Hkv,
                               k_cache=k_hat, witness=w)   # q: (*cells, d), cells = scores.shape[:-1]
    result = witcert.Gate(0.2, block_size=16)(scores, c, pager=pager)
    repairer.telemetry[(layer, (b, kv_head))]         # page_ins, bytes, repaired_slots, cache_hits

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
(:mod:`witcert.blocks`, Lemma 4 ``L4``), recomputing ``p~``, ``X`` and the real meter after
every page-in, until the gated value is ``<= tau`` or nothing is left to repair.
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

from witcert.blocks import block_tokens, expand_block_radius, log_block_excess
from witcert.meter import meter, risk_score
from witcert.validate import check_scores_and_bounds

MODES = ("certified", "risk")
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
    """

    logits: torch.Tensor
    nbytes: int


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
        Every repair in order.
    """

    tau: float
    mode: str
    before: torch.Tensor
    after: torch.Tensor
    fired: torch.Tensor
    reached: torch.Tensor
    blocks: torch.Tensor
    bytes: torch.Tensor
    scores: torch.Tensor
    c: torch.Tensor
    pages: tuple = field(default=(), repr=False)

    @property
    def certified(self) -> bool:
        """True for the certified regime (``tau < 1``): ``after <= tau`` is a proved TV bound."""
        return self.mode == "certified"

    @property
    def label(self) -> str:
        """The regime label that must accompany every gating number."""
        if self.certified:
            return f"certified (tau={self.tau:g} < 1): meter <= tau is a proved TV bound"
        return f"risk-ranked (tau={self.tau:g} >= 1): raw risk score, no guarantee"

    @property
    def bytes_paged(self) -> int:
        """Total bytes newly paged in by this call."""
        return int(self.bytes.sum())


@dataclass(frozen=True)
class Gate:
    """Meter-driven gate with block-level repair (DESIGN.md §3; soundness from Theorem 1 ``T1``).

    Parameters
    ----------
    tau : float
        Threshold, ``>= 0``. ``tau < 1``: certified; ``tau >= 1``: risk-ranked.
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
        if self.tau < 0 or math.isinf(self.tau):
            raise ValueError(f"tau must be finite and >= 0, got {self.tau!r}")
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

    def __call__(self, scores, c=None, *, radius=None, pager: Pager) -> GateResult:
        """Gate and repair.

        Parameters
        ----------
        scores : Tensor (..., S)
            Compressed logits, scaled; ``-inf`` masks a token.
        c : Tensor broadcastable to (..., S), optional
            Tier A per-token bounds (``>= 0``). Exactly one of ``c`` and ``radius``.
        radius : Tensor (..., n_blocks), optional
            Tier B shared radius per block of ``block_size`` tokens.
        pager : callable ``(cell, block) -> PageIn``

        Returns
        -------
        GateResult
        """
        scores, c = self._inputs(scores, c, radius)
        pager_blocks = getattr(pager, "block_size", self.block_size)
        if pager_blocks != self.block_size:
            raise ValueError(f"pager pages blocks of {pager_blocks} tokens; this gate's block_size is {self.block_size}")
        before = self.value(scores, c)  # (...)
        over = before > self.tau
        fired = over.clone() if self.granularity == "head" else over.any().expand(over.shape).clone()
        scores_after, c_after = scores.clone(), c.clone()
        blocks = torch.zeros(over.shape, dtype=torch.int64)
        nbytes = torch.zeros(over.shape, dtype=torch.int64)
        pages = []
        for cell in map(tuple, np.argwhere(fired.cpu().numpy())):
            cell = tuple(int(i) for i in cell)
            for block, moved in self._repair_cell(cell, scores_after[cell], c_after[cell], pager):
                pages.append((cell, block))
                blocks[cell] += 1
                nbytes[cell] += moved
        after = self.value(scores_after, c_after)
        return GateResult(
            tau=float(self.tau),
            mode=self.mode,
            before=before,
            after=after,
            fired=fired,
            reached=after <= self.tau,
            blocks=blocks,
            bytes=nbytes,
            scores=scores_after,
            c=c_after,
            pages=tuple(pages),
        )

    def _repair_cell(self, cell: tuple, scores: torch.Tensor, c: torch.Tensor, pager: Pager):
        """Repair one cell in place (``scores``, ``c`` are views of its row); yield (block, bytes)."""
        if self.repair == "whole":
            log_x = log_block_excess(scores, c, self.block_size)  # (nb,)
            for block in torch.nonzero(log_x > -math.inf).flatten().tolist():
                yield block, self._page(cell, block, scores, c, pager)
            return
        while self.value(scores, c) > self.tau:
            log_x = log_block_excess(scores, c, self.block_size)  # (nb,), recomputed: p~ moved
            block = int(torch.argmax(log_x))
            if log_x[block] == -math.inf:
                return  # nothing left to repair (masked or already exact everywhere)
            yield block, self._page(cell, block, scores, c, pager)

    def _page(self, cell: tuple, block: int, scores: torch.Tensor, c: torch.Tensor, pager: Pager) -> int:
        """Splice the exact logits of one block in; set its bounds to 0. Returns bytes moved."""
        tokens = block_tokens(block, self.block_size, scores.shape[-1])
        page = pager(cell, block)
        if not isinstance(page, PageIn):
            raise ValueError(f"pager must return a PageIn, got {type(page).__name__}")
        exact = page.logits.to(device=scores.device, dtype=scores.dtype).reshape(-1)
        if exact.shape[0] != tokens.stop - tokens.start:
            raise ValueError(
                f"pager returned {exact.shape[0]} logits for block {block} of cell {cell}; "
                f"it holds {tokens.stop - tokens.start} tokens (do the gate's and the store's block sizes agree?)"
            )
        masked = torch.isneginf(scores[tokens])
        if not torch.isfinite(exact[~masked]).all():
            raise ValueError(f"pager returned non-finite exact logits for block {block} of cell {cell}")
        scores[tokens] = torch.where(masked, scores[tokens], exact)
        slack = _cast_slack(page.logits.reshape(-1), exact, c.dtype)  # 0 unless the cast rounded
        c[tokens] = torch.where(masked, torch.zeros_like(slack), slack)
        return int(page.nbytes)

    def _inputs(self, scores, c, radius) -> tuple[torch.Tensor, torch.Tensor]:
        if (c is None) == (radius is None):
            raise ValueError("give exactly one of c (Tier A, per token) and radius (Tier B, per block)")
        if radius is not None:
            n_tokens = scores.shape[-1] if isinstance(scores, torch.Tensor) and scores.dim() else 0
            c = expand_block_radius(radius, self.block_size, n_tokens)
        scores, c = check_scores_and_bounds(scores, c)
        return scores, c.contiguous()


def _cast_slack(logits: torch.Tensor, cast: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bound on ``|cast - logits|`` in ``dtype``, rounded up: the repaired tokens' new ``c``.

    0 when the pager's logits already have the scores' dtype. When a pager returns fp64 logits
    for fp32 scores, the cast rounds them; this slack keeps the recomputed meter sound with
    respect to the pager's (more precise) exact logits. fp64 differences of a value and its
    fp32 rounding are exact (Sterbenz), the final cast is stepped up where it rounded down.
    """
    slack = (cast.to(torch.float64) - logits.to(device=cast.device, dtype=torch.float64)).abs()
    slack = torch.nan_to_num(slack, nan=0.0)  # masked tokens (-inf - -inf): no mass, no bound needed
    out = slack.to(dtype)
    below = out.to(torch.float64) < slack
    return torch.where(below, torch.nextafter(out, torch.full_like(out, math.inf)), out)

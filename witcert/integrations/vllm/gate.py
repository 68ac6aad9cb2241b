"""The gate inside the engine: which blocks of a decode step to repair, paged from the exact store.

For the gated decode rows of one layer's step, :func:`plan` runs :class:`witcert.gate.policy.Gate`
(certified, ``tau < 1``; Theorem 1 ``T1``) on the cells' compressed logits and per-token bounds:
blocks of ``gate_block`` tokens are paged in by decreasing contribution ``X_j`` (Lemma 4 ``L4``),
the meter recomputed after each, until it is ``<= tau`` or nothing is left. The :class:`Pager`
serves each (cell, block) from the content-checked :class:`~.exact_store.ExactStore` (one
verified page-in per (request, block) and step, shared by the query heads) and returns the exact
logits with the fp64 rounding of their dot products as their error.

The plan is the union, over query heads, of the blocks paged: their exact keys and values (every
kv head of those slots). The backend writes them back through vLLM's writer (persistent: a
repaired slot keeps witness 0 until vLLM writes the slot again), recomputes the step's attention
and meters again from the cache read back: the reported meter is that one, never the gate's
prediction.
"""
from dataclasses import dataclass

import torch

from witcert.gate.policy import Gate, PageIn

_U64 = 2.0**-53


def slots_of(blocks: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Cache slots of a sequence's first ``length`` tokens from its block ids (in order)."""
    positions = torch.arange(length)
    return blocks[positions // block_size] * block_size + positions % block_size


@dataclass(frozen=True)
class Plan:
    """Slots to write back (N,), their exact keys and values (N, Hkv, d), and the repaired blocks."""

    slots: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    blocks: int


class Pager:
    """``(cell, block) -> PageIn`` over the exact store, for cells ``(row, query head)``.

    Parameters
    ----------
    store : ExactStore
    q : Tensor (R, Hq, d)
        The gated rows' decode queries.
    blocks_of, lens : per row, its cache block ids and its length.
    block_size : int
        vLLM's cache block size (slots).
    gate_block : int
        Tokens per repair block.
    scale : float
        Softmax scale.
    """

    def __init__(self, store, q, blocks_of, lens, block_size: int, gate_block: int, scale: float):
        self.store, self.q, self.lens, self.scale = store, q.to(torch.float64), lens, scale
        self.block_size = gate_block
        self.slots = [slots_of(b, n, block_size) for b, n in zip(blocks_of, lens)]
        self.groups = q.shape[1] // store.k.shape[1]
        self.pages = {}  # (row, block) -> (slots, k, v)
        self.bytes = 0
        self.n_tokens = max(lens)  # the cells' padded length (set by plan)

    def fetch(self, row: int, block: int):
        """The verified exact rows of block ``block`` of row ``row`` (paged in once)."""
        page = self.pages.get((row, block))
        if page is None:
            start = block * self.block_size
            slots = self.slots[row][start: min(start + self.block_size, self.lens[row])]
            k, v = self.store.page_in(slots)
            page = self.pages[(row, block)] = (slots, k, v)
            self.bytes += slots.numel() * self.store.row_bytes
        return page

    def __call__(self, cell: tuple, block: int) -> PageIn:
        row, head = cell
        new = (row, block) not in self.pages
        slots, k, _ = self.fetch(row, block)
        kv = k[:, head // self.groups].to(torch.float64)  # (n, d)
        qh = self.q[row, head]
        d = qh.shape[0]
        logits = self.scale * (kv @ qh)
        gamma = (d + 2) * _U64 / (1 - (d + 2) * _U64)
        error = (2 * gamma * self.scale / (1 - gamma)) * (kv.abs() @ qh.abs())  # as metering.score_slack
        width = self.width(block)
        pad = width - logits.shape[0]  # tokens of the gate's block past this row's length (masked)
        if pad:
            logits = torch.cat([logits, logits.new_zeros(pad)])
            error = torch.cat([error, error.new_zeros(pad)])
        return PageIn(logits=logits, nbytes=slots.numel() * self.store.row_bytes if new else 0, error=error)

    def width(self, block: int) -> int:
        start = block * self.block_size
        return min(start + self.block_size, self.n_tokens) - start


def plan(scores: torch.Tensor, c: torch.Tensor, tau: float, gate_block: int, pager: Pager) -> Plan:
    """Run the certified gate on cells (R, Hq, S) and return the union of the blocks it paged."""
    return plan_of(pager, picks(scores, c, tau, gate_block, pager))


def picks(scores: torch.Tensor, c: torch.Tensor, tau: float, gate_block: int, pager: Pager) -> set:
    """The certified gate's ``(row, block)`` pairs for cells (R, Hq, S): any query head of the row paged the block."""
    pager.n_tokens = scores.shape[-1]
    result = Gate(tau, block_size=gate_block)(scores, c, pager=pager)
    return {tuple(p) for p in result.paged.any(dim=1).nonzero().tolist()}


def plan_of(pager: Pager, pairs) -> Plan:
    """The :class:`Plan` of ``(row, block)`` pairs (each paged once through ``pager``)."""
    if not pairs:
        empty = pager.store.k[:0]
        return Plan(slots=torch.zeros(0, dtype=torch.int64), k=empty, v=empty, blocks=0)
    pages = [pager.fetch(r, j) for r, j in sorted(pairs)]
    return Plan(slots=torch.cat([p[0] for p in pages]), k=torch.cat([p[1] for p in pages]),
                v=torch.cat([p[2] for p in pages]), blocks=len(pages))

"""Key groups read whole: the checked cells over one key history share its exact keys (registry SCO).

Cells that attend the same exact keys (one layer, batch row and kv head: the query heads over a kv head, the
queries of one call) form a group. When the group's history, the union of its cells' visible tokens not yet
known, has at most ``keys`` tokens per checked cell of the group, reading it whole costs no more keys per cell
than sampling may read, and gives every cell of the group its true TV (rounded up) with no failure
probability, as one cell with at most ``keys`` visible tokens is read whole. Each such cell's ``keys_read`` is
its share of the group's reads, ``ceil(history / cells of the group)``, so the group's cells together report at
least the keys the group read. :func:`witcert.spot.check_cells` reads groups whole when asked
(``read_groups=True``: the monitor's checks at the end of a forward call, :mod:`witcert.spot.deferred`).
"""
from __future__ import annotations

import torch


def whole_groups(fresh: torch.Tensor, groups: torch.Tensor, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(whole (N,) bool, shared (N,) int64)``: the cells whose group is read whole and each one's share of its reads.

    Parameters
    ----------
    fresh : (N, S) bool
        Each cell's visible tokens not known yet (the reads a whole read makes).
    groups : (N,) int64
        Each cell's group: cells of one group attend the same exact keys (token ``t`` is the same key for each).
    keys : int
        Most keys a cell may read: a group of ``n`` cells is read whole when its history is at most ``n keys``.
    """
    groups = torch.as_tensor(groups, dtype=torch.int64).reshape(-1)
    if groups.shape[0] != fresh.shape[0]:
        raise ValueError(f"groups: expected one group per cell ({fresh.shape[0]}), got {tuple(groups.shape)}")
    names, member = torch.unique(groups, return_inverse=True)
    history = torch.zeros(names.numel(), fresh.shape[1], dtype=torch.int32).index_add_(0, member, fresh.to(torch.int32))
    history = history > 0  # the union of the group's tokens
    size = torch.bincount(member, minlength=names.numel())
    reads = history.sum(-1)
    whole = (reads <= size * keys)[member]
    shared = (-(-reads // size))[member]  # ceil: the group's cells report at least its reads
    return whole, torch.where(whole, shared, 0)


def wanted_by_group(groups: torch.Tensor, wanted: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The key groups of cells asking for exact logits, what a dense read of each group fetches.

    Returns ``(names, member, first, head, tokens)``: the distinct groups (G,), each cell's group index (M,), each
    group's first cell (G,), and the union of each group's ``wanted`` (M, S) tokens as ``(group index, token)``
    pairs, by group then token (T,) each.
    """
    names, member = torch.unique(groups, return_inverse=True)
    union = torch.zeros(names.numel(), wanted.shape[1], dtype=torch.int32).index_add_(0, member, wanted.to(torch.int32))
    head, tokens = (union > 0).nonzero().unbind(-1)
    first = torch.full((names.numel(),), member.numel()).scatter_reduce(0, member, torch.arange(member.numel()), "amin")
    return names, member, first, head, tokens


def group_logits(queries: torch.Tensor, member: torch.Tensor, head: torch.Tensor, tokens: torch.Tensor,
                 keys: torch.Tensor, scale: float, width: int) -> torch.Tensor:
    """``(M, width)`` fp64 ``scale (q . k)`` of each cell's query ``queries`` (M, d) at its group's tokens (others 0):
    one matmul per group of its cells' queries against its keys ``keys`` (T, d), ordered as ``(head, tokens)`` of
    :func:`wanted_by_group`."""
    out = torch.zeros(queries.shape[0], width, dtype=torch.float64)
    sizes = torch.bincount(head, minlength=int(member.max()) + 1 if member.numel() else 0).tolist()
    for index, (rows, at) in enumerate(zip(keys.split(sizes), tokens.split(sizes))):
        if not at.numel():
            continue
        mine = (member == index).nonzero().reshape(-1)
        logits = (queries[mine] @ rows.T) * scale
        if at.numel() == width:  # the whole history, in order: rows of out, no scatter
            out[mine] = logits
        else:
            out[mine[:, None], at] = logits
    return out

"""The exact audit: a picked cell's bound is its true TV, from every exact key it sees (registry AU, ``keys=None``).

A picked cell of one pass (gathered per kv head, :class:`witcert.audit.cells.CellSet`) is bounded by

    TV(softmax(l), softmax(l~)),    l_t = (q . k_t) s + b_t,    l~_t = (q' . k~_t) s + b_t

over its visible tokens: ``k`` the exact keys (the exact cache, or in production the content-checked host backing
store, every row verified against the checksum of the bytes written), ``k~`` the keys attention read, ``q'`` the
query the attention kernel read (``q`` unless a query format quantizes it), ``b`` the additive mask term. Both
softmaxes are evaluated in fp64 and the TV is rounded up past that evaluation's error in any summation order
(:data:`witcert.spot.cell.TOKEN_SLACK` per visible token, then relative and absolute slack), as a spot check that
reads a cell whole does (:func:`witcert.spot.batched.inflated_rows`). No draw is made, so no check can fail: on
every outcome a picked cell with TV above ``tau`` is flagged, and the binomial limit gets the whole ``delta``
(``WitCert.measure_auditUpper_exact_le``). Nothing here reads a witness or a meter.
"""
from __future__ import annotations

import torch

from witcert.spot.batched import inflated_rows
from witcert.spot.gather import BackedKeys


def group_keys(keys, wanted: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Exact keys (B, Hkv, S, d) of the (row, kv head) groups ``wanted`` (B, Hkv) bool, as stored (zeros elsewhere).

    ``keys``: the exact cache (B, Hkv, S, d), returned as it is, or a :class:`~witcert.spot.gather.BackedKeys` (which
    checked that the store holds exactly the ``S`` tokens attended) whose wanted groups are read whole in one verified
    read (:meth:`~witcert.gate.backing_store.BackingStore.read_key_rows_at`: every row against the checksum of the
    bytes written)."""
    if not isinstance(keys, BackedKeys):
        return keys.detach()
    b, hkv = wanted.shape
    s = keys.length
    heads = wanted.reshape(-1).nonzero().reshape(-1)  # flat (row, kv head) of each wanted group
    if not heads.numel():
        return torch.zeros(b, hkv, s, head_dim)
    rows = keys.backing.read_key_rows_at(keys.layer, heads.repeat_interleave(s), torch.arange(s).repeat(heads.numel()))
    out = rows.new_zeros(b * hkv, s, head_dim)
    out[heads] = rows.view(heads.numel(), s, head_dim)
    return out.view(b, hkv, s, head_dim)


def true_tv_bounds(query: torch.Tensor, served: torch.Tensor | None, read_keys: torch.Tensor,
                   exact_keys: torch.Tensor, visible: torch.Tensor, bias: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(bound, tv, keys)`` (B, Hkv, n) fp64 of gathered cells: the true TV rounded up, the TV as evaluated and the
    exact keys each saw (NaN bound and TV where a cell sees no token).

    ``query`` (B, Hkv, n, d) the cells' queries (head ``g`` reads kv head ``g``); ``served`` the queries the kernel
    read (``None``: ``query``); ``read_keys`` (B, Hkv, S, d) the keys attention read; ``exact_keys`` (B, Hkv, S, d)
    (:func:`group_keys`; both key tensors enter the logits in fp64); ``visible`` bool (B, Hkv, n, S); ``bias`` fp64
    (B, Hkv, n, S) or ``None``.
    """
    exact = _masked(_logits(query, exact_keys, scale, bias), visible)
    attended = _masked(_logits(query if served is None else served, read_keys, scale, bias), visible)
    tv = (torch.softmax(exact, dim=-1) - torch.softmax(attended, dim=-1)).abs().sum(-1) / 2
    blank = ~visible.any(-1)
    tv = tv.masked_fill(blank, torch.nan)
    seen = visible.sum(-1).to(torch.float64)
    bound = inflated_rows(tv, seen).masked_fill(blank, torch.nan)  # a NaN TV of a seen cell (overflow): the trivial 1
    return bound, tv, seen


def _logits(query: torch.Tensor, keys: torch.Tensor, scale: float, bias: torch.Tensor | None) -> torch.Tensor:
    logits = (query.to(torch.float64) @ keys.to(torch.float64).transpose(-1, -2)) * scale
    return logits if bias is None else logits + bias


def _masked(logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~visible, -torch.inf)

"""The picks of many audited requests at once, each under its own seed and rate: one Philox call (registry AU).

A serving step holds many audited requests, each with its own secret seed (the Philox key) and rate.
:func:`picked_rows` evaluates every request's cells in one call: the key and the threshold broadcast per
request, and every cell's counter is the one :func:`witcert.audit.picks.picked` forms, so each request's
picks are bit-identical to its own :func:`~witcert.audit.picks.picked` call (the words are a function of the
counter and key alone).
"""
from __future__ import annotations

import torch

from witcert.audit.counters import AUDIT_STREAM, WORD, _range, pick_threshold
from witcert.tier_b.philox import MASK32, philox4x32_10


def picked_rows(seeds, rates, requests, layers, heads: int, positions) -> torch.Tensor:
    """bool ``(L, B, Hq, T)``: whether cell (row ``b``'s request, layer ``layers[l]``, head ``h``, position
    ``positions[b, t]``) is picked under row ``b``'s seed and rate; row ``b`` equals
    ``picked(seeds[b], [requests[b]], layers, heads, positions[b], rates[b])[:, 0]``.

    Parameters
    ----------
    seeds : sequence of int
        Each row's audit key, in ``[0, 2^64)`` (B,).
    rates : sequence of float
        Each row's pick rate in ``(0, 1]`` (B,).
    requests : sequence or int64 tensor
        Each row's request id in the counter, below ``2^32`` (B,).
    layers : sequence or int64 tensor
        Layer indices (L,), below ``2^16``.
    heads : int
        Query heads ``Hq`` (at most ``2^16``).
    positions : int64 tensor or nested sequence (B, T)
        Each row's query positions, below ``2^32``.
    """
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64) (seeds: one per row), got {seed!r}")
    positions = _range("positions", positions, WORD)
    if positions.dim() != 2 or positions.shape[0] != len(seeds) or len(rates) != len(seeds):
        raise ValueError(f"positions must be (B, T) with B = len(seeds) = len(rates), got {tuple(positions.shape)}, "
                         f"{len(seeds)} seeds and {len(rates)} rates")
    requests = _range("requests", requests, WORD)
    if requests.numel() != len(seeds):
        raise ValueError(f"requests: one per row, got {requests.numel()} for {len(seeds)} rows")
    layers = _range("layers", layers, 2**16)
    head = _range("heads", torch.arange(heads), 2**16)
    shape = (layers.numel(), len(seeds), heads, positions.shape[1])
    c0 = positions.view(1, len(seeds), 1, -1).expand(shape)
    c1 = (head.view(1, 1, -1, 1) | (layers.view(-1, 1, 1, 1) << 16)).expand(shape)
    c2 = requests.view(1, -1, 1, 1).expand(shape)
    c3 = torch.full(shape, AUDIT_STREAM, dtype=torch.int64)
    key = torch.tensor([[s & MASK32, s >> 32] for s in seeds], dtype=torch.int64).reshape(1, -1, 1, 1, 2)
    words = philox4x32_10(torch.stack((c0, c1, c2, c3), dim=-1), key)
    threshold = torch.tensor([pick_threshold(r) for r in rates], dtype=torch.int64).view(1, -1, 1, 1)
    return words[..., 0] < threshold

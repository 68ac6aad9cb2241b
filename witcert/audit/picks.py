"""Which cells the audit picks: one Philox word per (request, layer, query head, position) (registry AU).

A cell is picked when the first output word of ``Philox4x32-10`` (:mod:`witcert.tier_b.philox`) at
its counter, under the audit's secret key, is below ``ceil(rate 2^32)``. The pick is therefore a
function of the cell's identity and the seed alone: the same in a step and at a deferred flush, in
any order of calls and batch rows, replayable from the seed, and independent of every query,
key and meter (none enters the counter). Distinct cells have distinct counters, and distinct
Philox counters are modelled as independent uniform words (the generator's modelling assumption,
as for Tier B's dither), so the picks are independent Bernoulli draws of probability
:func:`pick_probability`, within ``2^-32`` above ``rate``; the audit's limits use that exact probability.

Counter layout (each field range-checked, so the packing is injective)::

    c0 = query position    c1 = head | layer << 16    c2 = request id    c3 = AUDIT_STREAM
    key = (seed bits 0..31, seed bits 32..63)

``AUDIT_STREAM`` sets bits that Tier B's dither counters keep zero, so no audit counter equals a
dither counter even under the same key.
"""
from __future__ import annotations

import torch

from witcert.audit.counters import AUDIT_STREAM, WORD, _range, pick_probability, pick_threshold
from witcert.audit.row_picks import picked_rows  # the counters, formed in one place

__all__ = ["AUDIT_STREAM", "WORD", "pick_probability", "pick_threshold", "picked"]


def picked(seed: int, requests, layers, heads: int, positions, rate: float) -> torch.Tensor:
    """bool ``(L, B, Hq, T)``: whether cell (request ``requests[b]``, layer ``layers[l]``, head ``h``, position
    ``positions[t]``) is picked.

    Parameters
    ----------
    seed : int
        The audit's key, in ``[0, 2^64)``.
    requests, layers, positions : sequences or int64 tensors
        Request ids ``(B,)`` (below ``2^32``), layer indices ``(L,)`` (below ``2^16``), query positions ``(T,)``
        (below ``2^32``).
    heads : int
        Query heads ``Hq`` (at most ``2^16``).
    rate : float
        Pick rate in ``(0, 1]``.

    Raises
    ------
    ValueError
        A seed, rate or range out of bounds (checked once, by :func:`~witcert.audit.row_picks.picked_rows`).
    """
    requests = _range("requests", requests, WORD)
    positions = _range("positions", positions, WORD).reshape(1, -1).expand(requests.numel(), -1)
    b = requests.numel()
    return picked_rows([seed] * b, [rate] * b, requests, layers, heads, positions)

"""The audit's Philox counter fields and pick threshold, shared by :mod:`.picks` and :mod:`.row_picks` (registry AU).

The counter layout and why it is injective are stated in :mod:`witcert.audit.picks`.
"""
from __future__ import annotations

import math

import torch


AUDIT_STREAM = 0x0A0D17ED
"""Word ``c3`` of every audit counter (bits 0..29, which Tier B's counters leave zero)."""
WORD = 2**32


def pick_threshold(rate: float) -> int:
    """``ceil(rate 2^32)``: a cell is picked when its word is below it (exact: ``rate 2^32`` is a scaled float)."""
    if isinstance(rate, bool) or not 0.0 < float(rate) <= 1.0:
        raise ValueError(f"rate must lie in (0, 1], got {rate!r}")
    return math.ceil(float(rate) * WORD)


def pick_probability(rate: float) -> float:
    """The true probability that a cell is picked: ``ceil(rate 2^32) / 2^32``, at least ``rate``."""
    return pick_threshold(rate) / WORD


def _range(name: str, values: torch.Tensor, bound: int) -> torch.Tensor:
    values = torch.as_tensor(values, dtype=torch.int64)
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= bound):
        raise ValueError(f"{name} must lie in [0, {bound}) for the audit's counters, got {values.tolist()[:8]}")
    return values

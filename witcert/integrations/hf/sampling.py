"""Sampled metering: an operator's explicit choice to meter fewer cells (off by default).

``witcert.monitor(..., sample=MeterSampling(every=4, heads=0.5))`` meters a forward call only when
its query positions include a multiple of ``every`` (at decode time: every ``every``-th step), and
in a metered call only ``ceil(heads G)`` of the ``G`` query heads of each kv head, drawn anew per
(layer, call) from the sampling seed, so every kv head stays under watch. Nothing is inferred about
the cells left out: their meter and every other measurement are NaN and their ``metered`` column is
``False`` (the summary counts them as *unmetered*, never as certified). The selection is a function
of ``(seed, layer, last query position)`` alone, so a run's ``metered`` column can be replayed. A
gate or a spot check needs every cell's meter and is refused with sampling.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class MeterSampling:
    """Which cells a monitor meters: every ``every``-th step, ``heads`` of each kv head's query heads.

    ``seed``: the head draw's seed (default: drawn from the OS once per object; fix it to replay).
    """

    every: int = 1
    heads: float = 1.0
    seed: int = field(default_factory=lambda: secrets.randbits(62))

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be an int >= 1 (meter every every-th step), got {self.every!r}")
        if isinstance(self.heads, bool) or not isinstance(self.heads, (int, float)) or not 0.0 < self.heads <= 1.0:
            raise ValueError(f"heads must be a fraction in (0, 1] of each kv head's query heads, got {self.heads!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")

    def metered_call(self, first: int, end: int) -> bool:
        """Whether the call of query positions ``first .. end - 1`` holds a multiple of ``every``."""
        return (end - 1) // self.every >= -(-first // self.every)

    def heads_of(self, layer: int, first: int, end: int, hq: int, hkv: int) -> torch.Tensor | None:
        """The query heads metered in this call, ascending (``m`` per kv head, so head ``i`` of them reads kv head
        ``i // m``); an empty tensor when the call is not metered; ``None`` when every head is."""
        if not self.metered_call(first, end):
            return torch.empty(0, dtype=torch.long)
        groups = hq // hkv
        m = math.ceil(self.heads * groups)
        if m >= groups:
            return None
        draw = torch.Generator().manual_seed((self.seed * 1_000_003 + layer * 65_537 + end) % 2**63)
        picked = torch.rand(hkv, groups, generator=draw).argsort(-1)[:, :m].sort(-1).values
        return (picked + torch.arange(hkv)[:, None] * groups).reshape(-1)


def spread(cell: torch.Tensor, chosen: torch.Tensor, hq: int) -> torch.Tensor:
    """(B, m, Tq) measurements of the ``chosen`` heads as (B, Hq, Tq): NaN (``False`` for bool fields) elsewhere."""
    fill = False if cell.dtype == torch.bool else math.nan
    full = torch.full((cell.shape[0], hq, *cell.shape[2:]), fill, dtype=cell.dtype)
    full[:, chosen] = cell
    return full

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


@dataclass(frozen=True)
class Selection:
    """The metered cells of one metering pass over ``T`` query columns (one call, or a deferred run of calls):
    the ``columns`` (T,) bool of the queries metered, and for each of them its query heads, ``heads``
    (M, T') (``None``: every head). Every metered column keeps the same number M of heads, ``m`` per kv head
    in kv-head order, so head ``i`` of a picked tensor reads kv head ``i // m`` in every column."""

    columns: torch.Tensor
    heads: torch.Tensor | None
    hq: int

    @property
    def empty(self) -> bool:
        return not bool(self.columns.any())

    def pick(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Hq|1, T|1, ...) -> (B, M|1, T', ...): the metered cells' entries."""
        x = x.expand(x.shape[0], x.shape[1], self.columns.numel(), *x.shape[3:])
        kept = self.columns.nonzero().squeeze(-1)
        return x[:, :, kept] if self.heads is None or x.shape[1] == 1 else x[:, self.heads, kept]

    def spread(self, cell: torch.Tensor) -> torch.Tensor:
        """(B, M, T') measurements as (B, Hq, T): NaN (``False`` for bool fields) on the cells not metered."""
        fill = False if cell.dtype == torch.bool else math.nan
        full = torch.full((cell.shape[0], self.hq, self.columns.numel()), fill, dtype=cell.dtype)
        kept = self.columns.nonzero().squeeze(-1)
        if self.heads is None:
            full[:, :, kept] = cell
        else:
            full[:, self.heads, kept] = cell
        return full

    def metered(self, rows: int) -> torch.Tensor:
        """bool (rows, Hq, T): which cells were metered."""
        heads = self.hq if self.heads is None else self.heads.shape[0]
        return self.spread(torch.ones((rows, heads, int(self.columns.sum())), dtype=torch.bool))


def selection(sample: MeterSampling, layer: int, spans: list[tuple[int, int]], hq: int, hkv: int) -> Selection | None:
    """The cells ``sample`` meters in a pass over the calls of query positions ``first .. end - 1`` for each
    ``(first, end)`` of ``spans`` (in column order); ``None`` when it meters every one."""
    chosen = [sample.heads_of(layer, first, end, hq, hkv) for first, end in spans]
    if all(heads is None for heads in chosen):
        return None
    columns = torch.cat([torch.full((end - first,), heads is None or len(heads) > 0)
                         for heads, (first, end) in zip(chosen, spans)])
    kept = [(heads, end - first) for heads, (first, end) in zip(chosen, spans) if heads is None or len(heads)]
    if not kept or kept[0][0] is None:  # every head of each metered call (sampling by step only)
        return Selection(columns, None, hq)
    return Selection(columns, torch.cat([heads[:, None].expand(-1, width) for heads, width in kept], dim=1), hq)

"""The cells one metering pass meters when they are not a rectangle: picked cells gathered per kv head.

A pass over ``T`` query columns of ``Hq`` query heads sharing ``Hkv`` kv heads meters, for the audit,
a scattered set of (row, head, column) cells. :class:`CellSet` lays them out as a call of ``Hkv``
query heads (one per kv head, so head ``g`` of the gathered tensor reads kv head ``g``) and ``n``
query columns, ``n`` the most cells any (row, kv head) holds; a (row, kv head) with fewer cells
repeats one of them (its results are discarded). Any meter that takes a (B, Hq, Tq, d) call with GQA
takes the gathered one unchanged; :meth:`CellSet.spread` puts the results back on the full grid.
The same interface as :class:`witcert.integrations.hf.sampling.Selection` (``empty``, ``pick``,
``spread``, ``metered``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CellSet:
    """Cells of a (B, Hq, T) grid gathered as (B, Hkv, n).

    ``heads``/``columns`` (B, Hkv, n) int64: the query head and column of each gathered cell; ``real`` (B, Hkv, n)
    bool: not a repeat; ``audited`` (B, Hkv, n) bool: picked by the audit (the others are metered for sampled
    metering only); ``shape`` the full grid (B, Hq, T).
    """

    heads: torch.Tensor
    columns: torch.Tensor
    real: torch.Tensor
    audited: torch.Tensor
    shape: tuple[int, int, int]

    @classmethod
    def of(cls, picked: torch.Tensor, kv_heads: int, sampled: torch.Tensor | None = None) -> "CellSet":
        """The cells ``picked | sampled`` of a bool (B, Hq, T) grid (``sampled``: cells metered for sampling)."""
        b, hq, t = picked.shape
        if hq % kv_heads:
            raise ValueError(f"kv_heads={kv_heads} must divide the {hq} query heads")
        wanted = picked if sampled is None else picked | sampled
        index = wanted.nonzero()  # (K, 3) sorted by row, head, column: each (row, kv head) group is contiguous
        group = index[:, 0] * kv_heads + index[:, 1] // (hq // kv_heads)
        counts = torch.bincount(group, minlength=b * kv_heads)
        width = max(int(counts.max()) if index.numel() else 0, 1)
        rank = torch.arange(index.shape[0]) - (torch.cumsum(counts, 0) - counts)[group]
        first = torch.arange(kv_heads) * (hq // kv_heads)  # a repeat reads column 0 of the group's first head
        heads = first.repeat(b).view(b * kv_heads, 1).expand(-1, width).clone()
        columns = torch.zeros(b * kv_heads, width, dtype=torch.int64)
        real = torch.zeros(b * kv_heads, width, dtype=torch.bool)
        heads[group, rank], columns[group, rank], real[group, rank] = index[:, 1], index[:, 2], True
        has = counts > 0  # repeat a real cell of the group where there is one
        heads[has] = torch.where(real[has], heads[has], heads[has, :1])
        columns[has] = torch.where(real[has], columns[has], columns[has, :1])
        audited = torch.zeros_like(real)
        audited[group, rank] = picked[index[:, 0], index[:, 1], index[:, 2]]
        grid = (b, kv_heads, width)
        return cls(heads.view(grid), columns.view(grid), real.view(grid), audited.view(grid), (b, hq, t))

    @property
    def empty(self) -> bool:
        return not bool(self.real.any())

    def _rows(self) -> torch.Tensor:
        return torch.arange(self.shape[0]).view(-1, 1, 1).expand_as(self.heads)

    def pick(self, x: torch.Tensor) -> torch.Tensor:
        """(B|1, Hq|1, T|1, ...) -> (B, Hkv, n, ...): the gathered cells' entries."""
        b, hq, t = self.shape
        full = x.expand(b, hq if x.shape[1] != 1 else 1, t, *x.shape[3:])
        heads = self.heads if full.shape[1] != 1 else torch.zeros_like(self.heads)
        return full[self._rows(), heads, self.columns]

    def spread(self, cell: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, n) results as (B, Hq, T): NaN (``False`` for bool fields) on the cells not gathered."""
        fill = False if cell.dtype == torch.bool else math.nan
        full = torch.full(self.shape, fill, dtype=cell.dtype)
        real = self.real
        full[self._rows()[real], self.heads[real], self.columns[real]] = cell.cpu()[real]
        return full

    def metered(self, rows: int | None = None) -> torch.Tensor:
        """bool (B, Hq, T): which cells this pass meters."""
        return self.spread(torch.ones(self.heads.shape, dtype=torch.bool))

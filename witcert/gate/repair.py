"""Persistent repair: page exact blocks in once per request, write them back, keep telemetry.

The paper's naive gate re-paged the whole request every time a new token's witness re-fired
it (1267 GiB on gated fp8); filtering already-repaired slots brought that to 30.9 GiB. Here:

- :class:`Repairer` owns the request-level state over a :class:`~witcert.gate.backing_store.BackingStore`:
  which slots are repaired (a slot is delivered at most once per request), a repair cache of
  the exact blocks already paged in (a re-request is a cache hit that moves 0 bytes), and
  per-(layer, head) :class:`HeadTelemetry` (page-ins, bytes, repaired slots, cache hits).
- :class:`LayerPager` is the pager a :class:`~witcert.gate.policy.Gate` calls for one layer: it maps a
  gate cell to its kv head (GQA), fetches the block through the repairer, writes the exact
  keys (and values) back into the compressed cache, zeroes the witness of those slots, and
  returns the exact logits; :meth:`LayerPager.pages` does a round's pages at once (one batched
  fp64 pass for their logits and error bounds).
- :meth:`Repairer.mask_repaired` zeroes ``c`` (or a Tier B radius expanded per token) on
  repaired slots for the next step, so the gate never selects a repaired slot again.

Bytes are counted per slot delivered to the cache: a block that grew since its last repair
(decode appends into the last block) delivers only its new slots. The store itself still reads
and verifies the whole block on the host (``BackingStore.bytes_paged`` counts those reads).
``persistent=False`` is the paper's naive re-paging, kept only as a measurement baseline.
"""
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np
import torch

from witcert.core import rounding
from witcert.gate.backing_store import BackingStore, PagedBlock
from witcert.gate.policy import PageIn


@dataclass
class HeadTelemetry:
    """Gate telemetry of one (layer, kv head): what repair cost there."""

    page_ins: int = 0  # blocks read (verified) from the backing store
    bytes: int = 0  # bytes delivered to the cache (new slots only when persistent)
    repaired_slots: int = 0  # distinct token slots made exact
    cache_hits: int = 0  # repair requests served with no new slot to deliver


@dataclass
class Repairer:
    """Request-level repair state over an exact backing store.

    Parameters
    ----------
    store : BackingStore
    persistent : bool
        True (default): remember repaired slots and cached blocks for the request. False: the
        naive baseline that pages the whole block again on every request.
    """

    store: BackingStore
    persistent: bool = True
    telemetry: dict = field(default_factory=dict)  # (key, index) -> HeadTelemetry
    _cache: dict = field(default_factory=dict, repr=False)  # (key, index, block) -> PagedBlock
    _repaired: dict = field(default_factory=dict, repr=False)  # key -> bool ndarray (*lead, tokens)

    def __post_init__(self):
        if not isinstance(self.store, BackingStore):
            raise ValueError(f"store must be a BackingStore, got {type(self.store).__name__}")

    @property
    def block_size(self) -> int:
        return self.store.block_size

    def fetch(self, key: Hashable, index: tuple[int, ...], block: int) -> tuple[PagedBlock, int]:
        """Exact block for a repair, and the bytes newly delivered for it.

        Persistent: a block whose written slots are all repaired is served from the repair
        cache (0 bytes, a cache hit); otherwise it is paged in (verified) and only the slots
        not yet repaired are counted and marked. Not persistent: always paged in, all counted.
        """
        index = tuple(int(i) for i in index)
        stats = self.telemetry.setdefault((key, index), HeadTelemetry())
        cache_key = (key, index, int(block))
        cached = self._cache.get(cache_key)
        n_tokens = self._block_len(key, block)
        if self.persistent and cached is not None and cached.k.shape[0] == n_tokens:
            stats.cache_hits += 1
            return cached, 0
        paged = self.store.page_in(key, index, block)
        stats.page_ins += 1
        if not self.persistent:
            stats.bytes += paged.nbytes
            return paged, paged.nbytes
        fresh = ~self._mask(key)[index][paged.tokens]  # (n,) slots not yet repaired
        new_bytes = int(fresh.sum()) * paged.nbytes // n_tokens
        self._mask(key)[index][paged.tokens] = True
        self._cache[cache_key] = paged
        stats.bytes += new_bytes
        stats.repaired_slots += int(fresh.sum())
        if new_bytes == 0:
            stats.cache_hits += 1
        return paged, new_bytes

    def repaired_tokens(self, key: Hashable) -> torch.Tensor:
        """BoolTensor (*lead, S): slots of stream ``key`` repaired in this request."""
        return torch.from_numpy(self._mask(key).copy())

    def mask_repaired(self, key: Hashable, c: torch.Tensor, group: int = 1) -> torch.Tensor:
        """``c`` with 0 on repaired slots (persistent repair for the next gate call).

        Sound only when the scores of those slots are computed from the exact keys (the
        cache was written back through :class:`LayerPager` ``k_cache``, or the scores come from
        a repaired ``GateResult``); with a compressed cache left in place, ``c = 0`` is false.

        Parameters
        ----------
        c : Tensor (*lead', *extra, S)
            Per-token bounds whose leading dims start with the stream's ``lead`` (``lead'`` equals
            ``lead`` with the last dim multiplied by ``group`` for GQA query heads), followed by
            any extra dims (e.g. query positions); ``S`` = the stream length.
        group : int
            Query heads per kv head.
        """
        mask = self.repaired_tokens(key)  # (*lead, S)
        lead = mask.shape[:-1]
        if group != 1:
            if not lead:
                raise ValueError("group > 1 needs a stream with a head dim in its leading shape")
            mask = mask.repeat_interleave(group, dim=len(lead) - 1)
        if c.shape[-1] != mask.shape[-1] or tuple(c.shape[: len(lead)]) != tuple(mask.shape[:-1]):
            raise ValueError(
                f"c of shape {tuple(c.shape)} does not match repaired-slot mask {tuple(mask.shape)} "
                f"(group={group}): expected (*lead, *extra, S)"
            )
        extra = c.dim() - mask.dim()
        mask = mask.reshape(mask.shape[:-1] + (1,) * extra + mask.shape[-1:]).to(c.device)
        return torch.where(mask, torch.zeros_like(c), c)

    def totals(self) -> HeadTelemetry:
        """Telemetry summed over every (layer, head)."""
        out = HeadTelemetry()
        for stats in self.telemetry.values():
            out.page_ins += stats.page_ins
            out.bytes += stats.bytes
            out.repaired_slots += stats.repaired_slots
            out.cache_hits += stats.cache_hits
        return out

    def new_request(self) -> None:
        """Forget the repair cache and repaired slots (telemetry is kept)."""
        self._cache.clear()
        self._repaired.clear()

    def _block_len(self, key: Hashable, block: int) -> int:
        length = self.store.length(key)
        return min(self.block_size, length - int(block) * self.block_size)

    def _mask(self, key: Hashable) -> np.ndarray:
        """The repaired-slot mask of ``key``, grown to the stream length."""
        lead, length = self.store.lead_shape(key), self.store.length(key)
        mask = self._repaired.get(key)
        if mask is None or mask.shape[-1] < length:
            grown = np.zeros(lead + (length,), dtype=bool)
            if mask is not None:
                grown[..., : mask.shape[-1]] = mask
            self._repaired[key] = mask = grown
        return mask


@dataclass
class LayerPager:
    """The pager of one layer: gate cell -> verified exact block -> write-back -> exact logits.

    Parameters
    ----------
    repairer : Repairer
    key : hashable
        The backing-store stream of this layer.
    q : Tensor (*cells, d)
        Queries of the gate's cells (same leading dims as the gate's ``scores``), in the frame
        of the stored keys (post-RoPE with a post-RoPE cache).
    sm_scale : float
        Softmax scale used for ``scores``.
    group : int
        Query heads per kv head: cell ``(*i, h, ...)`` reads stream index ``(*i, h // group)``
        (the stream's leading dims are the first dims of a cell).
    k_cache, v_cache : Tensor (*lead, S, d), optional
        The compressed cache to write exact keys / values back into (persistent repair).
        The write-back must be lossless (else ``ValueError``): ``c = 0`` is only sound if the
        attention then reads the exact key.
    witness : Tensor (*lead, S, ...), optional
        Tier A witness; repaired slots are zeroed.
    """

    repairer: Repairer
    key: Hashable
    q: torch.Tensor
    sm_scale: float
    group: int = 1
    k_cache: torch.Tensor | None = None
    v_cache: torch.Tensor | None = None
    witness: torch.Tensor | None = None

    def __post_init__(self):
        if not isinstance(self.q, torch.Tensor) or not torch.is_floating_point(self.q) or self.q.dim() < 1:
            raise ValueError("q must be a floating tensor (*cells, d)")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group <= 0:
            raise ValueError(f"group must be a positive int, got {self.group!r}")
        if not isinstance(self.sm_scale, (int, float)) or not self.sm_scale > 0:
            raise ValueError(f"sm_scale must be > 0, got {self.sm_scale!r}")

    @property
    def block_size(self) -> int:
        """Tokens per block of the backing store (the gate's ``block_size`` must match)."""
        return self.repairer.block_size

    def store_index(self, cell: tuple) -> tuple[int, ...]:
        """The stream index (kv head) that a gate cell reads."""
        n_lead = len(self.repairer.store.lead_shape(self.key))
        if len(cell) < n_lead:
            raise ValueError(f"cell {cell} has fewer dims than the stream's leading shape ({n_lead})")
        index = list(cell[:n_lead])
        if n_lead:
            index[-1] //= self.group
        return tuple(int(i) for i in index)

    def __call__(self, cell: tuple, block: int) -> PageIn:
        return self.pages([cell], [block])[0]

    def pages(self, cells: list[tuple], blocks: list[int]) -> list[PageIn]:
        """:meth:`__call__` of many (cell, block) pages at once: each block fetched (verified) and written back as
        one call would, then every page's exact logits and their error bound (:func:`_dot_error`) in one batched
        fp64 pass (the error bound holds for any summation order, so batching changes no statement)."""
        fetched = []
        for cell, block in zip(cells, blocks):
            index = self.store_index(cell)
            paged, nbytes = self.repairer.fetch(self.key, index, block)
            self._write_back(index, paged)
            fetched.append((paged.k, nbytes))
        if not fetched:
            return []
        q = torch.stack([self.q[cell] for cell in cells]).to(torch.float64)  # (P, d)
        k = _padded_blocks([keys for keys, _ in fetched], q.device)  # (P, n, d), zero rows past a short block
        scale = float(self.sm_scale)
        logits = (k @ q[:, :, None])[..., 0] * scale  # (P, n)
        error = _dot_error(k, q[:, None, :], scale)  # (P, n)
        return [PageIn(logits=logits[i, :keys.shape[0]], nbytes=nbytes, error=error[i, :keys.shape[0]])
                for i, (keys, nbytes) in enumerate(fetched)]

    def _write_back(self, index: tuple, paged: PagedBlock) -> None:
        tokens = paged.tokens
        if self.k_cache is not None:
            _write_exact(self.k_cache[index], tokens, paged.k, "k_cache")
        if self.v_cache is not None:
            if paged.v is None:
                raise ValueError("v_cache given but the backing store keeps no values")
            _write_exact(self.v_cache[index], tokens, paged.v, "v_cache")
        if self.witness is not None:
            self.witness[index][tokens] = 0


def _padded_blocks(blocks: list[torch.Tensor], device) -> torch.Tensor:
    """``(P, n, d)`` fp64 of ``P`` key blocks ``(n_i, d)`` (``n = max n_i``), zero rows past each block's end."""
    n, d = max(b.shape[0] for b in blocks), blocks[0].shape[-1]
    out = torch.zeros(len(blocks), n, d, dtype=torch.float64, device=device)
    for i, b in enumerate(blocks):
        out[i, :b.shape[0]] = b.to(device=device, dtype=torch.float64)
    return out


def _dot_error(k: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
    """``>= |fl(fl(k . q) scale) - (k . q) scale|`` per row of fp64 ``k`` (..., n, d), ``q`` (..., d) or broadcast
    against ``k`` (``(P, 1, d)`` for ``P`` pages).

    A d-term fp64 dot product (any order) then one product: ``gamma_{d+1} sum_i |k_i q_i|`` relative
    to the absolute products (Higham, Thm. 3.1), with ``gamma`` taken at ``d + 2`` to cover the
    rounding of that sum itself; below the normal range each product is off by half a
    ``2^-1074`` step more (``d`` steps). The repaired tokens' ``c`` carries it: the pager's fp64
    logits are not the exact ones.
    """
    d = k.shape[-1]
    magnitude = rounding.sum_up(rounding.mul_up(k.abs(), q.abs()))  # (n,) >= sum_i |k_i q_i|
    gamma = rounding.summation_gamma(d + 3, torch.float64)
    dot_error = rounding.add_up(rounding.mul_up(magnitude, gamma), d * rounding.SUBNORMAL_STEP)
    return rounding.add_up(rounding.mul_up(dot_error, scale), rounding.SUBNORMAL_STEP)


def _write_exact(cache_row: torch.Tensor, tokens: slice, exact: torch.Tensor, name: str) -> None:
    cache_row[tokens] = exact.to(device=cache_row.device, dtype=cache_row.dtype)
    if not torch.equal(cache_row[tokens].to(device="cpu", dtype=exact.dtype), exact):
        raise ValueError(
            f"write-back into {name} ({cache_row.dtype}) is lossy for exact {exact.dtype} keys: "
            "repaired slots would not be exact, so c = 0 there would be unsound"
        )

"""Where vLLM's CPU attention backend keeps each key and value, and what it stored.

vLLM (0.32, ``CPU_ATTN``) allocates one tensor per layer, ``[blocks, Hkv, block_size, 2 d]``: per
(block, kv head) a *slab* of ``2 block_size d`` entries holding that block's keys and values. How
the entries are ordered inside a slab depends on the kernel ISA vLLM picks: the ``vec`` kernels
keep the keys transposed (``[d, block_size]``) and then the values in token order
(``[block_size, d]``); the ``amx`` kernels (bf16 models on CPUs with AMX tiles) pack pairs of
coordinates and of tokens for their tile multiply. None of it is documented by vLLM, so the
plugin never assumes an order: :func:`measure` finds it through vLLM's own C++ writer (each entry
tagged with the bits of its index, one write per bit) and :mod:`.selftest` checks, per
configuration, that reading back through it gives the written keys and what the attention kernel
attends. A :class:`CacheLayout` is that measured order.

Reading back what the kernel stored (instead of imitating its cast) is what keeps the Tier A
witness sound whatever rounding, saturation or scale the engine uses: the witness is formed
from the very values attention reads. fp8 caches (``uint8`` storage) are decoded exactly in
fp64 as ``fp8 value * scale`` (a 4- or 3-bit mantissa times an fp32 scale is exact in fp64).
"""
import functools
import math
from dataclasses import dataclass

import torch

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
LOSSLESS = ("auto",)
READABLE = LOSSLESS + tuple(_FP8)  # kv_cache_dtype values the plugin reads back


class LayoutError(ValueError):
    """The cache writer does not store each entry of a block exactly once, the same way for every head."""


@dataclass(frozen=True)
class CacheLayout:
    """The order of one (block, kv head) slab of the cache: which entry holds which key or value coordinate.

    ``key_index[o, i]`` / ``value_index[o, i]`` (block_size, d) long: the position, in the slab's
    ``2 block_size d`` entries, of coordinate ``i`` of the key / value of the token at block offset
    ``o``. Together they are a permutation of the slab (checked).
    """

    key_index: torch.Tensor
    value_index: torch.Tensor

    def __post_init__(self):
        if self.key_index.dim() != 2 or self.key_index.shape != self.value_index.shape:
            raise LayoutError(f"key_index {tuple(self.key_index.shape)} and value_index "
                              f"{tuple(self.value_index.shape)} must both be (block_size, d)")
        every = torch.cat([self.key_index.flatten(), self.value_index.flatten()]).sort().values
        if not torch.equal(every, torch.arange(every.numel())):
            raise LayoutError("key_index and value_index must together name every slab entry exactly once")

    @property
    def block_size(self) -> int:
        return self.key_index.shape[0]

    @property
    def head_size(self) -> int:
        return self.key_index.shape[1]

    @classmethod
    def transposed_keys(cls, block_size: int, head_size: int) -> "CacheLayout":
        """The ``vec`` kernels' order: keys ``[d, block_size]``, then values ``[block_size, d]``."""
        o, i = torch.arange(block_size)[:, None], torch.arange(head_size)[None, :]
        return cls(key_index=i * block_size + o, value_index=block_size * head_size + o * head_size + i)

    def keys_at_slots(self, kv_cache: torch.Tensor, slots: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        """Stored key entries at flat ``slots`` (N,): ``[N, Hkv, d]`` in the storage dtype, read by index (only
        the ``N Hkv d`` entries, not the slots' whole block slabs); ``index``: :meth:`key_entries` of these slots
        (every layer of a step reads the same slots of a cache of the same shape)."""
        if index is None:
            index = self.key_entries(kv_cache, slots)
        return self._slabs(kv_cache).reshape(-1)[index]

    def key_entries(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """(N, Hkv, d) the positions, in the flattened cache, of the key entries of ``slots`` (N,)."""
        heads, width = kv_cache.shape[1], 2 * self.block_size * self.head_size
        slots = slots.long()
        start = (slots // self.block_size) * (heads * width)  # (N,) first entry of each slot's block
        return (start[:, None, None] + _head_starts(heads, width)
                + self.key_index[slots % self.block_size][:, None, :])

    def keys_of_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
        """Stored keys of one sequence: ``[Hkv, length, d]`` from its ``block_ids`` (in order)."""
        return self._of_blocks(kv_cache, block_ids, length, self.key_index)

    def values_of_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
        """Stored values of one sequence: ``[Hkv, length, d]`` from its ``block_ids`` (in order)."""
        return self._of_blocks(kv_cache, block_ids, length, self.value_index)

    def entries_at_slots(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """bool, shaped like ``kv_cache``: the entries (keys and values, every head) of flat ``slots``."""
        slabs = torch.zeros_like(self._slabs(kv_cache), dtype=torch.bool)
        at = torch.cat([self.key_index, self.value_index], dim=1)[slots % self.block_size]  # (N, 2 d)
        slabs[(slots // self.block_size)[:, None], :, at] = True
        return slabs.view(kv_cache.shape)

    def _of_blocks(self, kv_cache, block_ids, length, index) -> torch.Tensor:
        slabs = self._slabs(kv_cache)[block_ids]  # (nb, Hkv, 2 bs d)
        per_block = slabs[..., index]  # (nb, Hkv, bs, d)
        return per_block.transpose(0, 1).reshape(slabs.shape[1], -1, self.head_size)[:, :length]

    def _slabs(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache as ``(blocks, Hkv, 2 bs d)`` slabs: a view (vLLM allocates each layer's cache contiguous; a
        non-contiguous one is refused rather than copied whole at every read)."""
        if kv_cache.dim() != 4 or kv_cache.shape[2] != self.block_size or kv_cache.shape[3] != 2 * self.head_size:
            raise ValueError(f"kv_cache must be [blocks, Hkv, {self.block_size}, {2 * self.head_size}] for this "
                             f"layout, got {tuple(kv_cache.shape)}")
        if not kv_cache.is_contiguous():
            raise ValueError(f"kv_cache must be contiguous (strides {kv_cache.stride()})")
        return kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1)


@functools.lru_cache(maxsize=16)
def _head_starts(heads: int, width: int) -> torch.Tensor:
    """(1, Hkv, 1): the first entry of each kv head's slab within a block (never written)."""
    return (torch.arange(heads) * width)[None, :, None]


def measure(write, *, num_kv_heads: int, head_size: int, block_size: int, model_dtype: torch.dtype,
            storage_dtype: torch.dtype, k_unit: float = 1.0, v_unit: float = 1.0) -> CacheLayout:
    """The :class:`CacheLayout` vLLM's writer uses, found by writing through it.

    ``write(keys, values, kv_cache, slots)`` is the writer (keys, values ``[N, Hkv, d]`` in
    ``model_dtype``, ``kv_cache`` a ``[1, Hkv, block_size, 2 d]`` cache of ``storage_dtype``).
    Every key and value entry of one block gets an index; one write per bit of the indices puts
    ``k_unit`` / ``v_unit`` (a value the cache stores as nonzero: the fp8 scale, so the code is
    1) on the entries whose index has that bit and 0 elsewhere, so the nonzero entries of each
    write spell out, per slab position, the index it holds. A first write of every entry tells
    which positions the writer uses. Raises :class:`LayoutError` unless every index lands on
    exactly one position, the same for every head.
    """
    ids = torch.arange(2 * block_size * head_size).view(2, block_size, head_size)  # (side, offset, coordinate)
    slots = torch.arange(block_size)

    def nonzero_after(on: torch.Tensor) -> torch.Tensor:  # on: bool like ids; -> (Hkv, 2 bs d) bool
        keys = (on[0].to(torch.float64) * k_unit)[:, None].expand(-1, num_kv_heads, -1).to(model_dtype)
        values = (on[1].to(torch.float64) * v_unit)[:, None].expand(-1, num_kv_heads, -1).to(model_dtype)
        cache = torch.zeros(1, num_kv_heads, block_size, 2 * head_size, dtype=storage_dtype)
        write(keys.contiguous(), values.contiguous(), cache, slots)
        raw = cache.view(torch.uint8).reshape(num_kv_heads, 2 * block_size * head_size, cache.element_size())
        return raw.ne(0).any(-1)  # an entry is nonzero when any of its bytes is

    used = nonzero_after(torch.ones_like(ids, dtype=torch.bool))
    if int(used.sum()) != used.numel():
        raise LayoutError(f"writing every entry of a block set {int(used.sum())} of its {used.numel()} cache "
                          "positions to nonzero values")
    held = torch.zeros(used.shape, dtype=torch.long)
    for bit in range(math.ceil(math.log2(ids.numel()))):
        held |= nonzero_after(((ids >> bit) & 1).bool()).long() << bit
    if not (held == held[:1]).all():
        raise LayoutError("the writer orders the entries of different kv heads differently")
    position = torch.full((ids.numel(),), -1, dtype=torch.long)
    position[held[0]] = torch.arange(ids.numel())
    if (position < 0).any():
        raise LayoutError("two cache positions hold the same entry (the writer's order is not one-to-one)")
    key_index, value_index = position.view(2, block_size, head_size)
    return CacheLayout(key_index=key_index, value_index=value_index)


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value views vLLM hands its C++ writer and kernel (``[blocks, Hkv, block_size, d]`` each).

    They are views of memory, not indexed ``[block, head, offset, i]``: read entries through a
    :class:`CacheLayout`.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(f"kv_cache must be [blocks, Hkv, block_size, 2 d], got {tuple(kv_cache.shape)}")
    blocks, heads, block_size, _ = kv_cache.shape
    return kv_cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)


def decode(stored: torch.Tensor, kv_cache_dtype: str, scale: float) -> torch.Tensor:
    """The real values the kernel reads from ``stored`` entries, in fp64 (exact).

    ``auto`` caches hold the model dtype itself (``scale`` is not applied by vLLM there);
    fp8 caches hold fp8 codes (``uint8`` or ``float8`` storage) times the per-layer ``scale``.
    """
    if kv_cache_dtype in LOSSLESS:
        return stored.to(torch.float64)
    if kv_cache_dtype not in _FP8:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one the plugin can read back "
                         f"(supported: {READABLE})")
    codes = stored.view(_FP8[kv_cache_dtype]) if stored.dtype == torch.uint8 else stored
    if codes.dtype != _FP8[kv_cache_dtype]:
        raise ValueError(f"cache storage dtype {stored.dtype} does not match kv_cache_dtype {kv_cache_dtype!r}")
    return codes.to(torch.float64) * float(scale)


def decode_kept(stored: torch.Tensor, kv_cache_dtype: str, scale: float) -> torch.Tensor:
    """What the meter keeps of ``stored`` entries: :func:`decode` rounded to fp32 (exact for ``auto`` caches, whose
    entries are fp32/bf16/fp16, widened without a detour through fp64)."""
    if kv_cache_dtype in LOSSLESS and stored.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return stored.float()
    return decode(stored, kv_cache_dtype, scale).float()


def rows_of_blocks(side: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Rows of a side tensor ``[blocks, Hkv, block_size, X]`` for one sequence: ``[Hkv, length, X]``."""
    _, heads, _, width = side.shape
    return side[block_ids].permute(1, 0, 2, 3).reshape(heads, -1, width)[:, :length]


def scatter_rows(side: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write ``rows`` (N, Hkv, X) at flat ``slots`` of a side tensor ``[blocks, Hkv, block_size, X]``.

    Indexed exactly like the cache, so block reuse overwrites and prefix sharing reads the same
    rows as the cache entries they describe.
    """
    block_size = side.shape[2]
    side[slots // block_size, :, slots % block_size] = rows.to(side.dtype)

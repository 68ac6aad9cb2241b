"""Where vLLM's CPU attention backend keeps each key and value, and what it stored.

vLLM (0.32, ``CPU_ATTN``) allocates one tensor per layer, ``[blocks, Hkv, block_size, 2 d]``,
and views it as ``[blocks, Hkv, 2 block_size, d]``: per (block, kv head) the first
``block_size * d`` elements hold the keys **transposed** (``[d, block_size]``: coordinate ``i``
of the token at offset ``o`` is element ``i * block_size + o``), the next ``block_size * d``
the values in token order (``[block_size, d]``). Measured with one-hot probes through the C++
writer; not documented by vLLM, so :mod:`.selftest` re-measures it at start-up and refuses to
run if it changed.

Reading back what the kernel stored (instead of imitating its cast) is what keeps the Tier A
witness sound whatever rounding, saturation or scale the engine uses: the witness is formed
from the very values attention reads. fp8 caches (``uint8`` storage) are decoded exactly in
fp64 as ``fp8 value * scale`` (a 4- or 3-bit mantissa times an fp32 scale is exact in fp64).
"""
import torch

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
LOSSLESS = ("auto",)
READABLE = LOSSLESS + tuple(_FP8)  # kv_cache_dtype values the plugin reads back


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views ``[blocks, Hkv, block_size, d]`` of one layer's cache, as vLLM makes them.

    The returned key view is *not* indexed ``[block, head, offset, i]``: its memory is
    ``[d, block_size]`` per (block, head); use :func:`keys_of_blocks` / :func:`keys_at_slots`.
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


def keys_at_slots(key_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Stored key entries at flat ``slots`` (N,): ``[N, Hkv, d]`` in the storage dtype."""
    blocks, heads, block_size, d = key_cache.shape
    per_block = key_cache[slots // block_size].reshape(-1, heads, d, block_size)  # (N, Hkv, d, bs)
    offsets = (slots % block_size).view(-1, 1, 1, 1).expand(-1, heads, d, 1)
    return per_block.gather(3, offsets).squeeze(3)  # (N, Hkv, d)


def keys_of_blocks(key_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Stored keys of one sequence: ``[Hkv, length, d]`` from its ``block_ids`` (in order)."""
    _, heads, block_size, d = key_cache.shape
    per_block = key_cache[block_ids].reshape(-1, heads, d, block_size)  # (nb, Hkv, d, bs)
    return per_block.permute(1, 0, 3, 2).reshape(heads, -1, d)[:, :length]


def values_of_blocks(value_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Stored values of one sequence: ``[Hkv, length, d]`` (token order inside a block)."""
    _, heads, block_size, d = value_cache.shape
    per_block = value_cache[block_ids]  # (nb, Hkv, bs, d)
    return per_block.permute(1, 0, 2, 3).reshape(heads, -1, d)[:, :length]


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

"""Dithered INT8 quantizer of Tier B: ``x^ = s (round(x/s + xi) - xi)`` (registry "L2", "TB").

Per element, with ``Q = 127`` and the dither ``xi`` of ``witcert.tier_b.dither`` (centred 24-bit
grid, regenerated from the counter at read time):

1. ``s`` = group amax / ``(Q - 1/2)``, rounded UP to fp16 and stored; the same fp16 value is
   used to quantize (an fp32 scale with an fp16 store breaks ``|err| <= s/2``: docs/design.md "Tier B: the dithered INT8 cache").
   Rounding up keeps ``|x| / s <= Q - 1/2``, so ``|n| <= Q``: non-outlier channels never clip.
2. ``n`` = the integer nearest to ``x/s + xi`` *exactly*: a candidate
   ``floor(fl64(x/s + xi) + 1/2)`` is corrected by exact comparisons
   ``x < s (n - xi - 1/2)`` / ``x > s (n - xi + 1/2)`` (both sides exact in fp64: ``s`` has
   11 significant bits and ``n - xi -+ 1/2`` at most 33). Hence ``|s (n - xi) - x| <= s/2``
   holds exactly for every element, not just up to rounding, and the residual
   ``(n - xi) - x/s`` is a full-period 2^24-point grid in [-1/2, 1/2] (mean within ``2^-25``).
3. Outlier RoPE pairs (``witcert.tier_b.outliers``) are stored fp16, excluded from the amax; their
   payload slots hold 0 and their scale is reported as 0.

Dequantization computes ``s (n - xi)`` exactly in fp64 and rounds once to the requested dtype
(fp32 by default); ``witcert.tier_b.certificate`` bounds that rounding, in the dtype the keys are read in
(its ``key_dtype``: fp16 and bf16 models round much more than fp32), and also for a kernel
doing two fp32 roundings before the cast (registry "DB").
Bit-exact kernels must use the same candidate (fp64 ``x/s + xi``, ``floor(. + 1/2)``) and fix-up.
"""
from dataclasses import dataclass, replace

import torch

from witcert.core import rounding
from witcert.tier_b.dither import dither_of
from witcert.tier_b.outliers import block_pairs, calibrate_pairs
from witcert.tier_b.packed_store import GRANULARITIES, PackedStore, StoreLayout

Q_LEVELS = 127
SCALE_DIVISOR = Q_LEVELS - 0.5  # s = amax / (Q - 1/2)
FP16_MAX = 65504.0
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_cache_tensor(x: torch.Tensor, name: str = "x") -> None:
    """Reject what cannot be quantized: wrong dtype/shape, NaN or Inf (ValueError)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name}: expected a float tensor (fp16/bf16/fp32/fp64)")
    if x.dim() < 3:
        raise ValueError(f"{name}: expected shape (..., H, S, d), got {tuple(x.shape)}")
    if torch.isnan(x).any():
        raise ValueError(f"{name}: contains NaN")
    if torch.isinf(x).any():
        raise ValueError(f"{name}: contains Inf")


def fp16_scale_up(amax: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 ``s`` with ``s (Q - 1/2) >= amax`` (up to one fp16 step), exactly checked.

    ``s * 126.5`` is exact in fp64 (11 x 8 significant bits), so the check has no rounding.
    """
    amax = amax.to(torch.float64)
    if (amax / SCALE_DIVISOR > FP16_MAX).any():
        raise ValueError(f"x: a scale group's amax exceeds the fp16 scale range ({FP16_MAX} * {SCALE_DIVISOR})")
    scale = (amax / SCALE_DIVISOR).to(torch.float16)
    short = scale.to(torch.float64) * SCALE_DIVISOR < amax
    bumped = rounding.next_up(scale)  # not torch.nextafter: compiled, it is wrong on fp16
    scale = torch.where(short, bumped, scale)
    if torch.isinf(scale).any():
        raise ValueError("x: a scale group's amax exceeds the fp16 scale range")
    return scale


def nearest_code(x: torch.Tensor, scale: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
    """The integer ``n`` with ``|s (n - xi) - x| <= s/2`` exactly (fp64 inputs; 0 where s = 0)."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    n = torch.floor(x / safe + xi + 0.5)
    n = n - (x < scale * (n - xi - 0.5)).to(n.dtype)  # candidate one too high
    n = n + (x > scale * (n - xi + 0.5)).to(n.dtype)  # candidate one too low
    return torch.where(scale > 0, n, torch.zeros_like(n))


@dataclass(frozen=True)
class DitheredInt8:
    """Dithered INT8 quantizer for a cache tensor (*lead, H, S, d) (Tier B, "L2", "TB").

    Parameters
    ----------
    granularity : "token-group" (per token x ``group`` channels, paging-safe),
        "block-channel" (per ``block`` tokens x channel) or "token" (per-token scalar).
    group, block : ``Gc`` (default 32) and the token block (default 256; also the block of
        energy-mode outlier selection).
    outlier_pairs : ``m`` RoPE pairs kept fp16 and excluded from the amax and the variance.
    outlier_mode : "energy" (top-``m`` pairs by energy per block; indices stored) or "fixed"
        (``fixed_pairs`` (..., H, m) per (layer, kv_head), e.g. from :meth:`calibrate`).
    rope : RoPE pair convention, "rotate_half" (HF Llama) or "interleaved" (GPT-J).
    """

    granularity: str = "token-group"
    group: int = 32
    block: int = 256
    outlier_pairs: int = 0
    outlier_mode: str = "energy"
    rope: str = "rotate_half"
    fixed_pairs: torch.Tensor | None = None

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {self.granularity!r}")
        # validate every field now with a head dim any valid configuration accepts
        probe_head_dim = 2 * self.group * max(1, self.outlier_pairs) if isinstance(self.group, int) else 0
        self.layout(probe_head_dim)
        if self.fixed_pairs is not None and self.fixed_pairs.shape[-1:] != (self.outlier_pairs,):
            raise ValueError(f"fixed_pairs: last dim must be outlier_pairs = {self.outlier_pairs}")

    def layout(self, head_dim: int) -> StoreLayout:
        """The store layout for head dim ``head_dim`` (validates the configuration)."""
        return StoreLayout(self.granularity, head_dim, self.group, self.block, self.rope,
                           self.outlier_pairs, self.outlier_mode)

    def calibrate(self, x_prefix: torch.Tensor) -> "DitheredInt8":
        """A fixed-mode copy whose pair set is the top-``m`` energy pairs of a prefix (..., H, S0, d)."""
        check_cache_tensor(x_prefix, "x_prefix")
        pairs = calibrate_pairs(x_prefix, self.outlier_pairs, self.rope).to(torch.int32)
        return replace(self, outlier_mode="fixed", fixed_pairs=pairs)

    def quantize(self, x: torch.Tensor, counter) -> PackedStore:
        """Quantize ``x`` (*lead, H, S, d) with the dither stream of ``counter``."""
        check_cache_tensor(x)
        lay = self.layout(x.shape[-1])
        x64 = x.to(torch.float64)
        pair_index, fixed = self._outlier_pairs(x64, lay)
        store = PackedStore(lay, torch.zeros(x.shape, dtype=torch.int8), self._empty_scales(x.shape, lay),
                            torch.zeros(*x.shape[:-1], 2 * lay.outlier_pairs, dtype=torch.float16),
                            pair_index, fixed, x.dtype)
        channels = store.outlier_channels()  # (*lead, H, S, 2m)
        outliers = torch.gather(x64, -1, channels)
        if (outliers.abs() > FP16_MAX).any():
            raise ValueError(f"x: an outlier channel exceeds the fp16 range ({FP16_MAX})")
        mask = store.outlier_mask()
        scales = fp16_scale_up(self._amax(x64.abs().masked_fill(mask, 0.0), lay))
        store = replace(store, scales=scales, outliers=outliers.to(torch.float16))
        xi = dither_of(counter, x.shape)
        code = nearest_code(x64, store.scale_per_element(), xi).masked_fill(mask, 0.0)
        if code.abs().max() > Q_LEVELS:  # impossible by the scale rounding; guard the invariant
            raise AssertionError("dithered code outside [-Q, Q]")
        return replace(store, payload=code.to(torch.int8))

    def dequantize(self, store: PackedStore, counter, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``x^`` (*lead, H, S, d): ``s (n - xi)`` exact in fp64, rounded once to ``dtype``.

        ``counter`` must be the one the store was written with (same tuple and seed). Tier B
        bounds hold for these keys when given ``key_dtype=dtype``. A value that rounds to inf
        in ``dtype`` (fp16 near 65504) raises ValueError.
        """
        if dtype not in INPUT_DTYPES:
            raise ValueError(f"dtype: expected one of float16, bfloat16, float32, float64, got {dtype!r}")
        xi = dither_of(counter, store.shape)
        exact = store.scale_per_element() * (store.payload.to(torch.float64) - xi)
        exact = exact.scatter(-1, store.outlier_channels(), store.outliers.to(torch.float64))
        keys = exact.to(dtype)
        if torch.isinf(keys).any():
            raise ValueError(f"dtype: a dequantized value overflows {dtype} (|x^| up to {exact.abs().max().item():.6g})")
        return keys

    def _outlier_pairs(self, x64: torch.Tensor, lay: StoreLayout):
        """(per-block pair_index or None, fixed pair set or None) for this input."""
        if lay.outlier_pairs == 0:
            return None, None
        if lay.outlier_mode == "energy":
            return block_pairs(x64, lay.outlier_pairs, lay.block, lay.rope).to(torch.int32), None
        if self.fixed_pairs is None:
            raise ValueError("fixed_pairs: outlier_mode='fixed' needs a pair set (use calibrate)")
        if self.fixed_pairs.max() >= lay.head_dim // 2 or self.fixed_pairs.min() < 0:
            raise ValueError("fixed_pairs: pair indices must lie in [0, d/2)")
        return None, self.fixed_pairs.to(torch.int32)

    @staticmethod
    def _amax(xa: torch.Tensor, lay: StoreLayout) -> torch.Tensor:
        """Group amax of |x| (outliers zeroed) in the scale shape of the layout."""
        if lay.granularity == "token-group":
            return xa.view(*xa.shape[:-1], lay.head_dim // lay.group, lay.group).amax(-1)
        if lay.granularity == "token":
            return xa.amax(-1, keepdim=True)
        n_tokens = xa.shape[-2]
        n_blocks = -(-n_tokens // lay.block)
        padded = torch.nn.functional.pad(xa, (0, 0, 0, n_blocks * lay.block - n_tokens))
        return padded.view(*xa.shape[:-2], n_blocks, lay.block, lay.head_dim).amax(-2)

    @staticmethod
    def _empty_scales(shape: tuple[int, ...], lay: StoreLayout) -> torch.Tensor:
        lead, n_tokens = shape[:-2], shape[-2]
        scale_shape = {"token-group": (*lead, n_tokens, lay.head_dim // lay.group),
                       "block-channel": (*lead, -(-n_tokens // lay.block), lay.head_dim),
                       "token": (*lead, n_tokens, 1)}[lay.granularity]
        return torch.zeros(scale_shape, dtype=torch.float16)



"""Dither values from Philox words: a uniform on a centred 24-bit grid in (-1/2, 1/2).

``U = word >> 8`` (the top 24 bits), ``XI = 2U + 1 - 2^24`` (odd, |XI| < 2^24) and
``xi = XI / 2^25``: the 2^24 points ``(k + 1/2) 2^-24 - 1/2``, step ``g = 2^-24``, symmetric
about 0. Every value is exact in fp32 and fp64. Why a centred grid: the rounding residual of
a dithered quantizer driven by it is a full-period arithmetic progression whose mean is at
most ``g/2`` (the grid-offset slack of Tier B) and whose centred part is a discrete uniform
with MGF below the continuous one (Lemma 2, registry "L2"); see ``witcert.tier_b.certificate``.
"""
import torch

DITHER_BITS = 24
GRID_STEP = 2.0 ** -DITHER_BITS  # g
DITHER_DENOMINATOR = 1 << (DITHER_BITS + 1)  # xi = XI / 2^25


def dither_numerators(words: torch.Tensor) -> torch.Tensor:
    """Odd integers ``XI = 2 (word >> 8) + 1 - 2^24`` (int64, |XI| < 2^24) from uint32 words."""
    return 2 * (words >> (32 - DITHER_BITS)) + 1 - (1 << DITHER_BITS)


def dither_values(words: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dither ``xi = XI / 2^25`` on the centred grid (exact in fp32 and fp64)."""
    return dither_numerators(words).to(dtype) / DITHER_DENOMINATOR


def dither_of(counter, shape: tuple[int, ...], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dither (*shape) of a cache tensor under ``counter`` (a Standalone/PagedCounter)."""
    return dither_values(counter.words(tuple(shape)), dtype)

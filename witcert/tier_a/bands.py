"""RoPE frequency bands: which head coordinates form each band (Lemma 1, Theorem 2).

A band is a contiguous run of ``P = head_dim / (2 B)`` RoPE frequency pairs. Because RoPE
rotates each pair by a 2x2 rotation, the Euclidean norm of every band is invariant under
RoPE at any position in exact arithmetic (Lemma 1, registry key ``L1``; a rotation computed in
floating point perturbs it: ``L1fp``, :mod:`witcert.tier_a.rotary`); the per-band Cauchy-Schwarz bound
of Theorem 2 (``T2``) is formed over these bands.

Pair conventions
----------------
``"rotate_half"`` (HF Llama / Qwen / Mistral): pair ``j`` is ``(j, j + d/2)``.
``"interleaved"`` (GPT-J / GPT-NeoX-interleaved): pair ``j`` is ``(2j, 2j + 1)``.
Band ``b`` holds pairs ``[b P, (b + 1) P)`` under either convention.
"""
from dataclasses import dataclass, field
from functools import cached_property

import torch

from witcert.core.norms import scaled_norms

ROPE_CONVENTIONS = ("rotate_half", "interleaved")


@dataclass(frozen=True)
class BandLayout:
    """Grouping of a head's RoPE pairs into ``bands`` bands of whole pairs.

    Parameters
    ----------
    head_dim : int
        Head dimension ``d`` (even).
    bands : int
        Number of bands ``B``; must divide ``d / 2``. Default 16 (docs/design.md "Tier A: the band witness").
    rope : {"rotate_half", "interleaved"}
        The model's RoPE pair convention; a band must hold whole pairs under it.

    Attributes
    ----------
    index : LongTensor (B, 2P)
        Coordinates of band ``b`` in pair order: ``index[b, 2i], index[b, 2i + 1]`` is the
        ``i``-th pair of the band (``i`` in ``[0, P)``).
    """

    head_dim: int
    bands: int = 16
    rope: str = "rotate_half"
    _index: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int, got {self.head_dim!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE pairs), got {self.head_dim}")
        if isinstance(self.bands, bool) or not isinstance(self.bands, int) or self.bands <= 0:
            raise ValueError(f"bands must be a positive int, got {self.bands!r}")
        if (self.head_dim // 2) % self.bands:
            raise ValueError(
                f"bands={self.bands} must divide head_dim/2={self.head_dim // 2} "
                f"(head_dim={self.head_dim} not divisible by 2*bands={2 * self.bands})"
            )
        if self.rope not in ROPE_CONVENTIONS:
            raise ValueError(f"rope must be one of {ROPE_CONVENTIONS}, got {self.rope!r}")
        object.__setattr__(self, "_index", _band_index(self.head_dim, self.bands, self.rope))

    @property
    def pairs_per_band(self) -> int:
        """``P = head_dim / (2 B)``: whole RoPE pairs per band."""
        return self.head_dim // (2 * self.bands)

    @property
    def index(self) -> torch.Tensor:
        """LongTensor (B, 2P): coordinates of each band, pair by pair (a copy)."""
        return self._index.clone()

    @cached_property
    def pairs(self) -> torch.Tensor:
        """LongTensor (d/2, 2): the coordinates ``(a, b)`` of RoPE pair ``j``."""
        return _pair_coordinates(self.head_dim, self.rope)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., d) in bands: (..., B, 2P), the same entries as ``x[..., self.index]``, formed by a
        reshape and a permute (one copy for ``rotate_half``), never an indexed gather: compiled, the
        gather measured 20x slower than this (an indirect load per entry, no vector loop)."""
        _check_last_dim(x, self.head_dim, "x")
        lead, p = x.shape[:-1], self.pairs_per_band
        if self.rope == "interleaved":  # band b is the run [2bP, 2(b+1)P)
            return x.reshape(*lead, self.bands, 2 * p)
        halves = x.reshape(*lead, 2, self.bands, p)  # (..., h, b, i): coordinate h d/2 + b P + i
        return halves.movedim(-3, -1).reshape(*lead, self.bands, 2 * p)  # (..., b, i, h): pair i, member h

    def band_norms(self, x: torch.Tensor) -> torch.Tensor:
        """Euclidean norm of every band of ``x`` (..., d) -> (..., B).

        Computed in fp64 for fp64 input and fp32 otherwise, scaled so that squares neither
        overflow nor underflow. Accurate to a few ulps but *not* rounded up: use
        :func:`witcert.witness_of` for a sound stored witness (Lemma 1, ``L1``).
        """
        if not torch.is_floating_point(x):
            raise ValueError(f"x must be a floating tensor, got dtype {x.dtype}")
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        return scaled_norms(self.split(x.to(work)))  # (..., B)


def _pair_coordinates(head_dim: int, rope: str) -> torch.Tensor:
    """LongTensor (d/2, 2) of pair coordinates under the named convention."""
    half = head_dim // 2
    j = torch.arange(half, dtype=torch.long)
    if rope == "rotate_half":
        return torch.stack([j, j + half], dim=-1)
    return torch.stack([2 * j, 2 * j + 1], dim=-1)


def _band_index(head_dim: int, bands: int, rope: str) -> torch.Tensor:
    """LongTensor (B, 2P): band ``b`` holds pairs ``[b P, (b+1) P)``, pair by pair."""
    pairs = _pair_coordinates(head_dim, rope)  # (d/2, 2)
    return pairs.reshape(bands, -1).contiguous()  # (B, 2P)


def _check_last_dim(x: torch.Tensor, head_dim: int, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != head_dim:
        raise ValueError(f"{name} must have last dim head_dim={head_dim}, got shape {tuple(x.shape)}")

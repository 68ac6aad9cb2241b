"""The packed Tier B cache: INT8 payload, fp16 scales, fp16 outlier pairs, pair indices.

What a dithered INT8 cache holds per (…, kv_head) for ``S`` tokens of head dim ``d``
(``m`` outlier pairs, ``nB = ceil(S / block)`` blocks). The dither costs no storage: it is
regenerated from the counter (``witcert.tier_b.counters``).

==================  ===============================  =====  =================================
tensor              shape                            dtype  bytes per token per head
==================  ===============================  =====  =================================
payload             (*lead, H, S, d)                 int8   d (outlier slots hold 0)
scales              token-group (*lead, H, S, d/Gc)  fp16   2 d / Gc
                    block-channel (*lead, H, nB, d)  fp16   2 d / block
                    token (*lead, H, S, 1)           fp16   2
outliers            (*lead, H, S, 2m)                fp16   4 m
pair_index          (*lead, H, nB, m), energy mode   int32  4 m / block
==================  ===============================  =====  =================================

In ``"fixed"`` outlier mode the pair set is per-(layer, kv_head) metadata
(``fixed_pairs``), counted by ``metadata_nbytes`` and not per token. The store asserts at
construction that the analytic byte count equals the allocated tensors' ``nbytes``.
"""
from dataclasses import dataclass

import torch

from witcert.tier_b.outliers import check_rope, pair_channels

GRANULARITIES = ("token-group", "block-channel", "token")
FP16_BYTES = 2


@dataclass(frozen=True)
class StoreLayout:
    """How a store is laid out: granularity, group ``Gc``, block, RoPE pair convention."""

    granularity: str
    head_dim: int
    group: int = 32
    block: int = 256
    rope: str = "rotate_half"
    outlier_pairs: int = 0
    outlier_mode: str = "energy"

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {self.granularity!r}")
        check_rope(self.rope)
        if self.outlier_mode not in ("energy", "fixed"):
            raise ValueError(f"outlier_mode: expected 'energy' or 'fixed', got {self.outlier_mode!r}")
        for name in ("group", "block", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive int, got {getattr(self, name)!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: must be even (RoPE pairs), got {self.head_dim}")
        if self.granularity == "token-group" and self.head_dim % self.group:
            raise ValueError(f"group: head_dim {self.head_dim} is not divisible by group {self.group}")
        if not isinstance(self.outlier_pairs, int) or not 0 <= self.outlier_pairs <= self.head_dim // 2:
            raise ValueError(f"outlier_pairs: expected an int in [0, d/2], got {self.outlier_pairs!r}")

    @property
    def per_block_index(self) -> bool:
        """Whether the store carries per-block pair indices (energy mode with m > 0)."""
        return self.outlier_mode == "energy" and self.outlier_pairs > 0

    def bytes_per_token_per_head(self) -> float:
        """Exact bytes per token per head when ``S`` is a multiple of ``block``."""
        d, m = self.head_dim, self.outlier_pairs
        scale_bytes = {"token-group": FP16_BYTES * d / self.group,
                       "block-channel": FP16_BYTES * d / self.block,
                       "token": FP16_BYTES}[self.granularity]
        index_bytes = 4 * m / self.block if self.per_block_index else 0
        return d + scale_bytes + 2 * m * FP16_BYTES + index_bytes

    def expected_nbytes(self, n_heads_total: int, n_tokens: int) -> int:
        """Exact bytes of the per-token tensors of ``n_heads_total`` (lead x H) heads."""
        d, m = self.head_dim, self.outlier_pairs
        n_blocks = -(-n_tokens // self.block)
        scale_count = {"token-group": n_tokens * (d // self.group),
                       "block-channel": n_blocks * d,
                       "token": n_tokens}[self.granularity]
        index_bytes = 4 * n_blocks * m if self.per_block_index else 0
        per_head = n_tokens * d + FP16_BYTES * scale_count + FP16_BYTES * n_tokens * 2 * m + index_bytes
        return n_heads_total * per_head

    def capacity_ratio(self) -> float:
        """How many more tokens fit than in an fp16 cache: ``2 d / bytes_per_token_per_head``."""
        return FP16_BYTES * self.head_dim / self.bytes_per_token_per_head()


@dataclass(frozen=True)
class PackedStore:
    """A dithered INT8 cache of shape (*lead, H, S, d) (Tier B, registry "L2", "TB").

    ``payload`` holds ``n = round(x/s + xi)`` (|n| <= 127); ``scales`` the fp16 scales the
    quantizer used; ``outliers`` the fp16 values of the outlier channels, in the order of
    ``outlier_channels()``; ``pair_index`` per-block outlier pairs (energy mode);
    ``fixed_pairs`` the per-(layer, kv_head) set (fixed mode), broadcastable to (*lead, H, m);
    ``source_dtype`` the input dtype (fp16 inputs make the outlier bypass exact).
    """

    layout: StoreLayout
    payload: torch.Tensor
    scales: torch.Tensor
    outliers: torch.Tensor
    pair_index: torch.Tensor | None = None
    fixed_pairs: torch.Tensor | None = None
    source_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.payload.dtype != torch.int8 or self.payload.dim() < 3:
            raise ValueError("payload: expected an int8 tensor (..., H, S, d)")
        if self.payload.shape[-1] != self.layout.head_dim:
            raise ValueError("payload: last dim differs from layout.head_dim")
        if self.scales.dtype != torch.float16 or self.outliers.dtype != torch.float16:
            raise ValueError("scales, outliers: expected fp16 tensors")
        if self.layout.per_block_index and (self.pair_index is None or self.pair_index.dtype != torch.int32):
            raise ValueError("pair_index: energy-mode outliers need int32 per-block pair indices")
        if self.layout.outlier_mode == "fixed" and self.layout.outlier_pairs and self.fixed_pairs is None:
            raise ValueError("fixed_pairs: fixed-mode outliers need the per-(layer, kv_head) pair set")
        expected = self.layout.expected_nbytes(self.n_heads_total, self.n_tokens)
        if expected != self.nbytes():
            raise AssertionError(f"byte account {expected} != allocated {self.nbytes()}")

    @property
    def shape(self) -> torch.Size:
        return self.payload.shape

    @property
    def n_tokens(self) -> int:
        return self.payload.shape[-2]

    @property
    def n_heads_total(self) -> int:
        return self.payload[..., 0, 0].numel()

    def nbytes(self) -> int:
        """Bytes of the allocated per-token tensors (payload, scales, outliers, pair_index)."""
        tensors = [self.payload, self.scales, self.outliers]
        if self.pair_index is not None:
            tensors.append(self.pair_index)
        return sum(t.numel() * t.element_size() for t in tensors)

    def metadata_nbytes(self) -> int:
        """Bytes of the per-(layer, kv_head) fixed outlier set (not per token)."""
        return 0 if self.fixed_pairs is None else self.fixed_pairs.numel() * self.fixed_pairs.element_size()

    def bytes_per_token_per_head(self) -> float:
        """Allocated bytes per token per head (equals the layout's figure for full blocks)."""
        return self.nbytes() / (self.n_heads_total * self.n_tokens)

    def capacity_ratio(self) -> float:
        """fp16 bytes over packed bytes per token per head."""
        return FP16_BYTES * self.layout.head_dim / self.bytes_per_token_per_head()

    def outlier_channels(self) -> torch.Tensor:
        """Outlier channel indices (*lead, H, S, 2m), int64, per token."""
        lay = self.layout
        lead = self.payload.shape[:-1]  # (*lead, H, S)
        if lay.outlier_pairs == 0:
            return torch.zeros(*lead, 0, dtype=torch.int64)
        if lay.outlier_mode == "fixed":
            pairs = self.fixed_pairs.to(torch.int64).unsqueeze(-2)  # (..., H, 1, m)
            return pair_channels(pairs, lay.head_dim, lay.rope).expand(*lead, 2 * lay.outlier_pairs)
        pairs = self.pair_index.to(torch.int64).repeat_interleave(lay.block, dim=-2)[..., : self.n_tokens, :]
        return pair_channels(pairs, lay.head_dim, lay.rope)

    def outlier_mask(self) -> torch.Tensor:
        """Boolean (*lead, H, S, d): True on outlier (fp16-bypassed) channels."""
        mask = torch.zeros(self.payload.shape, dtype=torch.bool)
        return mask.scatter(-1, self.outlier_channels(), True)

    def scale_per_element(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The fp16 scale of every element (*lead, H, S, d), 0 on outlier channels."""
        lay = self.layout
        scales = self.scales.to(dtype)
        if lay.granularity == "token-group":
            full = scales.repeat_interleave(lay.group, dim=-1)
        elif lay.granularity == "block-channel":
            full = scales.repeat_interleave(lay.block, dim=-2)[..., : self.n_tokens, :]
        else:
            full = scales.expand(self.payload.shape)
        return full.masked_fill(self.outlier_mask(), 0.0)

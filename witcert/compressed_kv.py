"""The compressed twin of one layer's KV cache: what a compressed runtime would have stored.

Every token is compressed exactly once, when it is first written (the chunk of new tokens a
forward pass appends goes through the scheme as one tensor), together with its Tier A
witness ``w_{t,b} >= ||(k^_t - k_t)_b||`` (fp16, rounded up; Lemma 1 / Theorem 2, ``L1``/``T2``)
and its value residual norm ``rho_t >= ||v^_t - v_t||`` (rounded up). Old tokens are never
re-quantized. The exact keys and values stay in the model's own cache: that is the exact
shadow (and the backing store the gate repairs from).

Chunk-wise application matters for schemes that share statistics across tokens: KIVI keys
quantize complete 32-token groups of a chunk and keep the chunk's remainder exact (so single
decode tokens stay exact); a per-tensor scale is computed per chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from witcert.bands import BandLayout
from witcert.witness import round_up_to, witness_of

_VALUE_NORM_SLACK = 1.0 + 2.0**-40  # covers the fp64 rounding of a <=256-term norm with room to spare


@dataclass
class CompressedLayer:
    """Reconstructed keys/values, witnesses and value residual norms of one layer, in write order."""

    compress_key: object  # callable (x) -> x_hat, role "key"
    compress_value: object  # callable (x) -> x_hat, role "value"
    layout: BandLayout
    k_hat: torch.Tensor | None = field(default=None, repr=False)  # (B, Hkv, S, d)
    v_hat: torch.Tensor | None = field(default=None, repr=False)  # (B, Hkv, S, d)
    witness: torch.Tensor | None = field(default=None, repr=False)  # (B, Hkv, S, B) fp16
    value_residual: torch.Tensor | None = field(default=None, repr=False)  # (B, Hkv, S) fp32

    def __post_init__(self):
        if not callable(self.compress_key) or not callable(self.compress_value):
            raise ValueError("compress_key and compress_value must be callables x -> x_hat")
        if not isinstance(self.layout, BandLayout):
            raise ValueError(f"layout must be a BandLayout, got {type(self.layout).__name__}")

    @property
    def length(self) -> int:
        """Number of tokens stored."""
        return 0 if self.k_hat is None else self.k_hat.shape[-2]

    def sync(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Bring the store up to the exact cache ``key``/``value`` (B, Hkv, S, d).

        Tokens beyond :attr:`length` are compressed and appended. A cache shorter than the
        store (a new request reusing the layer) restarts the store.
        """
        if key.shape != value.shape or key.dim() != 4:
            raise ValueError(f"key/value must both be (B, Hkv, S, d), got {tuple(key.shape)} and {tuple(value.shape)}")
        total = key.shape[-2]
        if total < self.length or (self.k_hat is not None and self.k_hat.shape[:2] != key.shape[:2]):
            self.reset()
        start = self.length
        if total == start:
            return
        new_k, new_v = key[..., start:, :], value[..., start:, :]
        k_hat = self.compress_key(new_k)
        v_hat = self.compress_value(new_v)
        w = witness_of(new_k, k_hat, self.layout)  # (B, Hkv, n, Bands) fp16, rounded up
        rho = _value_residual_norm(new_v, v_hat)  # (B, Hkv, n)
        self.k_hat = _append(self.k_hat, k_hat)
        self.v_hat = _append(self.v_hat, v_hat)
        self.witness = _append(self.witness, w)
        self.value_residual = _append(self.value_residual, rho)

    def reset(self) -> None:
        self.k_hat = self.v_hat = self.witness = self.value_residual = None


def _append(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=2)


def _value_residual_norm(v: torch.Tensor, v_hat: torch.Tensor) -> torch.Tensor:
    """``rho_t >= ||v^_t - v_t||`` in fp32, never below the exact norm of the given floats."""
    r = v_hat.to(torch.float64) - v.to(torch.float64)  # exact for fp32 inputs
    norm = torch.linalg.vector_norm(r, dim=-1) * _VALUE_NORM_SLACK
    return round_up_to(norm, torch.float32)

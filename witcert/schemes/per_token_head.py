"""vLLM's per-token-head KV formats: ``int8_per_token_head``, ``fp8_per_token_head``, ``int4_per_token_head``.

Followed: vLLM at commit 055e47c28003156421365af985d676fc921cb075,
``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py`` (``_reshape_cache_per_token_head``, INT8 and FP8)
and ``vllm/v1/attention/ops/int4_per_token_head.py`` (``reshape_and_cache_int4``, ``_reshape_cache_int4_kernel``,
``single_rht``). One dynamic fp32 scale per (token, kv head), no calibration; the reconstruction the attention
kernel reads is ``code * scale`` (its dequantization multiplies the dot by the scale; vLLM's reference dequant,
``tests/quantization/test_per_token_kv_cache.py``, is ``q.float() * scale``).

Arithmetic, per head of ``d`` channels loaded as fp32 (every step an fp32 operation, as the Triton kernel does):

- INT8: ``scale = max(amax / 127, 1e-6)``; ``q = x * (1 / scale)``; round half away from zero by adding
  ``+-0.5`` in fp32, clamp to ``[-128, 127]``, truncate (the int8 store);
- FP8: ``scale = max(amax / 448, 1e-6)``; ``clamp(x * (1 / scale), -448, 448)`` cast to E4M3 (round to nearest
  even);
- INT4: the head is first rotated, ``RHT(x) = H (s * x)`` (:mod:`witcert.schemes.hadamard`), and rounded to the
  model's dtype; then asymmetric: ``scale = max((max - min) / 15, 1e-6)``, zero point
  ``zp = clamp(round_half_away(-min / scale), 0, 15)``, codes ``clamp(round_half_away(fma(x, 1 / scale, zp)),
  0, 15)`` two per byte (even channel in the low nibble), and ``zp`` hidden in the four low mantissa bits of the
  stored fp32 scale. Attention reads ``(q - zp) * scale'`` (``scale'`` with those bits cleared) in the rotated
  frame against the rotated query with ``softmax_scale / d``: in the model's frame that is the key
  ``s * H ((q - zp) scale') / d``, which is what the scheme returns.

Where this is not the kernel bit for bit: Triton lowers an fp32 ``/`` to an approximate division (``div.full``,
within 2 ulp), modelled here as the correctly rounded one; vLLM's Hadamard runs in bf16, Triton MMA or fp32
butterflies (:mod:`witcert.schemes.hadamard`), evaluated here exactly and rounded once. None of this touches the
meter's soundness: the witness is formed on the reconstruction returned.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from witcert.schemes.hadamard import check_power_of_two, inverse_rht, rht
from witcert.schemes.kv_format import KVFormat, exact_product, fma32, pack_bits, unpack_bits

SCALE_FLOOR = torch.tensor(1e-6, dtype=torch.float32)  # tl.maximum(..., 1e-6): the fp32 constant
E4M3_MAX = 448.0
_SOURCE = "vLLM 055e47c28003156421365af985d676fc921cb075"


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """``trunc(x +- 0.5)`` with the addition in fp32: the kernels' ``tl.where(x >= 0, x + 0.5, x - 0.5)`` followed
    by a truncating conversion (so ``0.49999997`` rounds to 1: ``0.49999997 + 0.5`` rounds to 1.0 in fp32)."""
    return torch.where(x >= 0, x + 0.5, x - 0.5).trunc()


def dynamic_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``max(amax / qmax, 1e-6)`` in fp32: zero heads get the floor, and reconstruct to zero."""
    return torch.maximum(amax / qmax, SCALE_FLOOR.to(amax.device))


class _AbsmaxPerTokenHead(KVFormat):
    """INT8 and FP8 per token and kv head: ``scale = max(amax / qmax, 1e-6)``, codes of ``x * (1 / scale)``."""

    qmax: float = 1.0
    token_axes = (-2, -2)
    roles_alike = True  # per head, keys and values alike: a store codes both in one call
    source = f"{_SOURCE} vllm/v1/attention/ops/triton_reshape_and_cache_flash.py (_reshape_cache_per_token_head)"

    def pack(self, x: torch.Tensor, role: str = "key") -> tuple:
        x32 = x.to(torch.float32)
        scale = dynamic_scale(x32.abs().amax(-1, keepdim=True), self.qmax)  # (..., T, 1)
        return self.codes(x32 * (1.0 / scale)), scale

    def decode(self, packed: tuple, dtype: torch.dtype) -> torch.Tensor:
        codes, scale = packed
        return exact_product(codes, scale).to(dtype)

    def code_bytes(self, head_dim: int, role: str) -> int:
        return head_dim + 4


@dataclass(frozen=True)
class Int8PerTokenHead(_AbsmaxPerTokenHead):
    """vLLM int8_per_token_head: int8 codes, one fp32 absmax scale per token and kv head (d + 4 bytes per token)."""

    qmax = 127.0
    label = "int8-per-token-head"

    def codes(self, scaled: torch.Tensor) -> torch.Tensor:
        """Round half away from zero in fp32, clamp to the int8 range, truncate (the int8 store)."""
        return round_half_away(scaled).clamp_(-128, 127).to(torch.int8)


@dataclass(frozen=True)
class Fp8PerTokenHead(_AbsmaxPerTokenHead):
    """vLLM fp8_per_token_head: FP8 E4M3 codes, one fp32 absmax scale per token and kv head (d + 4 bytes per token)."""

    qmax = E4M3_MAX
    label = "fp8-per-token-head"

    def codes(self, scaled: torch.Tensor) -> torch.Tensor:
        """Clamp to +-448 and cast to E4M3, round to nearest even."""
        return scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


@dataclass(frozen=True)
class Int4PerTokenHead(KVFormat):
    """vLLM int4_per_token_head: a fixed randomized Hadamard rotation, then asymmetric INT4 per token and kv head
    (d/2 + 4 bytes per token; the zero point hides in the fp32 scale)."""

    token_axes = (-2, -2)
    roles_alike = True  # per head, keys and values alike: a store codes both in one call
    label = "int4-per-token-head"
    source = f"{_SOURCE} vllm/v1/attention/ops/int4_per_token_head.py (reshape_and_cache_int4, single_rht)"

    def check_head_dim(self, head_dim: int) -> None:
        check_power_of_two(head_dim, "int4-per-token-head")

    def pack(self, x: torch.Tensor, role: str = "key") -> tuple:
        self.check_head_dim(x.shape[-1])
        y = rht(x).to(x.dtype).to(torch.float32)  # single_rht(key.float()).to(key.dtype), loaded as fp32
        if not bool(torch.isfinite(y).all()):
            raise ValueError(f"int4-per-token-head: the rotated head overflows {x.dtype} (its Hadamard rotation "
                             "grows a head by up to sqrt(d)): this format cannot hold this tensor")
        low, high = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
        scale = dynamic_scale(high - low, 15.0)
        zero = round_half_away(-low / scale).clamp_(0, 15)
        codes = round_half_away(fma32(y, 1.0 / scale, zero)).clamp_(0, 15)
        hidden = (scale.view(torch.int32) & -16) | zero.to(torch.int32)  # zp in the low 4 mantissa bits
        return pack_bits(codes.to(torch.int64), 4), hidden.view(torch.float32)

    def decode(self, packed: tuple, dtype: torch.dtype) -> torch.Tensor:
        payload, hidden = packed
        bits = hidden.view(torch.int32)
        zero = (bits & 0xF).to(torch.float64)
        scale = (bits & -16).view(torch.float32)
        codes = unpack_bits(payload, 4, 2 * payload.shape[-1]).to(torch.float64)
        return inverse_rht(exact_product(codes - zero, scale)).to(dtype)

    def code_bytes(self, head_dim: int, role: str) -> int:
        return head_dim // 2 + 4

"""vLLM's TurboQuant KV formats (``turboquant_4bit_nc``, ``turboquant_k3v4_nc``, ``turboquant_3bit_nc``).

A key is split into its norm and direction; the direction is rotated by a fixed orthogonal matrix and each
coordinate is scalar-quantized to the nearest Lloyd-Max centroid (:mod:`witcert.schemes.lloyd_max`); a value is
quantized uniformly per token. Attention reads the rotated key against the rotated query, so the key it reads,
in the model's frame, is the rotated reconstruction turned back: that is what the scheme returns.

Followed (vLLM): the store, ``vllm/v1/attention/ops/triton_turboquant_store.py`` at
c0fda2d6553d72a428fa8138f3bfb03d30db2daa (``triton_turboquant_store``: MSE path, ``_store_quantized_value``);
the read, ``vllm/v1/attention/ops/triton_turboquant_decode.py`` at 055e47c28003156421365af985d676fc921cb075
(``_tq_decode_stage1``: ``scores = vec_norm * (q_rot . c) * scale``, norm correction ``c / sqrt(sum c^2 +
1e-16)``, values ``idx * scale + zero`` from fp16); the rotation and presets,
``vllm/v1/attention/backends/turboquant_attn.py`` at 0135d081c30fa476130ae77a152539ce317ab8b1 (``PiT = Pi =
H / sqrt(d)``, the orthonormal Hadamard, shared by every layer) and
``vllm/model_executor/layers/quantization/turboquant/config.py`` at 1471680b24719d9d3b2fe1235878196142af89cc.

Per token and kv head, in fp32 as the store does: ``n = ||k||``, ``u = k / (n + 1e-8)``, ``y = u PiT``,
``idx_c = #{midpoints <= y_c}`` (the kernel's binary search sends ties up), ``n`` stored as fp16. Values:
``lo = min v``, ``s = max((max v - lo) / (2^b - 1), 1e-8)`` (``s > 1e-8`` else ``1e-8``), codes
``clamp(trunc((v - lo) / s + 0.5), 0, 2^b - 1)``, ``s`` and ``lo`` stored as fp16. Codes are packed little-endian
(:func:`~witcert.schemes.kv_format.pack_bits`: two per byte at 4 bits, eight per three bytes at 3 bits).

Not the engine bit for bit: ``||k||`` and ``u PiT`` are an fp32 reduction and an fp32 GEMM whose order vLLM does
not fix; here the norm is an fp64 sum of the exact squares in channel order and the rotation is exact, each
rounded once to fp32, so a coordinate within an ulp of a midpoint
can take the neighbouring centroid. The reconstruction is the exact real value the decode denotes
(``fp16 norm * corrected centroid``, turned back by ``Pi``), rounded once to the model's dtype. A norm, value or
scale beyond fp16's range is refused (the engine would store ``inf``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from witcert.schemes import lloyd_max
from witcert.schemes.hadamard import check_power_of_two, orthonormal_hadamard
from witcert.schemes.kv_format import KVFormat, exact_product, pack_bits, unpack_bits

NORM_EPS = 1e-8  # x_hat = k / (norms + 1e-8)
CENTROID_EPS = 1e-16  # 1 / sqrt(c_norm_sq + 1e-16)
VALUE_SCALE_FLOOR = 1e-8
FP16_MAX = 65504.0


@dataclass(frozen=True)
class TurboQuant(KVFormat):
    """vLLM TurboQuant: Hadamard rotation, Lloyd-Max keys with norm correction, uniform values."""

    key_bits: int = 4
    value_bits: int = 4
    norm_correction: bool = True
    token_axes = (-2, -2)
    source = ("vLLM c0fda2d6553d72a428fa8138f3bfb03d30db2daa vllm/v1/attention/ops/triton_turboquant_store.py; "
              "055e47c28003156421365af985d676fc921cb075 triton_turboquant_decode.py; "
              "0135d081c30fa476130ae77a152539ce317ab8b1 backends/turboquant_attn.py")

    def __post_init__(self):
        for name in ("key_bits", "value_bits"):
            if getattr(self, name) not in (3, 4):
                raise ValueError(f"turboquant: {name} must be 3 or 4 (vLLM's MSE presets), got {getattr(self, name)!r}")

    @property
    def label(self) -> str:
        """The registered name of a preset (``turboquant-4bit-nc``, ``turboquant-k3v4-nc``, ...)."""
        bits = f"{self.key_bits}bit" if self.key_bits == self.value_bits else f"k{self.key_bits}v{self.value_bits}"
        return f"turboquant-{bits}{'-nc' if self.norm_correction else ''}"

    @property
    def summary(self) -> str:
        return (f"vLLM TurboQuant: Hadamard rotation, {self.key_bits}-bit Lloyd-Max keys"
                f"{' with norm correction' if self.norm_correction else ''}, {self.value_bits}-bit uniform values")

    def check_head_dim(self, head_dim: int) -> None:
        check_power_of_two(head_dim, "turboquant")
        if head_dim < 8:
            raise ValueError(f"turboquant: head_dim {head_dim} is below 8 (codes are packed eight at a time)")

    def pack(self, x: torch.Tensor, role: str = "key") -> tuple:
        self.check_head_dim(x.shape[-1])
        return self._encode_key(x) if role == "key" else self._encode_value(x)

    def decode(self, packed: tuple, dtype: torch.dtype) -> torch.Tensor:
        codes, side = packed  # keys: (codes, fp16 norm); values: (codes, fp16 [scale, zero])
        if side.shape[-1] == 1:
            d = codes.shape[-1] * 8 // self.key_bits
            table = torch.tensor(lloyd_max.centroids(d, self.key_bits), dtype=torch.float64, device=codes.device)
            idx = unpack_bits(codes, self.key_bits, d)
            c = table[idx]
            if self.norm_correction:  # sum c^2 from the code counts, levels in a fixed order: the same on every CPU
                counts = torch.zeros(*idx.shape[:-1], len(table), dtype=torch.float64, device=idx.device)
                counts.scatter_add_(-1, idx, torch.ones_like(c))
                squares = table * table
                total = torch.zeros_like(counts[..., :1])
                for level in range(len(table)):
                    total = total + counts[..., level:level + 1] * squares[level]
                c = c / torch.sqrt(total + CENTROID_EPS)
            return orthonormal_hadamard(exact_product(c, side)).to(dtype)
        d = codes.shape[-1] * 8 // self.value_bits
        q = unpack_bits(codes, self.value_bits, d).to(torch.float64)
        return (exact_product(q, side[..., :1]) + side[..., 1:].to(torch.float64)).to(dtype)

    def code_bytes(self, head_dim: int, role: str) -> int:
        bits = self.key_bits if role == "key" else self.value_bits
        return -(-head_dim * bits // 8) + (2 if role == "key" else 4)

    def _encode_key(self, x: torch.Tensor) -> tuple:
        k32 = x.to(torch.float32)
        norm = torch.sqrt(_sum_in_order(k32.to(torch.float64) ** 2)).to(torch.float32)  # squares exact in fp64
        unit = k32 / (norm + NORM_EPS)
        rotated = orthonormal_hadamard(unit).to(torch.float32)  # u @ PiT, rounded once
        mids = lloyd_max.midpoints(x.shape[-1], self.key_bits).to(x.device)
        idx = torch.searchsorted(mids, rotated.contiguous(), right=True)  # midpoints <= y: ties go up
        return pack_bits(idx, self.key_bits), _fp16(norm, "a key norm")

    def _encode_value(self, x: torch.Tensor) -> tuple:
        v32 = x.to(torch.float32)
        low, high = v32.amin(-1, keepdim=True), v32.amax(-1, keepdim=True)
        levels = 2**self.value_bits - 1
        scale = (high - low) / float(levels)
        scale = torch.where(scale > VALUE_SCALE_FLOOR, scale, torch.full_like(scale, VALUE_SCALE_FLOOR))
        q = ((v32 - low) / scale + 0.5).trunc().clamp_(0, levels)
        side = torch.cat([_fp16(scale, "a value scale"), _fp16(low, "a value minimum")], dim=-1)
        return pack_bits(q.to(torch.int64), self.value_bits), side


def _sum_in_order(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., d) summed over the last axis left to right, (..., 1): one order on every CPU and shape (a library
    reduction may pair terms differently for one token and for many, and round differently)."""
    total = x[..., :1]
    for j in range(1, x.shape[-1]):
        total = total + x[..., j:j + 1]
    return total


def _fp16(x: torch.Tensor, what: str) -> torch.Tensor:
    """``x`` rounded to fp16 as the store writes it; ``ValueError`` where it overflows (the engine would store inf)."""
    if bool((x.abs() > FP16_MAX).any()):
        raise ValueError(f"turboquant: {what} of {float(x.abs().max()):.4g} exceeds fp16's {FP16_MAX:g}: the engine "
                         "stores it as fp16 and would read inf; this format cannot hold this tensor")
    return x.to(torch.float16)

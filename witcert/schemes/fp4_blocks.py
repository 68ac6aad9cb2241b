"""Block-scaled FP4 KV formats: vLLM's ``nvfp4`` and SGLang's ``fp4_e2m1`` (MXFP4 elements, blocks of 16).

Both store E2M1 values (:mod:`witcert.schemes.e2m1`), two per byte with the even channel in the low nibble, and
one 8-bit scale per block of 16 channels of a head: ``d/2 + d/16`` bytes per token per kv head.

**NVFP4** (vLLM at c46deb951c247ef75c719e72f1a8b781df5e0f00, ``csrc/libtorch_stable/quantization/fp4/
nvfp4_kv_cache_kernels.cu``: ``reshape_and_cache_nvfp4_kernel`` with ``NVFP4KVScaleSearch::DEFAULT``, calling
``cvt_warp_fp16_to_fp4`` of ``nvfp4_utils.cuh`` at 20b4ad8eb93309fce4bc0a069adcd2cfabb462f7). With the
per-tensor fp32 scale ``k_scale`` (``v_scale``; the checkpoint's, 1.0 when uncalibrated) and ``g = 1 / k_scale``,
per block of 16, in fp32: ``sf = g (vecMax rcp(6))`` cast to E4M3 (round to nearest even, saturating),
``out = rcp(sf rcp(g))`` (0 when ``sf`` is 0), codes ``cvt.rn.satfinite.e2m1(x out)``. The reconstruction is
``e2m1 * sf * k_scale``. ``rcp`` is PTX ``rcp.approx.ftz.f32`` (relative error below ``2^-23``), modelled as the
correctly rounded reciprocal: where the two differ by an ulp a code at an exact tie can differ.

**MXFP4 as SGLang ships it** (``fp4_e2m1`` KV cache; sglang at 0dae407b3cee5c310cdeeae348b6d42c025788b2,
``python/sglang/srt/layers/quantization/kvfp4_tensor.py``: ``FP4MXBlock16KVQuantizeUtil``). The source says
block 16, not the OCP MX block of 32 ("Similar to MXFP4 but uses block_size=16"). Per block:
``e = ceil(log2(clamp(max|x| / 6, min=1e-10)))``, stored as the biased exponent ``e + 127`` (uint8, E8M0), so the
scale ``2^e`` is a power of two at least ``max|x| / 6`` (nothing clips); codes round ``x / 2^e`` half away from
zero (:func:`~witcert.schemes.e2m1.round_half_up`). SGLang runs this under ``torch.compile``, which evaluates a
bf16 block's chain in fp32; here every input is widened to fp32 first, and the fp32 ``log2`` is taken correctly
rounded (:func:`ceil_log2_fp32`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from witcert.schemes import e2m1
from witcert.schemes.kv_format import KVFormat, blocks, exact_product, pack_bits, unpack_bits

BLOCK = 16
E4M3_MAX = 448.0
_RCP_6 = torch.tensor(1.0, dtype=torch.float32) / 6.0  # rcp(6.0) in fp32


def check_blocks(head_dim: int, name: str) -> None:
    """``ValueError`` naming the format unless a head splits into whole blocks of 16 channels."""
    if head_dim % BLOCK:
        raise ValueError(f"{name}: head_dim {head_dim} is not a multiple of {BLOCK}; the engine scales blocks of "
                         f"{BLOCK} channels of one head")


def ceil_log2_fp32(m: torch.Tensor) -> torch.Tensor:
    """``ceil(fl32(log2 m))`` (int64) for normal fp32 ``m > 0``, as the fp32 ``torch.log2`` SGLang calls gives it when
    correctly rounded, computed without a library ``log2``: a vectorized and a scalar ``log2`` can differ by an ulp
    (so one value could take two scales in one process), ``frexp`` cannot.

    With ``m = f 2^e``, ``f`` in ``[1/2, 1)``: ``log2 m = (e - 1) + log2(2 f)``, ``log2(2 f)`` in ``[0, 1)``. Its
    ceiling is ``e``, except that the fp32 value is ``e - 1`` when ``2 f = 1`` or ``log2(2 f)`` is within half an
    fp32 ulp above ``e - 1`` (``m`` just above a power of two, ``|e - 1| >= 2``): then the ceiling is ``e - 1``. The
    fraction is ``log1p(2 f - 1) / ln 2`` in fp64, far from that threshold except within ``1e-16`` of it."""
    f, e = torch.frexp(m)
    below = (e - 1).to(torch.float32)
    fraction = torch.log1p(2 * f.to(torch.float64) - 1) / math.log(2)  # log2(2 f), 0 exactly when 2 f = 1
    half_ulp = (torch.nextafter(below, torch.full_like(below, math.inf)) - below).to(torch.float64) / 2
    rounds_down = (fraction == 0) | ((below != 0) & (fraction <= half_ulp))
    return torch.where(rounds_down, e - 1, e).to(torch.int64)


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """``2^e`` in fp32 for integer ``e`` in the normal range ``[-126, 127]``, built from its bits (exact)."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def _unpack(payload: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (..., d / 16, 16) of a packed head."""
    return blocks(unpack_bits(payload, 4, 2 * payload.shape[-1]), BLOCK)


@dataclass(frozen=True)
class Nvfp4(KVFormat):
    """vLLM nvfp4: E2M1 values, an E4M3 scale per 16 channels and a per-tensor fp32 scale (d/2 + d/16 bytes per token)."""

    k_scale: float = 1.0
    v_scale: float = 1.0
    token_axes = (-2, -2, None)
    label = "nvfp4"
    source = ("vLLM c46deb951c247ef75c719e72f1a8b781df5e0f00 csrc/libtorch_stable/quantization/fp4/"
              "nvfp4_kv_cache_kernels.cu (reshape_and_cache_nvfp4_kernel, DEFAULT scale search)")

    def __post_init__(self):
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"nvfp4: {name} must be a positive finite float (the per-tensor scale), got {value!r}")

    @property
    def roles_alike(self) -> bool:
        """Keys and values are coded alike when their per-tensor scales agree (a store then codes both at once)."""
        return self.k_scale == self.v_scale

    def check_head_dim(self, head_dim: int) -> None:
        check_blocks(head_dim, "nvfp4")

    def pack(self, x: torch.Tensor, role: str = "key") -> tuple:
        self.check_head_dim(x.shape[-1])
        tensor_scale = torch.tensor(self.k_scale if role == "key" else self.v_scale, dtype=torch.float32)
        g = 1.0 / tensor_scale  # global_scale = 1.0f / *k_scale_ptr
        x32 = blocks(x.to(torch.float32), BLOCK)  # (..., T, d/16, 16)
        vec_max = x32.abs().amax(-1, keepdim=True)
        sf = (g * (vec_max * _RCP_6)).clamp_(max=E4M3_MAX).to(torch.float8_e4m3fn)  # satfinite E4M3
        sf32 = sf.to(torch.float32)
        out = torch.where(sf32 != 0, 1.0 / (sf32 * (1.0 / g)), torch.zeros_like(sf32))
        codes = e2m1.round_nearest_even(x32 * out).flatten(-2)
        return pack_bits(codes, 4), sf.squeeze(-1), float(tensor_scale)  # the per-tensor scale: a layer constant

    def decode(self, packed: tuple, dtype: torch.dtype) -> torch.Tensor:
        payload, sf, tensor_scale = packed
        per_tensor = torch.tensor(tensor_scale, dtype=torch.float64, device=payload.device)
        return exact_product(e2m1.values(_unpack(payload)), sf[..., None], per_tensor).flatten(-2).to(dtype)

    def code_bytes(self, head_dim: int, role: str) -> int:
        return head_dim // 2 + head_dim // BLOCK


@dataclass(frozen=True)
class Mxfp4Block16(KVFormat):
    """SGLang fp4_e2m1 (MXFP4 elements): E2M1 values, a power-of-two E8M0 scale per 16 channels (d/2 + d/16 bytes)."""

    token_axes = (-2, -2)
    roles_alike = True
    label = "mxfp4"
    source = ("sglang 0dae407b3cee5c310cdeeae348b6d42c025788b2 python/sglang/srt/layers/quantization/"
              "kvfp4_tensor.py (FP4MXBlock16KVQuantizeUtil)")

    def check_head_dim(self, head_dim: int) -> None:
        check_blocks(head_dim, "mxfp4")

    def pack(self, x: torch.Tensor, role: str = "key") -> tuple:
        self.check_head_dim(x.shape[-1])
        x32 = blocks(x.to(torch.float32), BLOCK)
        block_max = x32.abs().amax(-1, keepdim=True)
        exponent = ceil_log2_fp32(torch.clamp(block_max / 6.0, min=1e-10))
        codes = e2m1.round_half_up(x32 / power_of_two(exponent)).flatten(-2)
        return pack_bits(codes, 4), (exponent.squeeze(-1) + 127).to(torch.uint8)

    def decode(self, packed: tuple, dtype: torch.dtype) -> torch.Tensor:
        payload, biased = packed
        scale = power_of_two(biased.to(torch.int64) - 127).to(torch.float64)[..., None]
        return exact_product(e2m1.values(_unpack(payload)), scale).flatten(-2).to(dtype)

    def code_bytes(self, head_dim: int, role: str) -> int:
        return head_dim // 2 + head_dim // BLOCK

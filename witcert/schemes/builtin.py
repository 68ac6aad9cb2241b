"""Built-in cache-preserving quantizers for Tier A (each registered in :mod:`witcert.list_schemes`).

Every function maps a cache tensor ``x`` (..., S, d) (tokens on axis -2, channels on -1) to
its reconstruction, same shape and dtype. Work is done in fp32 (fp64 for fp64 input) and the
result cast back to ``x.dtype``; that final cast is part of the reconstruction, so the Tier A
witness (computed on the returned values) covers it. All-zero groups and ``-0`` give zeros,
never NaN (a zero scale is replaced by 1, which reconstructs the group exactly).

FP8 note: torch 2.13's ``.to(float8_e4m3fn)`` saturates out-of-range values to +-448 (and
maps +-inf to +-448), while ``.to(float8_e5m2)`` overflows to +-inf. Both schemes clamp to the
format's finite range first, so the result never depends on torch's cast policy.
"""
import math

import torch

from witcert.schemes.registry import register_scheme
from witcert.schemes.streaming import FlushPolicy, StreamingScheme, register_streaming_scheme

GROUP = 32  # channel group (per-token schemes) and token group (KIVI keys)
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
OUTLIER_TAIL = 0.005  # per tail: KVQuant keeps 1% of entries exact in all


def _work(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def _channel_groups(x: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """(..., d) -> (..., d/g, g); one group per row when ``g`` does not divide ``d``."""
    g = group if x.shape[-1] % group == 0 else x.shape[-1]
    return x.unflatten(-1, (-1, g))


def _safe(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _symmetric(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Symmetric round-to-nearest over ``dim``: levels ``s * [-qmax, qmax]``, ``s = amax/qmax``."""
    qmax = 2 ** (bits - 1) - 1
    scale = _safe(x.abs().amax(dim=dim, keepdim=True) / qmax)
    return torch.round(x / scale).clamp(-qmax, qmax) * scale


def _asymmetric(x: torch.Tensor, bits: int, dim: int, lo=None, hi=None) -> torch.Tensor:
    """Asymmetric round-to-nearest over ``dim`` between ``lo`` and ``hi`` (default min / max)."""
    levels = 2**bits - 1
    lo = x.amin(dim=dim, keepdim=True) if lo is None else lo
    hi = x.amax(dim=dim, keepdim=True) if hi is None else hi
    scale = _safe((hi - lo) / levels)
    return torch.round((x - lo) / scale).clamp(0, levels) * scale + lo


def _rtn(x: torch.Tensor, bits: int) -> torch.Tensor:
    grouped = _channel_groups(_work(x))  # (..., S, d/g, g)
    return _symmetric(grouped, bits, dim=-1).flatten(-2).to(x.dtype)


@register_scheme("rtn-int8")
def rtn_int8(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest INT8, per-token groups of 32 channels, symmetric absmax (LLM.int8/KIVI-baseline RTN)."""
    return _rtn(x, 8)


@register_scheme("rtn-int4")
def rtn_int4(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest INT4, per-token groups of 32 channels, symmetric absmax (KIVI's RTN baseline)."""
    return _rtn(x, 4)


@register_scheme("rtn-int2")
def rtn_int2(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest INT2 (symmetric: levels {-s, 0, s}), per-token groups of 32 (KIVI's RTN baseline)."""
    return _rtn(x, 2)


@register_scheme("sign-1bit")
def sign_1bit(x: torch.Tensor) -> torch.Tensor:
    """1-bit sign code with the L2-optimal per-token scale mean|x| (XNOR-Net, Rastegari et al. 2016)."""
    xw = _work(x)
    scale = xw.abs().mean(dim=-1, keepdim=True)
    return (torch.sign(xw) * scale).to(x.dtype)


@register_scheme("fp8-e4m3")
def fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Raw cast to OCP FP8 E4M3 (float8_e4m3fn), no scale, clamped to +-448 (raw-cast fp8 KV cache)."""
    xw = _work(x).clamp(-E4M3_MAX, E4M3_MAX)
    return xw.to(torch.float8_e4m3fn).to(x.dtype)


@register_scheme("fp8-e4m3-scaled")
def fp8_e4m3_scaled(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 with one per-tensor amax scale (Micikevicius et al. 2022; vLLM per-tensor fp8 KV scale)."""
    xw = _work(x)
    scale = _safe(xw.abs().amax() / E4M3_MAX)
    coded = (xw / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (coded.to(xw.dtype) * scale).to(x.dtype)


@register_scheme("fp8-e5m2")
def fp8_e5m2(x: torch.Tensor) -> torch.Tensor:
    """Raw cast to OCP FP8 E5M2 (float8_e5m2), no scale, clamped to +-57344 (Micikevicius et al. 2022)."""
    xw = _work(x).clamp(-E5M2_MAX, E5M2_MAX)
    return xw.to(torch.float8_e5m2).to(x.dtype)


def _kivi_keys(x: torch.Tensor) -> torch.Tensor:
    """KIVI keys: per-channel asymmetric 2-bit over each complete group of 32 tokens; the rest exact."""
    xw = _work(x)
    full = (x.shape[-2] // GROUP) * GROUP
    head = xw[..., :full, :].unflatten(-2, (-1, GROUP))  # (..., S/32, 32, d)
    quantized = _asymmetric(head, 2, dim=-2).flatten(-3, -2)  # (..., full, d)
    return torch.cat([quantized, xw[..., full:, :]], dim=-2).to(x.dtype)


def _kivi_values(x: torch.Tensor) -> torch.Tensor:
    """KIVI values: per-token asymmetric 2-bit over groups of 32 channels."""
    return _asymmetric(_channel_groups(_work(x)), 2, dim=-1).flatten(-2).to(x.dtype)


@register_scheme("kivi-2bit")
def kivi_2bit(x: torch.Tensor, role: str = "key") -> torch.Tensor:
    """KIVI 2-bit quantizer (Liu et al., ICML 2024) on one tensor: keys per-channel over 32-token groups, values per-token.

    Keys: each complete group of 32 tokens is quantized per channel; the trailing ``S mod 32``
    tokens stay exact. Values: per-token asymmetric over groups of 32 channels. This is KIVI's
    quantizer applied to one written tensor; the KIVI *cache* (an exact window of the 128 newest
    tokens, keys flushed in 128-token units, so decode tokens are quantized too) is the streaming
    scheme :data:`KIVI_2BIT` of the same name (:mod:`witcert.schemes.streaming`).
    """
    return _kivi_values(x) if role == "value" else _kivi_keys(x)


KIVI_RESIDUAL = 128  # KIVI's full-precision window R (paper and code default; a multiple of GROUP)

KIVI_2BIT = register_streaming_scheme(
    StreamingScheme(
        name="kivi-2bit",
        quantize_key=_kivi_keys,
        quantize_value=_kivi_values,
        key_policy=FlushPolicy(unit=KIVI_RESIDUAL),  # window fills to R, then R/32 per-channel groups
        value_policy=FlushPolicy(unit=1, keep=KIVI_RESIDUAL),  # R newest exact, older per token
    )
)
"""The KIVI 2-bit cache (Liu et al., ICML 2024; its reference code): keys held exactly until 128
have gathered, then quantized per channel in four 32-token groups; the 128 newest values exact,
each older value quantized per token (groups of 32 channels); the prefill attends exact keys."""


@register_scheme("kvquant-4bit")
def kvquant_4bit(x: torch.Tensor, role: str = "key") -> torch.Tensor:
    """KVQuant-style 4-bit (Hooper et al. 2024): per-channel keys / per-token values, 1% dense-and-sparse outliers exact.

    Per vector of ``n`` entries (a channel over tokens for keys, a token over channels for
    values) the ``m = ceil(0.005 n)`` smallest and ``m`` largest entries are kept exact (the
    sparse part, 1% in all); the rest are quantized on a uniform asymmetric 16-level grid
    between the ``(m+1)``-th smallest and ``(m+1)``-th largest entries (KVQuant's non-uniform
    NUQ grid is replaced by a uniform one). Vectors with ``n <= 2m`` have no outliers.
    """
    xw = _work(x)
    dim = -2 if role == "key" else -1
    lo, hi = _outlier_thresholds(xw, dim, OUTLIER_TAIL)
    dense = _asymmetric(xw.clamp(lo, hi), 4, dim=dim, lo=lo, hi=hi)
    outlier = (xw < lo) | (xw > hi)
    return torch.where(outlier, xw, dense).to(x.dtype)


def _outlier_thresholds(x: torch.Tensor, dim: int, tail: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(m+1)``-th smallest and largest entries along ``dim``, ``m = ceil(tail n)``.

    Uses ``kthvalue`` (no size limit, unlike ``torch.quantile``).
    """
    n = x.shape[dim]
    m = math.ceil(tail * n)
    if n <= 2 * m:
        return x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    lo = torch.kthvalue(x, m + 1, dim=dim, keepdim=True).values
    hi = torch.kthvalue(x, n - m, dim=dim, keepdim=True).values
    return lo, hi

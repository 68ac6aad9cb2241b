"""FP4 E2M1 values and the two ways engines round to them (the element format of NVFP4 and MXFP4).

E2M1 holds ``+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}``; code ``i`` (0..7) is the ``i``-th magnitude, bit 3 the sign.
Rounding is decided by exact comparisons with the midpoints ``0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5``:

- :func:`round_nearest_even` is PTX ``cvt.rn.satfinite.e2m1x2.f32`` (NVFP4 in vLLM): ties to the even
  mantissa (``0.25 -> 0``, ``0.75 -> 1``, ``1.25 -> 1``, ``1.75 -> 2``, ``2.5 -> 2``, ``3.5 -> 4``, ``5 -> 4``),
  everything above 6 saturates to 6, the sign bit is the input's (``-0.1 -> -0``);
- :func:`round_half_up` is SGLang's ``sum(abs >= bounds)`` (``FP4MXBlock16KVQuantizeUtil``): ties away from
  zero, and the sign bit is ``x < 0`` (``-0.1`` keeps its sign, ``-0.0`` becomes ``+0``).
"""
import torch

MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_GOES_UP = (False, True, False, True, False, True, False)  # the upper neighbour's mantissa is even
SIGN = 8


def round_nearest_even(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (int64, sign in bit 3) of fp32 ``v``: nearest, ties to even, saturating (``cvt.rn.satfinite``)."""
    mag = v.abs()
    code = torch.zeros_like(mag, dtype=torch.int64)
    for bound, up in zip(MIDPOINTS, _TIE_GOES_UP):
        code += (mag > bound) | ((mag == bound) & up)
    return code + SIGN * torch.signbit(v).to(torch.int64)


def round_half_up(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of ``v`` as SGLang forms them: the count of midpoints at or below ``|v|`` (ties up), sign ``v < 0``."""
    mag = v.abs()
    code = torch.zeros_like(mag, dtype=torch.int64)
    for bound in MIDPOINTS:
        code += mag >= bound
    return code + SIGN * (v < 0).to(torch.int64)


def values(codes: torch.Tensor) -> torch.Tensor:
    """fp64 values of E2M1 codes (``-0.0`` for code 8)."""
    table = torch.tensor(MAGNITUDES + tuple(-m for m in MAGNITUDES), dtype=torch.float64, device=codes.device)
    return table[codes.to(torch.int64)]

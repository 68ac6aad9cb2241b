"""How a store keeps its upper bounds: the band witness in fp16 or in one byte, always rounded up (T2, MW).

Every bound the meter forms grows with each stored band norm: ``c_t = sm_scale sum_b ||q_b|| w_{t,b}``
is monotone in ``w`` (Theorem 2 ``T2`` needs ``w_{t,b} >= ||r_{t,b}||``), and so is the T1 meter in
``c`` (registry ``MW``: Lean ``WitCert.tv_le_eform_of_rounded_witness``, from ``WitCert.bandBound_mono``
and ``WitCert.eform_meter_mono``). So a stored value at or above the band norm keeps every bound
sound, and one below it is unsound: each code here only rounds up.

Two codes (:class:`WitnessCode`, ``bits``):

- ``16``: fp16, rounded up (:func:`witcert.witness_of`): 2 bytes per band. The value statistics stay
  as they were: ``rho_t >= ||v^_t - v_t||`` and ``||v_t||`` rounded up to fp32.
- ``8``: **e5m3**, one byte per band: the bit pattern of a non-negative fp16 value without its sign bit,
  rounded up to a multiple of ``2^7`` (5 exponent bits with fp16's bias and range, 3 mantissa bits).
  Decoding shifts the byte back into place, so every code is an fp16 value and decodes exactly;
  encoding takes ``(bits + 127) >> 7`` of an fp16 upper bound, and since non-negative fp16 values are
  ordered like their bit patterns, ``decode(encode(w)) >= w``. The code grid is a subset of fp16's,
  so rounding fp64 up to fp16 and then to e5m3 gives the smallest e5m3 value above the fp64 one.
  Resolution: at most ``2^-3`` relative above the fp16 value for normal values, steps of ``2^-17``
  below ``2^-14``; 0 stays 0 (code 0), ``inf`` stays ``inf`` (code 248), and a value above the largest
  finite code, 61440, becomes ``inf``: the trivial bound, never NaN (codes 249-255 are never made).
  The value residual ``rho_t`` is coded the same way; ``||v_t||`` is kept in fp16 rounded up
  (2 bytes: it is also the unit of the ``pass_V`` threshold, where a coarser upper value would ease
  the test).

A third mode stores no band norm at all: ``0`` (**derived**, :mod:`witcert.tier_a.derived_witness`): a codec
that declares an elementwise bound on its reconstruction error (``error_bound``; the built-in rtn, KIVI and
fp8 codecs do) has its witness and value residual recomputed at every read from the scales it stores anyway
(``DW``), the bound checked against the exact values when each token is written; only ``||v_t||`` is
kept, in fp16 rounded up (2 bytes). Between the two, ``4``: each band norm stored as a 4-bit fraction
``k/16`` of that derived witness (the value residual as an 8-bit fraction ``k/256``), the smallest that
stays at or above the norm (:func:`witcert.tier_a.derived_witness.relative_codes`), ``ceil(B/2) + 3`` bytes.

Storage per token and kv head: ``2B + 8`` bytes at 16 bits (``2B + 6`` over transformers' quantized
caches, whose value witness is maintained in fp16), ``B + 3`` at 8 bits (16 bands: 40 against 19). Decoding happens where a store hands its statistics to the meter
(:meth:`WitnessCode.readable`), so every meter path (fused fast path, stored pass, full eager,
gate, spot radii, Tier B minimum) reads the same fp16 values, each at or above its norm.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from witcert.core.rounding import round_up_to

WITNESS_BITS = (16, 8, 4, 0)  # 4: a fraction of the derived witness; 0: derived, nothing stored per band
# what witcert.monitor stores: one e5m3 byte per band norm, rounded up. Chosen from
# benchmarks/results/witness_size.json (SmolLM2, 16 bands): held-out-style rtn-int8 coverage at tau 0.2 0.970
# against 0.980 in fp16, 19 bytes per token and kv head against 40; fewer bands cost more (8: 0.940, 4: 0.905)
DEFAULT_WITNESS_BITS = 8
E5M3_SHIFT = 7  # the low fp16 mantissa bits an e5m3 code drops
E5M3_INF = 0x7C00 >> E5M3_SHIFT  # 248: the code of +inf
E5M3_MAX = 61440.0  # the largest finite e5m3 value (code 247): 0x7B80 as fp16


def encode_e5m3(w16: torch.Tensor) -> torch.Tensor:
    """uint8 e5m3 codes of fp16 upper bounds ``w16 >= 0`` (``inf`` allowed), each decoding to a value ``>= w16``.

    Raises ``ValueError`` on a dtype other than fp16, a negative entry or NaN (a band norm is neither).
    """
    if not isinstance(w16, torch.Tensor) or w16.dtype != torch.float16:
        raise ValueError(f"w16 must be a float16 tensor of upper bounds, got {getattr(w16, 'dtype', type(w16))}")
    if not (w16 >= 0).all():  # NaN compares False too
        raise ValueError("w16 must be >= 0 and not NaN (a stored bound is a norm)")
    return encode_e5m3_checked(w16)


def encode_e5m3_checked(w16: torch.Tensor) -> torch.Tensor:
    """:func:`encode_e5m3` of fp16 values known to be ``>= 0`` or ``+inf`` (no host synchronisation).
    ``-0`` is taken as ``+0``."""
    bits = (w16 + 0.0).view(torch.int16).to(torch.int32)  # 0 ... 0x7C00; + 0.0 turns -0 into +0
    return ((bits + (1 << E5M3_SHIFT) - 1) >> E5M3_SHIFT).to(torch.uint8)  # round the pattern up


def decode_e5m3(codes: torch.Tensor) -> torch.Tensor:
    """fp16 values of uint8 e5m3 codes (exact: each code is an fp16 bit pattern shifted right by 7)."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be a uint8 tensor, got {getattr(codes, 'dtype', type(codes))}")
    return (codes.to(torch.int16) << E5M3_SHIFT).view(torch.float16)


@dataclass(frozen=True)
class WitnessCode:
    """How a store keeps the Tier A witness and the value statistics of each token (see the module docstring).

    Parameters
    ----------
    bits : {16, 8, 4, 0}
        Bits per stored band norm: fp16 rounded up, the e5m3 byte rounded up, a 4-bit fraction of the
        witness derived from the codec's elementwise error bound, or none (``0``: that derived witness, ``DW``).
    """

    bits: int = 16

    def __post_init__(self):
        if isinstance(self.bits, bool) or self.bits not in WITNESS_BITS:
            raise ValueError(f"witness_bits must be one of {WITNESS_BITS}, got {self.bits!r}")

    @property
    def derived(self) -> bool:
        """Whether the witness is formed at read time from the codec's error bound (``0``; ``4``: scaled by stored
        fractions), so the codec must declare one."""
        return self.bits in (0, 4)

    @property
    def relative(self) -> bool:
        """Whether each band norm is stored as a 4-bit fraction of the derived witness."""
        return self.bits == 4

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of a stored witness: fp16 or uint8."""
        return torch.float16 if self.bits == 16 else torch.uint8

    def bytes_per_token(self, bands: int) -> int:
        """Bytes one token and kv head holds: ``bands`` norms, ``rho_t`` and ``||v_t||`` (derived: ``||v_t||`` only;
        relative: half a byte per band, a byte for ``rho_t``)."""
        return {16: 2 * bands + 8, 8: bands + 3, 4: (bands + 1) // 2 + 3, 0: 2}[self.bits]

    # -- write -------------------------------------------------------------------------------------
    def witness(self, w16: torch.Tensor) -> torch.Tensor:
        """The stored form of an fp16 witness (``witcert.witness_of``'s output, ``>=`` the band norms)."""
        return w16 if self.bits == 16 else encode_e5m3_checked(w16)

    def residual(self, rho: torch.Tensor) -> torch.Tensor:
        """The stored form of value residual norms ``rho`` (fp32/fp64 upper bounds)."""
        return rho if self.bits == 16 else encode_e5m3_checked(round_up_to(rho.double(), torch.float16))

    def norm(self, v_norm: torch.Tensor) -> torch.Tensor:
        """The stored form of value norms (fp64 upper bounds): rounded up to fp32 (16 bits) or fp16 (8 bits, derived)."""
        return round_up_to(v_norm.double(), torch.float32 if self.bits == 16 else torch.float16)

    # -- read --------------------------------------------------------------------------------------
    def decoded(self, stored: torch.Tensor) -> torch.Tensor:
        """The fp16 values a stored witness (or residual) stands for, exactly."""
        return stored if self.bits == 16 else decode_e5m3(stored)

    def readable(self, witness: torch.Tensor, rho: torch.Tensor, v_norm: torch.Tensor) -> tuple:
        """``(witness fp16, rho fp32, v_norm fp32)`` as the meter reads them: each decoded exactly (the same
        values, the same layout), so every path sees a witness at or above each band norm."""
        if self.bits == 16:
            return witness, rho, v_norm
        return self.decoded(witness), self.decoded(rho).float(), v_norm.float()

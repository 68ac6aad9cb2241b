"""Tier A write path: band norms of the key residual, rounded UP to fp16 (Lemma 1 L1, Theorem 2 T2).

For each incoming token, ``w_{t,b} >= ||(k^_t - k_t)_b||`` for every band ``b`` of the
``BandLayout`` (whole RoPE pairs under the model's convention, so by Lemma 1 the witness of a
pre-RoPE residual serves post-RoPE queries). The witness must never be rounded down
(docs/design.md "Tier A: the band witness"): the kernel computes in fp64 and rounds up to fp16 explicitly.

Rounding: the fp64 residual of two fp16/bf16/fp32 values is off by at most ``2^-53``
relative, the ``2P`` squares and their sum by ``gamma_{2P}``, the sqrt by one more rounding;
the fp64 norm is inflated by ``1 + (2P + 8) 2^-52`` (twice the count), then cast to fp16
through fp32 (as torch does, so the result matches ``witcert.witness_of``) and bumped one fp16 step (bit pattern + 1; fp16 is monotone in its bits for values
>= 0) wherever the cast landed below. Squares of fp32-range values neither overflow nor
underflow in fp64. Torch oracle: ``witcert.witness_of``.

With ``bits=8`` the kernel stores the one-byte e5m3 code of that fp16 value instead
(:mod:`witcert.tier_a.witness_code`): its bit pattern rounded up to a multiple of ``2^7`` and shifted
right by 7, again only upward (the meter is monotone in the witness, registry ``MW``). Torch oracle:
``WitnessCode(8).witness(witcert.witness_of(...))``, bit for bit.
"""
import torch
import triton
import triton.language as tl

from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness_code import WitnessCode

from . import require_backend
from ._validate import require, require_finite, require_tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _round_up_fp16(x64):
    """fp16 value ``>= x64`` (``x64 >= 0``): nearest, then one step up where it fell short."""
    h = x64.to(tl.float32).to(tl.float16)  # via fp32, as torch casts fp64 -> fp16
    short = h.to(tl.float64) < x64
    bumped = (h.to(tl.int16, bitcast=True) + 1).to(tl.int16).to(tl.float16, bitcast=True)  # stay 16-bit
    return tl.where(short, bumped, h)


@triton.jit
def _e5m3_up(h):
    """uint8 e5m3 code of an fp16 value ``h >= 0``: its bit pattern rounded up to a multiple of 2^7, shifted by 7
    (the code decodes to ``>= h``; ``inf`` to 248, its own code)."""
    pattern = h.to(tl.int16, bitcast=True).to(tl.int32)  # 0 ... 0x7C00 for 0 <= h <= inf
    return ((pattern + 127) >> 7).to(tl.uint8)


@triton.jit
def _witness_write_kernel(
    k_ptr, k_hat_ptr, band_ptr, w_ptr, n_rows, inflate,
    stride_k_row, stride_k_hat_row, stride_w_row,
    BANDS: tl.constexpr, BAND_WIDTH: tl.constexpr, CODE_BITS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr,
):
    offs_row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask_row = offs_row < n_rows
    offs_b = tl.arange(0, BLOCK_B)
    offs_w = tl.arange(0, BLOCK_W)
    mask_bw = (offs_b[:, None] < BANDS) & (offs_w[None, :] < BAND_WIDTH)
    coords = tl.load(band_ptr + offs_b[:, None] * BAND_WIDTH + offs_w[None, :], mask=mask_bw, other=0)
    mask = mask_row[:, None, None] & mask_bw[None, :, :]
    k = tl.load(k_ptr + offs_row[:, None, None] * stride_k_row + coords[None, :, :], mask=mask, other=0.0)
    k_hat = tl.load(k_hat_ptr + offs_row[:, None, None] * stride_k_hat_row + coords[None, :, :], mask=mask,
                    other=0.0)
    residual = k_hat.to(tl.float64) - k.to(tl.float64)  # (rows, B, 2P)
    norms = tl.sqrt(tl.sum(residual * residual, axis=2)) * inflate  # fp64 sqrt is IEEE (PTX: sqrt.rn.f64)
    w_rows = w_ptr + offs_row[:, None] * stride_w_row + offs_b[None, :]
    w16 = _round_up_fp16(norms)  # T2's premise w >= ||r_b||
    stored = _e5m3_up(w16) if CODE_BITS == 8 else w16  # only upward again: the meter is monotone in w (MW)
    tl.store(w_rows, stored, mask=mask_row[:, None] & (offs_b[None, :] < BANDS))


KERNEL_BITS = (16, 8)
"""The stored witness codes this kernel writes: fp16 norms and the e5m3 byte (``witness_bits`` 0 and 4 derive the
witness from a codec's error bound, :mod:`witcert.tier_a.derived_witness`, and never reach it)."""


def _launch_witness_write(k_rows, k_hat_rows, band_index, block_rows, bits):
    n_rows = k_rows.shape[0]
    bands, band_width = band_index.shape
    w = torch.empty((n_rows, bands), dtype=WitnessCode(bits).dtype, device=k_rows.device)
    inflate = 1.0 + (band_width + 8) * 2.0**-52
    require_backend(_witness_write_kernel)
    _witness_write_kernel[(triton.cdiv(n_rows, block_rows),)](
        k_rows, k_hat_rows, band_index, w, n_rows, inflate,
        k_rows.stride(0), k_hat_rows.stride(0), w.stride(0),
        BANDS=bands, BAND_WIDTH=band_width, CODE_BITS=bits,
        BLOCK_ROWS=block_rows, BLOCK_B=triton.next_power_of_2(bands), BLOCK_W=triton.next_power_of_2(band_width),
    )
    return w


def witness_write(k: torch.Tensor, k_hat: torch.Tensor, layout: BandLayout, *, block_rows: int = 16,
                  bits: int = 16) -> torch.Tensor:
    """fp16 band witnesses of ``k_hat - k``, rounded up (Lemma 1 ``L1``, Theorem 2 ``T2``), or their e5m3 bytes.

    Parameters
    ----------
    k, k_hat : Tensor (..., S, d)
        Exact and reconstructed keys of the incoming tokens (fp16/bf16/fp32, same shape/device).
    layout : BandLayout
        Bands of whole RoPE pairs (``layout.head_dim == d``).
    block_rows : int
        Tokens per program (a power of two).
    bits : {16, 8}
        16: fp16 witnesses; 8: their e5m3 codes (:class:`witcert.tier_a.witness_code.WitnessCode`).

    Returns
    -------
    Tensor (..., S, B), fp16 (``bits=16``) or uint8 (``bits=8``)
        ``w >= ||(k_hat - k)_b||`` exactly (after decoding); ``inf`` where the norm exceeds the fp16 range
        (the e5m3 range: above 61440). Torch oracle: ``witcert.witness_of`` (and ``WitnessCode(8).witness``).
    """
    require(isinstance(layout, BandLayout), "layout", f"must be a BandLayout, got {type(layout).__name__}")
    require_tensor("k", k, dtypes=FLOAT_DTYPES, last_dim=layout.head_dim)
    require_tensor("k_hat", k_hat, dtypes=FLOAT_DTYPES, shape=k.shape, device=k.device)
    require(k.dim() >= 2, "k", f"must be (..., S, d), got shape {tuple(k.shape)}")
    require(block_rows > 0 and block_rows & (block_rows - 1) == 0, "block_rows", f"must be a power of two, got {block_rows}")
    require(bits in KERNEL_BITS and not isinstance(bits, bool), "bits", f"must be one of {KERNEL_BITS} (stored "
            f"witness codes; the derived modes 0 and 4 are formed from a codec's error bound), got {bits!r}")
    require_finite("k", k)
    require_finite("k_hat", k_hat)
    lead = k.shape[:-1]
    k_rows = k.reshape(-1, layout.head_dim).contiguous()
    k_hat_rows = k_hat.reshape(-1, layout.head_dim).contiguous()
    if k_rows.shape[0] == 0:
        return torch.empty(*lead, layout.bands, dtype=WitnessCode(bits).dtype, device=k.device)
    band_index = layout.index.to(device=k.device, dtype=torch.int32).contiguous()
    return _launch_witness_write(k_rows, k_hat_rows, band_index, block_rows, bits).reshape(*lead, layout.bands)

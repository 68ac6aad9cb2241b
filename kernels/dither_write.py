"""Tier B write path: quantize incoming tokens into the packed dithered INT8 store (L2, TB).

Bit-identical to ``witcert.DitheredInt8.quantize`` (the torch reference) for the streaming
configurations, where a token can be written on arrival:

* granularity ``"token-group"`` (per token x ``Gc`` channels; paging-safe) or ``"token"``;
* outliers: none, or a fixed per-(layer, kv_head) pair set (``outlier_mode="fixed"``).

``"block-channel"`` scales and per-block energy-selected outliers need a whole 256-token
block before any token can be written; they are rejected here (use the torch reference).

What the kernel does per element, and which hypothesis it serves:

* the group scale is the smallest fp16 ``s`` with ``s (Q - 1/2) >= amax`` of the group's
  non-outlier channels (fp64 quotient, cast through fp32 to fp16 exactly as torch casts, then
  one fp16 step up if short: checked exactly in fp64) -- the *stored* fp16 scale is the one
  used to quantize, so ``|err| <= s/2`` holds (docs/design.md "Tier B: the dithered INT8 cache") and ``|n| <= Q``: no clipping;
* the dither ``xi`` comes from in-kernel Philox4x32-10 (``kernels/philox.py``, int64 words)
  on the counter layout of ``witcert.tier_b.counters`` (channel ``c`` uses output word ``c & 3`` of
  the counter whose word 1 carries ``c >> 2``), mapped to the centred 24-bit grid of
  ``witcert.tier_b.dither``; the stream depends only on the element's counter tuple, not on the grid;
* the code is the integer nearest to ``x/s + xi`` exactly: the fp64 candidate
  ``floor(x/s + xi + 1/2)`` fixed by the two exact comparisons of ``witcert.tier_b.quantizer``.
"""
import torch
import triton
import triton.language as tl

from witcert.tier_b.counters import PagedCounter, StandaloneCounter, _key_of
from witcert.tier_b.quantizer import FP16_MAX, SCALE_DIVISOR, DitheredInt8
from witcert.tier_b.outliers import pair_channels
from witcert.tier_b.packed_store import PackedStore

from . import require_backend
from ._validate import require, require_tensor
from .philox import philox_rounds

STREAMING_GRANULARITIES = ("token-group", "token")
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DITHER_SHIFT = tl.constexpr(8)  # U = word >> 8: the top 24 bits
DITHER_OFFSET = tl.constexpr(1 << 24)  # XI = 2U + 1 - 2^24
DITHER_DENOMINATOR = tl.constexpr(float(1 << 25))  # xi = XI / 2^25


@triton.jit
def _round_up_scale(amax, SCALE_DIV: tl.constexpr):
    """Smallest-ish fp16 ``s`` with ``s * SCALE_DIV >= amax`` (exact fp64 check, one step up)."""
    s = (amax / SCALE_DIV).to(tl.float32).to(tl.float16)  # via fp32, as torch casts fp64 -> fp16
    short = s.to(tl.float64) * SCALE_DIV < amax  # exact: 11 x 8 significant bits
    bumped = (s.to(tl.int16, bitcast=True) + 1).to(tl.int16).to(tl.float16, bitcast=True)  # stay 16-bit
    return tl.where(short, bumped, s)


@triton.jit
def dither_of_words(word):
    """Centred 24-bit grid dither ``xi = (2 (word >> 8) + 1 - 2^24) / 2^25`` (fp64, exact)."""
    numerator = 2 * (word >> DITHER_SHIFT) + 1 - DITHER_OFFSET
    return numerator.to(tl.float64) / DITHER_DENOMINATOR


@triton.jit
def dither_block(c0, c1_base, c2, c3, k0, k1, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Dither (BLOCK_ROWS, BLOCK_D) for row counter words ``c0, c2, c3`` (rows, 1) and ``c1_base``.

    Channel ``c`` uses output word ``c & 3`` of the counter whose word 1 is ``c1_base | c >> 2``
    (``witcert.tier_b.counters``): one Philox call per four channels, its words interleaved back into
    channel order. All words are int64 in ``[0, 2^32)``.
    """
    offs_group = tl.arange(0, BLOCK_D // 4)  # channel >> 2
    c1 = c1_base | offs_group[None, :]
    zero = c0 * 0 + c1 * 0  # broadcast every word to the full (rows, groups) shape
    r0, r1, r2, r3 = philox_rounds(c0 + zero, c1 + zero, c2 + zero, c3 + zero, k0, k1)
    # [row, g, i, k] = r_{2i+k}: flattening (g, i, k) gives channel 4g + 2i + k, word c & 3
    words = tl.join(tl.join(r0, r2), tl.join(r1, r3))
    return dither_of_words(tl.reshape(words, (BLOCK_ROWS, BLOCK_D)))


@triton.jit
def _dither_write_kernel(
    x_ptr, counter_ptr, key_ptr, outlier_mask_ptr, outlier_chan_ptr,
    payload_ptr, scale_ptr, outlier_ptr,
    n_rows, tokens,
    stride_x_row, stride_counter_row, stride_mask_head, stride_chan_head,
    stride_payload_row, stride_scale_row, stride_outlier_row,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, N_GROUPS: tl.constexpr, N_OUTLIER_CH: tl.constexpr,
    SCALE_DIV: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_O: tl.constexpr,
):
    offs_row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask_row = offs_row < n_rows
    offs_c = tl.arange(0, BLOCK_D)
    mask = mask_row[:, None] & (offs_c[None, :] < HEAD_DIM)
    head_row = offs_row // tokens  # flattened (lead, kv_head) of each token row

    x = tl.load(x_ptr + offs_row[:, None] * stride_x_row + offs_c[None, :], mask=mask, other=0.0).to(tl.float64)
    is_outlier = tl.load(outlier_mask_ptr + head_row[:, None] * stride_mask_head + offs_c[None, :],
                         mask=mask, other=0) != 0
    # group amax of the non-outlier channels (outliers are excluded from the amax: docs/design.md "Tier B: the dithered INT8 cache")
    x_abs = tl.where(is_outlier, 0.0, tl.abs(x))
    amax = tl.max(tl.reshape(x_abs, (BLOCK_ROWS, N_GROUPS, GROUP)), axis=2)  # (rows, groups)
    scale16 = _round_up_scale(amax, SCALE_DIV)
    offs_g = tl.arange(0, N_GROUPS)
    tl.store(scale_ptr + offs_row[:, None] * stride_scale_row + offs_g[None, :], scale16, mask=mask_row[:, None])

    # the stored fp16 scale of each element (0 on outliers): the one the code is computed with
    scale = tl.reshape(tl.broadcast_to(scale16.to(tl.float64)[:, :, None], (BLOCK_ROWS, N_GROUPS, GROUP)),
                       (BLOCK_ROWS, BLOCK_D))
    scale = tl.where(is_outlier, 0.0, scale)

    counter_rows = counter_ptr + offs_row * stride_counter_row
    c0 = tl.load(counter_rows + 0, mask=mask_row, other=0)[:, None]
    c1 = tl.load(counter_rows + 1, mask=mask_row, other=0)[:, None]
    c2 = tl.load(counter_rows + 2, mask=mask_row, other=0)[:, None]
    c3 = tl.load(counter_rows + 3, mask=mask_row, other=0)[:, None]
    k0 = tl.load(key_ptr + 0)
    k1 = tl.load(key_ptr + 1)
    xi = dither_block(c0, c1, c2, c3, k0, k1, BLOCK_ROWS, BLOCK_D)  # (rows, d) fp64

    # exact nearest code to x/s + xi: fp64 candidate, then the two exact fix-ups
    safe = tl.where(scale > 0, scale, 1.0)
    n = tl.floor(x / safe + xi + 0.5)
    n = n - (x < scale * (n - xi - 0.5)).to(tl.float64)
    n = n + (x > scale * (n - xi + 0.5)).to(tl.float64)
    n = tl.where(scale > 0, n, 0.0)
    tl.store(payload_ptr + offs_row[:, None] * stride_payload_row + offs_c[None, :], n.to(tl.int8), mask=mask)

    if N_OUTLIER_CH > 0:
        offs_o = tl.arange(0, BLOCK_O)
        mask_o = mask_row[:, None] & (offs_o[None, :] < N_OUTLIER_CH)
        chans = tl.load(outlier_chan_ptr + head_row[:, None] * stride_chan_head + offs_o[None, :], mask=mask_o, other=0)
        kept = tl.load(x_ptr + offs_row[:, None] * stride_x_row + chans, mask=mask_o, other=0.0)
        tl.store(outlier_ptr + offs_row[:, None] * stride_outlier_row + offs_o[None, :],
                 kept.to(tl.float32).to(tl.float16), mask=mask_o)


def _outlier_tables(quantizer: DitheredInt8, lead_heads: tuple[int, ...], head_dim: int, device):
    """Per (lead, kv_head): the outlier channel list (n, 2m) int32 and channel mask (n, d) int8."""
    n_heads = 1
    for size in lead_heads:
        n_heads *= size
    m = quantizer.outlier_pairs
    if m == 0:
        return (torch.zeros((n_heads, 1), dtype=torch.int32, device=device),
                torch.zeros((n_heads, head_dim), dtype=torch.int8, device=device))
    pairs = quantizer.fixed_pairs.to(torch.int64).expand(*lead_heads, m).reshape(n_heads, m)
    chans = pair_channels(pairs, head_dim, quantizer.rope)  # (n, 2m): first members, then second
    mask = torch.zeros((n_heads, head_dim), dtype=torch.int8).scatter(-1, chans, 1)
    return chans.to(device=device, dtype=torch.int32).contiguous(), mask.to(device).contiguous()


def _check_streaming(x, quantizer, counter):
    require_tensor("x", x, dtypes=INPUT_DTYPES)
    require(x.dim() >= 3, "x", f"must be (..., H, S, d), got shape {tuple(x.shape)}")
    require(isinstance(quantizer, DitheredInt8), "quantizer", f"must be a DitheredInt8, got {type(quantizer).__name__}")
    require(isinstance(counter, (StandaloneCounter, PagedCounter)), "counter",
            f"must be a StandaloneCounter or PagedCounter, got {type(counter).__name__}")
    require(quantizer.granularity in STREAMING_GRANULARITIES, "quantizer",
            f"granularity {quantizer.granularity!r} needs whole blocks; the write kernel streams "
            f"{STREAMING_GRANULARITIES} (use DitheredInt8.quantize)")
    require(quantizer.outlier_pairs == 0 or quantizer.outlier_mode == "fixed", "quantizer",
            "energy-mode outliers select pairs per 256-token block; the write kernel needs a fixed pair set")
    require(quantizer.outlier_pairs == 0 or quantizer.fixed_pairs is not None, "quantizer",
            "outlier_mode='fixed' needs fixed_pairs (use calibrate)")
    require(bool(torch.isfinite(x).all()), "x", "must be finite (found NaN or Inf)")


def dither_write(x: torch.Tensor, quantizer: DitheredInt8, counter, *, block_rows: int = 16) -> PackedStore:
    """Quantize ``x`` (*lead, H, S, d) into a packed dithered INT8 store (``L2``, ``TB``).

    Parameters
    ----------
    x : Tensor (*lead, H, S, d)
        Incoming keys (or values), fp16/bf16/fp32, finite.
    quantizer : DitheredInt8
        ``"token-group"`` or ``"token"`` granularity; no outliers or a fixed pair set.
    counter : StandaloneCounter or PagedCounter
        The dither stream (the same object regenerates it at read time).
    block_rows : int
        Token rows per program (a power of two); any value gives the same store.

    Returns
    -------
    PackedStore
        Bit-identical to ``quantizer.quantize(x, counter)``.
    """
    _check_streaming(x, quantizer, counter)
    require(block_rows > 0 and block_rows & (block_rows - 1) == 0, "block_rows", f"must be a power of two, got {block_rows}")
    lay = quantizer.layout(x.shape[-1])
    head_dim, tokens = x.shape[-1], x.shape[-2]
    group = lay.group if lay.granularity == "token-group" else head_dim
    require(group & (group - 1) == 0 and head_dim & (head_dim - 1) == 0, "x",
            f"head_dim {head_dim} and group {group} must be powers of two for the kernel")
    rows = x.reshape(-1, head_dim).contiguous()
    n_rows = rows.shape[0]
    counters = counter.counters(tuple(x.shape[:-1]) + (1,)).reshape(n_rows, 4).to(x.device).contiguous()
    key = _key_of(counter.seed).to(x.device)
    chans, mask = _outlier_tables(quantizer, tuple(x.shape[:-2]), head_dim, x.device)
    n_outlier = 2 * lay.outlier_pairs
    payload = torch.empty((n_rows, head_dim), dtype=torch.int8, device=x.device)
    scales = torch.empty((n_rows, head_dim // group), dtype=torch.float16, device=x.device)
    outliers = torch.empty((n_rows, n_outlier), dtype=torch.float16, device=x.device)
    if n_rows:
        require_backend(_dither_write_kernel)
        _dither_write_kernel[(triton.cdiv(n_rows, block_rows),)](
            rows, counters, key, mask, chans, payload, scales, outliers,
            n_rows, tokens,
            rows.stride(0), counters.stride(0), mask.stride(0), chans.stride(0),
            payload.stride(0), scales.stride(0), max(outliers.stride(0), 1),
            HEAD_DIM=head_dim, GROUP=group, N_GROUPS=head_dim // group, N_OUTLIER_CH=n_outlier,
            SCALE_DIV=SCALE_DIVISOR,
            BLOCK_ROWS=block_rows, BLOCK_D=head_dim, BLOCK_O=max(1, triton.next_power_of_2(max(n_outlier, 1))),
        )
    if bool(torch.isinf(scales).any()):
        raise ValueError(f"x: a scale group's amax exceeds the fp16 scale range ({FP16_MAX} * {SCALE_DIVISOR})")
    if n_outlier and bool(torch.isinf(outliers).any()):
        raise ValueError(f"x: an outlier channel exceeds the fp16 range ({FP16_MAX})")
    lead = x.shape[:-1]
    fixed = None if lay.outlier_pairs == 0 else quantizer.fixed_pairs.to(torch.int32)
    return PackedStore(lay, payload.reshape(x.shape), scales.reshape(*lead, head_dim // group),
                       outliers.reshape(*lead, n_outlier), None, fixed, x.dtype)


@triton.jit
def _dither_stream_kernel(counter_ptr, key_ptr, xi_ptr, n_rows, stride_counter_row, stride_xi_row,
                          HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask_row = offs_row < n_rows
    offs_c = tl.arange(0, BLOCK_D)
    counter_rows = counter_ptr + offs_row * stride_counter_row
    c0 = tl.load(counter_rows + 0, mask=mask_row, other=0)[:, None]
    c1 = tl.load(counter_rows + 1, mask=mask_row, other=0)[:, None]
    c2 = tl.load(counter_rows + 2, mask=mask_row, other=0)[:, None]
    c3 = tl.load(counter_rows + 3, mask=mask_row, other=0)[:, None]
    xi = dither_block(c0, c1, c2, c3, tl.load(key_ptr), tl.load(key_ptr + 1), BLOCK_ROWS, BLOCK_D)
    tl.store(xi_ptr + offs_row[:, None] * stride_xi_row + offs_c[None, :], xi,
             mask=mask_row[:, None] & (offs_c[None, :] < HEAD_DIM))


def dither_stream(counter, shape: tuple[int, ...], *, block_rows: int = 16, device="cpu") -> torch.Tensor:
    """The dither (*shape) fp64 that the write and read kernels use, computed by :func:`dither_block`.

    For the Philox stream contracts: must equal ``witcert.tier_b.dither.dither_of(counter, shape)``
    bit for bit, for any ``block_rows`` (grid) and any batch order of the counter's tuples.
    """
    require(isinstance(counter, (StandaloneCounter, PagedCounter)), "counter",
            f"must be a StandaloneCounter or PagedCounter, got {type(counter).__name__}")
    require(len(shape) >= 3, "shape", f"must be (..., H, S, d), got {tuple(shape)}")
    require(block_rows > 0 and block_rows & (block_rows - 1) == 0, "block_rows", f"must be a power of two, got {block_rows}")
    head_dim = shape[-1]
    counters = counter.counters(tuple(shape[:-1]) + (1,)).reshape(-1, 4).to(device).contiguous()
    n_rows = counters.shape[0]
    xi = torch.empty((n_rows, head_dim), dtype=torch.float64, device=device)
    if n_rows:
        require_backend(_dither_stream_kernel)
        _dither_stream_kernel[(triton.cdiv(n_rows, block_rows),)](
            counters, _key_of(counter.seed).to(device), xi, n_rows, counters.stride(0), xi.stride(0),
            HEAD_DIM=head_dim, BLOCK_ROWS=block_rows, BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return xi.reshape(tuple(shape))

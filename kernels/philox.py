"""Philox4x32-10 inside Triton, computed in int64 with explicit masking (Tier B dither).

The dither of the Tier B certificate (registry keys ``L2``, ``TB``) must be regenerated at
read time bit for bit as it was drawn at write time. Triton's 32-bit integer multiply does
not give the high word the Random123 reference needs, and unsigned/signed promotion rules
differ between the interpreter and the GPU, so every round here works on int64 words that
hold a value in ``[0, 2^32)``: the 32 x 32 -> 64 bit product wraps modulo ``2^64`` (two's
complement), its low and high words are taken with an explicit ``& 0xFFFFFFFF`` after the
shift (the shift is arithmetic on int64, the mask undoes the sign extension), and every key
bump is masked. The torch reference (``witcert.tier_b.philox.philox4x32_10``) does the same, and
both are checked against the Random123 known-answer vectors (``contracts/test_philox_stream.py``).

Public: :func:`philox4x32_10` (a launcher for whole counter/key tensors, used by the
contracts) and the ``@triton.jit`` helper :func:`philox_rounds` that the write and read
kernels inline.
"""
import torch
import triton
import triton.language as tl

from . import require_backend
from ._validate import require, require_tensor

# Random123 constants (Salmon et al., SC'11): multipliers and Weyl key increments.
# constexpr: a @triton.jit body may only read globals that are constexpr
PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
PHILOX_ROUNDS = tl.constexpr(10)


@triton.jit
def _mulhilo(word, MULTIPLIER: tl.constexpr):
    """(hi, lo) 32-bit words of ``word * MULTIPLIER``; ``word`` int64 in [0, 2^32)."""
    product = word * tl.full(word.shape, MULTIPLIER, tl.int64)  # wraps mod 2^64: low 64 bits exact
    hi = (product >> 32) & 0xFFFFFFFF  # arithmetic shift; the mask drops the sign extension
    lo = product & 0xFFFFFFFF
    return hi, lo


@triton.jit
def philox_rounds(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of counter ``(c0..c3)`` under key ``(k0, k1)``; all int64 in [0, 2^32).

    Returns four int64 words in ``[0, 2^32)``, bit-identical to Random123's
    ``philox4x32_R(10, ctr, key)``.
    """
    for _ in tl.static_range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        # the bump after the last round is unused; it keeps the loop body uniform
        k0 = (k0 + PHILOX_W0) & 0xFFFFFFFF
        k1 = (k1 + PHILOX_W1) & 0xFFFFFFFF
    return c0, c1, c2, c3


@triton.jit
def _philox_block_kernel(
    counter_ptr, key_ptr, out_ptr, n,
    stride_counter_row, stride_key_row, stride_out_row,
    BLOCK: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask_n = offs_n < n
    c_row = counter_ptr + offs_n * stride_counter_row
    k_row = key_ptr + offs_n * stride_key_row
    c0 = tl.load(c_row + 0, mask=mask_n, other=0) & 0xFFFFFFFF
    c1 = tl.load(c_row + 1, mask=mask_n, other=0) & 0xFFFFFFFF
    c2 = tl.load(c_row + 2, mask=mask_n, other=0) & 0xFFFFFFFF
    c3 = tl.load(c_row + 3, mask=mask_n, other=0) & 0xFFFFFFFF
    k0 = tl.load(k_row + 0, mask=mask_n, other=0) & 0xFFFFFFFF
    k1 = tl.load(k_row + 1, mask=mask_n, other=0) & 0xFFFFFFFF
    r0, r1, r2, r3 = philox_rounds(c0, c1, c2, c3, k0, k1)
    o_row = out_ptr + offs_n * stride_out_row
    tl.store(o_row + 0, r0, mask=mask_n)
    tl.store(o_row + 1, r1, mask=mask_n)
    tl.store(o_row + 2, r2, mask=mask_n)
    tl.store(o_row + 3, r3, mask=mask_n)


def _launch_philox(counter: torch.Tensor, key: torch.Tensor, block: int) -> torch.Tensor:
    out = torch.empty_like(counter)
    n = counter.shape[0]
    grid = (triton.cdiv(n, block),)
    require_backend(_philox_block_kernel)
    _philox_block_kernel[grid](
        counter, key, out, n,
        counter.stride(0), key.stride(0), out.stride(0),
        BLOCK=block,
    )
    return out


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor, *, block: int = 128) -> torch.Tensor:
    """Philox4x32-10 in Triton for every row: (..., 4) counters, (..., 2) keys -> (..., 4).

    Parameters
    ----------
    counter : LongTensor (..., 4)
        Counter words, each in ``[0, 2^32)``.
    key : LongTensor (..., 2)
        Key words, each in ``[0, 2^32)``; broadcast against ``counter``'s leading dims.
    block : int
        Rows per program (a power of two); a different value must give the same stream.

    Returns
    -------
    LongTensor (..., 4)
        The four output words, in ``[0, 2^32)``. Serves the dither of ``L2``/``TB``.
    """
    require_tensor("counter", counter, dtypes=(torch.int64,), last_dim=4)
    require_tensor("key", key, dtypes=(torch.int64,), last_dim=2)
    require(block > 0 and block & (block - 1) == 0, "block", f"must be a power of two, got {block}")
    for name, words in (("counter", counter), ("key", key)):
        if words.numel() and (int(words.min()) < 0 or int(words.max()) > 0xFFFFFFFF):
            raise ValueError(f"{name} words must lie in [0, 2^32)")
    lead = torch.broadcast_shapes(counter.shape[:-1], key.shape[:-1])
    flat_counter = counter.expand(*lead, 4).reshape(-1, 4).contiguous()
    flat_key = key.expand(*lead, 2).reshape(-1, 2).contiguous()
    if flat_counter.shape[0] == 0:
        return flat_counter.reshape(*lead, 4)
    return _launch_philox(flat_counter, flat_key, block).reshape(*lead, 4)

"""One fused decode of a held integer-code history: what a production store reads at every step (``T2``).

A production store (``keep_exact=False``) holds a layer's keys and values as packed integer codes and one
absolute maximum per 32-channel group (:class:`~witcert.integrations.hf.codecs.IntCodes`), and decodes the
whole history at every read. The eager decode is a chain of tensor calls (unpack each nibble, stack,
convert, scale, cast), each a pass over the history; :func:`held_decode` is the same arithmetic as one
function that ``WITCERT_COMPILE=1`` compiles into one pass reading the codes in place: it takes the
store's growable buffers whole (their own storage, canonical strides: no copy, no recompile as they grow)
and the number of tokens held.

Why it must be bit for bit the eager decode: the witness of a token (``T2``: ``||k - k^||`` per band,
rounded up) was formed against ``IntCodes.decode`` of its codes, and the meter is sound only for the keys
attention reads. Every value here is the eager one: the code converted exactly to fp32, the scale
``amax / qmax`` (one correctly rounded fp32 division; 1 where the maximum is 0), one rounding of the
product, one cast to the model's dtype; no sum, so no order or contraction can change a bit
(``tests/test_packed_decode.py`` checks the compiled and eager forms against ``IntCodes.decode``).
"""
from __future__ import annotations

import torch

from witcert.fastpath.compiled import compile_requested, compiled_of

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # model dtypes whose codec works in fp32


def held_decode(codes: torch.Tensor, amax: torch.Tensor, length: int, bits: int, dtype: torch.dtype,
                start: int = 0, compiled: bool | None = None) -> torch.Tensor:
    """Tokens ``start .. length - 1`` of a held ``IntCodes`` history, decoded to ``dtype`` (``T2``: bit for bit
    ``IntCodes(bits).decode`` of their codes).

    Parameters
    ----------
    codes : Tensor (..., capacity, d * bits / 8) uint8, or (..., capacity, d) int8
        The codes buffer (tokens beyond ``length`` are spare room and never read).
    amax : Tensor (..., capacity, d / g, 1)
        Each group's absolute maximum, in the model's dtype.
    length : int
        Tokens held.
    bits : int
        2, 4 or 8.
    dtype : torch.dtype
        The model's dtype (fp32, fp16 or bf16).
    start : int
        The first token decoded (default 0: the whole history).
    compiled : bool or None
        Compile (default: ``WITCERT_COMPILE``).
    """
    if bits not in _DECODERS:
        raise ValueError(f"bits must be 2, 4 or 8, got {bits!r}")
    if dtype not in FUSED_DTYPES or amax.dtype not in FUSED_DTYPES:
        raise ValueError(f"dtype must be one of {FUSED_DTYPES}, got {dtype} (codes' maxima {amax.dtype})")
    if not 0 < length <= min(codes.shape[-2], amax.shape[-3]):
        raise ValueError(f"length must be in 1..{min(codes.shape[-2], amax.shape[-3])}, got {length}")
    if not 0 <= start < length:
        raise ValueError(f"start must be in 0..{length - 1}, got {start}")
    fn = _DECODERS[bits]
    want = compile_requested() if compiled is None else compiled
    fast = compiled_of(fn, lambda: _probe(bits)) if want else None
    return (fn if fast is None else fast)(codes, amax, start, length - start, dtype)


def _decoder(bits: int):
    """The decode of ``bits``-bit codes (one function per width: each compiles to its own graph)."""
    qmax, offset, mask, per_byte = 2 ** (bits - 1) - 1, 2 ** (bits - 1), (1 << bits) - 1, 8 // bits

    def decode(codes: torch.Tensor, amax: torch.Tensor, start: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        codes, amax = codes.narrow(-2, start, n), amax.narrow(-3, start, n)
        scale = amax.to(torch.float32) / qmax
        scale = torch.where(scale > 0, scale, 1.0)  # builtin._safe
        grouped = codes.unflatten(-1, (scale.shape[-2], -1))  # (..., S, groups, bytes of a group)
        if codes.dtype != torch.uint8:  # int8: one code per byte
            return (grouped.to(torch.float32) * scale).flatten(-2).to(dtype)
        # packed: code i of a byte sits in bits [bits * i, bits * (i + 1)), offset by 2^(bits-1), and is channel
        # i * g / per_byte + j of its group (planar: codecs._pack), so each part is a contiguous run of the group's
        # channels; a layout inductor vectorizes (measured 2x the interleaved pairs at 4096 tokens)
        # (each part scaled before the cat: scaling after it measured 2.4x slower)
        parts = [(((grouped >> (bits * i)) & mask).to(torch.float32) - offset) * scale for i in range(per_byte)]
        return torch.cat(parts, dim=-1).flatten(-2).to(dtype)

    decode.__name__ = f"decode_int{bits}"
    return decode


_DECODERS = {bits: _decoder(bits) for bits in (2, 4, 8)}


def _probe(bits: int) -> tuple:
    """Arguments of the shape class a store passes (2 roles, batch, kv heads, spare room; 64 channels)."""
    width = 64 * bits // 8 if bits < 8 else 64
    codes = torch.zeros(2, 1, 3, 40, width, dtype=torch.uint8 if bits < 8 else torch.int8)
    return codes, torch.ones(2, 1, 3, 40, 2, 1), 0, 33, torch.float32

"""The fused decode of held integer codes (witcert.fastpath.packed_decode, T2): bit for bit the codec's decode.

The witness of each token was formed against ``IntCodes.decode``; a production store that reads its history
through the fused decode must hand attention and the meter the very same bits (compiled and eager), over
the store's growable buffers with spare room, from any first token.
"""
import pytest
import torch

from witcert.fastpath.packed_decode import held_decode
from witcert.integrations.hf.codecs import IntCodes
from witcert.integrations.hf.compressed_cache import CompressedLayer
from witcert.tier_a.bands import BandLayout


def _history(bits: int, dtype: torch.dtype, tokens: int = 70, d: int = 64) -> torch.Tensor:
    """Keys and values (2, 1, 3, tokens, d) over 30 decades of magnitude, one all-zero group (scale 1)."""
    gen = torch.Generator().manual_seed(bits)
    magnitude = torch.logspace(-12 if dtype == torch.float16 else -30, 3, tokens, dtype=torch.float64)
    x = (torch.randn(2, 1, 3, tokens, d, generator=gen, dtype=torch.float64) * magnitude[:, None]).to(dtype)
    x[..., 5, :32] = 0
    return x


def _with_room(part: torch.Tensor, axis: int, room: int) -> torch.Tensor:
    """``part`` at the front of a buffer with ``room`` spare tokens of garbage along ``axis``."""
    shape = list(part.shape)
    shape[axis] += room
    buffer = torch.full(shape, 77, dtype=part.dtype)
    buffer.narrow(axis, 0, part.shape[axis]).copy_(part)
    return buffer


_EAGER = [(bits, dtype, False) for bits in (2, 4, 8) for dtype in (torch.float32, torch.bfloat16, torch.float16)]
_COMPILED = [(4, torch.float32, True), (4, torch.bfloat16, True), (2, torch.float16, True), (8, torch.float32, True)]


@pytest.mark.parametrize("bits,dtype,compiled", _EAGER + _COMPILED)
def test_held_decode_is_the_codecs_decode_bit_for_bit(bits, dtype, compiled):
    codec = IntCodes(bits)
    codes, amax, _ = codec.encode(_history(bits, dtype), "key")
    expected = codec.decode((codes, amax, 64), dtype)
    codes_buffer, amax_buffer = _with_room(codes, -2, 9), _with_room(amax, -3, 9)
    for start in (0, 1, 41):
        got = held_decode(codes_buffer, amax_buffer, 70, bits, dtype, start, compiled=compiled)
        want = expected[..., start:, :]
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           want.view(torch.int16 if dtype != torch.float32 else torch.int32)), start


@pytest.mark.parametrize("compile_env", ["0", "1"])
def test_production_store_reads_what_the_witness_describes(monkeypatch, compile_env):
    """A production store (codes only) reads bit for bit the decodes a validation store keeps, step after step."""
    monkeypatch.setenv("WITCERT_COMPILE", compile_env)
    layout = BandLayout(64, 4)
    production = CompressedLayer(IntCodes(4), layout, keep_exact=False)
    validation = CompressedLayer(IntCodes(4), layout, keep_exact=True)
    x = _history(4, torch.float32, tokens=40)
    for first, end in ((0, 30), (30, 31), (31, 32), (32, 40)):
        for store in (production, validation):
            store.append(x[0, ..., first:end, :], x[1, ..., first:end, :])
        for got, want in zip(production.read(), validation.read()):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert torch.equal(production.stored().witness, validation.stored().witness)


def test_bad_arguments_are_named():
    codes, amax, _ = IntCodes(4).encode(torch.randn(1, 1, 4, 64), "key")
    with pytest.raises(ValueError, match="bits"):
        held_decode(codes, amax, 4, 3, torch.float32)
    with pytest.raises(ValueError, match="length"):
        held_decode(codes, amax, 5, 4, torch.float32)
    with pytest.raises(ValueError, match="start"):
        held_decode(codes, amax, 4, 4, torch.float32, start=4)
    with pytest.raises(ValueError, match="dtype"):
        held_decode(codes, amax, 4, 4, torch.float64)


def test_a_read_of_a_full_buffer_does_not_fix_later_reads_to_its_length():
    """A history exactly as long as its buffer (a prefill of 512 tokens) read once, then a grown buffer: each read
    decodes exactly the tokens held. (torch 2.13's compiler, given a function that narrowed a buffer to a length equal
    to its capacity at one call, returned capacity-long outputs at later calls: witcert keeps the length an argument
    of the decode's own narrow, which this pins.)"""
    codec = IntCodes(4)
    for held, capacity in ((512, 512), (513, 640), (640, 640), (641, 800)):
        codes, amax, _ = codec.encode(torch.randn(2, 1, 3, capacity, 64, generator=torch.Generator().manual_seed(held)),
                                      "key")
        got = held_decode(codes, amax, held, 4, torch.float32, compiled=True)
        want = codec.decode((codes[..., :held, :], amax[..., :held, :, :], 64), torch.float32)
        assert got.shape == want.shape and torch.equal(got, want), (held, capacity)

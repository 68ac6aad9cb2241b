"""Growable token buffers and the packed history a monitored cache keeps per role.

Implementation: ``witcert.integrations.hf.token_buffer.TokenBuffer``, ``packed_history.PackedHistory``.
Oracles: ``torch.cat`` of the written chunks (the buffer's view), the codec's decode of each written
chunk on its own, concatenated (the history grown in place must decode to exactly that: the witness of
each token was formed against its own decode). Exact equality.
"""
import pytest
import torch

from witcert.integrations.hf.codecs import IntCodes, Reconstruction, codec_for
from witcert.integrations.hf.packed_history import PackedHistory
from witcert.integrations.hf.token_buffer import MIN_CAPACITY, TokenBuffer


def chunks(sizes, g, shape=(2, 3), d=8):
    return [torch.randn(*shape, n, d, generator=g) for n in sizes]


def test_appends_in_place_and_earlier_views_keep_their_tokens():
    g = torch.Generator().manual_seed(0)
    parts = chunks([5, 1, 1, 30, 1, 100], g)
    buffer, views = TokenBuffer(-2), []
    for i, part in enumerate(parts):
        views.append(buffer.append(part))
        assert torch.equal(views[-1], torch.cat(parts[:i + 1], dim=-2))
    for i, view in enumerate(views):  # every regrowth left the older views intact
        assert torch.equal(view, torch.cat(parts[:i + 1], dim=-2))
    assert buffer.data.shape[-2] < 2 * buffer.length + MIN_CAPACITY  # spare capacity at most the history
    assert buffer.nbytes() == buffer.length * 2 * 3 * 8 * 4


def test_any_token_axis_and_refusals():
    g = torch.Generator().manual_seed(1)
    last = TokenBuffer(-1)
    a, b = torch.randn(2, 4, 3, generator=g), torch.randn(2, 4, 20, generator=g)
    last.append(a)
    assert torch.equal(last.append(b), torch.cat([a, b], dim=-1))
    with pytest.raises(ValueError, match="does not continue"):
        last.append(torch.randn(2, 5, 1))
    with pytest.raises(ValueError, match="does not continue"):
        last.append(torch.randn(2, 4, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="negative"):
        TokenBuffer(1)


@pytest.mark.parametrize("codec", [IntCodes(8), IntCodes(4), IntCodes(2), Reconstruction("rtn-int4", narrow=True),
                                   codec_for("fp8-e4m3", packed=True)], ids=lambda c: repr(c)[:30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_history_grown_in_place_decodes_as_its_chunks(codec, dtype):
    g = torch.Generator().manual_seed(2)
    parts = [(x * 3).to(dtype) for x in chunks([17, 1, 1, 40, 1], g, d=64)]
    history = PackedHistory(codec)
    for part in parts:
        history.add(codec.encode(part, "key", 0), dtype)
    expected = torch.cat([codec.decode(codec.encode(part, "key", 0), dtype) for part in parts], dim=-2)
    assert len(history.chunks) == 1
    assert torch.equal(history.decode(dtype), expected)
    assert history.nbytes() == codec.nbytes(history.chunks[0])


def test_a_reconstruction_narrowed_differently_per_chunk_moves_to_the_model_dtype_losslessly():
    g = torch.Generator().manual_seed(3)
    codec = Reconstruction(lambda x: x, narrow=True)  # exact: fp8-representable values narrow to fp8, others not
    fp8_values = torch.randn(1, 2, 4, 8, generator=g).to(torch.float8_e4m3fn).float()
    other = torch.randn(1, 2, 3, 8, generator=g)
    history = PackedHistory(codec)
    for part in (fp8_values, other, fp8_values):
        history.add(codec.encode(part, "key", 0), torch.float32)
    assert history.decode(torch.float32).dtype == torch.float32
    assert torch.equal(history.decode(torch.float32), torch.cat([fp8_values, other, fp8_values], dim=-2))


def test_a_codec_without_token_axes_keeps_its_chunks_or_joins_them():
    class Whole:  # a user codec: one chunk per write, no join
        def encode(self, x, role, start=0):
            return x.clone()

        def decode(self, packed, dtype):
            return packed.to(dtype)

        def nbytes(self, packed):
            return packed.numel() * packed.element_size()

    g = torch.Generator().manual_seed(4)
    parts = chunks([3, 1, 1], g)
    history = PackedHistory(Whole())
    for part in parts:
        history.add(part, torch.float32)
    assert len(history.chunks) == 3 and torch.equal(history.decode(torch.float32), torch.cat(parts, dim=-2))

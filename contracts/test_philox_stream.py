"""Contract: one dither stream everywhere -- kernel == torch reference == pure-Python spec (L2, TB).

Implementation: ``witcert.kernels.philox.philox4x32_10`` (int64 words, explicit masks) and the
dither helper the write/read kernels inline (``dither_block``, via ``dither_stream``,
``dither_write`` and ``dequantize_packed``).
Oracles: the Random123 known-answer vectors (``kat_vectors``: philox4x32 10), the torch
reference ``witcert.tier_b.philox.philox4x32_10``, the spec ``witcert.spec.philox.philox4x32_10``
(Python integers), ``witcert.tier_b.dither.dither_of`` and ``DitheredInt8.quantize/dequantize``.
Domain: the three published vectors; counters of both layouts with random words over the
full 32-bit range (slots up to 2^45, seeds up to 2^64); grids of 4..256 rows per program;
permuted batch orders; batches keyed one request id per row, as the HF integration does.
Tolerance: none -- bitwise equality.
"""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from witcert.tier_b.counters import PagedCounter, StandaloneCounter, batch_requests
from witcert.tier_b.dither import dither_of
from witcert.tier_b.quantizer import DitheredInt8
from witcert.kernels.dither_write import dither_stream, dither_write
from witcert.kernels.packed_keys import PackedKeys, dequantize_packed
from witcert.kernels.philox import philox4x32_10 as kernel_philox
from witcert.tier_b.philox import philox4x32_10 as torch_philox
from witcert.spec.philox import philox4x32_10 as spec_philox

# Random123 tests/kat_vectors, "philox4x32 10" lines: counter (4 words), key (2), expected (4).
KAT_VECTORS = (
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
)
SHAPE = (2, 3, 24, 64)  # (batch, kv heads, tokens, d)


def _counters_and_keys(n, seed):
    generator = torch.Generator().manual_seed(seed)
    counter = torch.randint(0, 1 << 32, (n, 4), generator=generator, dtype=torch.int64)
    key = torch.randint(0, 1 << 32, (n, 2), generator=generator, dtype=torch.int64)
    return counter, key


def _layouts():
    generator = torch.Generator().manual_seed(5)
    slots = torch.randint(0, 1 << 45, (SHAPE[0], SHAPE[2]), generator=generator)
    return {
        "standalone": StandaloneCounter(request=torch.tensor([3, 1 << 31]), layer=1023, seed=(1 << 64) - 1),
        "paged": PagedCounter(layer=5, slots=slots, seed=0x243F6A8885A308D3, side="v"),
    }


LAYOUTS = _layouts()


def test_known_answer_vectors_kernel_torch_spec():
    counter = torch.tensor([v[0] for v in KAT_VECTORS], dtype=torch.int64)
    key = torch.tensor([v[1] for v in KAT_VECTORS], dtype=torch.int64)
    expected = torch.tensor([v[2] for v in KAT_VECTORS], dtype=torch.int64)
    assert torch.equal(kernel_philox(counter, key), expected)
    assert torch.equal(torch_philox(counter, key), expected)
    assert [spec_philox(c, k) for c, k, _ in KAT_VECTORS] == [v[2] for v in KAT_VECTORS]


@pytest.mark.parametrize("block", [4, 32, 256])
def test_random_words_kernel_equals_torch_and_spec(block):
    counter, key = _counters_and_keys(300, seed=block)
    out = kernel_philox(counter, key, block=block)
    assert torch.equal(out, torch_philox(counter, key))
    for row in range(0, 300, 37):  # the spec is pure Python: a sample of rows
        assert tuple(out[row].tolist()) == spec_philox(counter[row].tolist(), key[row].tolist())


WORD = st.integers(min_value=0, max_value=(1 << 32) - 1)


@settings(max_examples=40)  # each example launches the interpreted kernel
@given(counter=st.lists(WORD, min_size=4, max_size=4), key=st.lists(WORD, min_size=2, max_size=2))
@example(counter=[0, 0, 0, 0], key=[0, 0])
@example(counter=[(1 << 32) - 1] * 4, key=[(1 << 32) - 1] * 2)
@example(counter=[(1 << 31), (1 << 31) - 1, 1, (1 << 32) - 2], key=[(1 << 31), 0x9E3779B9])
def test_any_words_kernel_equals_spec(counter, key):
    out = kernel_philox(torch.tensor([counter]), torch.tensor([key]))
    assert tuple(out[0].tolist()) == spec_philox(counter, key)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_real_counters_kernel_equals_torch(layout):
    counter = LAYOUTS[layout]
    words = counter.counters(SHAPE[:-1] + (1,))[..., 0, :].reshape(-1, 4)
    key = torch.tensor([counter.seed & 0xFFFFFFFF, counter.seed >> 32], dtype=torch.int64)
    assert torch.equal(kernel_philox(words, key), torch_philox(words, key))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("block_rows", [4, 64])
def test_dither_stream_equals_reference_for_any_grid(layout, block_rows):
    counter = LAYOUTS[layout]
    assert torch.equal(dither_stream(counter, SHAPE, block_rows=block_rows), dither_of(counter, SHAPE))


def test_dither_stream_follows_the_slot_not_the_batch_order():
    """A paged pool permuting its batch rows reads the same per-slot stream, permuted."""
    counter = LAYOUTS["paged"]
    order = torch.tensor([1, 0])
    permuted = PagedCounter(layer=counter.layer, slots=counter.slots[order], seed=counter.seed, side=counter.side)
    assert torch.equal(dither_stream(permuted, SHAPE), dither_stream(counter, SHAPE)[order])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_write_then_read_regenerates_the_same_stream(layout):
    """Store written by the kernel == torch quantize; keys read by the decode loader == torch dequantize."""
    counter = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(SHAPE, generator=generator) * torch.logspace(-2, 1, SHAPE[-1])
    quantizer = DitheredInt8(outlier_pairs=2).calibrate(x[..., :8, :])
    store = dither_write(x, quantizer, counter, block_rows=8)
    reference = quantizer.quantize(x, counter)
    assert torch.equal(store.payload, reference.payload)
    assert torch.equal(store.scales, reference.scales)
    assert torch.equal(store.outliers, reference.outliers)
    read = dequantize_packed(PackedKeys.from_store(store, counter))
    assert torch.equal(read, quantizer.dequantize(reference, counter, torch.float64))


def test_write_is_independent_of_the_grid():
    counter = LAYOUTS["standalone"]
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(10))
    one = dither_write(x, DitheredInt8(), counter, block_rows=4)
    many = dither_write(x, DitheredInt8(), counter, block_rows=64)
    assert torch.equal(one.payload, many.payload) and torch.equal(one.scales, many.scales)


def test_distinct_tuples_get_distinct_streams():
    """K and V sides, and the two layouts, never share a dither row (sanity on real counters)."""
    counter = LAYOUTS["standalone"]
    other_side = StandaloneCounter(request=counter.request, layer=counter.layer, seed=counter.seed, side="v")
    k_stream, v_stream = dither_stream(counter, SHAPE), dither_stream(other_side, SHAPE)
    assert not bool((k_stream == v_stream).all(dim=-1).any())


@pytest.mark.parametrize("granularity", ["block-channel", "token"])
def test_read_path_regenerates_the_stream_of_a_reference_store(granularity):
    """Stores the write kernel does not stream (block-channel) are read back bit for bit too."""
    counter = LAYOUTS["standalone"]
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(11))
    quantizer = DitheredInt8(granularity=granularity, block=8)
    store = quantizer.quantize(x, counter)
    read = dequantize_packed(PackedKeys.from_store(store, counter))
    assert torch.equal(read, quantizer.dequantize(store, counter, torch.float64))


# ---------------------------------------------------------------- one stream per sequence of a batch (issue 16)


def _batch_counter(requests=None, seed=0x9E3779B97F4A7C15):
    """The HF integration's counter for a batch: one request id per row (``batch_requests``)."""
    return StandaloneCounter(request=batch_requests(requests, SHAPE[0]), layer=3, seed=seed)


def test_rows_of_a_batch_never_share_dither():
    """Rows 0 and 1 (different sequences) must differ: no (head, token) dither row is equal and
    equal elements occur at the chance rate of a 24-bit grid; the kernel stream agrees."""
    stream = dither_stream(_batch_counter(), SHAPE)
    assert torch.equal(stream, dither_of(_batch_counter(), SHAPE))
    assert not bool((stream[0] == stream[1]).all(dim=-1).any())
    assert float((stream[0] == stream[1]).double().mean()) < 1e-3


def test_each_row_writes_and_reads_its_own_stream():
    """Kernel write of the batch == torch quantize of each row alone under its request id, and the
    decode loader reads each row back from that row's stream."""
    counter = _batch_counter(requests=(17, 5))
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(12))
    quantizer = DitheredInt8()
    store = dither_write(x, quantizer, counter, block_rows=8)
    read = dequantize_packed(PackedKeys.from_store(store, counter))
    for row, request in enumerate((17, 5)):
        alone = StandaloneCounter(request=torch.tensor([request]), layer=3, seed=counter.seed)
        reference = quantizer.quantize(x[row:row + 1], alone)
        assert torch.equal(store.payload[row:row + 1], reference.payload)
        assert torch.equal(read[row:row + 1], quantizer.dequantize(reference, alone, torch.float64))


def test_a_row_keeps_its_stream_across_batch_orders():
    forward, backward = _batch_counter(requests=(17, 5)), _batch_counter(requests=(5, 17))
    assert torch.equal(dither_stream(backward, SHAPE), dither_stream(forward, SHAPE).flip(0))

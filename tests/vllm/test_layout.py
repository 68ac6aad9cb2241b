"""Reading vLLM's CPU cache layout back, against a cache built by hand from the documented layout.

Implementation: ``witcert.integrations.vllm.layout``. Oracle: a cache filled element by element
(per (block, head): keys ``[d, block_size]``, then values ``[block_size, d]``). Exact equality.
The layout itself is re-measured against vLLM's C++ writer in ``test_engine.py`` (self-test).
"""
import pytest
import torch

from witcert.integrations.vllm import layout

BLOCKS, HEADS, BS, D = 4, 2, 32, 8


def _hand_built(g):
    keys = torch.randn(BLOCKS * BS, HEADS, D, generator=g)  # by flat slot
    values = torch.randn(BLOCKS * BS, HEADS, D, generator=g)
    cache = torch.zeros(BLOCKS, HEADS, BS, 2 * D)
    flat = cache.view(BLOCKS, HEADS, -1)
    for slot in range(BLOCKS * BS):
        b, o = divmod(slot, BS)
        for h in range(HEADS):
            for i in range(D):
                flat[b, h, i * BS + o] = keys[slot, h, i]  # keys transposed
                flat[b, h, BS * D + o * D + i] = values[slot, h, i]  # values in token order
    return cache, keys, values


def test_reads_keys_and_values_by_slot_and_by_block():
    cache, keys, values = _hand_built(torch.Generator().manual_seed(0))
    key_cache, value_cache = layout.split_cache(cache)
    slots = torch.tensor([5, 127, 32, 0, 70])
    assert torch.equal(layout.keys_at_slots(key_cache, slots), keys[slots])
    blocks = torch.tensor([3, 1])  # a sequence's blocks, out of order
    seq_slots = torch.cat([torch.arange(3 * BS, 4 * BS), torch.arange(BS, BS + 10)])
    assert torch.equal(layout.keys_of_blocks(key_cache, blocks, BS + 10), keys[seq_slots].transpose(0, 1))
    assert torch.equal(layout.values_of_blocks(value_cache, blocks, BS + 10), values[seq_slots].transpose(0, 1))


def test_side_tensor_is_indexed_like_the_cache():
    side = torch.zeros(BLOCKS, HEADS, BS, 3)
    slots = torch.tensor([33, 34, 100])
    rows = torch.arange(18.0).view(3, HEADS, 3)
    layout.scatter_rows(side, slots, rows)
    read = layout.rows_of_blocks(side, torch.tensor([1]), 3)  # block 1 holds slots 32..63
    assert torch.equal(read[:, 1:3], rows[:2].transpose(0, 1))
    assert torch.equal(side[3, :, 4], rows[2])
    assert int((side != 0).sum()) == int((rows != 0).sum())


@pytest.mark.parametrize("name,fmt", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8", torch.float8_e4m3fn),
                                      ("fp8_e5m2", torch.float8_e5m2)])
def test_decode_fp8_codes_exactly(name, fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(fmt).to(torch.float64)
    finite = torch.isfinite(values)
    decoded = layout.decode(codes, name, 0.37)
    assert torch.equal(decoded[finite], values[finite] * 0.37)


def test_decode_auto_is_identity_and_rejects_unknown():
    x = torch.randn(5, dtype=torch.bfloat16)
    assert torch.equal(layout.decode(x, "auto", 2.0), x.double())
    with pytest.raises(ValueError, match="kv_cache_dtype 'bfloat16'"):
        layout.decode(x, "bfloat16", 1.0)
    with pytest.raises(ValueError, match="does not match"):
        layout.decode(torch.zeros(3, dtype=torch.float8_e5m2), "fp8_e4m3", 1.0)
    with pytest.raises(ValueError, match="kv_cache must be"):
        layout.split_cache(torch.zeros(2, 3, 5))

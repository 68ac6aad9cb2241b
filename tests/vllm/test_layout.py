"""Reading vLLM's CPU cache back through a :class:`CacheLayout`, and measuring a layout through a writer.

Implementation: ``witcert.integrations.vllm.layout``. Oracles: a cache filled element by element
(per (block, head): keys ``[d, block_size]``, then values ``[block_size, d]``, the ``vec`` order;
and a random order of the slab); writers written here by hand, whose order ``measure`` must recover
(and whose faults it must refuse). Exact equality. The layout of vLLM's own C++ writer is measured
and checked in ``test_selftest.py``.
"""
import pytest
import torch

from witcert.integrations.vllm import layout

BLOCKS, HEADS, BS, D = 4, 2, 32, 8


def _vec_order() -> layout.CacheLayout:
    """The ``vec`` order written out by hand: per (block, head) keys ``[d, block_size]``, then values
    ``[block_size, d]``."""
    o, i = torch.meshgrid(torch.arange(BS), torch.arange(D), indexing="ij")
    return layout.CacheLayout(key_index=i * BS + o, value_index=BS * D + o * D + i)


def _written_by(order: layout.CacheLayout, keys, values):
    """A cache holding ``keys``/``values`` (by flat slot) in ``order``, entry by entry."""
    cache = torch.zeros(BLOCKS, HEADS, BS, 2 * D)
    flat = cache.view(BLOCKS, HEADS, -1)
    for slot in range(BLOCKS * BS):
        b, o = divmod(slot, BS)
        for h in range(HEADS):
            for i in range(D):
                flat[b, h, order.key_index[o, i]] = keys[slot, h, i]
                flat[b, h, order.value_index[o, i]] = values[slot, h, i]
    return cache


def _random_order(g) -> layout.CacheLayout:
    perm = torch.randperm(2 * BS * D, generator=g).view(2, BS, D)
    return layout.CacheLayout(key_index=perm[0], value_index=perm[1])


def _check_reads(order, cache, keys, values):
    slots = torch.tensor([5, 127, 32, 0, 70])
    assert torch.equal(order.keys_at_slots(cache, slots), keys[slots])
    blocks = torch.tensor([3, 1])  # a sequence's blocks, out of order
    seq_slots = torch.cat([torch.arange(3 * BS, 4 * BS), torch.arange(BS, BS + 10)])
    assert torch.equal(order.keys_of_blocks(cache, blocks, BS + 10), keys[seq_slots].transpose(0, 1))
    assert torch.equal(order.values_of_blocks(cache, blocks, BS + 10), values[seq_slots].transpose(0, 1))
    entries = order.entries_at_slots(cache, slots)
    assert int(entries.sum()) == slots.numel() * HEADS * 2 * D
    marked = torch.zeros_like(cache)
    marked.view(BLOCKS, HEADS, -1)[(slots // BS)[:, None], :, order.key_index[slots % BS]] = 1
    marked.view(BLOCKS, HEADS, -1)[(slots // BS)[:, None], :, order.value_index[slots % BS]] = 1
    assert torch.equal(entries, marked.bool())


def test_reads_keys_and_values_by_slot_and_by_block():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(BLOCKS * BS, HEADS, D, generator=g), torch.randn(BLOCKS * BS, HEADS, D, generator=g)
    _check_reads(layout.CacheLayout.transposed_keys(BS, D), _written_by(_vec_order(), keys, values), keys, values)


def test_reads_any_order_of_the_slab():
    g = torch.Generator().manual_seed(1)
    order = _random_order(g)
    keys, values = torch.randn(BLOCKS * BS, HEADS, D, generator=g), torch.randn(BLOCKS * BS, HEADS, D, generator=g)
    _check_reads(order, _written_by(order, keys, values), keys, values)


def _writer(order, dtype=torch.float32, fault=None):
    """A cache writer storing in ``order`` (fp8: the value / scale cast to e4m3, as vLLM stores it)."""
    def write(k, v, kv_cache, slots):
        flat = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1)
        for row, slot in enumerate(slots.tolist()):
            b, o = divmod(slot, BS)
            for side, x, index in ((0, k, order.key_index), (1, v, order.value_index)):
                stored = x[row] if dtype != torch.uint8 else (x[row].float() / 0.5).to(torch.float8_e4m3fn).view(
                    torch.uint8)
                flat[b][:, index[o]] = stored
                if fault == "spill" and side == 0 and o == 3:
                    flat[b][:, index[o - 1]] = stored  # also lands on the previous token's entries
        if fault == "head" and flat.shape[1] > 1:
            flat[:, 1] = flat[:, 1].roll(1, dims=-1)
    return write


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16, torch.uint8])
def test_measure_recovers_the_writers_order(storage):
    order = _random_order(torch.Generator().manual_seed(2))
    unit = 0.5 if storage == torch.uint8 else 1.0
    model = torch.float32 if storage == torch.uint8 else storage
    measured = layout.measure(_writer(order, storage), num_kv_heads=HEADS, head_size=D, block_size=BS,
                              model_dtype=model, storage_dtype=storage, k_unit=unit, v_unit=unit)
    assert torch.equal(measured.key_index, order.key_index) and torch.equal(measured.value_index, order.value_index)
    assert torch.equal(layout.measure(_writer(layout.CacheLayout.transposed_keys(BS, D)), num_kv_heads=HEADS,
                                      head_size=D, block_size=BS, model_dtype=torch.float32,
                                      storage_dtype=torch.float32).key_index,
                       layout.CacheLayout.transposed_keys(BS, D).key_index)


@pytest.mark.parametrize("fault,match", [("spill", "same entry|nonzero"), ("head", "different kv heads")])
def test_measure_refuses_a_writer_that_is_not_one_order(fault, match):
    order = layout.CacheLayout.transposed_keys(BS, D)
    with pytest.raises(layout.LayoutError, match=match):
        layout.measure(_writer(order, fault=fault), num_kv_heads=HEADS, head_size=D, block_size=BS,
                       model_dtype=torch.float32, storage_dtype=torch.float32)


def test_layout_must_be_one_permutation_of_the_slab():
    order = layout.CacheLayout.transposed_keys(BS, D)
    with pytest.raises(layout.LayoutError, match="exactly once"):
        layout.CacheLayout(key_index=order.key_index, value_index=order.key_index)
    with pytest.raises(ValueError, match="kv_cache must be"):
        order.keys_at_slots(torch.zeros(2, HEADS, BS, D), torch.tensor([0]))


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

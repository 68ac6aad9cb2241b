"""Dither counter layouts and the 24-bit grid (Tier B, registry "L2").

Implementation: ``witcert.tier_b.counters`` / ``witcert.tier_b.dither``. Oracles: decoding the documented
bit layout back to the tuple (injectivity), exhaustive uniqueness on small grids, the spec
Philox for single words, and the documented grid formula. Tolerance: exact.
"""
import itertools

import pytest
import torch

from witcert.tier_b.counters import PagedCounter, StandaloneCounter
from witcert.tier_b.counters import batch_requests, pack_paged, pack_standalone
from witcert.tier_b.dither import GRID_STEP, dither_numerators, dither_of
from witcert.spec import philox as spec_philox

SEED = 0x5EED  # tests fix the seed explicitly (the library draws a secret one by default)


def decode(counter):
    """Read the documented fields back from counter words (the injectivity witness)."""
    c0, c1, c2, c3 = counter
    return dict(c0=c0, c2=c2, channel_group=c1 & 0xFFF, kv_head=(c1 >> 12) & 0x3FF,
                layer=(c1 >> 22) & 0x3FF, side=(c3 >> 30) & 1, layout=c3 >> 31, reserved=c3 & ((1 << 30) - 1))


def test_standalone_packing_decodes_to_its_tuple():
    for request, layer, head, token, channel, side in [(0, 0, 0, 0, 0, "k"), (2**32 - 1, 1023, 1023, 2**32 - 1, 16383, "v"),
                                                       (7, 3, 5, 1000, 127, "k")]:
        fields = decode(pack_standalone(request, layer, head, token, channel, side).tolist())
        assert fields == dict(c0=token, c2=request, channel_group=channel >> 2, kv_head=head, layer=layer,
                              side=int(side == "v"), layout=0, reserved=0)


def test_paged_packing_decodes_to_its_tuple():
    slot = (5 << 32) + 17
    fields = decode(pack_paged(9, 4, slot, 66, "v").tolist())
    assert fields == dict(c0=17, c2=5, channel_group=16, kv_head=4, layer=9, side=1, layout=1, reserved=0)


def all_stream_positions():
    """(counter words, output word) of every element of small standalone and paged grids, both sides."""
    out = []
    for side in ("k", "v"):
        for request, layer in itertools.product(range(2), range(2)):
            counter = StandaloneCounter(request=request, layer=layer, side=side)
            out.append(_positions(counter, (3, 4, 10)))
        for layer in range(2):
            counter = PagedCounter(layer=layer, slots=torch.tensor([0, 5, 1, 2**33]), side=side)
            out.append(_positions(counter, (3, 4, 10)))
    return torch.cat(out)


def _positions(counter, shape):
    channel = torch.arange(shape[-1]).expand(shape)
    return torch.cat((counter.counters(shape), (channel & 3).unsqueeze(-1)), dim=-1).reshape(-1, 5)


def test_distinct_tuples_never_share_a_stream_position():
    positions = all_stream_positions()
    assert torch.unique(positions, dim=0).shape[0] == positions.shape[0]


def test_grouped_words_equal_per_element_definition_and_spec():
    counter = StandaloneCounter(request=3, layer=2, seed=(7 << 32) + 11, token_offset=5)
    shape = (2, 3, 10)  # d = 10: last group partial
    words = counter.words(shape)
    assert torch.equal(words, counter.words_per_element(shape))
    h, t, c = 1, 2, 9
    spec_counter = counter.counters(shape)[h, t, c].tolist()
    assert words[h, t, c].item() == spec_philox.philox4x32_10(spec_counter, [11, 7])[c & 3]


def test_stream_is_invariant_to_batch_order_and_slicing():
    requests = torch.tensor([4, 1, 9])
    batched = StandaloneCounter(request=requests, layer=2, seed=SEED).words((3, 2, 6, 8))
    perm = torch.tensor([2, 0, 1])
    permuted = StandaloneCounter(request=requests[perm], layer=2, seed=SEED).words((3, 2, 6, 8))
    assert torch.equal(batched[perm], permuted)
    single = StandaloneCounter(request=9, layer=2, token_offset=4, seed=SEED).words((2, 2, 8))
    assert torch.equal(batched[2, :, 4:6], single)  # decode step = prefill slice


def test_paged_stream_follows_slots_not_positions():
    slots = torch.tensor([10, 3, 7])
    words = PagedCounter(layer=1, slots=slots, seed=SEED).words((2, 3, 8))
    reordered = PagedCounter(layer=1, slots=slots.flip(0), seed=SEED).words((2, 3, 8))
    assert torch.equal(words.flip(1), reordered)


# ------------------------------------------------------------------ secret seed (issue 16, item 8)


def test_default_seed_is_secret_and_fresh_per_counter():
    """Implementation: ``seed=None``; oracle: a public default (0) would make two counters agree,
    and the stream of a known seed computable. Domain: 64 default counters. Tolerance: exact."""
    seeds = {StandaloneCounter(request=0, layer=0).seed for _ in range(32)}
    seeds |= {PagedCounter(layer=0, slots=torch.tensor([0])).seed for _ in range(32)}
    assert len(seeds) == 64 and 0 not in seeds
    assert all(0 <= s < 2**64 for s in seeds)
    public = StandaloneCounter(request=0, layer=0, seed=0).words((1, 4, 8))
    assert not torch.equal(StandaloneCounter(request=0, layer=0).words((1, 4, 8)), public)


def test_a_counter_keeps_its_drawn_seed_so_write_and_read_agree():
    counter = StandaloneCounter(request=3, layer=1)
    assert torch.equal(counter.words((2, 5, 8)), counter.words((2, 5, 8)))
    replay = StandaloneCounter(request=3, layer=1, seed=counter.seed)
    assert torch.equal(replay.words((2, 5, 8)), counter.words((2, 5, 8)))


@pytest.mark.parametrize("requests, batch, match", [
    ((0, 0), 2, "own id"), ((0, 1, 2), 2, "expected 2"), ((0, -1), 2, "requests"), ((0, 2**32), 2, "requests"),
    ((0.5, 1), 2, "ints"), (3, 3, "sequence"),
])
def test_batch_requests_need_one_distinct_id_per_row(requests, batch, match):
    with pytest.raises(ValueError, match=match):
        batch_requests(requests, batch)
    assert batch_requests(None, 3).tolist() == [0, 1, 2]
    assert batch_requests((7, 3), 2).tolist() == [7, 3]


def test_dither_grid_is_centred_24_bit():
    words = torch.tensor([0, 0xFF, 0x100, 0xFFFFFFFF, 0x80000000])
    numerators = dither_numerators(words)
    assert numerators.tolist() == [1 - 2**24, 1 - 2**24, 3 - 2**24, 2**24 - 1, 1]
    xi = dither_of(StandaloneCounter(request=0, layer=0), (4, 64, 64))
    assert xi.min() > -0.5 and xi.max() < 0.5
    assert torch.equal(torch.remainder(xi / GRID_STEP - 0.5, 1.0), torch.zeros_like(xi))
    assert torch.equal(xi.float().double(), xi)  # exact in fp32


@pytest.mark.parametrize("kwargs, match", [
    (dict(request=-1, layer=0), "request"),
    (dict(request=0, layer=1024), "layer"),
    (dict(request=2**32, layer=0), "request"),
    (dict(request=0, layer=0, side="q"), "side"),
    (dict(request=0, layer=0, seed=2**64), "seed"),
    (dict(request=0, layer=0, seed=-1), "seed"),
    (dict(request=0.5, layer=0), "request"),
])
def test_bad_standalone_fields_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StandaloneCounter(**kwargs)


def test_bad_paged_and_shape_are_rejected():
    with pytest.raises(ValueError, match="slots"):
        PagedCounter(layer=0, slots=torch.tensor([-1]))
    with pytest.raises(ValueError, match="kv_head"):
        StandaloneCounter(request=0, layer=0).words((1025, 2, 4))
    with pytest.raises(ValueError, match="shape"):
        StandaloneCounter(request=0, layer=0).words((2, 4))

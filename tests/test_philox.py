"""Philox4x32 (Tier B dither source): torch int64 reference vs Random123 KAT and the spec.

Implementation: ``witcert.tier_b.philox.philox4x32`` (int64 tensors). Oracles: the published
Random123 known-answer vectors (``tests/kat_vectors`` of DEShawResearch/random123; the
extended list also ships as ``examples/kat_vectors`` in girving/random123-manual) and the
pure-Python ``witcert.spec.philox``. Domain: all uint32 counters/keys. Tolerance: bit-exact.
"""
import pytest
import torch
from hypothesis import given, strategies as st

from witcert.tier_b.philox import philox4x32_10
from witcert.tier_b.philox import mulhilo32, philox4x32
from witcert.spec import philox as spec_philox

# (rounds, counter words, key words, expected words), copied from Random123 kat_vectors
KAT = [
    (10, "00000000 00000000 00000000 00000000", "00000000 00000000", "6627e8d5 e169c58d bc57ac4c 9b00dbd8"),
    (10, "ffffffff ffffffff ffffffff ffffffff", "ffffffff ffffffff", "408f276d 41c83b0e a20bc7c6 6d5451fd"),
    (10, "243f6a88 85a308d3 13198a2e 03707344", "a4093822 299f31d0", "d16cfe09 94fdcceb 5001e420 24126ea1"),
    (7, "00000000 00000000 00000000 00000000", "00000000 00000000", "5f6fb709 0d893f64 4f121f81 4f730a48"),
    (7, "ffffffff ffffffff ffffffff ffffffff", "ffffffff ffffffff", "5207ddc2 45165e59 4d8ee751 8c52f662"),
    (7, "243f6a88 85a308d3 13198a2e 03707344", "a4093822 299f31d0", "4dfccaba 190a87f0 c47362ba b6b5242a"),
    (10, "00000001 00000000 00000000 00000000", "00000001 00000000", "ac08141b dfc5ccbe 79c07a47 a7f66093"),
    (10, "00000000 00000000 00000000 80000000", "00000001 00000000", "dde26e4e 17666f3b fc1f5b3a 83ac805d"),
    (10, "243f6a88 85a308d3 13198a2e 03707344", "00000000 ffffffff", "08f7720c 845ee9e0 502ccd3d a9a00e27"),
    (10, "a4093822 299f31d0 082efa98 ec4e6c89", "00000000 80000000", "aa74e81c c9ddb97b 2c2cd881 9390c78d"),
]


def words(text):
    return [int(w, 16) for w in text.split()]


@pytest.mark.parametrize("rounds, counter, key, expected", KAT)
def test_torch_reference_matches_random123_kat(rounds, counter, key, expected):
    out = philox4x32(torch.tensor(words(counter)), torch.tensor(words(key)), rounds=rounds)
    assert out.tolist() == words(expected)


@pytest.mark.parametrize("rounds, counter, key, expected", KAT)
def test_spec_matches_random123_kat(rounds, counter, key, expected):
    assert list(spec_philox.philox4x32(words(counter), words(key), rounds)) == words(expected)


def test_batched_kat_and_broadcast_key():
    counters = torch.tensor([words(c) for r, c, k, e in KAT if r == 10])
    keys = torch.tensor([words(k) for r, c, k, e in KAT if r == 10])
    expected = [words(e) for r, c, k, e in KAT if r == 10]
    assert philox4x32_10(counters, keys).tolist() == expected
    zero_key = torch.zeros(2, dtype=torch.int64)  # broadcast one key over many counters
    assert philox4x32_10(counters, zero_key)[0].tolist() == words(KAT[0][3])


uint32 = st.integers(0, 0xFFFFFFFF)


@given(st.lists(uint32, min_size=4, max_size=4), st.lists(uint32, min_size=2, max_size=2))
def test_torch_reference_equals_spec(counter, key):
    got = philox4x32_10(torch.tensor(counter), torch.tensor(key)).tolist()
    assert got == list(spec_philox.philox4x32_10(counter, key))


@given(uint32)
def test_mulhilo_is_the_exact_64_bit_product(word):
    for multiplier in (0xD2511F53, 0xCD9E8D57, 0xFFFFFFFF):
        high, low = mulhilo32(multiplier, torch.tensor([word]))
        assert (high.item() << 32) + low.item() == multiplier * word


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(3, dtype=torch.int64), "last dimension"),
    (torch.zeros(4, dtype=torch.int32), "int64"),
    (torch.tensor([0, 0, 0, 1 << 32]), r"\[0, 2\^32\)"),
    (torch.tensor([0, 0, -1, 0]), r"\[0, 2\^32\)"),
])
def test_bad_counter_is_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        philox4x32_10(bad, torch.zeros(2, dtype=torch.int64))

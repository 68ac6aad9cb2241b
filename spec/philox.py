"""Philox4x32-R in pure Python integers (spec mirror of ``witcert.tier_b.philox``; no torch).

Written from the Random123 definition, independently of the torch reference: Python ints
are unbounded, so ``mulhilo`` is the plain product split at bit 32. Used to cross-check the
torch reference and, later, the Triton kernels bit for bit.
"""
MASK32 = 0xFFFFFFFF
M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85


def philox4x32(counter, key, rounds=10):
    """Philox4x32-``rounds`` of a 4-word ``counter`` under a 2-word ``key`` (Python ints)."""
    c0, c1, c2, c3 = (int(w) & MASK32 for w in counter)
    k0, k1 = (int(w) & MASK32 for w in key)
    for round_index in range(rounds):
        if round_index:
            k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
        p0, p1 = M0 * c0, M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32)
    return (c0, c1, c2, c3)


def philox4x32_10(counter, key):
    """Philox4x32-10 (Random123's default round count)."""
    return philox4x32(counter, key, rounds=10)

"""Philox4x32-R counter-based generator, torch reference in int64 (Tier B dither source).

Hand-written on purpose: the dither stream must be bit-identical in this torch reference,
in the Triton kernels (``kernels/``) and in the pure-Python spec (``spec/philox.py``), and
library generators (``torch.Generator``, ``tl.rand``'s float conversion) neither expose the
counter layout nor promise bit-exactness across backends. The algorithm is Random123's
Philox4x32 (Salmon et al., SC'11) and matches the published known-answer vectors
(``tests/kat_vectors`` of Random123; checked in ``tests/test_philox.py``).

One round, with constants ``M0 = 0xD2511F53``, ``M1 = 0xCD9E8D57``::

    hi0, lo0 = mulhilo(M0, c0);  hi1, lo1 = mulhilo(M1, c2)
    (c0, c1, c2, c3) <- (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)

and between rounds the key is bumped ``k0 += 0x9E3779B9``, ``k1 += 0xBB67AE85`` (mod 2^32).
This is exactly Triton's ``tl.philox(seed, c0, c1, c2, c3)`` with
``k0 = seed & 0xFFFFFFFF`` and ``k1 = seed >> 32``.

Arithmetic: every word is a uint32 value held in int64 and masked with ``& 0xFFFFFFFF``
after every add. ``mulhilo`` cannot multiply two 32-bit words directly in int64
(``0xD2511F53 * 0xFFFFFFFF > 2^63``), so the word is split into 16-bit halves and the
partial products (each < 2^48) are recombined exactly.
"""
import torch

MASK32 = 0xFFFFFFFF
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85


def mulhilo32(multiplier: int, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (high, low) 32-bit halves of ``multiplier * word`` for uint32 values in int64.

    ``word = wh * 2^16 + wl``; ``multiplier * wh`` and ``multiplier * wl`` are < 2^48, and
    ``mid = (multiplier*wh mod 2^16) * 2^16 + multiplier*wl < 2^49``, so no int64 overflow.
    """
    word_hi = word >> 16
    word_lo = word & 0xFFFF
    prod_hi = multiplier * word_hi  # < 2^48
    prod_lo = multiplier * word_lo  # < 2^48
    mid = ((prod_hi & 0xFFFF) << 16) + prod_lo  # < 2^49
    low = mid & MASK32
    high = (prod_hi >> 16) + (mid >> 32)  # exact, < 2^32 because the full product is < 2^64
    return high, low


def _check_words(name: str, words: torch.Tensor, last: int) -> None:
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int64:
        raise ValueError(f"{name}: expected an int64 tensor of uint32 values")
    if words.shape[-1:] != (last,):
        raise ValueError(f"{name}: last dimension must be {last}, got shape {tuple(words.shape)}")
    if words.numel() and (words.min() < 0 or words.max() > MASK32):
        raise ValueError(f"{name}: values must lie in [0, 2^32)")


def philox4x32(counter: torch.Tensor, key: torch.Tensor, rounds: int = 10) -> torch.Tensor:
    """Philox4x32-``rounds`` of ``counter`` (..., 4) under ``key`` (..., 2), broadcast.

    Returns the four output words (..., 4) as uint32 values in int64.
    """
    _check_words("counter", counter, 4)
    _check_words("key", key, 2)
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds: expected a positive int, got {rounds!r}")
    shape = torch.broadcast_shapes(counter.shape[:-1], key.shape[:-1])
    c0, c1, c2, c3 = (w.expand(shape) for w in counter.unbind(-1))
    k0, k1 = (w.expand(shape) for w in key.unbind(-1))
    for round_index in range(rounds):
        if round_index:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack((c0, c1, c2, c3), dim=-1)


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 (the Tier B dither generator, registry "L2" context).

    Parameters
    ----------
    counter : int64 tensor (..., 4) of uint32 values, word 0 first.
    key : int64 tensor (..., 2) of uint32 values, broadcastable against ``counter``.

    Returns
    -------
    int64 tensor (..., 4) of uint32 values.
    """
    return philox4x32(counter, key, rounds=10)

"""Exact oracle for witness checks: is every stored witness >= the band norm of its real residual?

Fast path: the band norms of ``read - exact`` in fp64 (relative error below ``1e-13`` for the
head dims used here). Every entry that fp64 cannot decide with that margin (the norm within
``1e-12`` relative of its witness, e.g. a residual whose norm is an fp16 value) is decided exactly
with mpmath at 60 digits, where the subtraction of the two floats is exact. So the verdict is
exact, per (token, band), with no tolerance.
"""
import torch
from mpmath import mp, mpf

from witcert.spec import bands as spec

MARGIN = 1e-12


def witness_shortfalls(witness: torch.Tensor, read: torch.Tensor, exact: torch.Tensor, layout) -> int:
    """Number of (token, band) entries with ``witness < ||(read - exact)_b||`` (exactly decided).

    ``witness`` (..., S, B), ``read`` and ``exact`` (..., S, d) on the same tokens.
    """
    assert witness.shape[:-1] == read.shape[:-1] == exact.shape[:-1], (witness.shape, read.shape, exact.shape)
    w = witness.double()
    r64 = layout.band_norms(read.double() - exact.double())  # (..., S, B)
    unsure = r64 > w * (1 - MARGIN)
    if not unsure.any():
        return 0
    index = layout.index  # (B, 2P)
    reads, exacts = read.double().reshape(-1, read.shape[-1]), exact.double().reshape(-1, exact.shape[-1])
    short = 0
    for flat, band in zip(*torch.nonzero(unsure.reshape(-1, w.shape[-1]), as_tuple=True)):
        coords = index[band].tolist()
        with mp.workdps(60):
            residual = [mpf(reads[flat, i].item()) - mpf(exacts[flat, i].item()) for i in coords]
            norm = mp.sqrt(mp.fsum(v * v for v in residual))
        short += int(norm > mpf(w.reshape(-1, w.shape[-1])[flat, band].item()))
    return short


def value_shortfalls(witness: torch.Tensor, read: torch.Tensor, exact: torch.Tensor) -> int:
    """As :func:`witness_shortfalls` for a one-band value witness (..., S) against ``||read_t - exact_t||``."""
    from witcert.tier_a.bands import BandLayout

    return witness_shortfalls(witness[..., None], read, exact, BandLayout(read.shape[-1], 1))


def exact_band_norm(residual: list[float], bands: int, rope: str) -> list[mpf]:
    """The spec's band norms (60 digits) of a residual given as floats."""
    with mp.workdps(60):
        return spec.band_norms(residual, bands, rope)

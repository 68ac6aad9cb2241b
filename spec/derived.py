"""Spec mirror of the derived witness (``DW``): band norms of elementwise error bounds.

Pure Python + mpmath at ``SPEC_DPS`` digits, no torch. A reconstruction ``x^`` of ``x`` with
``|x^_i - x_i| <= e_i`` for every coordinate has, in every band ``b``,

    ``||(x^ - x)_b|| <= ||e_b|| = sqrt(sum_{i in b} e_i^2)``

(Lean: ``WitCert.band_norm_le_of_abs_le``; with Theorem 2 ``WitCert.abs_inner_div_sqrt_le_derived``).
Bands as in :mod:`witcert.spec.bands`.
"""
from collections.abc import Sequence

from mpmath import mp, mpf

from .bands import SPEC_DPS, Real, band_norms


def bound_derived_witness(e: Sequence[Real], bands: int, rope: str = "rotate_half") -> list[mpf]:
    """``||e_b||`` for every band (``DW``): a witness of any ``x^`` whose error is elementwise within ``e``."""
    if any(mpf(ei) < 0 for ei in e):
        raise ValueError("e must be >= 0 (elementwise error bounds)")
    with mp.workdps(SPEC_DPS):
        return band_norms([mpf(ei) for ei in e], bands, rope)


def hypotheses_derived_witness(x: Sequence[Real], x_hat: Sequence[Real], e: Sequence[Real]) -> bool:
    """``DW``'s hypothesis: ``|x^_i - x_i| <= e_i`` for every coordinate (exact arithmetic)."""
    with mp.workdps(SPEC_DPS):
        return all(abs(mpf(a) - mpf(b)) <= mpf(ei) for a, b, ei in zip(x_hat, x, e, strict=True))

"""Spec mirror of witness maintenance (``WM``): a band witness after a re-quantization.

Pure Python + mpmath at ``SPEC_DPS`` digits, no torch. A token's reconstruction moves from
``x^_old`` to ``x^_new``; with ``w_b >= ||(x^_old - x)_b||`` for the exact ``x``,

    ``||(x^_new - x)_b|| <= w_b + ||(x^_new - x^_old)_b||``

(Lean: ``WitCert.bandNorm_sub_le_add_of_le``; over a chain of moves
``WitCert.bandNorm_sub_le_add_sum``). Bands as in :mod:`witcert.spec.bands`.
"""
from collections.abc import Sequence

from mpmath import mp, mpf

from .bands import SPEC_DPS, Real, band_norms, hypotheses_band_witness


def bound_maintained_witness(
    w: Sequence[Real], x_hat_old: Sequence[Real], x_hat_new: Sequence[Real], bands: int, rope: str = "rotate_half"
) -> list[mpf]:
    """``w_b + ||(x^_new - x^_old)_b||`` for every band (``WM``): a witness of ``x^_new`` when ``w`` is one of ``x^_old``."""
    if len(w) != bands:
        raise ValueError(f"w must have {bands} entries, got {len(w)}")
    with mp.workdps(SPEC_DPS):
        moves = band_norms([mpf(a) - mpf(b) for a, b in zip(x_hat_new, x_hat_old, strict=True)], bands, rope)
        return [mpf(wb) + move for wb, move in zip(w, moves, strict=True)]


def hypotheses_maintained_witness(
    x: Sequence[Real], x_hat_old: Sequence[Real], w: Sequence[Real], bands: int, rope: str = "rotate_half"
) -> bool:
    """``WM``'s hypothesis: ``w_b >= ||(x^_old - x)_b||`` for every band."""
    with mp.workdps(SPEC_DPS):
        residual = [mpf(a) - mpf(b) for a, b in zip(x_hat_old, x, strict=True)]
        return hypotheses_band_witness(residual, w, bands, rope)

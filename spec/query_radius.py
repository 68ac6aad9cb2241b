"""Spec mirror of the query-side radius (registry key ``QR``; Lean statement planned:
logit_error_le_query_key_bound in the WitCert namespace).

Pure Python + mpmath at ``SPEC_DPS`` digits, no torch; floats convert exactly (``mpf(float)``). With the exact
query ``q``, the query the kernel reads ``q' = q + e``, exact keys ``k`` and stored keys ``k^``:

    l~ - l = sm q' . k^ - sm q . k = sm q . (k^ - k) + sm e . k^              (logit_error_split)
    |l~ - l| <= sm sum_b ||q_b|| w_b + |sm e . k^|,  w_b >= ||(k^ - k)_b||     (bound_query_key)
    |sm e . k^| <= sm sum_b ||e_b|| ||k^_b||                                   (bound_query_cauchy_schwarz)

The first is an identity; the second is Theorem 2's band Cauchy-Schwarz on the key side plus the exact query
term (``witcert.tier_a.query_radius`` evaluates it in fp64 with its rounding); the third is the Cauchy-Schwarz
form, valid and never smaller (the torch code forms the exact dot instead).
"""
from collections.abc import Sequence

from mpmath import fabs, mp, mpf

from witcert.spec.bands import SPEC_DPS, band_norms, bound_band_witness

Real = float | int | mpf


def _dot(a: Sequence[Real], b: Sequence[Real]) -> mpf:
    return mp.fsum(mpf(x) * mpf(y) for x, y in zip(a, b, strict=True))


def logit_error(q: Sequence[Real], q_read: Sequence[Real], k: Sequence[Real], k_hat: Sequence[Real],
                sm_scale: Real) -> mpf:
    """``sm q' . k^ - sm q . k``: the error of the logit the kernel forms against the exact one."""
    with mp.workdps(SPEC_DPS):
        return mpf(sm_scale) * (_dot(q_read, k_hat) - _dot(q, k))


def logit_error_split(q: Sequence[Real], q_read: Sequence[Real], k: Sequence[Real], k_hat: Sequence[Real],
                      sm_scale: Real) -> tuple[mpf, mpf]:
    """``(sm q . (k^ - k), sm e . k^)``, whose sum is :func:`logit_error` (the identity the bound rests on)."""
    with mp.workdps(SPEC_DPS):
        residual = [mpf(a) - mpf(b) for a, b in zip(k_hat, k, strict=True)]
        e = [mpf(a) - mpf(b) for a, b in zip(q_read, q, strict=True)]
        return mpf(sm_scale) * _dot(q, residual), mpf(sm_scale) * _dot(e, k_hat)


def bound_query_key(q: Sequence[Real], q_read: Sequence[Real], k_hat: Sequence[Real], witness: Sequence[Real],
                    sm_scale: Real, bands: int, rope: str = "rotate_half") -> mpf:
    """``sm sum_b ||q_b|| w_b + |sm (q' - q) . k^|`` (its Lean statement is planned):
    bounds ``|sm q' . k^ - sm q . k|`` whenever ``w_b >= ||(k^ - k)_b||`` for every band (Theorem 2's premise)."""
    with mp.workdps(SPEC_DPS):
        key_side = bound_band_witness(q, witness, bands, rope, sm_scale)
        e = [mpf(a) - mpf(b) for a, b in zip(q_read, q, strict=True)]
        return key_side + fabs(mpf(sm_scale) * _dot(e, k_hat))


def bound_query_cauchy_schwarz(q: Sequence[Real], q_read: Sequence[Real], k_hat: Sequence[Real], sm_scale: Real,
                               bands: int, rope: str = "rotate_half") -> mpf:
    """``sm sum_b ||e_b|| ||k^_b||`` with ``e = q' - q``: the band Cauchy-Schwarz form of the query term."""
    with mp.workdps(SPEC_DPS):
        e = [mpf(a) - mpf(b) for a, b in zip(q_read, q, strict=True)]
        e_norms = band_norms(e, bands, rope)
        k_norms = band_norms(k_hat, bands, rope)
        return mpf(sm_scale) * mp.fsum(a * b for a, b in zip(e_norms, k_norms))

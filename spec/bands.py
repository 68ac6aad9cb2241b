"""Spec mirror of Lemma 1 (RoPE band invariance) and Theorem 2 (band Cauchy-Schwarz witness).

Pure Python + mpmath at ``SPEC_DPS`` digits, no torch. Floats convert exactly (``mpf(float)``).

- ``band_coordinates`` fixes which head coordinates form each band (mirrors
  ``witcert.BandLayout.index``): pair ``j`` is ``(j, j + d/2)`` under ``rotate_half`` and
  ``(2j, 2j + 1)`` under ``interleaved``; band ``b`` holds pairs ``[bP, (b+1)P)``, ``P = d/(2B)``.
- ``band_norms`` (``L1``): ``||x_b||`` per band; ``rotate`` applies RoPE, which preserves them.
- ``bound_band_witness`` (``T2``): ``sm_scale sum_b ||q_b|| w_b``, which bounds
  ``sm_scale |q . r|`` whenever ``w_b >= ||r_b||`` for every band (``hypotheses_band_witness``).
"""
from collections.abc import Sequence

from mpmath import mp, mpf

SPEC_DPS = 50
ROPE_CONVENTIONS = ("rotate_half", "interleaved")

Real = float | int | mpf


def _check_layout(head_dim: int, bands: int, rope: str) -> None:
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be positive and even, got {head_dim}")
    if bands <= 0 or (head_dim // 2) % bands:
        raise ValueError(f"bands={bands} must divide head_dim/2={head_dim // 2}")
    if rope not in ROPE_CONVENTIONS:
        raise ValueError(f"rope must be one of {ROPE_CONVENTIONS}, got {rope!r}")


def pair_coordinates(head_dim: int, rope: str = "rotate_half") -> list[tuple[int, int]]:
    """The two coordinates of every RoPE frequency pair ``j`` in ``[0, d/2)``."""
    _check_layout(head_dim, 1, rope)
    half = head_dim // 2
    if rope == "rotate_half":
        return [(j, j + half) for j in range(half)]
    return [(2 * j, 2 * j + 1) for j in range(half)]


def band_coordinates(head_dim: int, bands: int, rope: str = "rotate_half") -> list[list[int]]:
    """Coordinates of each band, pair by pair (mirrors ``BandLayout.index``)."""
    _check_layout(head_dim, bands, rope)
    pairs = pair_coordinates(head_dim, rope)
    per_band = len(pairs) // bands
    return [[i for pair in pairs[b * per_band : (b + 1) * per_band] for i in pair] for b in range(bands)]


def band_norms(x: Sequence[Real], bands: int, rope: str = "rotate_half") -> list[mpf]:
    """``||x_b||`` for every band of ``x`` (length ``d``) (Lemma 1, ``L1``)."""
    with mp.workdps(SPEC_DPS):
        xs = [mpf(v) for v in x]
        return [mp.sqrt(mp.fsum(xs[i] ** 2 for i in idx)) for idx in band_coordinates(len(xs), bands, rope)]


def rotate(x: Sequence[Real], position: Real, rope: str = "rotate_half", rope_theta: Real = 10000) -> list[mpf]:
    """RoPE at ``position``: pair ``j`` rotated by ``position * rope_theta^(-2j/d)`` (Lemma 1, ``L1``)."""
    with mp.workdps(SPEC_DPS):
        xs = [mpf(v) for v in x]
        d = len(xs)
        out = list(xs)
        for j, (a, b) in enumerate(pair_coordinates(d, rope)):
            angle = mpf(position) * mpf(rope_theta) ** (-mpf(2 * j) / d)
            cos, sin = mp.cos(angle), mp.sin(angle)
            out[a], out[b] = xs[a] * cos - xs[b] * sin, xs[b] * cos + xs[a] * sin
        return out


def logit_error(q: Sequence[Real], r: Sequence[Real], sm_scale: Real | None = None) -> mpf:
    """``|eps| = sm_scale |q . r|``; default ``sm_scale = 1/sqrt(d)`` (exact real)."""
    with mp.workdps(SPEC_DPS):
        scale = _scale(sm_scale, len(q))
        return scale * abs(mp.fsum(mpf(a) * mpf(b) for a, b in zip(q, r, strict=True)))


def hypotheses_band_witness(r: Sequence[Real], w: Sequence[Real], bands: int, rope: str = "rotate_half") -> bool:
    """Theorem 2's hypothesis: ``w_b >= ||r_b||`` for every band."""
    with mp.workdps(SPEC_DPS):
        return all(mpf(wb) >= nb for wb, nb in zip(w, band_norms(r, bands, rope), strict=True))


def bound_band_witness(
    q: Sequence[Real], w: Sequence[Real], bands: int, rope: str = "rotate_half", sm_scale: Real | None = None
) -> mpf:
    """``c = sm_scale sum_b ||q_b|| w_b`` (Theorem 2, ``T2``); ``>= |eps|`` under the hypothesis."""
    if len(w) != bands:
        raise ValueError(f"w must have {bands} entries, got {len(w)}")
    with mp.workdps(SPEC_DPS):
        scale = _scale(sm_scale, len(q))
        return scale * mp.fsum(n * mpf(wb) for n, wb in zip(band_norms(q, bands, rope), w, strict=True))


def _scale(sm_scale: Real | None, head_dim: int) -> mpf:
    return 1 / mp.sqrt(head_dim) if sm_scale is None else mpf(sm_scale)

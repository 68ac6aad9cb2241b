"""Spec mirror of Lemma 1 (RoPE band invariance) and Theorem 2 (band Cauchy-Schwarz witness).

Pure Python + mpmath at ``SPEC_DPS`` digits, no torch. Floats convert exactly (``mpf(float)``).

- ``band_coordinates`` fixes which head coordinates form each band (mirrors
  ``witcert.BandLayout.index``): pair ``j`` is ``(j, j + d/2)`` under ``rotate_half`` and
  ``(2j, 2j + 1)`` under ``interleaved``; band ``b`` holds pairs ``[bP, (b+1)P)``, ``P = d/(2B)``.
- ``band_norms`` (``L1``): ``||x_b||`` per band; ``rotate`` applies RoPE, which preserves them.
- ``bound_band_witness`` (``T2``): ``sm_scale sum_b ||q_b|| w_b``, which bounds
  ``sm_scale |q . r|`` whenever ``w_b >= ||r_b||`` for every band (``hypotheses_band_witness``).
- ``bound_rounded_rotation`` (``L1fp``): the band witness after a RoPE computed in floating
  point, ``(1 + eta) w_b + sqrt(2) kappa (1 + eta) (||k_b|| + ||k^_b||) + 2 sqrt(2P) alpha0``;
  ``rotate_rounded`` is the arithmetic it covers (HF Llama's, every operation rounded to nearest
  even in the named format, emulated exactly by ``round_to_format``).
"""
from collections.abc import Sequence

from mpmath import mp, mpf

SPEC_DPS = 50
ROPE_CONVENTIONS = ("rotate_half", "interleaved")
# binary formats: (significand bits p, exponent of the smallest subnormal, exponent of the largest finite's ulp)
FORMATS = {
    "float16": (11, -24, 5),
    "bfloat16": (8, -133, 120),
    "float32": (24, -149, 104),
    "float64": (53, -1074, 971),
}
ETA_UNITS, KAPPA_UNITS, ALPHA_SUBNORMALS = 8, 3, 4  # L1fp constants in units of u, u, sigma

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


def rotation_rounding(rope_dtype: str) -> tuple[mpf, mpf, mpf]:
    """``(eta, kappa, alpha0) = (8 u, 3 u, 4 sigma)`` of ``rope_dtype`` (``L1fp``).

    ``u = 2^-p`` is the unit roundoff and ``sigma`` the smallest subnormal; ``eta`` bounds
    ``sqrt(c~^2 + s~^2) - 1``, ``kappa`` and ``alpha0`` the per-component rounding
    ``|delta| <= kappa (|a c~| + |b s~|) + alpha0`` (justified in ``witcert.tier_a.rotary``).
    """
    p, sub, _ = _format(rope_dtype)
    with mp.workdps(SPEC_DPS):
        u = mpf(2) ** -p
        return ETA_UNITS * u, KAPPA_UNITS * u, ALPHA_SUBNORMALS * mpf(2) ** sub


def bound_rounded_rotation(w: Real, k_norm: Real, k_hat_norm: Real, pairs_per_band: int, rope_dtype: str) -> mpf:
    """``(1 + eta) w + sqrt(2) kappa (1 + eta) (||k_b|| + ||k^_b||) + 2 sqrt(2P) alpha0`` (``L1fp``).

    Lean: ``WitCert.band_norm_sub_le_of_rounded_rotation`` (``||x' - y'|| <= (1 + eta) ||x - y||
    + ||dx|| + ||dy||`` for ``x' = M x + dx``, ``y' = M y + dy``) with
    ``||d_b|| <= sqrt(2) kappa (1 + eta) ||x_b|| + sqrt(2P) alpha0``. Bounds the band norm of
    the residual after a rotation computed in ``rope_dtype`` whenever ``w >= ||(k^ - k)_b||``.
    """
    eta, kappa, alpha0 = rotation_rounding(rope_dtype)
    with mp.workdps(SPEC_DPS):
        grow = 1 + eta
        spread = mp.sqrt(2) * kappa * grow
        return grow * mpf(w) + spread * (mpf(k_norm) + mpf(k_hat_norm)) + 2 * mp.sqrt(2 * pairs_per_band) * alpha0


def round_to_format(x: Real, rope_dtype: str) -> mpf:
    """``x`` rounded to nearest (ties to even) in the binary format ``rope_dtype``; ``+-inf`` on overflow."""
    p, sub, top = _format(rope_dtype)
    with mp.workdps(SPEC_DPS + 400):  # exact for every product/sum of two values of these formats
        x = mpf(x)
        if x == 0:
            return mpf(0)
        _, e = mp.frexp(x)  # |x| in [2^(e-1), 2^e)
        ulp = mpf(2) ** max(e - p, sub)
        scaled = x / ulp  # exact: a power-of-two division
        low = mp.floor(scaled)
        rest = scaled - low
        n = low + 1 if rest > 0.5 or (rest == 0.5 and int(low) % 2) else low
        value = n * ulp
        largest = (2 ** p - 1) * mpf(2) ** top
        if abs(value) > largest:
            return mp.inf if value > 0 else -mp.inf
        return value


def rotate_rounded(x: Sequence[Real], cos: Sequence[Real], sin: Sequence[Real], rope: str, rope_dtype: str) -> list[mpf]:
    """RoPE as HF Llama computes it in the model dtype ``rope_dtype`` (``L1fp``'s arithmetic).

    ``cos[j]``, ``sin[j]`` are the values pair ``j`` uses (already in ``rope_dtype``); each
    product and each sum is rounded to nearest even: ``a' = fl(fl(a c) - fl(b s))``,
    ``b' = fl(fl(b c) + fl(a s))``.
    """
    xs = [mpf(v) for v in x]
    out = list(xs)
    rnd = lambda v: round_to_format(v, rope_dtype)  # noqa: E731
    with mp.workdps(SPEC_DPS + 400):
        for j, (a, b) in enumerate(pair_coordinates(len(xs), rope)):
            c, s = mpf(cos[j]), mpf(sin[j])
            out[a] = rnd(rnd(xs[a] * c) - rnd(xs[b] * s))
            out[b] = rnd(rnd(xs[b] * c) + rnd(xs[a] * s))
    return out


def _format(rope_dtype: str) -> tuple[int, int, int]:
    if rope_dtype not in FORMATS:
        raise ValueError(f"rope_dtype must be one of {tuple(FORMATS)}, got {rope_dtype!r}")
    return FORMATS[rope_dtype]


def _scale(sm_scale: Real | None, head_dim: int) -> mpf:
    return 1 / mp.sqrt(head_dim) if sm_scale is None else mpf(sm_scale)

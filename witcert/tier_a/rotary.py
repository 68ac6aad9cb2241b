"""Rotary position embedding (RoPE) in both pair conventions, and the rounding of a computed one.

``inv_freq_j = rope_theta^(-2j/d)``; position ``n`` rotates pair ``j`` by ``n inv_freq_j``.
``"rotate_half"`` follows HF Llama (``x cos + rotate_half(x) sin``, pair ``(j, j + d/2)``);
``"interleaved"`` follows GPT-J (pair ``(2j, 2j + 1)``).

Exact arithmetic (Lemma 1, ``L1``): every band norm of a :class:`witcert.BandLayout` with the
same convention is invariant under the rotation, so a witness of the unrotated residual bounds
the rotated one at every position.

Floating point (``L1fp``, Lean ``WitCert.band_norm_sub_le_of_rounded_rotation``)
------------------------------------------------------------------------------
A computed rotation does not preserve band norms: in fp16 with a massive channel the exact and
the compressed key of one token round to different values (-523.0 vs -523.5), and a witness of
the unrotated residual falls below the rotated one. Write the computed rotation of a pair
``(a, b)`` with the cosine and sine values it actually uses, ``c~``, ``s~``, as::

    a' = a c~ - b s~ + delta_a,   b' = b c~ + a s~ + delta_b,

i.e. ``x' = M x + delta_x`` with ``M = [[c~, -s~], [s~, c~]]``, a rotation scaled by
``r = sqrt(c~^2 + s~^2)``. Both keys of a token are rotated at one position, by one ``M``, so
per band ``||k^'_b - k'_b|| <= r ||(k^ - k)_b|| + ||delta_{k^,b}|| + ||delta_{k,b}||``
(``L1fp``). With ``u = 2^-p`` the unit roundoff and ``sigma`` the smallest subnormal of
``rope_dtype`` (the coarsest dtype the rotation rounds to), :func:`rotation_rounding` assumes

(A1) ``r <= 1 + eta``, ``eta = 8 u``. If ``c~, s~`` lie within ``m u`` of ``(cos t, sin t)``
     for *some* angle ``t`` (which one does not matter, so the rounding of the angle itself is
     free) then ``r <= 1 + sqrt(2) m u + m^2 u^2``. HF casts fp32 ``cos``/``sin`` (<= 1 ulp
     on CPU, 2 on CUDA: <= 2^-23 absolute) to the model dtype (<= u/2 absolute below 1):
     ``m <= 0.6`` in fp16/bf16, ``m <= 2`` in fp32; ``eta = 8 u`` covers ``m`` up to 5.
     Measured on HF's own values at every position below ``2^17`` (d = 128, theta 1e4 and
     5e5): ``r - 1 <= 0.76 u`` in fp16, bf16 and fp32.
(A2) per component ``|delta| <= kappa (|a c~| + |b s~|) + alpha0``, ``kappa = 3 u``,
     ``alpha0 = 4 sigma``. HF Llama (``x * cos + rotate_half(x) * sin`` in the model dtype):
     two products and one sum, each rounded to nearest in ``rope_dtype``, so
     ``(1 + u)^2 - 1 = 2 u + u^2`` relative and three subnormal floors ``sigma / 2``.
     :func:`apply_rope` (fp32 products and sum, one cast to ``x.dtype``): ``u + 3 u_32 + O(u^2)
     <= 2 u``. A fused multiply-add drops one rounding. Margins: 1.5 on ``kappa``, 8/3 on
     ``alpha0``.
(A3) ``cos``/``sin`` are not scaled: HF ``attention_scaling == 1`` (default, linear, dynamic
     and llama3 RoPE). YaRN and LongRoPE multiply them by their ``mscale`` (``r = mscale``):
     for those compute the witness on the rotated keys (:func:`witcert.witness_of` without
     ``rope_dtype``).

Since ``|c~| + |s~| <= sqrt(2) r``, a band of ``P`` pairs gets
``||delta_{x,b}|| <= sqrt(2) kappa (1 + eta) ||x_b|| + sqrt(2 P) alpha0`` (Minkowski over
components and pairs), and the witness of the rotated residual (:func:`rounded_rotation_witness`)

    w'_b = (1 + eta) w_b + sqrt(2) kappa (1 + eta) (||k_b|| + ||k^_b||) + 2 sqrt(2 P) alpha0

depends only on band norms of unrotated vectors: it is still position-invariant. Overflow: when
a rotated component could exceed the largest finite ``rope_dtype`` value, the witness is
``inf`` (the trivial bound).
"""
import math
from dataclasses import dataclass

import torch

from witcert.tier_a.bands import ROPE_CONVENTIONS

ROPE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ETA_UNITS = 8  # r <= 1 + 8 u            (A1)
KAPPA_UNITS = 3  # |delta| <= 3 u (...)    (A2)
ALPHA_SUBNORMALS = 4  # + 4 sigma            (A2)
_U64 = 2.0**-52  # fp64 margin unit for the combination below


@dataclass(frozen=True)
class RotationRounding:
    """Error model of a RoPE computed in ``dtype`` (``L1fp``; see the module docstring).

    Attributes
    ----------
    dtype : torch.dtype
        The dtype the rotation rounds to.
    eta : float
        ``sqrt(c~^2 + s~^2) <= 1 + eta`` for the cosine/sine values used (A1).
    kappa : float
        Per-component relative rounding: ``|delta| <= kappa (|a c~| + |b s~|) + alpha0`` (A2).
    alpha0 : float
        Per-component absolute floor (subnormal results) (A2).
    max_finite : float
        Largest finite value of ``dtype`` (beyond it a rotated key overflows).
    """

    dtype: torch.dtype
    eta: float
    kappa: float
    alpha0: float
    max_finite: float


def rotation_rounding(rope_dtype: torch.dtype) -> RotationRounding:
    """The constants of (A1)-(A2) for a rotation that rounds to ``rope_dtype`` (``L1fp``)."""
    if rope_dtype not in ROPE_DTYPES:
        raise ValueError(f"rope_dtype must be one of {ROPE_DTYPES}, got {rope_dtype!r}")
    info = torch.finfo(rope_dtype)
    u = info.eps / 2  # 2^-p
    sigma = info.tiny * info.eps  # smallest subnormal: 2^(emin - p + 1)
    return RotationRounding(rope_dtype, ETA_UNITS * u, KAPPA_UNITS * u, ALPHA_SUBNORMALS * sigma, float(info.max))


def rounded_rotation_witness(
    w: torch.Tensor, k_norms: torch.Tensor, k_hat_norms: torch.Tensor, pairs_per_band: int, rope_dtype: torch.dtype
) -> torch.Tensor:
    """fp64 upper bound on every band norm of the residual after a rounded rotation (``L1fp``).

    Parameters
    ----------
    w, k_norms, k_hat_norms : Tensor (..., B), fp64
        Upper bounds on the band norms of ``k^ - k``, ``k`` and ``k^`` (unrotated).
    pairs_per_band : int
        ``P``: RoPE pairs per band.
    rope_dtype : torch.dtype
        The coarsest dtype the rotation rounds to (its arithmetic or its result).

    Returns
    -------
    Tensor (..., B), fp64: ``>= ||(rot~ k^ - rot~ k)_b||`` for every position and every
    rotation satisfying (A1)-(A3); ``inf`` where the rotation may overflow ``rope_dtype``.
    """
    model = rotation_rounding(rope_dtype)
    grow = 1.0 + model.eta  # exact in fp64 (eta = 8 u >= 2^-50)
    spread = _product_upper(_SQRT2_UP, model.kappa, grow)  # sqrt(2) kappa (1 + eta)
    floor = _product_upper(2.0, _up(math.sqrt(2.0 * pairs_per_band)), model.alpha0)  # 2 sqrt(2P) alpha0
    # five fp64 roundings (two products, two sums, one more product); 16 u_64 covers them twice
    # over. (For rope_dtype fp64 the floor is subnormal in fp64 and off by <= 2^-1075: the fp16
    # witness this feeds is either >= 2^-24 anyway or covered by that inflation.)
    bound = (grow * w + spread * (k_norms + k_hat_norms) + floor) * (1.0 + 16 * _U64)
    # a rotated component is at most sqrt(2) (1 + eta) (1 + kappa) ||x_b|| + alpha0 (one pair)
    peak = torch.maximum(k_norms, k_hat_norms) * _product_upper(_SQRT2_UP, grow, 1.0 + 2 * model.kappa)
    overflow = peak + model.alpha0 >= model.max_finite
    return torch.where(overflow, torch.full_like(bound, math.inf), bound)


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    rope: str = "rotate_half",
    rope_theta: float = 10000.0,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rotate ``x`` (..., T, d) at ``positions`` (T,) or (..., T) (Lemma 1 ``L1``; rounding ``L1fp``).

    The arithmetic: angles ``position * inv_freq`` and their ``cos``/``sin`` in fp32 (fp64 for
    fp64 ``x``); ``cos``/``sin`` cast to ``compute_dtype``; the products ``a c - b s``,
    ``b c + a s`` and their sums in ``compute_dtype``; the result cast to ``x.dtype``.

    Parameters
    ----------
    compute_dtype : torch.dtype, optional
        Default: fp32 (fp64 for fp64 ``x``), then one cast to ``x.dtype``.
        ``compute_dtype=x.dtype`` is HF Llama's ``x * cos + rotate_half(x) * sin`` in the model
        dtype (``cos``/``sin`` computed in fp32 and cast to it).

    Returns
    -------
    Tensor
        The same shape and dtype as ``x``. Under either arithmetic the rotated keys of a witness
        stored before RoPE are covered by ``witcert.witness_of(..., rope_dtype=x.dtype)``.
    """
    if rope not in ROPE_CONVENTIONS:
        raise ValueError(f"rope must be one of {ROPE_CONVENTIONS}, got {rope!r}")
    if not torch.is_floating_point(x) or x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(f"x must be a float tensor (..., T, d) with even d, got {tuple(x.shape)} {x.dtype}")
    if not (rope_theta > 0):
        raise ValueError(f"rope_theta must be > 0, got {rope_theta!r}")
    angle_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    work = angle_dtype if compute_dtype is None else compute_dtype
    if work not in ROPE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {ROPE_DTYPES}, got {compute_dtype!r}")
    angles = _angles(torch.as_tensor(positions, device=x.device), x.shape[-1], rope_theta, angle_dtype)  # (..., T, d/2)
    cos, sin = torch.cos(angles).to(work), torch.sin(angles).to(work)
    xw = x.to(work)
    if rope == "rotate_half":
        half = x.shape[-1] // 2
        a, b = xw[..., :half], xw[..., half:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = xw[..., 0::2], xw[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)


def _angles(positions: torch.Tensor, head_dim: int, rope_theta: float, dtype: torch.dtype) -> torch.Tensor:
    """Rotation angle of every pair at every position: (..., T, d/2).

    ``inv_freq = 1 / theta^(2j/d)`` and ``position * inv_freq`` in ``dtype``, as HF Llama's
    default rotary embedding computes them (in fp32), so that with ``compute_dtype`` equal to
    the model dtype the rotation is HF's bit for bit.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).to(dtype) / head_dim
    inv_freq = 1.0 / (float(rope_theta) ** exponents)  # (d/2,)
    return positions.to(dtype).unsqueeze(-1) * inv_freq


def _up(value: float) -> float:
    """One fp64 step above ``value`` (a constant computed with one rounding, rounded up)."""
    return math.nextafter(value, math.inf)


def _product_upper(*factors: float) -> float:
    """An fp64 value ``>=`` the exact product of non-negative fp64 ``factors``.

    Each of the ``n - 1`` multiplies rounds once (relative ``2^-53`` in the normal range);
    ``(1 + (n + 1) 2^-52)`` covers them and its own rounding.
    """
    value = 1.0
    for factor in factors:
        value *= factor
    return value * (1.0 + (len(factors) + 1) * _U64)


_SQRT2_UP = _up(math.sqrt(2.0))

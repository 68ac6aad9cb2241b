"""A witness derived from what a codec stores: no stored band norms (``DW``, then Theorem 2 ``T2``).

A codec whose reconstruction error has a known elementwise bound ``|x_i - x^_i| <= e_i`` needs no stored
witness: the residual of a band is bounded by the norm of the bounds over that band,

    ``||r_b||_2 = sqrt(sum_{i in b} (x^_i - x_i)^2) <= sqrt(sum_{i in b} e_i^2)``

(registry ``DW``: Lean ``WitCert.band_norm_le_of_abs_le``), and so are the value residual (one band over
all channels) and every bound the meter forms from them (``T2`` is monotone in the witness, ``MW``). The
bounds ``e`` come from the codec's ``error_bound(packed, decoded)`` (group steps from the stored scales,
relative half-spacings of a float grid), recomputed at every read from what the cache holds anyway.

Soundness never rests on the declaration: when a token is written, while the exact values exist,
:func:`check_error_bound` compares ``|x - x^|`` with ``e`` elementwise in fp64 (exact: both are at most
fp32 values, and their difference is exact in fp64) and refuses the write with a ``ValueError`` naming the
codec where any element exceeds its bound. The comparison is of the very fp64 values the read recomputes:
``error_bound`` is elementwise arithmetic on the packed chunk (no reduction whose order could change with
the number of tokens), checked deterministic at its first call for a user codec
(:class:`witcert.integrations.hf.codecs.OwnedCodec`).

Rounding: ``e`` is taken as the exact real values of its fp64 entries; :func:`derived_witness` forms the band
norms with :func:`witcert.core.norms.norms_upper_fp64` (each ``>=`` the exact norm) and rounds them up to
fp16, as a stored witness is (:func:`witcert.witness_of`); the value residual is rounded up to fp32.
"""
from __future__ import annotations

import torch

from witcert.core.norms import norms_upper_fp64
from witcert.core.rounding import round_up_to
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness import band_major


def rounding_terms(dtype: torch.dtype) -> tuple[float, float]:
    """``(u, a)`` of a float ``dtype``: rounding a real ``y`` to nearest in it moves it by at most
    ``u |fl(y)| + a`` (``u`` the unit roundoff, ``a`` half the subnormal spacing), below overflow."""
    info = torch.finfo(dtype)
    return info.eps / 2, info.smallest_normal * info.eps / 2


def check_error_bound(x: torch.Tensor, x_hat: torch.Tensor, bound: torch.Tensor, codec: str) -> None:
    """Refuse (``ValueError`` naming ``codec``) unless ``|x - x_hat| <= bound`` elementwise, in fp64.

    ``x`` exact values, ``x_hat`` their decodes (..., T, d); ``bound`` the codec's declared elementwise bound,
    broadcastable to them, fp64, ``>= 0`` (``inf`` allowed). NaN anywhere fails.
    """
    if not isinstance(bound, torch.Tensor) or bound.dtype != torch.float64:
        raise ValueError(f"codec {codec}: error_bound must return a float64 tensor, got "
                         f"{getattr(bound, 'dtype', type(bound).__name__)}")
    try:
        bound = bound.expand_as(x_hat)
    except RuntimeError:
        raise ValueError(f"codec {codec}: error_bound of shape {tuple(bound.shape)} does not broadcast to the "
                         f"decoded chunk {tuple(x_hat.shape)}") from None
    error = (x_hat.to(torch.float64) - x.to(torch.float64)).abs()
    bad = ~(error <= bound)  # NaN in either compares False: refused
    if bad.any():
        tokens = int(bad.any(-1).sum())
        excess = float((error - bound)[bad].nan_to_num(nan=float("inf")).max())
        raise ValueError(f"codec {codec}: the reconstruction error exceeds the codec's declared error_bound on "
                         f"{tokens} token(s) (by up to {excess:.3g}): a witness derived from that bound would be "
                         "unsound. Fix error_bound, or store the witness (witness_bits=8 or 16)")


def derived_witness(bound: torch.Tensor, layout: BandLayout) -> torch.Tensor:
    """fp16 band witness (..., S, B), band-major, from elementwise bounds ``bound`` (..., S, d) fp64 (``DW``):
    each entry ``>=`` the exact norm of the band's bounds, so ``>=`` the band norm of any residual they bound."""
    return band_major(round_up_to(norms_upper_fp64(layout.split(bound)), torch.float16))


def group_counts(layout: BandLayout, groups: int) -> torch.Tensor:
    """(G, B) float64: how many channels of band ``b`` lie in channel group ``g`` (groups of ``d / G`` contiguous
    channels; ``layout=None`` style one band is ``BandLayout(d, 1)``)."""
    d = layout.head_dim
    if groups < 1 or d % groups:
        raise ValueError(f"groups must divide the head dim {d}, got {groups}")
    of_channel = layout.split(torch.arange(d)) // (d // groups)  # (B, 2P): each band's channels' groups
    return torch.stack([(of_channel == g).sum(-1) for g in range(groups)]).to(torch.float64)


def group_band_norms(group_bound: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """fp64 upper band norms (..., S, B) of elementwise bounds that are constant over channel groups: ``group_bound``
    (..., S, G) fp64, ``counts`` from :func:`group_counts` (``DW`` with ``e_i = E_g`` for ``i`` in group ``g``).

    ``||e_b|| = sqrt(sum_g n_{g,b} E_g^2)``: one fp64 matmul of the squares against the counts, after dividing each
    token's bounds by their largest (no overflow); a ratio below ``2^-400`` is lifted to it (its square stays
    normal: never lost to underflow, and an upper bound still). ``G + 5`` roundings (ratio, square, the matmul's
    products and any-order sum, sqrt, rescale) are covered by the inflation ``1 + (G + 16) 2^-52``; ``inf`` stays
    ``inf``. ``S G B`` operations and no decode: what makes the derived witness cheap to recompute at every read.
    """
    peak = group_bound.amax(-1, keepdim=True)  # (..., S, 1)
    ratio = group_bound / torch.where(peak > 0, peak, 1.0)
    ratio = torch.where(group_bound > 0, ratio.clamp(min=2.0**-400), ratio)
    norms = peak * torch.sqrt((ratio * ratio) @ counts)  # (..., S, B)
    norms = torch.where(torch.isinf(peak), peak, norms)
    return norms * (1.0 + (counts.shape[0] + 16) * 2.0**-52)


def witness_of_norms(norms: torch.Tensor) -> torch.Tensor:
    """fp16 band-major witness (..., S, B) of fp64 upper band norms, rounded up."""
    return band_major(round_up_to(norms, torch.float16))


def derived_residual(bound: torch.Tensor) -> torch.Tensor:
    """Value residual bounds (..., S) fp32 from elementwise bounds (..., S, d) fp64 (``DW`` with one band)."""
    return round_up_to(norms_upper_fp64(bound), torch.float32)


# -- a short code relative to the derived witness (witness_bits=4) -------------------------------------------------
RELATIVE_MARGIN = 1.0 - 2.0**-8  # the derived norms at a read may differ from the write's by fp64 reduction order


def derived_norms(bound: torch.Tensor, layout: BandLayout | None) -> torch.Tensor:
    """fp64 upper band norms (..., S, B) of elementwise bounds (..., S, d), before any rounding to storage
    (``layout=None``: one band over all of ``d``, the value residual)."""
    return norms_upper_fp64(bound if layout is None else layout.split(bound))


def relative_codes(norms: torch.Tensor, derived: torch.Tensor, levels: int) -> torch.Tensor:
    """Codes ``k - 1`` (uint8) of the smallest ``k`` in ``1 .. levels`` with ``(1 - 2^-8) derived k / levels >= norms``,
    ``k = levels`` where none is: the stored fraction of the derived witness (``DW``, ``MW``).

    ``norms`` fp64 upper band norms of the actual residual, ``derived`` fp64 upper band norms of the elementwise
    bounds (``>= norms`` in exact arithmetic). A read forms ``derived' k / levels`` rounded up
    (:func:`relative_witness`): for ``k < levels`` it is ``>= norms`` by the checked inequality, ``derived'`` being
    the same fp64 reduction within far less than ``2^-8`` of ``derived``; for ``k = levels`` it is the derived
    witness itself, sound by ``DW`` whatever the residual.
    """
    base = derived * RELATIVE_MARGIN / levels  # rounded: checked below, exactly, against each candidate
    k = torch.ceil(norms / torch.where(base > 0, base, torch.ones_like(base))).clamp(1, levels)
    k = torch.where(base * k >= norms, k, k + 1).clamp(max=levels)  # one step up where the quotient rounded low
    k = torch.where((base > 0) & (base * k >= norms), k, torch.full_like(k, levels))
    return (k - 1).to(torch.uint8)


def relative_witness(codes: torch.Tensor, derived: torch.Tensor, levels: int, dtype: torch.dtype) -> torch.Tensor:
    """``derived (code + 1) / levels`` rounded up to ``dtype``: the witness (or value residual) a relative code
    stands for (:func:`relative_codes`)."""
    scaled = derived * ((codes.to(torch.float64) + 1) / levels)  # (code + 1) / levels: exact (levels a power of 2)
    scaled = torch.where(codes == levels - 1, derived, scaled * (1 + 2.0**-52))  # the product's rounding, covered
    return round_up_to(scaled, dtype)  # the top code is the derived witness itself, rounded as it is


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 (..., B, S), ``B`` even, -> (..., B/2, S): band ``2j`` low nibble, ``2j + 1`` high."""
    return codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: (..., B/2, S) -> (..., B, S)."""
    return torch.stack([packed & 15, packed >> 4], dim=-2).flatten(-3, -2)

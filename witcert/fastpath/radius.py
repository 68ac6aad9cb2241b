"""Tier A per-token radius ``c_t = sm_scale sum_b ||q_b|| w_{t,b}`` in fp32 for the fast path (T2, FP).

:func:`witcert.logit_bound` forms the same bound in fp64 with a directed round-up per element.
Here the band dot is one fp32 batched matmul (BLAS, any order, FMA or not) over an fp16 witness,
which is what :func:`witcert.witness_of` stores, enclosed a priori:

* query band norms: the fp64 upper norms of ``logit_bound`` times the scale (one fp64 rounding,
  the scale being the exact multiplier), rounded up to fp32 (``fp32_up``: covers that rounding) and
  lifted to at least ``2^-100`` -- zero ones too (``2^-100 >= 0``: still an upper bound) -- so that
  every product with a positive fp16 witness entry (``>= 2^-24``) is a normal fp32 number: the dot
  never underflows (it is 0 exactly when every witness entry is, and then so is the exact value),
  and an infinite witness entry makes ``c = inf``, never ``0 * inf = NaN`` (a zero band against an
  infinite witness band gives the trivial ``inf``, where ``logit_bound`` gives that band 0: looser,
  still sound);
* the ``B``-term dot of non-negative terms: ``gamma_B`` relative (Higham Thm 3.1), and the lift,
  applied to the norms before the dot, one rounding each: ``1 + (B + 4) 2^-23`` covers
  ``(1 - gamma_B)^-1 (1 - u)^-1`` with room.

Other witness dtypes (bf16, fp32: products could underflow) take :func:`witcert.logit_bound`.
"""
import torch

from witcert.core.norms import norms_upper_fp64
from witcert.fastpath.budgeted_pass import fp32_up
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness import _resolve_scale, check_head_pairing, check_logit_bound_inputs, logit_bound

_NORM_FLOOR = 2.0**-100  # query band norms are lifted to this: no product with fp16 underflows, no 0 * inf
_ROW_BLOCK = 4  # query rows padded (zeros) to a multiple of this: the CPU sgemm measured 2x faster for 4 rows than 3


def radius_kernel(q_norms: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 ``c`` (..., Q, S) from scaled fp32 query band norms (..., Q, B) (all ``>= 2^-100``) and an fp16
    witness (..., S, B); every result above the exact ``sum_b q_b w_b``. No host synchronisation.

    A norm beyond fp32 (an fp64 query above ``3.4e38``) is ``inf``: its row is ``inf`` (the trivial bound;
    the exact value may be 0 where the witness is, never above), never the NaN of ``inf * 0``.
    """
    finite, overflow = split_overflow(q_norms)
    lifted = finite * (1.0 + (w.shape[-1] + 4) * 2.0**-23)  # the lift on the (Q, B) norms, not the (Q, S) result
    rows = lifted.shape[-2]
    lifted = torch.cat([lifted, lifted.new_zeros(*lifted.shape[:-2], -rows % _ROW_BLOCK, lifted.shape[-1])], dim=-2)
    return (lifted @ w.float().transpose(-1, -2))[..., :rows, :] + overflow  # each row's dot is its own: padding changes none


def split_overflow(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., Q, B) with ``inf`` entries zeroed, and (..., Q, 1) ``inf`` on rows that had one, else 0: adding it
    makes such a row ``inf`` (``x + 0 = x`` exactly) with no elementwise NaN test in the token loop (compiled,
    ``isnan`` there measured 4x the cost of the pass it guarded)."""
    infinite = torch.isinf(x)
    overflow = torch.where(infinite.any(-1, keepdim=True), float("inf"), 0.0).to(x.dtype)
    return torch.where(infinite, 0.0, x), overflow


def probe() -> tuple[torch.Tensor, ...]:
    """Arguments that compile :func:`radius_kernel` (sizes >= 2)."""
    return torch.ones(1, 2, 2), torch.ones(1, 2, 2, dtype=torch.float16)


def fast_logit_bound(q: torch.Tensor, w: torch.Tensor, layout: BandLayout, sm_scale: float | None = None, *,
                     checked: bool = False) -> torch.Tensor:
    """:func:`witcert.logit_bound`'s bound (same arguments, checks, shapes and head pairing), in fp32 from one
    compiled pass (``WITCERT_COMPILE=1``) where the witness is fp16; never below the exact value.

    ``checked``: the inputs are already valid (finite ``q``, a witness ``>= 0``): skip the checks and
    their pass over the witness (the shapes are still checked).
    """
    if w.dtype != torch.float16:
        return logit_bound(q, w, layout, sm_scale)
    if checked:
        hkv, _ = check_head_pairing(q.shape, w.shape, "q", "w")
    else:
        hkv, _ = check_logit_bound_inputs(q, w, layout)
    folded = scaled_query_norms(q, layout, _resolve_scale(sm_scale, layout.head_dim), hkv)
    c = radius_kernel(folded, w)  # one BLAS call and an epilogue: compiled alone it measured slower (the per-layer pass compiles it inside its graph)
    return c.reshape(*q.shape[:-1], w.shape[-2])


def scaled_query_norms(q: torch.Tensor, layout: BandLayout, scale: float, hkv: int) -> torch.Tensor:
    """fp32 ``>= scale ||q_b||``, at least ``2^-100`` (..., Hkv, G Tq, B): each kv head's query rows folded."""
    lead, hq, tq = q.shape[:-3], q.shape[-3], q.shape[-2]
    folded = q.to(torch.float64).reshape(*lead, hkv, hq // hkv * tq, layout.head_dim)
    return scaled_norms_of(folded, layout.index, scale)


def scaled_norms_of(q64: torch.Tensor, index: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`scaled_query_norms` of fp64 rows (..., d), bands gathered by ``index`` -> (..., B) (no host synchronisation)."""
    return torch.clamp(fp32_up(norms_upper_fp64(q64[..., index.to(q64.device)]) * scale), min=_NORM_FLOOR)

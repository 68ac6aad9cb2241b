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
  ``(1 - gamma_B)^-1 (1 - u)^-1`` with room;
* an fp32 matmul that torch may run on TF32 or bf16 inputs (a setting
  :func:`~witcert.core.matmul_precision.reduced_fp32_matmul` names) is lifted once more, by
  ``REDUCED_PRECISION_LIFT`` (the input rounding, relative, of non-negative products).

Other witness dtypes (bf16, fp32: products could underflow) take :func:`witcert.logit_bound`.
"""
import torch

from witcert.core.matmul_precision import REDUCED_PRECISION_LIFT, reduced_fp32_matmul
from witcert.core.norms import norms_upper_fp64
from witcert.fastpath.budgeted_pass import fp32_up, lean_pass
from witcert.fastpath.compiled import pick
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness import _resolve_scale, band_major, check_head_pairing, check_logit_bound_inputs, logit_bound

_NORM_FLOOR = 2.0**-100  # query band norms are lifted to this: no product with fp16 underflows, no 0 * inf
_ROW_BLOCK = 4  # query rows padded (zeros) to a multiple of this: the CPU sgemm measured 2x faster for 4 rows than 3


def radius_kernel(q_norms: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 ``c`` (..., Q, S) from scaled fp32 query band norms (..., Q, B) (all ``>= 2^-100``) and an fp16
    witness (..., S, B); every result above the exact ``sum_b q_b w_b``. No host synchronisation.

    A norm beyond fp32 (an fp64 query above ``3.4e38``) is ``inf``: its row is ``inf`` (the trivial bound;
    the exact value may be 0 where the witness is, never above), never the NaN of ``inf * 0``.
    Eager, the dot is one BLAS call; inside a compiled graph it is a loop over the bands, each read
    contiguously from a band-major witness (:func:`~witcert.tier_a.witness.band_major`): both are a
    ``B``-term dot of non-negative fp32 products in some order, the case the lift covers.
    """
    return band_dot(*lifted_norms(q_norms, w.shape[-1]), w)


def lifted_norms(q_norms: torch.Tensor, bands: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (..., Q, B) half of :func:`radius_kernel`: ``inf`` entries split off (:func:`split_overflow`) and the
    lift applied. Formed before a compiled :func:`band_dot`, not in it: inlined into its token loop, this
    chain of scalar operations was recomputed per band and per 32 tokens (measured 2.5x the dot)."""
    finite, overflow = split_overflow(q_norms, _NORM_FLOOR)
    return finite * (1.0 + (bands + 4) * 2.0**-23), overflow


def band_dot(lifted: torch.Tensor, overflow: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`radius_kernel` from :func:`lifted_norms`' results: the dot, plus the per-row ``inf`` or 0."""
    dot = _band_loop if torch.compiler.is_compiling() else _blas_dot
    return dot(lifted, w) + overflow


def _band_loop(norms: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_b norms[q, b] w[t, b]`` elementwise over ``t``, each band read contiguously (band-major), the ``B``
    products added pairwise: independent vector operations per block of tokens. (A ``sum`` over the band
    axis compiles to one accumulator chain, 16 or 32 lanes wide as Inductor's tiling falls: measured
    0.67 or 0.37 ms for 3 x 3 rows at S = 32k; pairwise 0.34 ms either way, the BLAS call 0.61 ms.)"""
    bands = w.transpose(-1, -2)
    terms = [norms[..., b:b + 1] * bands[..., None, b, :].float() for b in range(w.shape[-1])]
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


def _blas_dot(norms: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same dot as one sgemm, rows padded with zeros to a multiple of 4 (each row's dot is its own); lifted by
    ``REDUCED_PRECISION_LIFT`` when torch may round the sgemm's inputs to TF32 or bf16."""
    rows = norms.shape[-2]
    norms = torch.cat([norms, norms.new_zeros(*norms.shape[:-2], -rows % _ROW_BLOCK, norms.shape[-1])], dim=-2)
    dot = (norms @ w.float().transpose(-1, -2))[..., :rows, :]
    return dot * REDUCED_PRECISION_LIFT if reduced_fp32_matmul() else dot


def split_overflow(x: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., Q, B) with ``inf`` entries replaced by ``floor``, and (..., Q, 1) ``inf`` on rows that had one, else
    0: adding it makes such a row ``inf`` (``x + 0 = x`` exactly) with no elementwise NaN test in the token loop
    (compiled, ``isnan`` there measured 4x the cost of the pass it guarded).

    ``floor`` is the positive value the caller lifts every entry to: the replaced entry is never 0, so its
    product with an infinite witness (or scale) entry is ``inf``, not the NaN of ``0 * inf``, and the row's sum
    ``inf + inf`` stays ``inf`` (issue 28: a zeroed entry gave ``c = [nan, inf, inf]``, a NaN meter, risk 0).
    """
    infinite = torch.isinf(x)
    overflow = torch.where(infinite.any(-1, keepdim=True), float("inf"), 0.0).to(x.dtype)
    return torch.where(infinite, floor, x), overflow


def probe() -> tuple[torch.Tensor, ...]:
    """Arguments that compile :func:`band_dot` (sizes >= 2; the witness band-major, as stored)."""
    return torch.ones(1, 2, 2), torch.zeros(1, 2, 1), band_major(torch.ones(1, 3, 2, dtype=torch.float16))


def tier_a_pass(scores: torch.Tensor, lifted: torch.Tensor, overflow: torch.Tensor, w: torch.Tensor, rho,
                v_norm) -> tuple[torch.Tensor, ...]:
    """:func:`~witcert.fastpath.budgeted_pass.lean_pass` on flat (rows, S) ``scores`` with the radius of
    :func:`band_dot` formed inside the same pass (:func:`lifted_norms` (..., Hkv, Q, B) and ``w`` (..., Hkv, S, B)
    with ``rows = ... Hkv Q``): one compiled graph, ``c`` never stored."""
    return lean_pass(scores, band_dot(lifted, overflow, w).reshape(scores.shape), rho, v_norm)


def tier_a_probe() -> tuple:
    """Arguments that compile :func:`tier_a_pass` (two rows of three tokens, no value statistics)."""
    return torch.zeros(2, 3), *probe(), None, None


def fast_logit_bound(q: torch.Tensor, w: torch.Tensor, layout: BandLayout, sm_scale: float | None = None, *,
                     checked: bool = False) -> torch.Tensor:
    """:func:`witcert.logit_bound`'s bound (same arguments, checks, shapes and head pairing), in fp32 from one
    compiled pass (``WITCERT_COMPILE=1``) where the witness is fp16; never below the exact value.

    ``checked``: the inputs are already valid (finite ``q``, a witness ``>= 0``): skip the checks and
    their pass over the witness (the shapes are still checked).
    """
    if w.dtype != torch.float16:
        return logit_bound(q, w, layout, sm_scale)
    c = pick(band_dot, probe)(*checked_query_norms(q, w, layout, sm_scale, checked=checked), w)
    return c.reshape(*q.shape[:-1], w.shape[-2])


def checked_query_norms(q: torch.Tensor, w: torch.Tensor, layout: BandLayout, sm_scale: float | None, *,
                        checked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lifted_norms` of ``q``'s scaled band norms (..., Hkv, G Tq, B), after :func:`witcert.logit_bound`'s
    checks of ``q`` and ``w`` (only the shapes and head pairing when ``checked``)."""
    if checked:
        hkv, _ = check_head_pairing(q.shape, w.shape, "q", "w")
    else:
        hkv, _ = check_logit_bound_inputs(q, w, layout)
    folded = scaled_query_norms(q, layout, _resolve_scale(sm_scale, layout.head_dim), hkv)
    return lifted_norms(folded, w.shape[-1])


def scaled_query_norms(q: torch.Tensor, layout: BandLayout, scale: float, hkv: int) -> torch.Tensor:
    """fp32 ``>= scale ||q_b||``, at least ``2^-100`` (..., Hkv, G Tq, B): each kv head's query rows folded."""
    lead, hq, tq = q.shape[:-3], q.shape[-3], q.shape[-2]
    folded = q.to(torch.float64).reshape(*lead, hkv, hq // hkv * tq, layout.head_dim)
    return scaled_norms_of(folded, layout, scale)


def scaled_norms_of(q64: torch.Tensor, layout: BandLayout, scale: float) -> torch.Tensor:
    """:func:`scaled_query_norms` of fp64 rows (..., d), bands as ``layout`` splits them -> (..., B) (no host
    synchronisation)."""
    return torch.clamp(fp32_up(norms_upper_fp64(layout.split(q64)) * scale), min=_NORM_FLOOR)

"""One metering pass per layer and step over every metered query row of the batch (T2, DB, T1, P1, MN, CS, MS; SR, FP).

The inputs are what a running sequence's metering state keeps (:mod:`.sequence_state`): its keys as the meter
reads them (fp32, the stored values widened exactly), their band witnesses (fp16, rounded up, band-major), an
upper bound on each key's norm and, for the dithered cache, its Tier B scales. For the rows ``R`` of a step
(each a sequence), ``M`` query rows per kv head (its ``G`` query heads times the step's query tokens), ``S``
tokens:

1. ``q . k^_t`` as one fp32 batched GEMM (BLAS, any order) over the state's rows (views, no gather);
2. :func:`decode_pass` (one compiled graph with the GEMM where ``torch.compile`` works, :mod:`witcert.fastpath.compiled`):
   the scores ``s = fl32(fl32(scale) logits)``, the radius ``c = min(Tier A band dot (T2), Tier B deterministic
   branch (DB)) + the logits' rounding`` (:func:`~witcert.tier_a.score_rounding.score_rounding_linear` with the
   coefficients of an fp32 GEMM, ``SR``: ``rate ||k^_t|| + floor``, one rate and floor per query row, added in
   fp32 and lifted), so the exact logits lie in the box ``|l - s| <= c``, and the
   fused meter and risk (:func:`~witcert.fastpath.budgeted_pass.lean_pass`, ``FP``) of that box. The real
   compressed logits lie in the box of the rounding alone, where attention is within ``tanh(max slack / 2)``
   of ``softmax(s)`` (``MN``); the reported meter adds that (about ``1e-5``), so by the triangle inequality it
   bounds the TV between attention over the exact keys and over the stored keys, both in exact arithmetic;
3. :func:`exact_cells`: the zero-witness short cut. A (row, kv head) whose every witness is 0 stores its keys
   exactly (``c`` is the score rounding alone); the meter of a constant radius ``c`` is at most ``tanh(c/2) <=
   c/2`` (``MN``) whatever the scores, so such cells need no logits: ``c`` is the fp64 reference's score
   rounding (:func:`~witcert.tier_a.score_rounding.score_rounding_linear` with fp64 coefficients) at the
   sequence's largest key norm.

Visibility and weights come from the length mask and the finite scores, never from a rounded probability:
the pass's mass ``e^{s - max s}`` may underflow to 0 for a token far below the maximum, and its budget carries
an absolute slack per token for exactly that (``budgeted_pass``: a token whose exact weight is large while its
compressed weight underflows has ``c`` beyond ``C_CAP`` and the row reports 1).
"""
import functools
import math

import torch

from witcert.core import rounding
from witcert.core.matmul_precision import reduced_fp32_matmul
from witcert.fastpath.budgeted_pass import _expm1_up, fp32_up, lean_pass
from witcert.fastpath.compiled import pick
from witcert.fastpath.radius import radius_kernel, scaled_norms_of
from witcert.fastpath.tier_b_radius import group_sums, tier_b_kernel
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.score_rounding import score_rounding_coefficients, score_rounding_linear

_COEFFICIENTS = 8  # a_m, a_l, a_0, b_m, b_0, out_m, u_out, h_out
_LIFT = 1.0 + 2.0**-20  # covers four fp32 roundings of a sum of non-negative terms
_FP32_ABS = 2.0**-120  # above the absolute error of three fp32 operations that underflow (2^-149 each)


@functools.lru_cache(maxsize=64)  # one per (head dim, scale): a model asks for one, every step
def pass_constants(head_dim: int, scale: float) -> torch.Tensor:
    """fp64 ``[scale, fp32-GEMM coefficients (8), fp64 coefficients (8)]`` (:func:`score_rounding_coefficients`):
    the scores of :func:`decode_pass` (fp32 inputs, fp32 accumulation in any order, scaled by ``fl32(scale)``
    in fp32: the final cast's term covers that rounding of the scale) and the fp64 reference of the short cut.
    Shared and never written."""
    gemm = score_rounding_coefficients(head_dim, scale, torch.float32, torch.float32, torch.float32)
    reference = score_rounding_coefficients(head_dim, scale, torch.float64, torch.float64, torch.float64)
    return torch.tensor([scale, *gemm[:6], *gemm[6], *reference[:6], *reference[6]], dtype=torch.float64)


def _coefficients(constants: torch.Tensor, which: int) -> tuple:
    """The ``which``-th coefficient set of :func:`pass_constants` in :func:`score_rounding_coefficients`' order."""
    start = 1 + which * _COEFFICIENTS
    a_m, a_l, a_0, b_m, b_0, out_m, u_out, h_out = constants[start:start + _COEFFICIENTS].unbind()
    return a_m, a_l, a_0, b_m, b_0, out_m, (u_out, h_out)


def logits_of(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q . k^_t`` (R, Hkv, M, S) fp32 from ``q`` (R, Hkv, M, d) and ``keys`` (R, Hkv, S, d) fp32 (a strided view
    of the state is read in place): one BLAS call. Refused where torch may round an fp32 matmul's inputs to
    TF32 or bf16 (the rounding bound assumes fp32 products)."""
    reduced = reduced_fp32_matmul()
    if reduced:
        raise RuntimeError(f"WitCert vLLM plugin: {reduced} lets an fp32 matmul round its inputs below fp32; the "
                           "meter's logits need fp32 products (set torch.set_float32_matmul_precision('highest'))")
    return torch.matmul(q, keys.transpose(-1, -2))


def norms_up(x: torch.Tensor) -> torch.Tensor:
    """fp64 ``>= ||x||`` over the last axis of fp32 (or narrower) ``x`` (..., d) -> (...): the squares are exact in
    fp64 and never overflow or underflow there; a ``d``-term fp64 sum (``d < 2^20``) and a square root err by
    less than ``2^-32`` relative, which the factor covers."""
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64) * (1.0 + 2.0**-30)


def rounding_terms(q_norm: torch.Tensor, norm_max: torch.Tensor, constants: torch.Tensor, head_dim: int,
                   which: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rate, floor)`` (R, Hkv, M) fp64 of :func:`score_rounding_linear` for the ``which``-th coefficient set:
    the logit of a token with key norm ``<= n`` is within ``rate n + floor`` of its exact value."""
    return score_rounding_linear(q_norm, norm_max.unsqueeze(-1), head_dim, constants[0],
                                 _coefficients(constants, which))


def decode_pass(q: torch.Tensor, keys: torch.Tensor, witness: torch.Tensor, key_norms: torch.Tensor,
                lengths: torch.Tensor, lossy: torch.Tensor, norm_max: torch.Tensor, constants: torch.Tensor,
                layout: BandLayout, scales: torch.Tensor | None = None,
                own: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(meter, risk)`` (R, Hkv, M) fp64 of every query row: what ``WITCERT_VLLM_COMPILE=1`` compiles (the logits'
    GEMM is BLAS inside the graph).

    Parameters
    ----------
    q : Tensor (R, Hkv, M, d) fp32
        The query rows, each kv head's ``M`` rows folded (query head ``h`` reads kv head ``h // G``).
    keys : Tensor (R, Hkv, S, d) fp32
        The stored keys as the meter keeps them (a strided view of the state is read in place).
    witness : Tensor (R, Hkv, B, S) fp16
        Band witnesses, band-major (``w[r, h, b, t] >= ||(k^_t - k_t)_b||``); ``inf`` allowed.
    key_norms : Tensor (R, Hkv, S) fp64
        ``>= ||k^_t||``.
    lengths : LongTensor (R, 1, M)
        Tokens each query row attends (``>= 1``); the rest of its ``S`` are masked.
    lossy : BoolTensor (R, Hkv)
        Some witness of the (row, kv head) is above 0; elsewhere the short cut (:func:`exact_cells`) is reported.
    norm_max : Tensor (R, Hkv) fp64
        ``>=`` every key norm of the row.
    constants : Tensor
        :func:`pass_constants`.
    layout : BandLayout
    scales : Tensor (R, Hkv, n_g, S) fp16, optional
        The dithered cache's per-group scales (``inf`` where a token has no valid Tier B data): the radius
        becomes the per-token minimum of Tier A and the deterministic branch ``DB``.
    own : tuple, optional
        ``(keys (R, Hkv, M, d) fp32, witness (R, Hkv, M, B) fp16, norms (R, Hkv, M) fp64)``: each query row's own
        token (its last, ``lengths - 1``) as the cache held it when the row was computed (a deferred row's own
        token has been stored compressed since); it replaces the state's entry for that row only.
    """
    s = keys.shape[-2]
    positions = torch.arange(s, device=q.device)
    keep = positions < lengths.unsqueeze(-1)  # (R, 1, M, S)
    logits = torch.matmul(q, keys.transpose(-1, -2))  # (R, Hkv, M, S) fp32, BLAS
    q64 = q.double()
    norms = scaled_norms_of(q64, layout, constants[0])  # (R, Hkv, M, B) fp32
    radius = radius_kernel(norms, witness.transpose(-1, -2))  # fp32 >= T2's c
    if scales is not None:
        a, _ = group_sums(q64, scales.shape[-2], constants[0], 1.0)
        radius = torch.minimum(radius, tier_b_kernel(a, a, scales, True))  # DB: valid for every query
    key_norms = key_norms.unsqueeze(-2)  # (R, Hkv, 1, S)
    if own is not None:
        own_keys, own_witness, own_norms = own
        mine = positions == (lengths - 1).unsqueeze(-1)  # (R, 1, M, S)
        logits = torch.where(mine, (q * own_keys).sum(-1, keepdim=True), logits)
        own_radius = radius_kernel(norms.unsqueeze(-2), own_witness.unsqueeze(-2)).squeeze(-2)  # (R, Hkv, M, 1)
        radius = torch.where(mine, own_radius, radius)
        key_norms = torch.where(mine, own_norms.unsqueeze(-1), key_norms)
    scores = (logits * constants[0].float()).masked_fill(~keep, float("-inf"))  # fp32: the coefficients' case
    rate, floor = rounding_terms(norms_up(q), norm_max, constants, q.shape[-1], 0)
    # c = radius + rate ||k^_t|| + floor in fp32: three roundings of non-negative terms (floor lifted above the
    # absolute error of an fp32 underflow), then the lift covers them: (1 - 2^-24)^-4 < 1 + 2^-20
    rate32, floor32 = fp32_up(rate).unsqueeze(-1), (fp32_up(floor) + _FP32_ABS).unsqueeze(-1)
    c = (radius + rate32 * fp32_up(key_norms) + floor32) * _LIFT
    meter, risk, _, _ = lean_pass(scores.reshape(-1, s), torch.where(keep, c, 0.0).reshape(-1, s), None, None)
    # the scores are the GEMM's, not the real compressed logits: those lie within the rounding of the scores, so
    # attention over them is within tanh(max slack / 2) <= max slack / 2 (MN) of softmax(scores)
    drift = rounding.next_up((rate * norm_max.unsqueeze(-1) + floor) * (0.5 * (1 + 2.0**-40)))
    meter = torch.clamp(rounding.add_up(meter.view(drift.shape), drift), max=1.0)
    exact_meter, exact_risk = exact_cells(q, norm_max, constants)
    chosen = lossy.unsqueeze(-1)
    return torch.where(chosen, meter, exact_meter), torch.where(chosen, risk.view(drift.shape), exact_risk)


def cell_terms(q: torch.Tensor, keys: torch.Tensor, witness: torch.Tensor, key_norms: torch.Tensor,
               lengths: torch.Tensor, norm_max: torch.Tensor, layout: BandLayout, scale: float,
               scales: torch.Tensor | None = None, reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores and per-token radii :func:`decode_pass` meters, ``(scores, c)`` (R, Hkv, M, S) fp64 (``-inf`` and 0
    past each row's length), eager: for the gate's planner (which needs them per token) and the shadow.
    ``reference``: the fp64 reference's scores (an fp64 GEMM) and rounding terms instead of the pass's."""
    constants = pass_constants(q.shape[-1], float(scale))
    s = keys.shape[-2]
    keep = torch.arange(s) < lengths.unsqueeze(-1)
    if reference:
        scores = (q.double() @ keys.double().transpose(-1, -2)) * constants[0]
    else:
        scores = (logits_of(q, keys) * constants[0].float()).double()
    q64 = q.double()
    radius = radius_kernel(scaled_norms_of(q64, layout, constants[0]), witness.transpose(-1, -2))
    if scales is not None:
        a, _ = group_sums(q64, scales.shape[-2], constants[0], 1.0)
        radius = torch.minimum(radius, tier_b_kernel(a, a, scales, True))
    rate, floor = rounding_terms(norms_up(q), norm_max, constants, q.shape[-1], 1 if reference else 0)
    c = rounding.add_up(rounding.add_up(radius.double(), rate.unsqueeze(-1) * key_norms.double().unsqueeze(-2)),
                        floor.unsqueeze(-1))
    return scores.masked_fill(~keep, float("-inf")), torch.where(keep, rounding.next_up(c), 0.0)


def exact_cells(q: torch.Tensor, norm_max: torch.Tensor, constants: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(meter, risk)`` (R, Hkv, M) fp64 of query rows ``q`` (R, Hkv, M, d) over keys stored exactly (every witness
    0), ``norm_max`` (R, Hkv) fp64 ``>=`` every key's norm: the short cut of the module docstring (``MN``, ``T1``,
    ``SR``). ``c`` is one radius per row, the fp64 reference's rounding term at the largest key norm; the meter
    ``tanh(c/2) <= c/2`` and the risk ``(e^{2c} - 1)/2`` (T1 at ``A = e^c``) are rounded up."""
    rate, floor = rounding_terms(norms_up(q), norm_max, constants, q.shape[-1], 1)
    c = rounding.next_up(rate * norm_max.unsqueeze(-1) + floor)
    meter = torch.clamp(rounding.next_up(c * 0.5), max=1.0)
    risk = rounding.next_up(0.5 * _expm1_up(2.0 * c))
    return meter, risk


def meter_rows(q: torch.Tensor, keys: torch.Tensor, witness: torch.Tensor, key_norms: torch.Tensor,
               lengths: torch.Tensor, lossy: torch.Tensor, norm_max: torch.Tensor, layout: BandLayout,
               scale: float, scales: torch.Tensor | None = None, own: tuple | None = None,
               compiled: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The meter and risk (R, Hkv, M) fp64 of a step's query rows: :func:`decode_pass` (one graph, one call), or
    :func:`exact_cells` alone when no (row, kv head) is ``lossy`` (no logits at all). Arguments as
    :func:`decode_pass`; ``compiled``: the passes compiled (default ``WITCERT_COMPILE``)."""
    constants = pass_constants(q.shape[-1], float(scale))
    if q.shape[0] == 1:  # one row: padded to two (a copy of it), so no compiled graph is specialised to one row
        def two(x):
            return None if x is None else torch.cat([x, x])
        meter, risk = meter_rows(two(q), two(keys), two(witness), two(key_norms), two(lengths), two(lossy),
                                 two(norm_max), layout, scale, two(scales),
                                 None if own is None else tuple(two(x) for x in own), compiled)
        return meter[:1], risk[:1]
    if not bool(lossy.any()):
        return pick(exact_cells, _exact_probe, compiled)(q, norm_max, constants)
    reduced = reduced_fp32_matmul()
    if reduced:
        raise RuntimeError(f"WitCert vLLM plugin: {reduced} lets an fp32 matmul round its inputs below fp32; the "
                           "meter's logits need fp32 products (set torch.set_float32_matmul_precision('highest'))")
    run = pick(decode_pass, functools.partial(probe, layout, scales is not None), compiled)
    return run(q, keys, witness, key_norms, lengths, lossy, norm_max, constants, layout, scales, own)


def meter_pairs(wanted: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, witness: torch.Tensor,
                key_norms: torch.Tensor, lengths: torch.Tensor, lossy: torch.Tensor, norm_max: torch.Tensor,
                layout: BandLayout, scale: float, scales: torch.Tensor | None = None, own: tuple | None = None,
                compiled: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`meter_rows` of the (row, kv head) pairs ``wanted`` (R, Hkv) bool only, NaN at the others (a request
    audit picks a few cells: most pairs of a flush meter none). A pair's cells depend on that pair's inputs alone
    (nothing in the pass reduces across rows or kv heads), so they are the values :func:`meter_rows` gives over
    every pair; the wanted pairs are folded into rows of one kv head (a gathered copy of their keys)."""
    if bool(wanted.all()):
        return meter_rows(q, keys, witness, key_norms, lengths, lossy, norm_max, layout, scale, scales, own, compiled)
    meter = torch.full(q.shape[:3], math.nan, dtype=torch.float64)
    risk = torch.full_like(meter, math.nan)
    if not bool(wanted.any()):
        return meter, risk
    rows, heads = wanted.nonzero(as_tuple=True)

    def pair(x):  # (R, Hkv, ...) -> (P, 1, ...)
        return None if x is None else x[rows, heads].unsqueeze(1)

    m, r = meter_rows(pair(q), pair(keys), pair(witness), pair(key_norms), lengths[rows], pair(lossy),
                      pair(norm_max), layout, scale, pair(scales), None if own is None else tuple(map(pair, own)),
                      compiled)
    meter[rows, heads], risk[rows, heads] = m[:, 0], r[:, 0]
    return meter, risk


def meter_cells(wanted: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, witness: torch.Tensor,
                key_norms: torch.Tensor, lengths: torch.Tensor, lossy: torch.Tensor, norm_max: torch.Tensor,
                layout: BandLayout, scale: float, scales: torch.Tensor | None = None, own: tuple | None = None,
                compiled: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`meter_pairs` of the query rows ``wanted`` (R, Hkv, M) bool only, NaN at the others (a request audit
    picks a cell here and there: of a wanted pair's ``M`` query rows, most meter nothing). A query row's cells depend
    on its own query, length and own token and on its pair's keys, witnesses and norms alone (nothing in the pass
    reduces across query rows), so they are the values :func:`meter_rows` gives over every row: each wanted pair's
    wanted rows are gathered (padded to the most any pair wants, at least two, with a copy of its first: no graph
    specialised to one row), metered as rows of one kv head, and scattered back."""
    per_pair = wanted.sum(-1)  # (R, Hkv)
    width = max(int(per_pair.max()), 2)
    if width >= q.shape[2]:  # some pair wants every row: no gather
        meter, risk = meter_pairs(per_pair > 0, q, keys, witness, key_norms, lengths, lossy, norm_max, layout, scale,
                                  scales, own, compiled)
        return (meter, risk) if bool(wanted.all()) else (meter.masked_fill(~wanted, math.nan),
                                                        risk.masked_fill(~wanted, math.nan))
    meter = torch.full(q.shape[:3], math.nan, dtype=torch.float64)
    risk = torch.full_like(meter, math.nan)
    rows, heads = (per_pair > 0).nonzero(as_tuple=True)
    if not rows.numel():
        return meter, risk
    mask = wanted[rows, heads]  # (P, M)
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :width]  # wanted rows first, in order
    counts = per_pair[rows, heads].unsqueeze(1)
    m = torch.where(torch.arange(width) < counts, order, order[:, :1])  # (P, width): a short pair repeats its first

    def pair(x):  # (R, Hkv, ...) -> (P, 1, ...)
        return None if x is None else x[rows, heads].unsqueeze(1)

    def cells(x):  # (R, Hkv, M, ...) -> (P, 1, width, ...)
        x = x[rows, heads]
        return torch.take_along_dim(x, m.view(*m.shape, *[1] * (x.dim() - 2)), dim=1).unsqueeze(1)

    cell_lengths = torch.take_along_dim(lengths[rows, 0], m, dim=1).unsqueeze(1)  # (P, 1, width)
    got_m, got_r = meter_rows(cells(q), pair(keys), pair(witness), pair(key_norms), cell_lengths, pair(lossy),
                              pair(norm_max), layout, scale, pair(scales),
                              None if own is None else tuple(map(cells, own)), compiled)
    real = torch.arange(width) < counts  # (P, width): the padding's copies are not written back
    at = (rows.unsqueeze(1).expand_as(m)[real], heads.unsqueeze(1).expand_as(m)[real], m[real])
    meter[at], risk[at] = got_m[:, 0][real], got_r[:, 0][real]
    return meter, risk


_WARM: set = set()


def warm_up(layout: BandLayout, tier_b: bool, compiled: bool | None = None) -> None:
    """Compile every graph :func:`meter_rows` uses for ``layout`` now (with and without deferred rows' own tokens,
    the short cut; over every kv head and over :func:`meter_pairs`' one), so that no request waits for a
    compilation; once per process and layout."""
    key = (layout.head_dim, layout.bands, layout.rope, tier_b, compiled)
    if key in _WARM:
        return
    _WARM.add(key)
    args = list(probe(layout, tier_b))
    q, keys, witness, key_norms, lengths, lossy, norm_max, constants = args[:8]
    scale, scales = float(constants[0]), args[9]
    r, h, m, d = q.shape
    own = (torch.ones(r, h, m, d), torch.zeros(r, h, m, layout.bands, dtype=torch.float16),
           torch.ones(r, h, m, dtype=torch.float64))
    one_head = torch.zeros(r, h, dtype=torch.bool)
    one_head[:, 0] = True  # meter_pairs' shapes: pairs folded into rows of one kv head
    for wanted in (torch.ones(r, h, dtype=torch.bool), one_head):
        for mine in (None, own):
            meter_pairs(wanted, q, keys, witness.clone().fill_(1.0), key_norms, lengths, lossy, norm_max, layout,
                        scale, scales, mine, compiled)
        meter_pairs(wanted, q, keys, witness, key_norms, lengths, ~lossy, norm_max, layout, scale, scales, None,
                    compiled)


def _exact_probe() -> tuple:
    """Arguments that compile :func:`exact_cells` (two rows, two kv heads, three query rows, d = 64)."""
    return torch.ones(2, 2, 3, 64), torch.ones(2, 2, dtype=torch.float64), pass_constants(64, 0.125)


def probe(layout: BandLayout, tier_b: bool) -> tuple:
    """Arguments that compile :func:`decode_pass` for ``layout`` (two rows, two kv heads, three query rows, eight
    tokens; with Tier B scales when ``tier_b``)."""
    r, h, m, s, d = 2, 2, 3, 8, layout.head_dim
    scales = torch.ones(r, h, max(1, d // 32), s, dtype=torch.float16) if tier_b else None
    return (torch.ones(r, h, m, d), torch.ones(r, h, s, d), torch.zeros(r, h, layout.bands, s, dtype=torch.float16),
            torch.ones(r, h, s, dtype=torch.float64), torch.full((r, 1, m), s), torch.ones(r, h, dtype=torch.bool),
            torch.ones(r, h, dtype=torch.float64), pass_constants(d, 1.0 / math.sqrt(d)), layout, scales, None)

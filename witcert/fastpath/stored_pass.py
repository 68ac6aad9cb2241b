"""One pass per layer and step from what a compressed cache stores: logits, radius, the lean meter and the joint pass (T2, T1, FP).

:func:`witcert.tier_a.observation.observe_stored` with ``fused=True`` (the monitor's path) needs,
per call, the fp64 logits of the queries against the stored keys, the radius ``c`` (the fp32 band
dot of :mod:`witcert.fastpath.radius` plus the logits' own rounding,
:func:`~witcert.tier_a.score_rounding.score_rounding_from`), the fused meter, risk and value term
(:func:`~witcert.fastpath.budgeted_pass.lean_pass`), the output bound and the joint pass event. Each
piece is sound on its own; here they are one function, so that ``WITCERT_COMPILE=1`` makes them one
compiled graph (a decode step of a small model is dominated by the dispatch of many small
operations, not by arithmetic).

Why the arguments are tensors only. A compiled call's fixed cost grows with its Python-scalar
arguments (each float becomes a guarded symbolic input, boxed into a tensor on every call): the
scale, the rounding coefficients and the thresholds travel as one fp64 tensor
(:func:`pass_constants`, built once per layer geometry).

Why the logits come from a GEMM outside the graph. Inside a compiled graph a ``d``-term dot per
(row, token) is a multiply-and-sum with a horizontal reduction per entry; one BLAS GEMM before the
graph is far cheaper, and the logits' rounding bound needs no second dot: one bound per query row, from
Hoelder's ``||q||_inf max_t ||k^_t||_1`` for ``sum |q k^_t|``
(:func:`~witcert.tier_a.score_rounding.score_rounding_from` ``per_row=True``; about ``1e-14`` of the row's
largest logit, so the per-token form it replaces bought nothing but per-token fp64 arithmetic). Measured
interleaved on one thread of an Intel Xeon VM, 9 query rows on 3 kv heads, the two in-graph dots against the
one GEMM: 0.93 against 0.10 ms at S = 515, 7.2 against 1.1 ms at 4,096.
"""
import functools

import torch

from witcert.core import rounding
from witcert.core.values import output_bound_of
from witcert.fastpath.budgeted_pass import lean_pass
from witcert.fastpath.compiled import graph_input, pick
from witcert.fastpath.radius import radius_kernel, scaled_norms_of
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.score_rounding import score_rounding_coefficients, score_rounding_from
from witcert.tier_a.witness import band_major


@functools.lru_cache(maxsize=64)  # one per (head dim, scale, thresholds): a model asks for one, every step
def pass_constants(d: int, scale: float, tau_k: float, tau_v: float) -> torch.Tensor:
    """fp64 ``[scale, a_m, a_l, a_0, b_m, b_0, out_m, u_out, h_out, tau_k, tau_v]``: the exact softmax multiplier,
    :func:`~witcert.tier_a.score_rounding.score_rounding_coefficients` of fp64 logits and the joint pass's
    thresholds (each a Python float, so exact in fp64). Shared and never written (a CPU tensor; moved per call
    to another device)."""
    coefficients = score_rounding_coefficients(d, scale, torch.float64, torch.float64, torch.float64)
    return torch.tensor([scale, *coefficients[:6], *coefficients[6], tau_k, tau_v], dtype=torch.float64)


def stored_pass(q: torch.Tensor, k_hat: torch.Tensor, layout: BandLayout, witness: torch.Tensor,
                keep: torch.Tensor, rho: torch.Tensor, v_norm: torch.Tensor,
                constants: torch.Tensor, compiled: bool | None = None) -> tuple[torch.Tensor, ...]:
    """``(scores, c, meter, risk, value_term, v_norm_max, output_bound, pass_k, pass_v)`` of every folded query row.

    ``q`` (..., Hkv, Q, d) queries, each kv head's ``Q = G Tq`` rows folded, and ``k_hat`` (..., Hkv, S, d) the
    stored keys, both in any float dtype (widened to fp64, exactly); ``layout`` the witness's
    :class:`~witcert.tier_a.bands.BandLayout`; ``witness`` (..., Hkv, S, B) fp16; ``keep`` (..., Hkv, Q, S)
    bool, a live token per row; ``rho``, ``v_norm`` (..., Hkv, 1, S) value residual and value norms;
    ``constants`` :func:`pass_constants`; ``compiled``: :func:`pass_from_logits` compiled (default
    ``WITCERT_COMPILE``). Returns fp64 ``scores``/``c`` (..., Hkv, Q, S; ``-inf`` and 0 on masked tokens) and
    per-row results (..., Hkv, Q), the last two bool (``pass_K``: meter ``<= tau_k``; ``pass_V``: value term
    ``<= tau_v max ||v||``, rounded down).
    """
    logits = q.to(torch.float64) @ k_hat.to(torch.float64).transpose(-1, -2)  # one GEMM: each entry a d-term fp64 dot
    # one memory layout per argument (views of a growing cache, expanded masks, transposes: copied once), the
    # witness band-major: a compiled graph guards on its inputs' strides and would recompile on a new layout
    q, k_hat, keep, rho, v_norm = (graph_input(x) for x in (q, k_hat, keep, rho, v_norm))
    witness = graph_input(witness.transpose(-1, -2)).transpose(-1, -2)
    return pick(pass_from_logits, probe, compiled)(logits, q, k_hat, layout, witness, keep, rho, v_norm, constants)


def pass_from_logits(logits: torch.Tensor, q: torch.Tensor, k_hat: torch.Tensor, layout: BandLayout,
                     witness: torch.Tensor, keep: torch.Tensor, rho: torch.Tensor, v_norm: torch.Tensor,
                     constants: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`stored_pass` from the fp64 dots ``logits`` (..., Hkv, Q, S) of ``q`` and ``k_hat`` (any order, FMA
    or not: what the rounding bound assumes): what ``WITCERT_COMPILE=1`` compiles."""
    q64, k64 = q.to(torch.float64), k_hat.to(torch.float64)
    scale, tau_k, tau_v = constants[0], constants[9], constants[10]
    a_m, a_l, a_0, b_m, b_0, out_m, u_out, h_out = constants[1:9].unbind()
    scores = (logits * scale).masked_fill(~keep, float("-inf"))
    radius = radius_kernel(scaled_norms_of(q64, layout, scale), witness).double()
    slack = score_rounding_from(q64, k64, scale, (a_m, a_l, a_0, b_m, b_0, out_m, (u_out, h_out)), per_row=True)
    # 0 on masked tokens: p~ and p are both 0 there, so no bound needs their radius (a deferred call's row
    # holds the tokens written after it, masked; in-step rows hold none)
    c = torch.where(keep, rounding.add_up(radius, slack), 0.0)
    meter, risk, value_term, v_max = lean_pass(scores, c, rho, v_norm)  # rho, v_norm broadcast over the rows
    pass_k = meter <= tau_k  # fp64, where tau is exact
    pass_v = value_term <= rounding.mul_down(tau_v, v_max)
    return scores, c, meter, risk, value_term, v_max, output_bound_of(meter, value_term, v_max), pass_k, pass_v


def probe() -> tuple:
    """Arguments that compile :func:`pass_from_logits` as the monitor calls it for one request (B = 1, two kv heads
    of two rows, 8 tokens, d = 64 in the default 16 bands; fp32 queries, keys and value
    statistics, as an fp32 model's compressed cache holds them): the graph compiled up front rather than at the
    first metered call."""
    q, k = torch.ones(1, 2, 2, 64), torch.ones(1, 2, 8, 64)  # d = 64, S = 8
    return (torch.ones(1, 2, 2, 8, dtype=torch.float64), q, k, BandLayout(64, 16),
            band_major(torch.ones(1, 2, 8, 16, dtype=torch.float16)), torch.ones(1, 2, 2, 8, dtype=torch.bool),
            torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8), pass_constants(64, 0.5, 0.2, 0.05))

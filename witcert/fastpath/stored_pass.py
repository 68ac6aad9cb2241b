"""One pass per layer and step from what a compressed cache stores: logits, radius and the lean meter (T2, T1, FP).

:func:`witcert.tier_a.observation.observe_stored` with ``fused=True`` (the monitor's path) needs,
per call, the fp64 logits of the queries against the stored keys, the radius ``c`` (the fp32 band
dot of :mod:`witcert.fastpath.radius` plus the logits' own rounding,
:func:`~witcert.tier_a.score_rounding.score_rounding_from`) and the fused meter, risk and value term
(:func:`~witcert.fastpath.budgeted_pass.lean_pass`). Each piece is sound on its own; here they are
one function, so that ``WITCERT_COMPILE=1`` makes them one compiled graph (a decode step of a small
model is dominated by the dispatch of many small operations, not by arithmetic).
"""
import torch

from witcert.core import rounding
from witcert.core.values import output_bound_of
from witcert.fastpath.budgeted_pass import lean_pass
from witcert.fastpath.radius import radius_kernel, scaled_norms_of
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.score_rounding import score_rounding_from
from witcert.tier_a.witness import band_major


def stored_pass(q64: torch.Tensor, k_hat64: torch.Tensor, layout: BandLayout, witness: torch.Tensor,
                keep: torch.Tensor, rho: torch.Tensor, v_norm: torch.Tensor, scale: float,
                coefficients: tuple) -> tuple[torch.Tensor, ...]:
    """``(scores, c, meter, risk, value_term, v_norm_max, output_bound)`` of every folded query row.

    ``q64`` (..., Hkv, Q, d) fp64 queries, each kv head's ``Q = G Tq`` rows folded; ``k_hat64``
    (..., Hkv, S, d) fp64 stored keys; ``layout`` the witness's :class:`~witcert.tier_a.bands.BandLayout`;
    ``witness`` (..., Hkv, S, B) fp16; ``keep`` (..., Hkv, Q, S) bool, a live token per row;
    ``rho``, ``v_norm`` (..., Hkv, 1, S) value residual and value norms; ``scale`` the exact softmax
    multiplier; ``coefficients`` those of
    :func:`~witcert.tier_a.score_rounding.score_rounding_coefficients` for fp64 logits. Returns fp64
    ``scores``/``c`` (..., Hkv, Q, S) and per-row results (..., Hkv, Q).
    """
    scores = ((q64 @ k_hat64.transpose(-1, -2)) * scale).masked_fill(~keep, float("-inf"))
    radius = radius_kernel(scaled_norms_of(q64, layout, scale), witness).double()
    c = rounding.add_up(radius, score_rounding_from(q64, k_hat64, scale, coefficients))
    meter, risk, value_term, v_max = lean_pass(scores, c, rho, v_norm)  # rho, v_norm broadcast over the rows
    return scores, c, meter, risk, value_term, v_max, output_bound_of(meter, value_term, v_max)


def probe() -> tuple:
    """Arguments that compile :func:`stored_pass` (sizes >= 2: two kv heads of two rows, 8 tokens, d = 8, B = 2)."""
    q64, k64 = torch.ones(2, 2, 8, dtype=torch.float64), torch.ones(2, 8, 8, dtype=torch.float64)  # d = 8, S = 8
    return (q64, k64, BandLayout(8, 2), band_major(torch.ones(2, 8, 2, dtype=torch.float16)),
            torch.ones(2, 2, 8, dtype=torch.bool), torch.ones(2, 1, 8, dtype=torch.float64),
            torch.ones(2, 1, 8, dtype=torch.float64), 0.5, (1e-16,) * 5 + (1.0, (1e-16, 1e-300)))

"""A cheap lower bound on ``witcert.meter``: lets a repair loop skip meters that cannot come out ``<= tau``.

The gate's repair loops (:class:`~witcert.gate.policy.Gate`, :func:`witcert.spot.gate.spot_gated`) page a block,
then recompute the meter of every open cell to see whether it is ``<= tau`` yet. On a cache whose witness
saturates (4-bit and 2-bit keys) the meter stays far above ``tau`` for most rounds, and each recomputation is a
few hundred small tensor operations per call. :func:`meter_floor` is a few dozen, and where it is above ``tau`` the
meter is too, so the loop skips the meter and decides exactly as it would have.

Why it is below the meter. ``witcert.meter(s, c)`` is an upper bound on ``TV(softmax(s - eps), softmax(s))`` for
*every* ``|eps| <= c`` (``T1``, ``P1``, ``MN``, ``CS``, ``MS``). The floor is that TV at particular perturbations:
``eps = -c'`` on the ``k`` tokens of largest ``c'`` and ``+c'`` on the rest, with ``c' = min(c, 30)`` (inside the
box), for every ``k``. With ``p = softmax(s)``, ``A`` those ``k`` tokens and ``q`` the perturbed distribution,
``q(A) = X / (X + Y)`` with ``X = sum_A p e^{c'}`` and ``Y = sum_{not A} p e^{-c'}``, and ``TV(q, p) >= q(A) - p(A)``.
The floor is the largest of these over ``k``, less a margin for the rounding of its fp64 evaluation. Every term is
a sum, product or ratio of non-negative values (the suffix sums ``Y`` are summed from the end, never differences):
``p_t`` is within ``S + 760`` units ``u = 2^-53`` of its value relatively (the rounded ``s_t - max s``, at most 745
in size where ``e^x`` is not 0, moves ``e^x`` by ``745 u``; ``exp`` within 4 units; the sum, the division), each
prefix or suffix sum within ``2S + 770``, so ``q(A)`` and ``p(A)``, both in ``[0, 1]``, are within ``4S + 1550`` and
``2S + 760`` units of their exact values, inside the margin ``(8S + 4096) u``; an underflowed ``p_t`` (below
``2^-1074``) moves either by less than ``S e^30 2^-1074 < S 2^-1000``. Where the floor is above ``tau``, the meter,
at least the exact TV at that perturbation, is too (rounded up, it stays so).
For a constant radius the best ``k`` gives ``tanh(c/2)``, the sharpest any bound of ``c`` alone can be.

What a floor above the meter would cost: never a reported bound below the truth. A loop that takes "not yet"
pages one more block (the meter of the cell it finally reports is computed, or the spot bound that stopped it is
reported, which is above the TV with its probability), so the floor decides how much work a gate does, not
what it states.
"""
from __future__ import annotations

import torch

CAP = 30.0  # |eps| <= min(c, CAP) is inside the box; e^{+-30} keeps every sum finite in fp64
_UNIT = 2.0**-53


def meter_floor(scores: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp64 (...): at most ``witcert.meter(scores, c)`` for scores (..., S) and bounds ``c`` broadcastable to them,
    as the meter takes them (``-inf`` masks a token). A row the meter refuses (NaN or ``+inf`` scores, every token
    masked, a NaN or negative ``c``) gets NaN: no comparison with ``tau`` holds, so a caller computes the meter, which
    raises."""
    s = scores.double()
    c = torch.broadcast_to(c, s.shape).double()
    n_tokens = s.shape[-1]
    visible = s > -torch.inf
    # a NaN or negative c (the meter refuses both) makes its row NaN: never "surely over", so the meter is asked
    radius = torch.where(c >= 0, torch.where(visible, torch.clamp(c, max=CAP), 0.0), torch.nan)
    top = s.amax(-1, keepdim=True)
    weight = torch.where(visible, torch.exp(s - top), 0.0)
    p = weight / weight.sum(-1, keepdim=True)  # (..., S); NaN where the meter raises
    order = radius.argsort(dim=-1, descending=True, stable=True)
    p, radius = p.gather(-1, order), radius.gather(-1, order)
    raised = (p * torch.exp(radius)).cumsum(-1)  # X of the k largest radii, k = 1..S
    lowered = (p * torch.exp(-radius)).flip(-1).cumsum(-1).flip(-1)  # sum from token k on (from the end)
    rest = torch.cat([lowered[..., 1:], torch.zeros_like(lowered[..., :1])], dim=-1)  # Y: after the k largest
    gap = raised / (raised + rest) - p.cumsum(-1)
    margin = (8 * n_tokens + 4096) * _UNIT + n_tokens * 2.0**-1000  # the module docstring's rounding account
    return gap.amax(-1) - margin


def surely_over(scores: torch.Tensor, c: torch.Tensor, tau: float) -> torch.Tensor:
    """bool (...): rows whose meter is certainly above ``tau`` (:func:`meter_floor` above it, decided in fp64)."""
    return meter_floor(scores, c) > tau

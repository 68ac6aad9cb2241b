"""The one-sided spot check of one cell (registry SCO with SCB; spec ``witcert.spec.spot_check.bound_spot_one_sided``).

``TV(p, p~) = E_p~ (1 - W/Z)^+ <= E_p~ (1 - W/Z_U)^+`` for every ``Z_U >= Z``
(``WitCert.tv_le_spot_one_sided``; ``W_t = e^{-eps_t}``, ``Z = E_p~ W``). Only the upper side of
``Z`` and of one nonnegative mean are estimated, so the whole failure budget goes to two one-sided
statements instead of three two-sided ones:

1. exact set ``E``: the ``keys * exact_share`` tokens of largest ``p~_t (e^{c_t} - 1)``, read exactly;
2. ``Z`` stage: draws ``~ p~ u`` on the rest (``u = e^c - 1``), ``Y = (W - 1) / u`` in [-1, 1]
   (``WitCert.exp_neg_sub_one_mem``); the betting bound on ``(1 + Y) / 2`` at ``z_share * delta``
   gives ``Z_U = z_known + G (2 U - 1)``, kept inside ``[A-, A] = [E_p~ e^{-c}, E_p~ e^c]``, where
   ``Z`` lies;
3. one-sided stage: every token read so far is known exactly; on the others, draws
   ``~ p~ h`` with ``h = (1 - e^{-c} / Z_U)^+`` and ``X = (1 - W / Z_U)^+ / h`` in [0, 1]
   (``WitCert.spot_one_sided_term_le``); the betting bound ``U'`` at ``(1 - z_share) delta``;
4. bound ``= sum_known p~ (1 - W / Z_U)^+ + H U'``, ``H = sum p~ h`` over the others.

On ``Z <= Z_U`` (probability ``>= 1 - z_share delta``) step 4 bounds TV unless, conditionally on
stage 2 (which fixes the known set and ``h``), ``E X > U'`` (probability ``<= (1 - z_share) delta``):
``>= 1 - delta`` in all. Each stage draws with replacement until it has read its share of new
distinct keys, or ``MAX_DRAWS_PER_KEY`` times as many draws: a stopping time, valid for the betting
bound by Ville's inequality with the planned count in the bets (:mod:`witcert.spot.confidence`).
"""
import torch

from witcert.spot.cell import (CellWeights, ExactRatios, Reader, SpotCheck, inflated, prepare_cell, read_whole, result,
                               sampling_weights, unit_ratio, z_resolved)
from witcert.spot.confidence import ONE_SIDED_CAP, betting_upper

EXACT_SHARE = 3 / 8
"""Share of the key budget read deterministically (the heaviest witness contributions)."""
Z_KEYS_SHARE = 0.85
"""Share of the remaining keys spent on the upper bound of ``Z``; the one-sided stage reads the rest.

The ``Z`` stage is limited by the range of its ratios, not their spread: ``c`` exceeds the logit
error by far where the witness saturates, so ``Z_U - Z`` is about ``G ln(1/delta) / n`` and most
keys go there (on SmolLM2 rtn-int4 cells: exact 3/8, then 0.85 of the rest, beat 1/2 and 1/2)."""
Z_SHARE_OF_DELTA = 0.8
"""Share of ``delta`` spent on the upper bound of ``Z`` (spec ``Z_SHARE_OF_DELTA``)."""
MAX_DRAWS_PER_KEY = 8
"""A stage stops after this many draws per planned key even if fewer distinct keys turned up."""
SMALL = 1e-6
"""Tokens whose sampling weight ``u`` (or ``h``) is below this are bounded by it, not sampled: their
ratios would carry the fp64 error of ``W`` divided by a tiny weight."""
ROUNDING = 1e-9
"""Rounding-up past the fp64 evaluation: ``Z_U`` relatively and per unit of sampled mass, the mean
per unit of ``H`` (ratios err by ~1e-16 / SMALL = 1e-10; a larger ``Z_U`` only loosens the bound)."""


def draw_until_new(weights: torch.Tensor, new_keys: int, known: torch.Tensor, generator) -> torch.Tensor:
    """I.i.d. draws ``~ weights`` until ``new_keys`` distinct tokens outside ``known`` turned up (or the draw cap).

    Drawing the cap at once and cutting at the stopping index is the sequential process itself.
    """
    if new_keys < 1 or not float(weights.sum()) > 0:
        return torch.empty(0, dtype=torch.int64)
    draws = torch.multinomial(weights, new_keys * MAX_DRAWS_PER_KEY, replacement=True, generator=generator)
    unique, inverse = torch.unique(draws, return_inverse=True)
    order = torch.arange(draws.numel())
    first = torch.full((unique.numel(),), draws.numel()).scatter_reduce(0, inverse, order, "amin")
    is_new = torch.zeros(draws.numel(), dtype=torch.bool)
    is_new[first] = True
    is_new &= ~known[draws]
    reached = (torch.cumsum(is_new, 0) >= new_keys).nonzero()
    stop = int(reached[0, 0]) + 1 if reached.numel() else draws.numel()
    return draws[:stop]


def _z_upper(cell: CellWeights, known, reader: ExactRatios, z_keys: int, delta_z: float, generator):
    """``(Z_U, draws)``: the upper confidence bound on ``Z`` at level ``delta_z`` and the draws it used.

    Tokens with ``u < SMALL`` are not sampled: ``p~ e^c`` bounds their share of ``Z``. Every term is
    formed in log space (:mod:`witcert.spot.cell`): a token whose ``p~`` underflows keeps its ``p~ W``.
    """
    rest = cell.visible & ~known
    small = rest & (cell.u < SMALL)
    sampled = rest & ~small
    index = known.nonzero().reshape(-1)
    known_w = torch.zeros_like(cell.c)
    known_w[index] = reader.log_ratios(index)
    z_known = cell.mass(known, known_w) + cell.mass(small, cell.c) + cell.mass(sampled)
    g_total, weights = sampling_weights(torch.where(sampled, cell.log_p + cell.log_u, -torch.inf))
    a_minus, a_plus = cell.mass(cell.visible, -cell.c), cell.mass(cell.visible, cell.c)  # Z in [A-, A]
    draws = torch.empty(0, dtype=torch.int64)
    if g_total == 0:
        z_upper = z_known
    elif g_total < float("inf") and z_keys > 0:
        draws = draw_until_new(weights, z_keys, known, generator)
        y = unit_ratio(reader.log_ratios(draws), cell.u[draws], cell.log_u[draws])  # the reader checked |x| <= c
        upper = betting_upper((1 + y) / 2, delta_z, cap=ONE_SIDED_CAP, planned=z_keys)
        z_upper = z_known + g_total * (2 * upper - 1) + g_total * ROUNDING
    else:
        z_upper = a_plus
    return max(min(z_upper, a_plus), a_minus) * (1 + ROUNDING), draws


def _one_sided_mean(cell: CellWeights, known, reader: ExactRatios, z_upper: float, new_keys: int, delta_f: float,
                    generator) -> tuple[float, torch.Tensor]:
    """``(bound on E_p~ (1 - W / Z_U)^+, draws)``: known terms, small ``h`` by ``h``, the rest sampled.

    Each term is ``p~`` times a number in ``[0, 1]``, so the rounded ``p~`` serves (:mod:`witcert.spot.cell`).
    """
    p, log_z = cell.p, torch.log(torch.tensor(z_upper, dtype=torch.float64))
    index = known.nonzero().reshape(-1)
    total = float((p[index] * (1 - torch.exp(reader.log_ratios(index) - log_z)).clamp_min(0)).sum())
    h = (1 - torch.exp(-cell.c - log_z)).clamp_min(0)
    rest = cell.visible & ~known
    small = rest & (h < SMALL)
    total += float((p[small] * h[small]).sum())  # each term is at most h
    h_total, weights = sampling_weights(torch.where(rest & ~small, cell.log_p + torch.log(h), -torch.inf))
    if h_total == 0:
        return total, torch.empty(0, dtype=torch.int64)
    draws = draw_until_new(weights, new_keys, known, generator)
    if not draws.numel():
        return total + h_total, draws  # no draws: E X <= 1
    x = ((1 - torch.exp(reader.log_ratios(draws) - log_z)).clamp_min(0) / h[draws]).clamp(0.0, 1.0)  # W >= e^-c
    upper = betting_upper(x, delta_f, cap=ONE_SIDED_CAP, planned=new_keys)
    return total + h_total * (upper + ROUNDING), draws


def spot_check(scores, radii, read_exact: Reader, *, keys: int, delta: float,
               generator: torch.Generator | None = None, meter: float | None = None,
               exact_share: float = EXACT_SHARE, z_keys_share: float = Z_KEYS_SHARE,
               z_share: float = Z_SHARE_OF_DELTA) -> SpotCheck:
    """One-sided spot-check bound on ``TV(p, p~)`` for one cell (registry SCO with SCB).

    Same arguments and result as :func:`witcert.spot.spot_check_two_sided` (``z_prime`` holds ``Z_U``,
    ``pilot`` the ``Z`` stage's draws, ``draws`` the one-sided stage's). ``keys`` bounds the
    distinct exact keys read; ``exact_share``, ``z_keys_share`` and ``z_share`` split the keys and
    ``delta`` between the stages.
    """
    if not (0 <= exact_share <= 1 and 0 <= z_keys_share <= 1 and 0 < z_share < 1):
        raise ValueError(f"exact_share, z_keys_share, z_share: expected shares in [0, 1] (z_share in (0, 1)), "
                         f"got {exact_share!r}, {z_keys_share!r}, {z_share!r}")
    cell, reader, generator = prepare_cell(scores, radii, read_exact, keys, delta, generator)
    empty = torch.empty(0, dtype=torch.int64)
    if int(cell.visible.sum()) <= keys:
        return read_whole(cell, reader, meter, delta)
    k_exact = min(int(round(keys * exact_share)), keys)
    z_keys = int(round((keys - k_exact) * z_keys_share))
    exact = cell.exact_set(k_exact)
    known = torch.zeros_like(cell.visible)
    known[exact] = True
    z_upper, z_draws = _z_upper(cell, known, reader, z_keys, z_share * delta, generator)
    if not z_resolved(z_upper, cell.c.numel()):  # overflow, or Z below what fp64 resolves: trivial bound
        return result(1.0, meter, reader, delta, z_upper, exact, z_draws, empty)
    known[z_draws] = True  # read already: their terms are known exactly in the one-sided stage
    new_keys = keys - reader.keys_read  # fixed before the stage's draws: predictable bets
    bound, draws = _one_sided_mean(cell, known, reader, z_upper, new_keys, (1 - z_share) * delta, generator)
    return result(inflated(bound), meter, reader, delta, z_upper, exact, z_draws, draws)

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

With ``tau`` the check reads keys in rounds of 32, 128, 512, ... keys (:mod:`witcert.spot.rounds`): round ``r`` is the
check above with the
cumulative budget ``B_r`` and ``delta_r``, every key read in earlier rounds known exactly (the exact set takes the
heaviest contributions up to the budget left); the cell stops at the first round whose bound is ``<= tau``. A round
whose budget covers every visible token reads the cell whole (its true TV, no draws). :mod:`witcert.spot.batched`
runs the same statistics for many cells at once.
"""
import torch

from witcert.spot.cell import (CellWeights, ExactRatios, Reader, SpotCheck, inflated, prepare_cell, sampling_weights,
                               unit_ratio, whole_bound, z_resolved)
from witcert.spot.confidence import ONE_SIDED_CAP, betting_upper
from witcert.spot.randomness import MAX_DRAWS_PER_KEY, MultinomialSampler
from witcert.spot.randomness import draw_until_new as draw_rows
from witcert.spot.rounds import DEFAULT_SPLIT, ROUND_GROWTH, schedule

EXACT_SHARE = 3 / 8
"""Share of the key budget read deterministically (the heaviest witness contributions)."""
Z_KEYS_SHARE = 0.85
"""Share of the remaining keys spent on the upper bound of ``Z``; the one-sided stage reads the rest.

The ``Z`` stage is limited by the range of its ratios, not their spread: ``c`` exceeds the logit
error by far where the witness saturates, so ``Z_U - Z`` is about ``G ln(1/delta) / n`` and most
keys go there (on SmolLM2 rtn-int4 cells: exact 3/8, then 0.85 of the rest, beat 1/2 and 1/2)."""
Z_SHARE_OF_DELTA = 0.8
"""Share of ``delta`` spent on the upper bound of ``Z`` (spec ``Z_SHARE_OF_DELTA``)."""
SMALL = 1e-6
"""Tokens whose sampling weight ``u`` (or ``h``) is below this are bounded by it, not sampled: their
ratios would carry the fp64 error of ``W`` divided by a tiny weight."""
ROUNDING = 1e-9
"""Rounding-up past the fp64 evaluation: ``Z_U`` relatively and per unit of sampled mass, the mean
per unit of ``H`` (ratios err by ~1e-16 / SMALL = 1e-10; a larger ``Z_U`` only loosens the bound)."""


def draw_until_new(weights: torch.Tensor, new_keys: int, known: torch.Tensor, sampler) -> torch.Tensor:
    """I.i.d. draws ``~ weights`` until ``new_keys`` distinct tokens outside ``known`` turned up (or the draw cap):
    :func:`witcert.spot.randomness.draw_until_new` of one row. ``sampler`` a
    :class:`~witcert.spot.randomness.MultinomialSampler` (or a ``torch.Generator``, wrapped in one).
    """
    if new_keys < 1 or not float(weights.sum()) > 0:
        return torch.empty(0, dtype=torch.int64)
    if isinstance(sampler, torch.Generator):
        sampler = MultinomialSampler(sampler)
    draws, valid = draw_rows(sampler, weights[None], torch.tensor([new_keys]), known[None])
    return draws[0][valid[0]]


def _z_upper(cell: CellWeights, known, reader: ExactRatios, z_keys: int, delta_z: float, sampler):
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
        draws = draw_until_new(weights, z_keys, known, sampler)
        y = unit_ratio(reader.log_ratios(draws), cell.u[draws], cell.log_u[draws])  # the reader checked |x| <= c
        upper = betting_upper((1 + y) / 2, delta_z, cap=ONE_SIDED_CAP, planned=z_keys)
        z_upper = z_known + g_total * (2 * upper - 1) + g_total * ROUNDING
    else:
        z_upper = a_plus
    return max(min(z_upper, a_plus), a_minus) * (1 + ROUNDING), draws


def _one_sided_mean(cell: CellWeights, known, reader: ExactRatios, z_upper: float, new_keys: int, delta_f: float,
                    sampler) -> tuple[float, torch.Tensor]:
    """``(bound on E_p~ (1 - W / Z_U)^+, draws)``: known terms, small ``h`` by ``h``, the rest sampled.

    Each term is ``p~`` times a number in ``[0, 1]``, so the rounded ``p~`` serves (:mod:`witcert.spot.cell`).
    """
    p, log_z = cell.p, torch.log(torch.tensor(z_upper, dtype=torch.float64))
    index = known.nonzero().reshape(-1)
    total = float((p[index] * (1 - torch.exp(reader.log_ratios(index) - log_z)).clamp_min(0)).sum())
    h = (1 - torch.exp(-cell.c) / z_upper).clamp_min(0)
    rest = cell.visible & ~known
    small = rest & (h < SMALL)
    total += float((p[small] * h[small]).sum())  # each term is at most h
    weights = torch.where(rest & ~small, p * h, 0.0)  # a term p~ h <= p~: the rounded p~ serves
    h_total = float(weights.sum())
    if h_total == 0:
        return total, torch.empty(0, dtype=torch.int64)
    draws = draw_until_new(weights, new_keys, known, sampler)
    if not draws.numel():
        return total + h_total, draws  # no draws: E X <= 1
    x = ((1 - torch.exp(reader.log_ratios(draws) - log_z)).clamp_min(0) / h[draws]).clamp(0.0, 1.0)  # W >= e^-c
    upper = betting_upper(x, delta_f, cap=ONE_SIDED_CAP, planned=new_keys)
    return total + h_total * (upper + ROUNDING), draws


def exact_set_within(cell: CellWeights, known: torch.Tensor, k_exact: int, room: int, most: int) -> torch.Tensor:
    """The round's exact set: the ``k_exact`` heaviest contributions (a prefix of the ranking of the ``most``
    heaviest), of which at most ``room`` not yet known (the heaviest unknown ones first): the round never reads
    past its budget."""
    exact = cell.exact_set(k_exact, most)
    fresh = ~known[exact]
    keep = ~fresh | (torch.cumsum(fresh, 0) <= room)
    return exact[keep]


def exact_keys(budget: int, exact_share: float) -> int:
    """Keys of the exact set at a round's cumulative ``budget``."""
    return min(int(round(budget * exact_share)), budget)


def _round(cell: CellWeights, reader: ExactRatios, known: torch.Tensor, budget: int, delta: float, sampler,
           shares: tuple[float, float, float], keys: int) -> tuple[float, float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One round at the cumulative budget ``budget`` (of at most ``keys``): ``(bound, Z_U, exact, Z draws,
    one-sided draws)``; marks every key it read in ``known``."""
    exact_share, z_keys_share, z_share = shares
    empty = torch.empty(0, dtype=torch.int64)
    exact = exact_set_within(cell, known, exact_keys(budget, exact_share), budget - reader.keys_read,
                             exact_keys(keys, exact_share))
    known[exact] = True
    reader.log_ratios(exact)
    z_keys = int(round((budget - reader.keys_read) * z_keys_share))
    z_upper, z_draws = _z_upper(cell, known, reader, z_keys, z_share * delta, sampler)
    if not z_resolved(z_upper, cell.c.numel()):  # overflow, or Z below what fp64 resolves: trivial bound
        return 1.0, z_upper, exact, z_draws, empty
    known[z_draws] = True  # read already: their terms are known exactly in the one-sided stage
    new_keys = budget - reader.keys_read  # fixed before the stage's draws: predictable bets
    bound, draws = _one_sided_mean(cell, known, reader, z_upper, new_keys, (1 - z_share) * delta, sampler)
    known[draws] = True
    return inflated(bound), z_upper, exact, z_draws, draws


def spot_check(scores, radii, read_exact: Reader, *, keys: int, delta: float,
               generator: torch.Generator | None = None, meter: float | None = None, tau: float | None = None,
               split: str = DEFAULT_SPLIT, exact_share: float = EXACT_SHARE, z_keys_share: float = Z_KEYS_SHARE,
               z_share: float = Z_SHARE_OF_DELTA, sampler=None, growth: int = ROUND_GROWTH) -> SpotCheck:
    """One-sided spot-check bound on ``TV(p, p~)`` for one cell (registry SCO with SCB; rounds SCR).

    Same arguments and result as :func:`witcert.spot.spot_check_two_sided` (``z_prime`` holds ``Z_U``,
    ``pilot`` the ``Z`` stage's draws, ``draws`` the one-sided stage's, of the last round run). ``keys``
    bounds the distinct exact keys read (``keys_read`` is what was read); with ``tau`` the cell reads them
    in rounds (32, 128, 512, ...: ``growth``) and stops at the first bound ``<= tau`` (``split`` divides ``delta``
    over the rounds, :mod:`witcert.spot.rounds`; ``delta`` in the result is what the rounds run spent, 0 for a cell read
    whole). ``exact_share``, ``z_keys_share`` and ``z_share`` split each round's keys and ``delta`` between
    the stages. ``sampler`` (default: a :class:`~witcert.spot.randomness.MultinomialSampler` of ``generator``)
    draws the tokens: a replay of recorded draws is one.
    """
    if not (0 <= exact_share <= 1 and 0 <= z_keys_share <= 1 and 0 < z_share < 1):
        raise ValueError(f"exact_share, z_keys_share, z_share: expected shares in [0, 1] (z_share in (0, 1)), "
                         f"got {exact_share!r}, {z_keys_share!r}, {z_share!r}")
    if tau is not None and not 0 <= tau < 1:
        raise ValueError(f"tau: expected a threshold in [0, 1) or None, got {tau!r}")
    cell, reader, generator = prepare_cell(scores, radii, read_exact, keys, delta, generator)
    sampler = MultinomialSampler(generator) if sampler is None else sampler
    empty = torch.empty(0, dtype=torch.int64)
    known = torch.zeros_like(cell.visible)
    visible = int(cell.visible.sum())
    best, spent, rounds, last = 1.0, 0.0, 0, (1.0, empty, empty, empty)
    for budget, share in schedule(keys, tau, split, growth):
        rounds += 1
        if visible <= budget:  # the round can read the cell whole: its true TV, no draws, no delta
            whole, every = whole_bound(cell, reader)
            best, last = min(best, whole), (1.0, every, empty, empty)
            break
        bound, z_upper, exact, z_draws, draws = _round(cell, reader, known, budget, share * delta, sampler,
                                                       (exact_share, z_keys_share, z_share), keys)
        best, spent, last = min(best, bound), spent + share * delta, (z_upper, exact, z_draws, draws)
        if tau is not None and best <= tau:
            break
    reported = best if meter is None else min(float(meter), best)
    return SpotCheck(bound=best, meter=reported, keys_read=reader.keys_read, delta=spent, z_prime=last[0],
                     exact=last[1], pilot=last[2], draws=last[3], rounds=rounds)

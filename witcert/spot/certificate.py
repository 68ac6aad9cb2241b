"""The two-sided spot check of one cell (registry SC, SCB; spec ``bound_spot_check``).

The library's default is the tighter one-sided form, :func:`witcert.spot.one_sided.spot_check`; what both
forms share (the cell in log space, the exact reader, the read-whole path) is :mod:`witcert.spot.cell`.

Where the witness saturates, the meter reads a few exact keys chosen with its own randomness
after the query is fixed. ``W_t = e^{-eps_t} = e^{l_t - l~_t}``, ``Z = E_p~ W``; for any ``Z' > 0``
(``WitCert.tv_le_spot_identity``)::

    TV(p, p~) <= (1/2 E_p~|W - Z'| + 1/2 |Z' - Z|) / Z'

1. exact set ``E``: the ``keys * exact_share`` tokens of largest witness contribution
   ``p~_t (e^{c_t} - 1)``, read exactly (a few heavy tokens with huge ``c_t`` cannot blow up the
   ranges below);
2. pilot: ``Z'`` from ``keys * pilot_share`` draws ``~ p~_t (e^{c_t} - 1)`` on the rest ``R``
   (any ``Z' > 0`` is valid; these draws are independent of the main ones);
3. main draws, with replacement, from ``q_t ~ p~_t g_t`` on ``R``, ``g_t = e^{c_t} - 1 + |1 - Z'|``:
   ``X = |W - Z'| / g`` in [0, 1], ``Y = (W - 1) / g`` in [-1, 1] because ``|W - 1| <= e^c - 1``;
   three one-sided statements (upper on ``E X``; upper and lower on ``E Y``) at ``delta / 3``
   (:mod:`witcert.spot.confidence`), so the bound holds with probability ``>= 1 - delta``.

Computed in fp64, every weighted term in log space (:mod:`witcert.spot.cell`: a token whose ``p~``
underflows keeps its ``p~ W``); the final bound is inflated by ``RELATIVE_SLACK`` and ``ABSOLUTE_SLACK`` so the
fp64 evaluation (softmax, sums, ratios rounded by a few units) never reports below the
exact-arithmetic value of the same expression. A cell with at most ``keys`` visible tokens is read
whole: its bound is the true TV (inflated likewise). An infinite radius outside the exact set
gives the trivial bound 1.
"""
import torch

from witcert.spot.cell import (CellWeights, ExactRatios, Reader, SpotCheck, inflated, prepare_cell, read_whole, result,
                               sampling_weights, z_resolved)
from witcert.spot.confidence import mean_upper, signed_mean_interval

EXACT_SHARE = 1 / 2
"""Share of the key budget read deterministically (128 of 256; on SmolLM2 cells 1/2 beat 1/4 and 3/8)."""
PILOT_SHARE = 1 / 16
"""Share spent on the pilot estimate of ``Z'`` (16 of 256); the rest are the main draws."""
STATEMENTS = 3
UNIT_TOLERANCE = 1e-9
"""Excess of a sampled ratio over its range accepted as fp64 rounding (the radius check catches more)."""


def _pilot_z(cell: CellWeights, rest, reader: ExactRatios, z_known: float, n_pilot: int,
             generator) -> tuple[float, torch.Tensor]:
    """``Z'``: ``z_known + G0 mean((W - 1)/u)`` over draws ``~ p~ u`` on ``rest``, or ``z_known``."""
    g0, weights = sampling_weights(torch.where(rest, cell.log_p + cell.log_u, -torch.inf))
    if n_pilot < 1 or not 0 < g0 < float("inf"):
        return z_known, torch.empty(0, dtype=torch.int64)
    draws = torch.multinomial(weights, n_pilot, replacement=True, generator=generator)
    y = torch.expm1(reader.log_ratios(draws)) / cell.u[draws]
    return z_known + g0 * float(y.mean()), draws


def spot_check_two_sided(scores, radii, read_exact: Reader, *, keys: int, delta: float,
                         generator: torch.Generator | None = None, meter: float | None = None,
                         exact_share: float = EXACT_SHARE, pilot_share: float = PILOT_SHARE) -> SpotCheck:
    """Two-sided spot-check bound on ``TV(p, p~)`` for one cell (registry SC with SCB).

    Parameters
    ----------
    scores : (S,) tensor
        Compressed logits ``l~`` (``-inf`` = masked; every finite one is visible, however small its weight).
    radii : (S,) tensor
        Per-token bounds ``c_t >= |l~_t - l_t|`` (checked on every token read).
    read_exact : callable
        ``read_exact(index (k,) int64) -> (k,)`` exact logits ``l_t`` of those tokens.
    keys : int
        Exact keys the check may read (exact set + pilot + main draws).
    delta : float
        Failure probability of this cell's statement (see :mod:`witcert.spot.budget`).
    generator : torch.Generator, optional
        The meter's own randomness (:func:`witcert.spot.randomness.spot_randomness`); by default a
        fresh one seeded from the operating system's cryptographic source.
    meter : float, optional
        The deterministic meter of the cell; the reported ``meter`` is ``min(meter, bound)``.

    Returns
    -------
    SpotCheck
    """
    if not (0 <= exact_share <= 1 and 0 <= pilot_share <= 1 and exact_share + pilot_share <= 1):
        raise ValueError(f"exact_share and pilot_share: expected shares in [0, 1] summing to <= 1, "
                         f"got {exact_share!r} and {pilot_share!r}")
    cell, reader, generator = prepare_cell(scores, radii, read_exact, keys, delta, generator)
    empty = torch.empty(0, dtype=torch.int64)
    if int(cell.visible.sum()) <= keys:
        return read_whole(cell, reader, meter)
    k_exact = min(int(round(keys * exact_share)), keys)
    n_pilot = min(int(round(keys * pilot_share)), keys - k_exact)
    exact = cell.exact_set(k_exact)
    rest = cell.visible.clone()
    rest[exact] = False
    if bool(torch.isinf(cell.u[rest]).any()):
        return result(1.0, meter, reader, delta, 1.0, exact, empty, empty)
    x_exact = reader.log_ratios(exact)
    p_exact_w = torch.exp(cell.log_p[exact] + x_exact)  # p~ W of the exact set, in log space
    z_known = float(p_exact_w.sum()) + cell.mass(rest)
    z_prime, pilot = _pilot_z(cell, rest, reader, z_known, n_pilot, generator)
    a_minus, a_plus = cell.mass(cell.visible, -cell.c), cell.mass(cell.visible, cell.c)  # Z in [A-, A]
    z_prime = min(max(z_prime, a_minus), a_plus)
    if not 0 < z_prime < float("inf"):
        z_prime = z_known
    if not z_resolved(z_prime, cell.c.numel()):  # Z' below what fp64 resolves (or no Z'): trivial bound
        return result(1.0, meter, reader, delta, 1.0, exact, pilot, empty)
    g = cell.u + abs(1 - z_prime)
    g_total, weights = sampling_weights(torch.where(rest, cell.log_p + torch.log(g), -torch.inf))
    if not g_total < float("inf"):  # radii near the fp64 exponent limit: no sampling distribution, trivial bound
        return result(1.0, meter, reader, delta, z_prime, exact, pilot, empty)
    spread = float((p_exact_w - torch.exp(cell.log_p[exact]) * z_prime).abs().sum())
    z_lo = z_hi = z_known
    draws = empty
    n_main = keys - k_exact - n_pilot
    if g_total > 0 and n_main > 0:
        draws = torch.multinomial(weights, n_main, replacement=True, generator=generator)
        w = reader.ratios(draws)
        per = delta / STATEMENTS
        spread += g_total * mean_upper(_unit((w - z_prime).abs() / g[draws], 0.0), per)
        y_lo, y_hi = signed_mean_interval(_unit(torch.expm1(reader.log_ratios(draws)) / g[draws], -1.0), per)
        z_lo, z_hi = z_known + g_total * y_lo, z_known + g_total * y_hi
    elif g_total > 0:
        spread += g_total  # no draws: E X <= 1 and E Y in [-1, 1]
        z_lo, z_hi = z_known - g_total, z_known + g_total
    z_lo, z_hi = max(z_lo, a_minus), min(z_hi, a_plus)
    deviation = max(z_hi - z_prime, z_prime - z_lo, 0.0)
    bound = inflated((spread / 2 + deviation / 2) / z_prime)
    return result(bound, meter, reader, delta, z_prime, exact, pilot, draws)


def _unit(ratios: torch.Tensor, low: float) -> torch.Tensor:
    """Ratios checked to lie in ``[low, 1]`` up to fp64 rounding, then clamped there."""
    slack = UNIT_TOLERANCE
    if bool(((ratios < low - slack) | (ratios > 1 + slack)).any()):
        raise AssertionError(f"spot ratio outside [{low}, 1] beyond rounding: the radius check should have caught it")
    return ratios.clamp(low, 1.0)

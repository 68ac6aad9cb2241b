"""The two-sided spot check of one cell and the parts both forms share (registry SC, SCB; spec ``bound_spot_check``).

The library's default is the tighter one-sided form, :func:`witcert.spot.one_sided.spot_check`.

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

Computed in fp64; the final bound is inflated by ``RELATIVE_SLACK`` and ``ABSOLUTE_SLACK`` so the
fp64 evaluation (softmax, sums, ratios rounded by a few units) never reports below the
exact-arithmetic value of the same expression. A cell with at most ``keys`` visible tokens is read
whole: its bound is the true TV (inflated likewise). An infinite radius outside the exact set
gives the trivial bound 1.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch

from witcert.spot.confidence import mean_upper, signed_mean_interval

EXACT_SHARE = 1 / 2
"""Share of the key budget read deterministically (128 of 256; on SmolLM2 cells 1/2 beat 1/4 and 3/8)."""
PILOT_SHARE = 1 / 16
"""Share spent on the pilot estimate of ``Z'`` (16 of 256); the rest are the main draws."""
STATEMENTS = 3
RELATIVE_SLACK = 1e-9
ABSOLUTE_SLACK = 1e-12
RANGE_TOLERANCE = 1e-9
"""Relative excess of ``|W - 1|`` over ``e^c - 1`` accepted as fp64 rounding; beyond it the radius is wrong."""

Reader = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SpotCheck:
    """The spot check of one cell. ``bound`` holds with probability ``>= 1 - delta`` over the draws."""

    bound: float  # spot bound on TV(p, p~), <= 1
    meter: float  # reported: min(deterministic meter, bound)
    keys_read: int  # distinct exact keys read (exact set, pilot and main draws)
    delta: float  # failure probability of this cell's statement
    z_prime: float
    exact: torch.Tensor  # (k,) int64 token indices read deterministically
    pilot: torch.Tensor  # (n0,) int64 pilot draws
    draws: torch.Tensor  # (n,) int64 main draws


class _ExactLogits:
    """Reads exact logits through the caller's reader, once per token, and counts the keys read."""

    def __init__(self, read_exact: Reader, scores: torch.Tensor, radii: torch.Tensor):
        self._read, self._scores, self._radii = read_exact, scores, radii
        self._w: dict[int, float] = {}

    def ratios(self, index: torch.Tensor) -> torch.Tensor:
        """``W_t = e^{l_t - l~_t}`` (fp64) at ``index``, checked against ``|W - 1| <= e^c - 1``."""
        fresh = sorted({int(t) for t in index.tolist()} - self._w.keys())
        if fresh:
            wanted = torch.tensor(fresh, dtype=torch.int64)
            logits = torch.as_tensor(self._read(wanted)).to(torch.float64).reshape(-1).cpu()
            if logits.numel() != len(fresh):
                raise ValueError(f"read_exact: returned {logits.numel()} logits for {len(fresh)} tokens")
            if not bool(torch.isfinite(logits).all()):
                raise ValueError("read_exact: returned a non-finite exact logit for a visible token")
            w = torch.exp(logits - self._scores[wanted])
            self._check_radius(wanted, w)
            self._w.update(zip(fresh, w.tolist()))
        return torch.tensor([self._w[int(t)] for t in index.tolist()], dtype=torch.float64)

    def _check_radius(self, index: torch.Tensor, w: torch.Tensor) -> None:
        u = torch.expm1(self._radii[index])
        bad = (w - 1).abs() > u * (1 + RANGE_TOLERANCE) + ABSOLUTE_SLACK
        if bool(bad.any()):
            t = int(index[bad.nonzero()[0, 0]])
            raise ValueError(f"radii: c[{t}] = {float(self._radii[t])!r} does not bound the logit error of token {t} "
                             "(|l~ - l| > c): the spot check's ranges need a valid per-token radius")

    @property
    def keys_read(self) -> int:
        return len(self._w)


def _check_inputs(scores, radii, keys: int, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(keys, int) or isinstance(keys, bool) or keys < 1:
        raise ValueError(f"keys: expected a positive int, got {keys!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta: expected a probability in (0, 1), got {delta!r}")
    s = torch.as_tensor(scores).detach().to(torch.float64).cpu()
    c = torch.as_tensor(radii).detach().to(torch.float64).cpu()
    if s.dim() != 1 or c.shape != s.shape:
        raise ValueError(f"scores and radii: expected two (S,) tensors, got {tuple(s.shape)} and {tuple(c.shape)}")
    if bool(torch.isnan(s).any()) or bool((s == torch.inf).any()):
        raise ValueError("scores: contains NaN or +inf")
    if not bool(torch.isfinite(s).any()):
        raise ValueError("scores: every token is masked (-inf)")
    if bool(torch.isnan(c).any()) or bool((c < 0).any()):
        raise ValueError("radii: must be >= 0 (NaN is not a radius)")
    return s, c


def _inflated(value: float) -> float:
    """``value`` rounded up past the fp64 evaluation's error; NaN and overflow give the trivial 1."""
    if not value == value or value >= 1:
        return 1.0
    return min(1.0, value * (1 + RELATIVE_SLACK) + ABSOLUTE_SLACK)


def _exact_tv(p: torch.Tensor, w: torch.Tensor) -> float:
    """``1/2 E_p~ |W/Z - 1|`` over every visible token (all read)."""
    z = float((p * w).sum())
    return float((p * (w / z - 1).abs()).sum()) / 2


def _pilot_z(p, u, rest, reader: _ExactLogits, z_known: float, n_pilot: int, generator) -> tuple[float, torch.Tensor]:
    """``Z'``: ``z_known + G0 mean((W - 1)/u)`` over draws ``~ p~ u`` on ``rest``, or ``z_known``."""
    weights = torch.where(rest, p * u, torch.zeros_like(p))
    g0 = float(weights.sum())
    if n_pilot < 1 or not 0 < g0 < float("inf"):
        return z_known, torch.empty(0, dtype=torch.int64)
    draws = torch.multinomial(weights, n_pilot, replacement=True, generator=generator)
    y = (reader.ratios(draws) - 1) / u[draws]
    return z_known + g0 * float(y.mean()), draws


def prepare_cell(scores, radii, read_exact: Reader, keys: int, delta: float, generator):
    """``(s, c, p~, visible, u, reader, generator)`` of one cell, checked; both forms start here."""
    s, c = _check_inputs(scores, radii, keys, delta)
    if generator is None:
        from witcert.spot.randomness import spot_randomness
        generator = spot_randomness().generator
    p = torch.softmax(s, dim=0)  # masked tokens get exactly 0
    return s, c, p, p > 0, torch.expm1(c), _ExactLogits(read_exact, s, c), generator


def read_whole(p, visible, reader: _ExactLogits, meter, delta: float) -> SpotCheck:
    """A cell with no more visible tokens than keys is read whole: its bound is its true TV (rounded up)."""
    every = visible.nonzero().reshape(-1)
    empty = torch.empty(0, dtype=torch.int64)
    return _result(_inflated(_exact_tv(p[every], reader.ratios(every))), meter, reader, delta, 1.0, every, empty, empty)


def spot_check_two_sided(scores, radii, read_exact: Reader, *, keys: int, delta: float, generator: torch.Generator | None = None,
               meter: float | None = None, exact_share: float = EXACT_SHARE,
               pilot_share: float = PILOT_SHARE) -> SpotCheck:
    """Two-sided spot-check bound on ``TV(p, p~)`` for one cell (registry SC with SCB).

    Parameters
    ----------
    scores : (S,) tensor
        Compressed logits ``l~`` (``-inf`` = masked).
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
    s, c, p, visible, u, reader, generator = prepare_cell(scores, radii, read_exact, keys, delta, generator)
    empty = torch.empty(0, dtype=torch.int64)
    if int(visible.sum()) <= keys:
        return read_whole(p, visible, reader, meter, delta)
    contribution = torch.where(visible, p * u, torch.full_like(p, -1.0))  # inf for an infinite radius
    k_exact = min(int(round(keys * exact_share)), keys)
    n_pilot = min(int(round(keys * pilot_share)), keys - k_exact)
    exact = torch.sort(contribution, descending=True, stable=True).indices[:k_exact]  # ties: lower index
    rest = visible.clone()
    rest[exact] = False
    if bool(torch.isinf(u[rest]).any()):
        return _result(1.0, meter, reader, delta, 1.0, exact, empty, empty)
    w_exact = reader.ratios(exact)
    z_known = float((p[exact] * w_exact).sum() + p[rest].sum())
    z_prime, pilot = _pilot_z(p, u, rest, reader, z_known, n_pilot, generator)
    a_minus, a_plus = float((p * torch.exp(-c)).sum()), float((p * torch.exp(c)).sum())  # Z in [A-, A]
    z_prime = min(max(z_prime, a_minus), a_plus)
    if not 0 < z_prime < float("inf"):
        z_prime = z_known
    g = u + abs(1 - z_prime)
    weights = torch.where(rest, p * g, torch.zeros_like(p))
    g_total = float(weights.sum())
    if not g_total < float("inf"):  # radii near the fp64 exponent limit: no sampling distribution, trivial bound
        return _result(1.0, meter, reader, delta, z_prime, exact, pilot, empty)
    spread = float((p[exact] * (w_exact - z_prime).abs()).sum())
    z_lo = z_hi = z_known
    draws = empty
    n_main = keys - k_exact - n_pilot
    if g_total > 0 and n_main > 0:
        draws = torch.multinomial(weights, n_main, replacement=True, generator=generator)
        w = reader.ratios(draws)
        per = delta / STATEMENTS
        spread += g_total * mean_upper(_unit((w - z_prime).abs() / g[draws], 0.0), per)
        y_lo, y_hi = signed_mean_interval(_unit((w - 1) / g[draws], -1.0), per)
        z_lo, z_hi = z_known + g_total * y_lo, z_known + g_total * y_hi
    elif g_total > 0:
        spread += g_total  # no draws: E X <= 1 and E Y in [-1, 1]
        z_lo, z_hi = z_known - g_total, z_known + g_total
    z_lo, z_hi = max(z_lo, a_minus), min(z_hi, a_plus)
    deviation = max(z_hi - z_prime, z_prime - z_lo, 0.0)
    bound = _inflated((spread / 2 + deviation / 2) / z_prime)
    return _result(bound, meter, reader, delta, z_prime, exact, pilot, draws)


def _unit(ratios: torch.Tensor, low: float) -> torch.Tensor:
    """Ratios checked to lie in ``[low, 1]`` up to fp64 rounding, then clamped there."""
    slack = RANGE_TOLERANCE
    if bool(((ratios < low - slack) | (ratios > 1 + slack)).any()):
        raise AssertionError(f"spot ratio outside [{low}, 1] beyond rounding: the radius check should have caught it")
    return ratios.clamp(low, 1.0)


def _result(bound, meter, reader, delta, z_prime, exact, pilot, draws) -> SpotCheck:
    reported = bound if meter is None else min(float(meter), bound)
    return SpotCheck(bound=bound, meter=reported, keys_read=reader.keys_read, delta=delta, z_prime=z_prime,
                     exact=exact, pilot=pilot, draws=draws)

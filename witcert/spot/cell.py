"""One cell of the spot check, in log space: what both forms share (registry SC, SCO, SCB).

Visibility comes from the finite compressed logits (the mask), never from a rounded probability.
A visible token whose compressed logit lies more than ~745 below the row maximum has ``p~_t = 0``
in fp64, yet its exact weight ``p_t = p~_t W_t / Z`` (``W_t = e^{l_t - l~_t}``) can be most of the
row (a scheme that blows one token's scale). So every weighted term the check forms is taken as
``exp(log p~_t + x_t)`` with ``log p~ = l~ - logsumexp(l~)``: ``p~ W`` (``x = l - l~``), ``p~ e^{+-c}``,
the sampling weights ``p~ (e^c - 1)`` and ``p~ h``. Only terms of the form ``p~_t a_t`` with
``0 <= a_t <= 1`` are formed from the rounded ``p~`` itself: a visible token whose ``p~_t`` rounds to
0 has an exact ``p~_t < 2^-1070`` (``log p~ < -744`` up to its rounding), so such terms, even ``2^40``
of them, stay far below ``ABSOLUTE_SLACK``, which every bound adds.

``Z = E_p~ W`` itself can underflow: a compressed logit thousands *above* its exact one on most of
``p~``'s mass (a blown scale the other way) makes every term ``p~_t W_t`` subnormal or 0. Each term lost
to underflow or rounded in the subnormal range is off by less than ``2^-1074``, so a sum of ``S`` such
terms is off by less than ``S 2^-1074``; :func:`z_resolved` accepts an estimate of ``Z`` only at or
above ``S 2^-1000``, where that loss is below ``2^-74`` of it (inside every form's relative rounding
margin), and the forms give the trivial bound 1 below it.

Exact logits are read through the caller's ``read_exact(index) -> logits`` once per token, and each is
checked against the radius: ``|l_t - l~_t| <= c_t`` (up to ``RANGE_TOLERANCE``) is what makes the
sampled ratios lie in their ranges.
"""
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from witcert.gate.blocks import log_expm1

RELATIVE_SLACK = 1e-9
ABSOLUTE_SLACK = 1e-12
RANGE_TOLERANCE = 1e-9
"""Relative excess of ``|l - l~|`` over ``c`` accepted as fp64 rounding; beyond it the radius is wrong."""
TOKEN_SLACK = 8 * 2.0**-53
"""Per visible token, what a true TV read whole adds before rounding up: two fp64 softmaxes over ``S`` tokens and the
sum of ``|p_t - p~_t|`` are off by at most about ``7 S u`` (``u = 2^-53``) in any summation order: each ``exp`` of a
shifted logit is off by at most ``2u`` of the row maximum's term, each normalizer by ``(S - 1) u`` relative, the TV's
sum by ``S u`` relative (docs/design.md, "The request audit"). ``ABSOLUTE_SLACK`` covers it only up to about 1,300
tokens."""

Reader = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SpotCheck:
    """The spot check of one cell. ``bound`` holds with probability ``>= 1 - delta`` over the draws (``delta = 0``:
    the cell was read whole, its bound is its true TV rounded up)."""

    bound: float  # spot bound on TV(p, p~), <= 1
    meter: float  # reported: min(deterministic meter, bound)
    keys_read: int  # distinct exact keys read (exact set, pilot and main draws)
    delta: float  # failure probability of this cell's statement
    z_prime: float
    exact: torch.Tensor  # (k,) int64 token indices read deterministically
    pilot: torch.Tensor  # (n0,) int64 pilot draws
    draws: torch.Tensor  # (n,) int64 main draws
    rounds: int = 1  # rounds of reads run (witcert.spot.rounds; 1 without a threshold)


@dataclass(frozen=True)
class CellWeights:
    """The compressed attention of one cell, (S,) fp64 each: ``scores`` ``l~`` (``-inf`` masked), radii ``c``."""

    scores: torch.Tensor
    c: torch.Tensor
    _rankings: dict = field(default_factory=dict, repr=False, compare=False)

    @cached_property
    def visible(self) -> torch.Tensor:
        """bool: the finite logits (the mask), whatever their rounded probability."""
        return torch.isfinite(self.scores)

    @cached_property
    def log_p(self) -> torch.Tensor:
        """``log p~`` (finite wherever ``p~`` underflows; ``-inf`` on masked tokens)."""
        return self.scores - torch.logsumexp(self.scores, dim=0)

    @cached_property
    def p(self) -> torch.Tensor:
        """``p~`` rounded (0 where it underflows): only for terms ``p~ a`` with ``a`` in ``[0, 1]``."""
        return torch.exp(self.log_p)

    @cached_property
    def u(self) -> torch.Tensor:
        """``e^c - 1`` (``inf`` above ~709.78)."""
        return torch.expm1(self.c)

    @cached_property
    def log_u(self) -> torch.Tensor:
        """``log(e^c - 1)``, finite for every finite ``c > 0``."""
        return log_expm1(self.c)

    def log_contribution(self) -> torch.Tensor:
        """``log p~_t (e^{c_t} - 1)``, the T1 witness share of each token; ``+inf`` for an infinite radius on a
        visible token, ``-inf`` on masked ones."""
        log_c = self.log_p + self.log_u
        infinite = self.visible & torch.isinf(self.c)
        return torch.where(infinite, torch.inf, torch.where(self.visible, log_c, -torch.inf))

    def exact_set(self, k: int, most: int | None = None) -> torch.Tensor:
        """The ``k`` visible tokens of largest witness contribution, in that order: the first ``k`` of the ranking
        of the ``most`` largest (:func:`exact_order`, ranked once: the rounds of a check take prefixes of one order)."""
        most = k if most is None else max(k, most)
        if most not in self._rankings:
            self._rankings[most] = exact_order(self.log_contribution()[None], self.visible[None], most)[0]
        return self._rankings[most][:min(k, int(self.visible.sum()))]

    def mass(self, mask: torch.Tensor, log_factor: torch.Tensor | float = 0.0) -> float:
        """``sum_{mask} p~_t e^{x_t}`` (``x = log_factor``), formed as ``exp(log p~ + x)``: ``inf`` on overflow."""
        return float(torch.exp((self.log_p + log_factor)[mask]).sum())


Z_FLOOR = 2.0**-1000
"""Per token: the least ``Z`` estimate whose underflow losses (``< 2^-1074`` a term) the rounding margins cover."""


def z_resolved(z: float, tokens: int) -> bool:
    """Whether an estimate ``z`` of ``Z`` over ``tokens`` tokens is finite and at least ``tokens Z_FLOOR``."""
    return tokens * Z_FLOOR <= z < float("inf")


def exact_order(log_contribution: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """``(..., k)`` the tokens of largest ``log_contribution`` (..., S), visible ones first, in decreasing order with
    ties to the lower index among those taken (``torch.topk``: no full sort of the row). Past a row's visible
    tokens the order holds masked ones (the callers stop at the row's visible count)."""
    key = torch.where(visible, log_contribution.clamp(min=-1e308), -torch.inf)  # c = 0 still above masked
    values, index = torch.topk(key, min(k, key.shape[-1]), dim=-1, sorted=False)
    index, at = torch.sort(index, dim=-1)  # by index, then stably by value: ties keep the lower index first
    values = values.gather(-1, at)
    return index.gather(-1, torch.sort(values, dim=-1, descending=True, stable=True).indices)


def sampling_weights(log_weights: torch.Tensor) -> tuple[float, torch.Tensor]:
    """``(sum e^{log w}, weights proportional to it)``: the total (``inf`` on overflow) and the normalised
    weights ``e^{log w - max}`` a sampler can take without underflow (all 0 when every weight is)."""
    top = log_weights.max() if log_weights.numel() else torch.tensor(-torch.inf, dtype=torch.float64)
    if not bool(torch.isfinite(top)):
        total = 0.0 if top == -torch.inf else float("inf")
        return total, torch.zeros_like(log_weights)
    total = float(torch.exp(torch.logsumexp(log_weights, dim=0)))
    return total, torch.exp(log_weights - top)


class ExactRatios:
    """Reads exact logits through the caller's reader, once per token, and counts the keys read.

    Holds ``x_t = l_t - l~_t`` (``W_t = e^{x_t}``), checked against the radius: ``|x_t| <= c_t``.
    """

    def __init__(self, read_exact: Reader, scores: torch.Tensor, radii: torch.Tensor):
        self._read, self._scores, self._radii = read_exact, scores, radii
        self._x: dict[int, float] = {}

    def log_ratios(self, index: torch.Tensor) -> torch.Tensor:
        """``x_t = l_t - l~_t`` (fp64) at ``index``, checked against ``|x_t| <= c_t``."""
        fresh = sorted({int(t) for t in index.tolist()} - self._x.keys())
        if fresh:
            wanted = torch.tensor(fresh, dtype=torch.int64)
            logits = torch.as_tensor(self._read(wanted)).to(torch.float64).reshape(-1).cpu()
            if logits.numel() != len(fresh):
                raise ValueError(f"read_exact: returned {logits.numel()} logits for {len(fresh)} tokens")
            if not bool(torch.isfinite(logits).all()):
                raise ValueError("read_exact: returned a non-finite exact logit for a visible token")
            x = logits - self._scores[wanted]
            check_radius(wanted, x, self._radii[wanted])
            self._x.update(zip(fresh, x.tolist()))
        return torch.tensor([self._x[int(t)] for t in index.tolist()], dtype=torch.float64)

    def ratios(self, index: torch.Tensor) -> torch.Tensor:
        """``W_t = e^{x_t}`` at ``index`` (``inf`` past the fp64 range)."""
        return torch.exp(self.log_ratios(index))

    @property
    def keys_read(self) -> int:
        return len(self._x)


def check_radius(index: torch.Tensor, x: torch.Tensor, c: torch.Tensor) -> None:
    """Raise unless ``|x_t| <= c_t`` up to fp64 rounding (``x = l - l~`` of tokens ``index``)."""
    bad = x.abs() > c * (1 + RANGE_TOLERANCE) + ABSOLUTE_SLACK
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        t = int(index[first])
        raise ValueError(f"radii: c[{t}] = {float(c[first])!r} does not bound the logit error of token {t} "
                         "(|l~ - l| > c): the spot check's ranges need a valid per-token radius")


def unit_ratio(x: torch.Tensor, u: torch.Tensor, log_u: torch.Tensor) -> torch.Tensor:
    """``(W - 1) / u`` in ``[-1, 1]`` (``|x| <= c``, checked on reading), also where ``u`` overflows fp64."""
    direct = torch.expm1(x) / u
    logged = torch.exp(x - log_u) - torch.exp(-log_u)
    return torch.where(torch.isfinite(u), direct, logged).clamp(-1.0, 1.0)


def check_keys(keys) -> None:
    """Raise unless ``keys`` is a positive int (the most exact keys a cell may read)."""
    if not isinstance(keys, int) or isinstance(keys, bool) or keys < 1:
        raise ValueError(f"keys: expected a positive int, got {keys!r}")


def checked_cells(scores, radii, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, radii)`` as fp64 CPU tensors of ``rank`` 1 (S,) or 2 (N, S), checked: no NaN or ``+inf`` logit, a
    visible token in every cell, radii ``>= 0``."""
    s = torch.as_tensor(scores).detach().to(torch.float64).cpu()
    c = torch.as_tensor(radii).detach().to(torch.float64).cpu()
    shape = "(S,)" if rank == 1 else "(N, S)"
    if s.dim() != rank or c.shape != s.shape:
        raise ValueError(f"scores and radii: expected two {shape} tensors, got {tuple(s.shape)} and {tuple(c.shape)}")
    if bool(torch.isnan(s).any()) or bool((s == torch.inf).any()):
        raise ValueError("scores: contains NaN or +inf")
    if not bool(torch.isfinite(s).any(-1).all()):
        raise ValueError("scores: every token of a cell is masked (-inf)")
    if bool(torch.isnan(c).any()) or bool((c < 0).any()):
        raise ValueError("radii: must be >= 0 (NaN is not a radius)")
    return s, c


def check_inputs(scores, radii, keys: int, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, radii)`` as (S,) fp64 CPU tensors, checked with ``keys`` and ``delta``."""
    check_keys(keys)
    if not 0 < delta < 1:
        raise ValueError(f"delta: expected a probability in (0, 1), got {delta!r}")
    return checked_cells(scores, radii, 1)


def inflated(value: float, tokens: int = 0) -> float:
    """``value`` rounded up past the fp64 evaluation's error (``tokens``: a true TV over that many visible tokens, which
    adds :data:`TOKEN_SLACK` per token); NaN and overflow give the trivial 1."""
    if not value == value or value >= 1:
        return 1.0
    return min(1.0, (value + TOKEN_SLACK * tokens) * (1 + RELATIVE_SLACK) + ABSOLUTE_SLACK)


def prepare_cell(scores, radii, read_exact: Reader, keys: int, delta: float, generator):
    """``(cell, reader, generator)`` of one cell, checked; both forms start here."""
    s, c = check_inputs(scores, radii, keys, delta)
    if generator is None:
        from witcert.spot.randomness import spot_randomness
        generator = spot_randomness().generator
    return CellWeights(s, c), ExactRatios(read_exact, s, c), generator


def exact_tv(log_p: torch.Tensor, x: torch.Tensor) -> float:
    """``TV(p, p~)`` of tokens whose every term is known: ``p~ = e^{log p~}``, ``p = softmax(log p~ + x)``."""
    return float((torch.softmax(log_p + x, dim=0) - torch.exp(log_p)).abs().sum()) / 2


def whole_bound(cell: CellWeights, reader: ExactRatios) -> tuple[float, torch.Tensor]:
    """``(true TV rounded up, every visible token)``: the cell read whole."""
    every = cell.visible.nonzero().reshape(-1)
    return inflated(exact_tv(cell.log_p[every], reader.log_ratios(every)), every.numel()), every


def read_whole(cell: CellWeights, reader: ExactRatios, meter) -> SpotCheck:
    """A cell with no more visible tokens than keys is read whole: its bound is its true TV (rounded up), with
    no failure probability."""
    bound, every = whole_bound(cell, reader)
    empty = torch.empty(0, dtype=torch.int64)
    return result(bound, meter, reader, 0.0, 1.0, every, empty, empty)


def result(bound, meter, reader, delta, z_prime, exact, pilot, draws) -> SpotCheck:
    """The :class:`SpotCheck` of a bound; ``meter`` the deterministic one (``None``: the bound alone)."""
    reported = bound if meter is None else min(float(meter), bound)
    return SpotCheck(bound=bound, meter=reported, keys_read=reader.keys_read, delta=delta, z_prime=z_prime,
                     exact=exact, pilot=pilot, draws=draws)

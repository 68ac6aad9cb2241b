"""What an operator asks of the request audit: ``witcert.Audit(rate, tau, delta, keys)`` (registry AU).

The audit picks each cell of a request independently with probability ``rate``, bounds every
picked cell, and states for the whole request, with probability at least ``1 - delta``: at most
``M_upper`` of its ``N`` cells have attention TV above ``tau`` (:mod:`witcert.audit.limit`).

How a picked cell is bounded (``keys``):

- ``None`` (the default), *exact*: its true TV, read from every exact key it sees (the exact cache, or in
  production the host backing store; :mod:`witcert.audit.exact`). No check can fail, so the whole ``delta``
  goes to the binomial limit (``WitCert.measure_auditUpper_exact_le``), and nothing is metered: the store
  keeps no witness. A picked cell's read costs its history, about ``rate`` times the model's own attention reads;
- an int, *bounded reads*: the deterministic meter where it certifies, else a spot check of at most ``keys``
  exact keys (for contexts where a picked cell's whole history costs too much to read). The user's ``delta``
  is then split in two fixed halves (:data:`SAMPLING_SHARE`): ``delta_s`` for the binomial limit,
  ``delta_spot`` for the union of the picked cells' spot checks, spread over the request's steps
  (:mod:`witcert.audit.budget`).
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Real

SAMPLING_SHARE = 0.5
"""Share of ``delta`` spent on the binomial limit (``delta_s``); the rest bounds the spot checks' union.

Both sides pay only ``log(1/share)``: the limit at ``X = 0`` is ``ln(1/delta_s) / rate`` cells, a spot
check's width grows with ``ln(1/delta_c)``; halving either costs ``ln 2`` against ``ln(1/delta) ~ 7``. A
power of two, so ``delta_s + delta_spot == delta`` exactly in floating point."""
DEFAULT_KEYS = 512
"""The budget the benchmarks and docs use for an audit with bounded reads (``keys=DEFAULT_KEYS``): the most exact keys a
picked cell's spot check may read, in rounds of 32, 128, 512 that stop at a bound ``<= tau``
(:mod:`witcert.spot.rounds`); the checked cells over one key history read it whole where it holds at most this
many tokens per checked cell (:mod:`witcert.spot.groups`: their true TVs, no failure probability). Why 512
(SmolLM2 rtn-int4, 512-token code requests, rate 0.05, 6 audits, ``benchmarks/audit.py``'s usefulness section,
2026-12-06, before key groups were read whole): ``fraction_upper`` exceeded the true fraction by 0.10
(median) reading 378 keys per check on average, against 0.28 with one round of 256 keys; a cell whose meter
saturates needs more keys than the spot certificate's budget to be told apart from one above ``tau``."""


def _probability(name: str, value, closed_above: bool = False) -> float:
    """``value`` as a float in ``(0, 1)`` (``(0, 1]`` when ``closed_above``), or a ValueError naming ``name``."""
    interval = "(0, 1]" if closed_above else "(0, 1)"
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    value = float(value)
    if not (0.0 < value < 1.0 or (closed_above and value == 1.0)):
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")
    return value


@dataclass(frozen=True)
class Audit:
    """A sampled request audit (registry AU): pass it as ``witcert.monitor(model, scheme, audit=Audit(...))``.

    Parameters
    ----------
    rate : float
        Probability, in ``(0, 1]``, that each (request, layer, query head, step) cell is picked, independently
        of every other cell and of the queries. Only picked cells are metered.
    tau : float
        The threshold of the statement, in ``(0, 1)``: a picked cell is *flagged* when its bound exceeds it.
    delta : float
        Failure probability of each request's statement, in ``(0, 1)``: ``P(M > M_upper) <= delta``.
    keys : int or None
        ``None`` (default): each picked cell is bounded by its true TV, from every exact key it sees (no failure
        probability, no witness kept). An int: the most exact keys each picked cell's spot check may read (cells
        whose meter exceeds ``tau``), in rounds that stop once the cell's bound is at most ``tau``
        (:data:`DEFAULT_KEYS` is a measured choice).
    seed : int, optional
        Replay opt-in: fixes the picks and the spot draws. By default the monitor draws a secret seed from the
        operating system's cryptographic source (a known seed lets whoever chooses the queries know the picks).
    """

    rate: float = 0.02
    tau: float = 0.2
    delta: float = 1e-3
    keys: int | None = None
    seed: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "rate", _probability("rate", self.rate, closed_above=True))
        object.__setattr__(self, "tau", _probability("tau", self.tau))
        object.__setattr__(self, "delta", _probability("delta", self.delta))
        if self.keys is not None and (isinstance(self.keys, bool) or not isinstance(self.keys, int) or self.keys < 1):
            raise ValueError(f"keys must be None (every exact key: true TVs) or a positive int (exact keys per spot "
                             f"check), got {self.keys!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be None (drawn from the OS) or an int in [0, 2**63), got {self.seed!r}")

    @property
    def exact(self) -> bool:
        """Whether each picked cell is bounded by its true TV (``keys=None``)."""
        return self.keys is None

    @property
    def delta_sampling(self) -> float:
        """``delta_s``: the binomial limit's level (the whole ``delta`` when the picked cells' bounds are exact)."""
        return self.delta if self.exact else self.delta * SAMPLING_SHARE

    @property
    def delta_spot(self) -> float:
        """The request's budget for the union of its picked cells' spot-check failures (0 when exact)."""
        return self.delta - self.delta_sampling

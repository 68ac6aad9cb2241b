"""The request audit's leaf (registry AU): the exact binomial limit, the interval, the budget, the picks, the settings.

Implementation under test: ``witcert.audit`` (``limit.upper_limit``, ``limit.flagged_interval``,
``budget.check_delta``, ``picks.picked``, ``settings.Audit``). Oracles: a brute-force scan over every
``m <= N`` of the exact binomial tail in mpmath (40 digits, ``witcert.spec.audit.binomial_cdf``), the
spec mirror ``witcert.spec.audit`` (bisection over the same exact tail), closed forms at the edges
(``X = 0``: ``floor(ln delta_s / ln(1 - r))``; ``X = N``; ``r = 1``), the union sum of the step
allocation, the binomial law of the picks (scipy), and the Philox counter layout decoded back.
Domain: N up to 400 (brute force) and 10^6 (spec and closed forms), rates 1e-3 to 1, delta_s 1e-9 to 0.5.
Tolerances: limits exact (integers); deltas rel 1e-12.
"""
import math

import mpmath
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from scipy import stats

import witcert
from witcert.audit import budget, limit, picks
from witcert.audit.settings import SAMPLING_SHARE, Audit
from witcert.spec import audit as spec
from witcert.spec.registry import by_key


def exact_tails(x: int, n: int, r: float) -> list:
    """``P(Bin(m, r) <= x)`` for every ``m = 0..n`` at 40 digits (``F_{m+1} = F_m - r P(Bin(m, r) = x)``)."""
    with mpmath.workdps(40):
        r = mpmath.mpf(r)
        tails = [mpmath.mpf(1) if x >= 0 else mpmath.mpf(0)]
        for m in range(n):
            at_x = mpmath.binomial(m, x) * r**x * (1 - r) ** (m - x) if 0 <= x <= m else 0
            tails.append(tails[-1] - r * at_x)
        return tails


def brute_force_upper(x: int, n: int, r: float, delta_s: float) -> int:
    """``max{m <= n : P(Bin(m, r) <= x) >= delta_s}`` by scanning every m."""
    return max(m for m, tail in enumerate(exact_tails(x, n, r)) if tail >= delta_s)


def brute_force_lower(x: int, n: int, r: float, alpha: float) -> int:
    """``min{k in [x, n] : P(Bin(k, r) >= x) >= alpha}`` (n when none) by scanning."""
    accepted = [k for k, below in enumerate(exact_tails(x - 1, n, r)) if k >= x and 1 - below >= alpha]
    return accepted[0] if accepted else n


def test_registry_row():
    row = by_key("AU")
    assert row.lean == "WitCert.measure_auditUpper_lt_le"
    assert row.spec == "witcert.spec.audit.upper_limit" and row.torch == "witcert.audit.limit.upper_limit"
    assert "WitCert.measure_auditUpper_lt_le" in spec.upper_limit.__doc__ and "WitCert.auditUpper" in spec.upper_limit.__doc__


@settings(max_examples=120)
@given(n=st.integers(0, 400), data=st.data(), r=st.sampled_from([1e-3, 0.02, 0.05, 0.3, 0.77, 1.0]),
       delta_s=st.sampled_from([1e-9, 5e-4, 0.05, 0.15, 0.5]))
@example(n=0, data=None, r=0.02, delta_s=5e-4)
@example(n=400, data=None, r=1.0, delta_s=5e-4)
def test_upper_limit_is_the_brute_force_limit(n, data, r, delta_s):
    x = 0 if data is None else data.draw(st.integers(0, n))
    got = int(limit.upper_limit(x, n, r, delta_s))
    assert got == brute_force_upper(x, n, r, delta_s), (x, n, r, delta_s)
    if n <= 120:  # the spec's bisection over the same exact tail (slower: a sum per probe)
        with mpmath.workdps(40):
            assert got == spec.upper_limit(x, n, r, delta_s)


def test_upper_limit_edges_have_their_closed_forms():
    n = np.array([10, 1000, 10**6])
    for r, delta_s in ((0.02, 5e-4), (0.05, 0.15), (1e-3, 1e-6)):
        closed = np.minimum(n, math.floor(math.log(delta_s) / math.log(1 - r)))
        assert np.array_equal(limit.upper_limit(0, n, r, delta_s), closed)  # X = 0
        assert np.array_equal(limit.upper_limit(n, n, r, delta_s), n)  # X = N: nothing above N
    x = np.array([0, 3, 10])
    assert np.array_equal(limit.upper_limit(x, 10, 1.0, 5e-4), x)  # r = 1: every cell picked, M <= X


def test_upper_limit_is_vectorized_and_monotone():
    x = np.arange(0, 60)
    got = limit.upper_limit(x, 5000, 0.02, 5e-4)
    assert np.all(np.diff(got) >= 0) and np.all(got >= x) and np.all(got <= 5000)
    for i in (0, 7, 59):  # the vectorized call is the scalar one
        assert got[i] == limit.upper_limit(int(x[i]), 5000, 0.02, 5e-4)
    assert np.all(limit.upper_limit(x, 5000, 0.05, 5e-4) <= got)  # a larger rate, a tighter limit
    assert np.all(limit.upper_limit(x, 5000, 0.02, 1e-2) <= got)  # a larger level, a tighter limit
    with mpmath.workdps(40):
        assert int(got[25]) == spec.upper_limit(25, 5000, 0.02, 5e-4)  # spec at a large N


@settings(max_examples=120)
@given(n=st.integers(1, 300), data=st.data(), r=st.sampled_from([0.02, 0.1, 0.5, 1.0]))
def test_interval_ends_are_the_brute_force_ends(n, data, r):
    x = data.draw(st.integers(0, n))
    estimate, low, high = limit.flagged_interval(x, n, r)
    alpha = (1 - limit.LEVEL) / 2
    assert round(float(high) * n) == brute_force_upper(x, n, r, alpha)
    assert round(float(low) * n) == min(brute_force_lower(x, n, r, alpha), brute_force_upper(x, n, r, alpha))
    assert float(estimate) == pytest.approx(min(1.0, x / (r * n)), rel=1e-15)
    assert low <= high


def test_interval_covers_the_would_be_flagged_fraction():
    """X ~ Binomial(K, r): the interval covers K / N in at least 95% of draws (binomial ceiling on the misses)."""
    rng = np.random.default_rng(3)
    n, r, trials = 2000, 0.05, 4000
    for k in (0, 30, 400, 1500):
        x = rng.binomial(k, r, size=trials)
        _, low, high = limit.flagged_interval(x, n, r)
        misses = int(np.sum((low > k / n) | (high < k / n)))
        assert misses <= stats.binom.ppf(1 - 1e-4, trials, 1 - limit.LEVEL), (k, misses)


def test_bad_limit_arguments_name_themselves():
    for args, match in (((5, 3, 0.1, 0.1), "flagged must lie in"), ((1, 3, 0.0, 0.1), "rate"),
                        ((1, 3, 1.5, 0.1), "rate"), ((1, 3, 0.1, 1.0), "delta_s"), ((1.5, 3, 0.1, 0.1), "integer")):
        with pytest.raises(ValueError, match=match):
            limit.upper_limit(*args)


def test_step_budget_matches_spec_and_stays_within_delta_spot():
    layers, heads, rate = 30, 9, 0.02
    pick = picks.pick_probability(rate)
    with mpmath.workdps(30):
        for k in (1, 2, 17, 4096):
            expected = spec.check_delta(5e-4, k, layers * heads, spec.pick_probability(rate))
            assert budget.check_delta(5e-4, k, layers * heads, pick) == pytest.approx(float(expected), rel=1e-12)
        # every cell of 20,000 steps, each picked with probability pick: the union stays within delta_spot
        deltas = [budget.check_delta(5e-4, k, layers * heads, pick) for k in range(1, 20_000)]
        total = spec.statement_delta(0, deltas, pick) * layers * heads  # L Hq cells per step
        assert total <= 5e-4
    assert budget.check_delta(0.4, 1, 1, picks.pick_probability(1e-3)) == budget.MAX_CHECK_DELTA  # capped
    steps = torch.tensor([[1, 2], [2, 9]])
    assert torch.equal(budget.check_deltas(5e-4, steps, 270, pick),
                       torch.tensor([[budget.check_delta(5e-4, int(k), 270, pick) for k in row] for row in steps.tolist()],
                                    dtype=torch.float64))


def test_picks_are_bernoulli_at_the_rate_and_keyed_by_the_cell():
    rate = 0.05
    assert picks.pick_probability(rate) >= rate and picks.pick_probability(rate) - rate < 2**-32
    assert picks.pick_probability(1.0) == 1.0 and picks.picked(1, [0], [0], 4, torch.arange(8), 1.0).all()
    grid = picks.picked(11, torch.arange(4), torch.arange(30), 9, torch.arange(1000, 1100), rate)  # (L, B, Hq, T)
    count = int(grid.sum())
    assert stats.binom.cdf(count, grid.numel(), rate) > 1e-4 and stats.binom.sf(count - 1, grid.numel(), rate) > 1e-4
    # the same cell gets the same pick whatever else is asked with it: a function of (seed, request, layer, head, pos)
    part = picks.picked(11, torch.tensor([2]), torch.tensor([7]), 9, torch.arange(1050, 1080), rate)
    assert torch.equal(part[0, 0], grid[7, 2, :, 50:80])
    other = picks.picked(12, torch.arange(4), torch.arange(30), 9, torch.arange(1000, 1100), rate)
    assert not torch.equal(grid, other)
    # neighbouring cells are not correlated: pairs along each axis picked together at about rate^2
    for a, b in ((grid[:, :, :, 1:], grid[:, :, :, :-1]), (grid[:, :, 1:], grid[:, :, :-1]), (grid[1:], grid[:-1])):
        both = int((a & b).sum())
        assert stats.binom.sf(both - 1, a.numel(), rate**2) > 1e-4, both


def test_pick_counters_are_distinct_per_cell():
    """The counter packs (position, head, layer, request) into disjoint bit ranges, so distinct cells have distinct
    counters; ranges beyond the layout are refused by name."""
    words = {}
    for request in (0, 1, 2**32 - 1):
        for layer in (0, 1, 2**16 - 1):
            for head in (0, 3):
                for pos in (0, 5, 2**32 - 1):
                    counter = (pos, head | layer << 16, request, picks.AUDIT_STREAM)
                    assert counter not in words
                    words[counter] = (request, layer, head, pos)
    assert picks.AUDIT_STREAM >> 30 == 0  # Tier B's dither counters keep bits 0..29 of c3 zero: never equal
    with pytest.raises(ValueError, match="positions"):
        picks.picked(1, [0], [0], 2, torch.tensor([2**32]), 0.5)
    with pytest.raises(ValueError, match="layers"):
        picks.picked(1, [0], [2**16], 2, torch.tensor([0]), 0.5)
    with pytest.raises(ValueError, match="seed"):
        picks.picked(-1, [0], [0], 2, torch.tensor([0]), 0.5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(rate=0.0), r"rate must lie in \(0, 1\]"), (dict(rate=1.5), r"rate must lie in \(0, 1\]"),
    (dict(rate=True), "rate must be a number"), (dict(rate="0.1"), "rate must be a number"),
    (dict(tau=0.0), r"tau must lie in \(0, 1\)"), (dict(tau=1.0), r"tau must lie in \(0, 1\)"),
    (dict(delta=0.0), r"delta must lie in \(0, 1\)"), (dict(delta=1.0), r"delta must lie in \(0, 1\)"),
    (dict(delta=float("nan")), r"delta must lie in \(0, 1\)"), (dict(keys=0), "keys must be None .* or a positive int"),
    (dict(seed=-1), "seed must be None"), (dict(seed=2.0), "seed must be None"),
])
def test_bad_audit_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        witcert.Audit(**kwargs)


def test_audit_defaults_and_the_split_of_delta():
    audit = witcert.Audit()
    assert (audit.rate, audit.tau, audit.delta, audit.seed, audit.keys) == (0.02, 0.2, 1e-3, None, None)
    assert audit.exact and audit.delta_sampling == 1e-3 and audit.delta_spot == 0.0  # exact bounds: no check fails
    bounded = witcert.Audit(keys=512)
    assert bounded.delta_sampling == 1e-3 * SAMPLING_SHARE and bounded.delta_sampling + bounded.delta_spot == 1e-3
    assert witcert.Audit(rate=1).rate == 1.0 and isinstance(Audit(rate=1).rate, float)

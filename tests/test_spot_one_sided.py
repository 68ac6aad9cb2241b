"""The one-sided spot check, the library's default (registry SCO with SCB).

Implementation under test: ``witcert.spot.spot_check`` (``witcert.spot.one_sided``, torch fp64).
Oracles: the mpmath spec ``witcert.spec.spot_check`` (the identity ``bound_spot_one_sided_identity``,
``one_sided_z_upper`` and ``bound_spot_one_sided`` on the same draws), the true TV and the true
``Z`` of each synthetic cell (30 digits), and the binomial law of failures: each of the two
statements (``Z <= Z_U`` at ``z_share delta``, the whole bound at ``delta``) and the betting bound
stopped at a random time (Ville's inequality, the planned count in the bets).
Domain: the adversarial cells of ``tests/spot_cells.py`` (errors at the vertices ``eps = +-c``,
split by score, heavy tails, a few huge radii, masked tokens), S up to 3000.
Tolerances: identity >= TV to 1e-25 relative and equal to it at ``Z_U = Z``; torch ``Z_U`` >= the
spec's within 1e-8 relative; torch bound >= the spec's (to 1e-12) and within one betting grid
cell above it; failures within a binomial ceiling at 1e-4; zero violations at delta = 1e-6.
"""
import mpmath
import pytest
import torch

from witcert.spec import bounds as spec_bounds
from witcert.spec import spot_check as spec
from witcert.spec.registry import by_key
from witcert.spot import confidence, one_sided, spot_check, spot_randomness

from tests.spot_cells import FAMILIES, GRID, binomial_ceiling, reader_for, synthetic_cell, true_tv


def run(scores, c, eps, *, keys, delta, seed, **shares):
    return spot_check(scores, c, reader_for(scores, eps), keys=keys, delta=delta,
                      generator=spot_randomness(seed).generator, **shares)


def spec_inputs(scores, c, eps):
    """``(p~, c, eps)`` as mpmath lists, with ``eps = 0`` on masked tokens."""
    p = spec_bounds.softmax([float(v) for v in scores])
    return p, [float(x) for x in c], [float(x) if pt > 0 else 0.0 for x, pt in zip(eps, p)]


def true_z(scores, eps) -> float:
    with mpmath.workdps(30):
        p, _, e = spec_inputs(scores, torch.zeros_like(scores), eps)
        return float(mpmath.fsum(pt * mpmath.exp(-et) for pt, et in zip(p, e)))


def planned_counts(result, keys: int) -> tuple[int, int]:
    """The two stages' planned key counts, as the library fixes them before each stage's draws."""
    k_exact = result.exact.numel()
    z_keys = int(round((keys - k_exact) * one_sided.Z_KEYS_SHARE))
    read_before = len(set(result.exact.tolist()) | set(result.pilot.tolist()))
    return z_keys, keys - read_before


# ----------------------------------------------------------------------------- statement and mirror


def test_registry_row():
    row = by_key("SCO")
    assert row.lean == "WitCert.tv_le_spot_one_sided"
    assert row.spec == "witcert.spec.spot_check.bound_spot_one_sided" and row.torch == "witcert.spot.one_sided.spot_check"


@pytest.mark.parametrize("family", FAMILIES)
def test_identity_bounds_tv_for_every_z_upper_above_z(family):
    """``E_p~ (1 - W/Z_U)^+ >= TV`` for ``Z_U >= Z``, equal at ``Z_U = Z`` (``WitCert.tv_le_spot_one_sided``)."""
    scores, c, eps = synthetic_cell(family, 300, seed=3)
    with mpmath.workdps(40):
        p, _, e = spec_inputs(scores, c, eps)
        tv = spec_bounds.tv(spec_bounds.perturbed(p, e), p)
        z = mpmath.fsum(pt * mpmath.exp(-et) for pt, et in zip(p, e))
        assert abs(spec.bound_spot_one_sided_identity(p, e, z) - tv) <= tv * mpmath.mpf(10) ** -30 + mpmath.mpf(10) ** -35
        for factor in ("1.0001", "1.5", "3", "40"):
            assert spec.bound_spot_one_sided_identity(p, e, z * mpmath.mpf(factor)) >= tv * (1 - mpmath.mpf(10) ** -25)


@pytest.mark.parametrize("family", FAMILIES)
def test_z_upper_and_bound_agree_with_spec(family):
    """Same draws: ``Z_U`` and the bound are the spec's, rounded up by at most the betting grid."""
    scores, c, eps = synthetic_cell(family, 600, seed=11)
    keys, delta = 64, 1e-3
    result = run(scores, c, eps, keys=keys, delta=delta, seed=5)
    planned_z, planned_f = planned_counts(result, keys)
    with mpmath.workdps(30):
        p, cl, e = spec_inputs(scores, c, eps)
        exact, z_draws, f_draws = result.exact.tolist(), result.pilot.tolist(), result.draws.tolist()
        z_upper = spec.one_sided_z_upper(p, cl, e, exact, z_draws, spec.Z_SHARE_OF_DELTA * delta, planned_z)
        want = spec.bound_spot_one_sided(p, cl, e, exact, z_draws, f_draws, delta, planned_z, planned_f)
    assert float(z_upper) * (1 - 1e-12) <= result.z_prime <= float(z_upper) * (1 + 1e-8) + 1e-12
    assert float(want) * (1 - 1e-12) - 1e-15 <= result.bound <= float(want) * (1 + 1e-6) + GRID


def test_draws_stop_at_the_planned_number_of_new_keys():
    """A stopping time: the prefix up to the draw that brings the ``new_keys``-th new token, or the cap."""
    weights = torch.tensor([5.0, 1.0, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    known = torch.tensor([True, False, False, False, False, False])
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        draws = one_sided.draw_until_new(weights, 3, known, g)
        new = [t for t in dict.fromkeys(draws.tolist()) if t != 0]
        assert 3 not in draws.tolist() and len(new) <= 3
        assert (len(new) == 3 and draws[-1].item() == new[-1]) or draws.numel() == 3 * one_sided.MAX_DRAWS_PER_KEY
    few = one_sided.draw_until_new(weights, 9, known, g)  # only 4 new tokens exist: the cap ends it
    assert few.numel() == 9 * one_sided.MAX_DRAWS_PER_KEY
    assert one_sided.draw_until_new(weights, 0, known, g).numel() == 0


# ----------------------------------------------------------------------------- soundness


@pytest.mark.parametrize("family", FAMILIES)
def test_bound_covers_true_tv_at_small_delta(family):
    """delta = 1e-6: bound >= true TV on every cell; never more than ``keys`` exact keys read."""
    for seed, size in enumerate((50, 300, 3000)):
        scores, c, eps = synthetic_cell(family, size, seed=100 + seed)
        tv = true_tv(scores, eps)
        for draw_seed in range(3):
            result = run(scores, c, eps, keys=128, delta=1e-6, seed=draw_seed)
            assert result.bound >= tv, (family, size, draw_seed, result.bound, tv)
            assert 0 <= result.bound <= 1 and result.meter == result.bound and result.keys_read <= 128


@pytest.mark.parametrize("family", ("vertex", "split", "heavy", "flat", "aligned", "sparse_big"))
def test_each_statement_fails_within_its_share_at_large_delta(family):
    """delta = 0.2, few keys, many seeds: ``Z_U < Z`` at most as often as ``z_share delta`` allows,
    the bound below the true TV at most as often as ``delta`` allows."""
    delta, trials = 0.2, 150
    scores, c, eps = synthetic_cell(family, 400, seed=21)
    tv, z = true_tv(scores, eps), true_z(scores, eps)
    results = [run(scores, c, eps, keys=16, delta=delta, seed=s) for s in range(trials)]
    z_failures = sum(r.z_prime < z for r in results)
    failures = sum(r.bound < tv for r in results)
    assert z_failures <= binomial_ceiling(trials, one_sided.Z_SHARE_OF_DELTA * delta), (family, z_failures)
    assert failures <= binomial_ceiling(trials, delta), (family, failures)


@pytest.mark.parametrize("planned", (4, 10, 25))
def test_betting_bound_stopped_at_a_random_time(planned):
    """SCB at a stopping time (draw until ``planned`` distinct atoms of a skewed law turned up): the
    betting bound with the planned count in its bets falls below the mean at most as often as delta allows."""
    delta, trials = 0.2, 400
    g = torch.Generator().manual_seed(planned)
    values = torch.rand(40, generator=g, dtype=torch.float64) ** 3
    weights = torch.rand(40, generator=g, dtype=torch.float64) ** 4
    mean = float((weights * values).sum() / weights.sum())
    none_known = torch.zeros(40, dtype=torch.bool)
    failures = 0
    for _ in range(trials):
        draws = one_sided.draw_until_new(weights, planned, none_known, g)
        failures += confidence.betting_upper(values[draws], delta, cap=confidence.ONE_SIDED_CAP,
                                             planned=planned) < mean
    assert failures <= binomial_ceiling(trials, delta), (planned, failures)


# ----------------------------------------------------------------------------- edges and inputs


def test_small_cell_is_read_whole():
    scores, c, eps = synthetic_cell("vertex", 30, seed=2)
    result = run(scores, c, eps, keys=64, delta=1e-6, seed=0)
    tv = true_tv(scores, eps)
    assert tv <= result.bound <= tv * (1 + 1e-8) + 1e-11 and result.keys_read == 30


def test_infinite_and_overflowing_radii_give_the_trivial_bound_never_nan():
    scores, c, eps = synthetic_cell("flat", 500, seed=4)
    c_inf = c.clone()
    c_inf[0] = torch.inf  # the largest contribution: read exactly, the rest is sampled as usual
    assert run(scores, c_inf, eps, keys=64, delta=1e-6, seed=0).bound < 1
    for radius in (torch.inf, 709.7):  # more such radii than exact slots; 709.7: e^c sums overflow fp64
        c_many = c.clone()
        c_many[:200] = radius
        assert run(scores, c_many, eps, keys=64, delta=1e-6, seed=0).bound == 1.0


def test_wrong_radius_is_refused():
    scores, c, eps = synthetic_cell("vertex", 500, seed=6)
    with pytest.raises(ValueError, match="radii"):
        run(scores, c * 0.5, eps, keys=64, delta=1e-6, seed=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(keys=0), "keys"), (dict(delta=1.0), "delta"), (dict(exact_share=1.5), "exact_share"),
    (dict(z_share=1.0), "z_share"), (dict(z_keys_share=-0.1), "z_keys_share")])
def test_bad_arguments_name_themselves(kwargs, match):
    scores, c, eps = synthetic_cell("flat", 200, seed=0)
    args = dict(keys=8, delta=1e-3) | kwargs
    with pytest.raises(ValueError, match=match):
        spot_check(scores, c, reader_for(scores, eps), **args)


def test_meter_is_min_of_both_and_seed_replays():
    scores, c, eps = synthetic_cell("heavy", 800, seed=9)
    a = spot_check(scores, c, reader_for(scores, eps), keys=64, delta=1e-5, meter=0.01,
                   generator=spot_randomness(42).generator)
    b = run(scores, c, eps, keys=64, delta=1e-5, seed=42)
    assert a.meter == min(0.01, a.bound) and a.delta == 1e-5
    assert a.bound == b.bound and torch.equal(a.draws, b.draws) and torch.equal(a.pilot, b.pilot)

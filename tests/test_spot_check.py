"""The spot-check certificate, two-sided form (registry SC, SCB, SCD).

Implementation under test: ``witcert.spot.spot_check_two_sided`` (torch fp64); the default
one-sided form is tested in ``tests/test_spot_one_sided.py`` on the same cells. Oracles: the mpmath spec
``witcert.spec.spot_check`` on the same draws (exact set, identity, confidence bounds, the whole
bound), the true TV of each synthetic cell (``spec.bounds.tv_perturbed``, 30 digits), and the
binomial law of failures for the confidence bounds that are not proved in Lean (SCB).
Domain: adversarial synthetic cells (peaked, flat, heavy-tailed scores and radii, errors aligned
with ``c``, at the vertices ``eps = +-c``, split by score, a few huge radii, masked tokens),
S up to 3000; bounded samples (Bernoulli, two-point, Beta, uniform) for SCB.
Tolerances: spec vs torch exact set identical; torch bound >= spec bound (to 1e-12) and within
the betting grid's resolution above it; empirical failure rates <= delta within a binomial
tolerance at 1e-4 (scipy.stats); zero violations at delta = 1e-6. Every check is per cell.
"""
import mpmath
import pytest
import torch

from witcert.spec import bounds as spec_bounds
from witcert.spec import spot_check as spec
from witcert.spec.registry import by_key
from witcert.spot import confidence, delta_at_step, delta_per_cell, spot_randomness
from witcert.spot import spot_check_two_sided as spot_check

from tests.spot_cells import FAMILIES, GRID, binomial_ceiling, reader_for, synthetic_cell, true_tv


def run(scores, c, eps, *, keys, delta, seed):
    return spot_check(scores, c, reader_for(scores, eps), keys=keys, delta=delta,
                      generator=spot_randomness(seed).generator)


# ----------------------------------------------------------------------------- registry


def test_registry_rows():
    """SC is proved in Lean; SCB is named as a published, unproved bound; SCD is the union bound over
    the step allocation."""
    assert by_key("SC").lean == "WitCert.tv_le_spot_identity"
    assert by_key("SCB").lean is None and "Waudby-Smith" in by_key("SCB").note and "Maurer" in by_key("SCB").note
    assert by_key("SCD").lean == "WitCert.measure_iUnion_steps_le"


# ----------------------------------------------------------------------------- deterministic parts vs spec


@pytest.mark.parametrize("family", FAMILIES)
def test_identity_bounds_tv_for_any_z_prime(family):
    """WitCert.tv_le_spot_identity, per cell and per Z' (including Z' far from Z); equality at Z' = Z."""
    scores, c, eps = synthetic_cell(family, 40, seed=3)
    with mpmath.workdps(40):
        p = spec_bounds.softmax([float(v) for v in scores])
        e = [float(x) if pt > 0 else 0.0 for x, pt in zip(eps, p)]
        tv = spec_bounds.tv_perturbed(p, e)
        z = mpmath.fsum(pt * mpmath.exp(-et) for pt, et in zip(p, e))
        for z_prime in (z, z * mpmath.mpf("0.5"), z * 3, mpmath.mpf("1e-3"), mpmath.mpf(40)):
            bound = spec.bound_spot_identity(p, e, z_prime)
            assert bound >= tv * (1 - mpmath.mpf(10) ** -35), (family, z_prime)
        assert abs(spec.bound_spot_identity(p, e, z) - tv) <= tv * mpmath.mpf(10) ** -30


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_set_and_bound_agree_with_spec(family):
    """Same draws: the exact set is the spec's; the bound is the spec's, rounded up by at most the grid."""
    scores, c, eps = synthetic_cell(family, 600, seed=11)
    result = run(scores, c, eps, keys=64, delta=1e-3, seed=5)
    with mpmath.workdps(30):
        p = spec_bounds.softmax([float(v) for v in scores])
        cl = [float(x) for x in c]
        k = result.exact.numel()
        assert spec.exact_set(p, cl, k) == result.exact.tolist()
        e = [float(x) if pt > 0 else 0.0 for x, pt in zip(eps, p)]
        want = spec.bound_spot_check(p, cl, e, result.exact.tolist(), result.z_prime, result.draws.tolist(), 1e-3)
    assert float(want) * (1 - 1e-12) - 1e-15 <= result.bound <= float(want) * (1 + 1e-8) + 1e-11  # same grid cells


@pytest.mark.parametrize("n", (2, 7, 60, 300))
def test_confidence_bounds_agree_with_spec(n):
    """EB equal to rounding; betting the spec's grid point (never below it: the fp64 test keeps a margin)."""
    g = torch.Generator().manual_seed(n)
    x = torch.rand(n, generator=g, dtype=torch.float64) ** 4
    xs = [float(v) for v in x]
    with mpmath.workdps(30):
        assert confidence.empirical_bernstein_upper(x, 1e-4) == pytest.approx(float(spec.empirical_bernstein_upper(xs, 1e-4)), rel=1e-10)
        spec_m = spec.betting_upper(xs, 1e-4)
        m = confidence.betting_upper(x, 1e-4)
        assert float(spec_m) <= m <= float(spec_m) + GRID


# ----------------------------------------------------------------------------- soundness


@pytest.mark.parametrize("family", FAMILIES)
def test_bound_covers_true_tv_at_small_delta(family):
    """delta = 1e-6: bound >= true TV on every cell (sizes around and far above the key budget)."""
    for seed, size in enumerate((50, 300, 3000)):
        scores, c, eps = synthetic_cell(family, size, seed=100 + seed)
        tv = true_tv(scores, eps)
        for draw_seed in range(3):
            result = run(scores, c, eps, keys=128, delta=1e-6, seed=draw_seed)
            assert result.bound >= tv, (family, size, draw_seed, result.bound, tv)
            assert 0 <= result.bound <= 1 and result.meter == result.bound
            assert result.keys_read <= 128


@pytest.mark.parametrize("bound", ("betting_upper", "empirical_bernstein_upper", "mean_upper"))
@pytest.mark.parametrize("law", ("bernoulli_small", "two_point", "beta", "uniform", "near_one"))
def test_mean_upper_failure_rate(law, bound):
    """SCB at delta = 0.2: each bound falls below the known mean at most as often as delta allows
    (betting alone fails about 12% of the Bernoulli(0.05) trials: the test can see a miscalibration)."""
    delta, trials, n = 0.2, 400, 40
    g = torch.Generator().manual_seed(7)
    samplers = {
        "bernoulli_small": (lambda: (torch.rand(n, generator=g, dtype=torch.float64) < 0.05).double(), 0.05),
        "two_point": (lambda: torch.where(torch.rand(n, generator=g, dtype=torch.float64) < 0.3, 0.9, 0.1), 0.34),
        "beta": (lambda: torch.distributions.Beta(0.5, 4.0).sample((n,)).double(), 0.5 / 4.5),
        "uniform": (lambda: torch.rand(n, generator=g, dtype=torch.float64), 0.5),
        "near_one": (lambda: 1 - 0.1 * torch.rand(n, generator=g, dtype=torch.float64), 0.95),
    }
    torch.manual_seed(8)  # Beta draws use the global generator
    sample, mean = samplers[law]
    upper = getattr(confidence, bound)
    failures = sum(upper(sample(), delta) < mean for _ in range(trials))
    assert failures <= binomial_ceiling(trials, delta), (law, bound, failures)


@pytest.mark.parametrize("family", ("vertex", "split", "heavy", "flat"))
def test_cell_failure_rate_at_large_delta(family):
    """The whole cell bound at delta = 0.2 with few keys: failures <= binomial ceiling over many seeds."""
    delta, trials = 0.2, 120
    scores, c, eps = synthetic_cell(family, 400, seed=21)
    tv = true_tv(scores, eps)
    failures = sum(run(scores, c, eps, keys=16, delta=delta, seed=s).bound < tv for s in range(trials))
    assert failures <= binomial_ceiling(trials, delta), (family, failures)


# ----------------------------------------------------------------------------- edges and inputs


def test_small_cell_is_read_whole():
    """S <= keys: every token is read and the bound is the true TV (rounded up by the slack only)."""
    scores, c, eps = synthetic_cell("vertex", 30, seed=2)
    result = run(scores, c, eps, keys=64, delta=1e-6, seed=0)
    tv = true_tv(scores, eps)
    assert tv <= result.bound <= tv * (1 + 1e-8) + 1e-11
    assert result.keys_read == 30 and result.draws.numel() == 0


def test_infinite_radius_outside_exact_set_is_trivial_inside_is_fine():
    scores, c, eps = synthetic_cell("flat", 500, seed=4)
    c_inf = c.clone()
    c_inf[0] = torch.inf  # flat scores: an infinite contribution goes first into the exact set
    assert run(scores, c_inf, eps, keys=64, delta=1e-6, seed=0).bound < 1
    c_many = c.clone()
    c_many[:200] = torch.inf  # more infinite radii than exact slots
    assert run(scores, c_many, eps, keys=64, delta=1e-6, seed=0).bound == 1.0
    c_huge = c.clone()
    c_huge[:200] = 709.7  # finite radii whose e^c sum overflows fp64: trivial bound, never NaN
    assert run(scores, c_huge, eps, keys=64, delta=1e-6, seed=0).bound == 1.0


def test_meter_is_min_of_both_and_delta_is_reported():
    scores, c, eps = synthetic_cell("vertex", 500, seed=6)
    reader = reader_for(scores, eps)
    result = spot_check(scores, c, reader, keys=64, delta=1e-5, meter=0.01, generator=spot_randomness(1).generator)
    assert result.meter == min(0.01, result.bound) and result.delta == 1e-5


def test_wrong_radius_is_refused():
    scores, c, eps = synthetic_cell("vertex", 500, seed=6)
    with pytest.raises(ValueError, match="radii"):
        run(scores, c * 0.5, eps, keys=64, delta=1e-6, seed=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(keys=0), "keys"), (dict(keys=2.5), "keys"), (dict(delta=0.0), "delta"), (dict(delta=1.0), "delta")])
def test_bad_arguments_name_themselves(kwargs, match):
    scores, c, eps = synthetic_cell("flat", 20, seed=0)
    args = dict(keys=8, delta=1e-3) | kwargs
    with pytest.raises(ValueError, match=match):
        spot_check(scores, c, reader_for(scores, eps), **args)


def test_bad_tensors_name_themselves():
    scores, c, eps = synthetic_cell("flat", 20, seed=0)
    reader = reader_for(scores, eps)
    bad = scores.clone()
    bad[3] = torch.nan
    with pytest.raises(ValueError, match="scores"):
        spot_check(bad, c, reader, keys=8, delta=1e-3)
    with pytest.raises(ValueError, match="scores"):
        spot_check(torch.full((5,), -torch.inf), c[:5], reader, keys=8, delta=1e-3)
    with pytest.raises(ValueError, match="radii"):
        spot_check(scores, -c, reader, keys=8, delta=1e-3)
    with pytest.raises(ValueError, match="radii"):
        spot_check(scores, c[:5], reader, keys=8, delta=1e-3)


# ----------------------------------------------------------------------------- randomness and budget


def test_randomness_from_os_by_default_seed_replays():
    first, second = spot_randomness(), spot_randomness()
    assert first.from_os and second.from_os and first.seed != second.seed
    scores, c, eps = synthetic_cell("heavy", 800, seed=9)
    a, b = run(scores, c, eps, keys=64, delta=1e-6, seed=42), run(scores, c, eps, keys=64, delta=1e-6, seed=42)
    assert torch.equal(a.draws, b.draws) and a.bound == b.bound and not spot_randomness(42).from_os
    with pytest.raises(ValueError, match="seed"):
        spot_randomness(-1)


def test_budget_matches_spec_and_sums_within_request():
    assert delta_per_cell(1e-2, 400) == pytest.approx(float(spec.delta_per_cell(1e-2, 400)), rel=1e-15)
    for k in (1, 2, 17):
        assert delta_at_step(1e-2, k, 270) == pytest.approx(float(spec.delta_at_step(1e-2, k, 270)), rel=1e-14)
    assert sum(delta_at_step(1e-2, k, 270) * 270 for k in range(1, 20000)) <= 1e-2
    for bad in (dict(delta_req=0.0), dict(step=0), dict(cells_per_step=0)):
        args = dict(delta_req=1e-2, step=1, cells_per_step=3) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            delta_at_step(**args)


# ----------------------------------------------------------------------------- the monitor option


@pytest.mark.usefixtures("one_thread")
def test_monitor_spot_certificate_on_a_tiny_model():
    """certificate='spot': cells above tau are checked, meter = min(meter before the check, spot bound) >= true TV,
    keys and bytes reported per cell (the bytes deduplicated across the query heads of a kv head: at most the
    keys' bytes), delta reported where a check ran."""
    import numpy as np

    import witcert
    from tests.tiny_models import prompts, tiny

    model = tiny("llama")
    ids, mask = prompts(2, length=40)
    with torch.no_grad(), witcert.monitor(model, "kivi-2bit", certificate="spot", spot_keys=16,
                                          spot_delta=1e-6, tau=0.04) as mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    table = mon.table()
    meter, det, spot = table["meter"], table["meter_before_spot"], table["spot_bound"]
    live = ~np.isnan(meter)
    checked = live & (det > mon.tau)
    assert checked.any() and not checked.all(), np.quantile(det[live], [0, 0.5, 1])
    assert np.array_equal(~np.isnan(spot) & live, checked)
    assert np.all(meter[live] <= det[live]) and np.all(meter[checked] == np.minimum(det, spot)[checked])
    assert np.all(table["true_tv"][live] <= meter[live])
    assert np.all(table["spot_keys"][checked] >= 1) and np.all(table["spot_keys"][checked] <= 16)
    row = model.config.head_dim * 4  # an fp32 key
    assert 0 < table["spot_bytes"][checked].sum() < table["spot_keys"][checked].sum() * row  # shared reads count once
    assert np.all(table["spot_bytes"][live & ~checked] == 0)
    assert np.all(table["spot_delta"][checked] <= 1e-6 * (1 + 1e-6))
    # checked at generate's end (deferred): a key group read whole gives its cells their true TV, no delta spent
    whole = checked & (table["spot_delta"] == 0)
    assert np.all(spot[whole] >= table["true_tv"][whole]) and np.all(spot[whole] <= table["true_tv"][whole] + 1e-9)
    assert np.all(table["spot_delta"][live & ~checked] == 0)


def test_monitor_spot_options_are_checked():
    import witcert
    from tests.tiny_models import tiny

    model = tiny("llama")
    with pytest.raises(ValueError, match="backing_dir"):
        witcert.monitor(model, "rtn-int4", certificate="deterministic", keep_exact=False, backing_dir="/tmp")
    with pytest.raises(ValueError, match="certificate"):
        witcert.monitor(model, "rtn-int4", certificate="sampled")
    with pytest.raises(ValueError, match="spot_keys"):
        witcert.monitor(model, "rtn-int4", certificate="spot", spot_keys=0)
    with pytest.raises(ValueError, match="spot_delta"):
        witcert.monitor(model, "rtn-int4", certificate="spot", spot_delta=2.0)

"""The chi-square (CS) and mass-split (MS) bounds in the spec (registry CS, MS).

Implementations: ``spec.bounds.bound_chi_square`` / ``bound_mass_split`` (mpmath at the caller's
precision), their 50-digit goldens in ``spec.golden`` and the ``decimal`` fourth implementation
``spec.independent`` (literal formulas, own threshold arithmetic).
Oracles: the exhaustive sup of the true TV over the box (``golden.sup_box_tv_exhaustive``, exact:
every vertex, S <= 12), the golden true TV at errors inside the box, the fourth implementation.
Domain: ``tests/oracles`` cells (scores in [-40, 40] with ties and ``-inf`` masks, radii in
{0} u [1e-30, 12] u {50, 700}), S <= 12 for the sup, explicit thresholds drawn around the radii.
Tolerances: ``sup <= bound`` and ``TV <= bound`` up to 1e-45 relative (two 50-digit values);
golden vs fourth 40 digits; the ``g = max c`` identity exactly (same arithmetic).
Every property is checked per input (docs/design.md "The meter and the risk score").
"""
import math

import mpmath
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import mpf

from tests.oracles import EDGE_CELLS, NEG_INF, Cell, agree, at_most, cells, interior_errors, radius_lists, score_lists, to_mpf, with_edge_cells
from witcert.spec import bounds, golden, independent
from witcert.spec.registry import by_key

NEW = ("chi_square", "mass_split")


@st.composite
def small_cells(draw, max_size: int = 12, interior: bool = False) -> Cell:
    """A cell with S <= ``max_size`` (the exhaustive sup's range); errors in the box."""
    scores = draw(score_lists(1, max_size))
    c = draw(radius_lists(len(scores)))
    if interior:
        return Cell(scores, c, draw(interior_errors(c)))
    return Cell(scores, c, tuple(0.0 for _ in c))


@st.composite
def threshold_lists(draw, c: tuple[float, ...]) -> tuple[float, ...]:
    """Thresholds at, between and around the radii (ties with some ``c_t`` on purpose)."""
    finite = [r for r in c if math.isfinite(r)] or [0.0]
    near = st.tuples(st.sampled_from(finite), st.sampled_from((1.0, 0.5, 0.999, 1.001))).map(lambda rf: rf[0] * rf[1])
    anywhere = st.floats(0.0, 2 * max(finite) + 1.0)
    return tuple(draw(st.lists(st.one_of(near, anywhere, st.just(-1.0)), min_size=1, max_size=5)))


def _base(scores, c) -> mpf:
    """``min(T1, P1, CS, MN)``: the first term at ``L`` = every token (golden)."""
    return min(golden.eform_from_scores(scores, c), golden.two_sided_from_scores(scores, c),
               golden.chi_square_from_scores(scores, c), golden.maxnorm_from_scores(scores, c))


# ----------------------------------------------------------------------------- registry


def test_registry_rows():
    """CS and MS name their Lean theorems, these mirrors and the torch bounds; the kernel carries CS, not MS."""
    cs, ms = by_key("CS"), by_key("MS")
    assert cs.lean == "WitCert.tv_le_chi_square" and cs.spec == "witcert.spec.bounds.bound_chi_square"
    assert ms.lean == "WitCert.tv_le_mass_split" and ms.spec == "witcert.spec.bounds.bound_mass_split"
    assert cs.torch == "witcert.core.bounds.chi_square_bound" and ms.torch == "witcert.core.bounds.mass_split_bound"
    assert cs.kernel == "witcert.kernels.decode_attention.decode_attention" and ms.kernel is None
    assert "kernels/certificate.py" in cs.note and "min(1, T1, P1, MN, CS)" in ms.note


# ----------------------------------------------------------------------------- soundness, per query


@settings(max_examples=60)
@given(cell=small_cells())
@with_edge_cells
def test_never_below_the_exact_sup_over_the_box(cell):
    """CS and MS (default grid) >= the exhaustive sup of the true TV over |eps_t| <= c_t, S <= 12."""
    sup = golden.sup_box_tv_exhaustive(cell.scores, cell.c)
    for name in NEW:
        assert at_most(sup, golden.BOUNDS_FROM_SCORES[name](cell.scores, cell.c)), name


@settings(max_examples=60)
@given(cell=small_cells(max_size=8), data=st.data())
def test_mass_split_at_any_thresholds_never_below_the_exact_sup(cell, data):
    """MS is a theorem for every threshold set: explicit thresholds, ties with the radii included."""
    thresholds = data.draw(threshold_lists(cell.c))
    sup = golden.sup_box_tv_exhaustive(cell.scores, cell.c)
    assert at_most(sup, golden.mass_split_from_scores(cell.scores, cell.c, thresholds))


@pytest.mark.parametrize("cell", EDGE_CELLS, ids=str)
def test_edge_cells_at_every_single_threshold(cell):
    """The pinned cells (ties, S = 1, all but one masked, huge and tiny c): MS at each radius as the
    only threshold is >= the exact sup and agrees with the fourth implementation (40 digits)."""
    sup = golden.sup_box_tv_exhaustive(cell.scores, cell.c)
    for g in sorted(set(cell.c)):
        ms = golden.mass_split_from_scores(cell.scores, cell.c, [g])
        assert at_most(sup, ms), g
        assert agree(ms, independent.mass_split_from_scores(cell.scores, cell.c, [g])), g


@given(cell=small_cells(max_size=8, interior=True))
@with_edge_cells
def test_never_below_the_true_tv_inside_the_box(cell):
    """At errors inside the box (not only vertices): golden TV <= CS, MS; hypotheses hold."""
    true_tv = golden.tv_from_scores(cell.scores, cell.eps)
    p_tilde = golden.softmax(cell.scores)
    for name in NEW:
        with mpmath.workdps(50):
            assert bounds.HYPOTHESES[name](p_tilde, cell.c, cell.eps, tol=mpf("1e-45")), name
        assert at_most(true_tv, golden.BOUNDS_FROM_SCORES[name](cell.scores, cell.c)), name


# ----------------------------------------------------------------------------- shape


@pytest.mark.parametrize("c", [1e-12, 1e-6, 1e-3, 0.1])
def test_chi_square_for_equal_radii_is_first_order_tanh_half(c):
    """Equal radii: CS = expm1(c) e^c / 2 whatever p~; it dominates tanh(c/2) (attained by the
    two-point extremal case, so any sound data-free bound must) and agrees with it to first order:
    0 <= CS / tanh(c/2) - 1 <= 2c (CS / (c/2) = 1 + 3c/2 + O(c^2))."""
    for scores in [(0.0, 0.0), (0.0, c), (3.0, -1.0, 0.5, NEG_INF)]:
        k = sum(1 for s in scores if s != NEG_INF)
        cs = golden.chi_square_from_scores(scores, [c] * len(scores))
        with mpmath.workdps(60):
            assert agree(cs, mpmath.expm1(mpf(c)) * mpmath.exp(mpf(c)) / 2)
            excess = to_mpf(cs) / mpmath.tanh(mpf(c) / 2) - 1
        assert 0 <= excess <= 2 * c, (scores, k)


def test_chi_square_sees_little_mass_on_large_radii():
    """One token of mass 1e-4 with c = 5, the rest c = 0.01: CS ~ 1/2 sqrt(E expm1(c)^2) ~ 0.74,
    while tanh(D/2) = 0.987; MS splits the large radius off and is far below both."""
    scores, c = (0.0, math.log(1e-4)), (0.01, 5.0)
    cs, ms = golden.chi_square_from_scores(scores, c), golden.mass_split_from_scores(scores, c)
    sup = golden.sup_box_tv_exhaustive(scores, c)
    assert cs < golden.maxnorm_from_scores(scores, c) / 1.25
    assert ms < cs / 20 and at_most(sup, ms)


@given(cell=small_cells(max_size=8), data=st.data())
def test_threshold_at_max_c_is_the_base_bound(cell, data):
    """g = max c: L holds every token, delta = 0, and MS = min(T1, P1, CS, MN) (45 digits: the
    same formulas, p~ normalised once more); every grid holding max c (the default one does) is at
    most that."""
    d = max(r for r, s in zip(cell.c, cell.scores) if s != NEG_INF)
    base = _base(cell.scores, cell.c)
    assert agree(golden.mass_split_from_scores(cell.scores, cell.c, [d]), base, digits=45)
    assert at_most(golden.mass_split_from_scores(cell.scores, cell.c), base)
    extra = data.draw(threshold_lists(cell.c))
    assert at_most(golden.mass_split_from_scores(cell.scores, cell.c, [d, *extra]), base)


def test_default_grid_is_max_c_then_two_bit_mantissa_floats_below_it():
    """D, then the 11 largest (1 + r/4) 2^q strictly below D (exact); D = 0 or inf gives [D]."""
    grid = bounds.mass_split_thresholds((0.5, 0.5), (0.3, 0.7))
    assert grid == [mpf(0.7)] + [mpf(x) for x in (0.625, 0.5, 0.4375, 0.375, 0.3125, 0.25, 0.21875, 0.1875,
                                                   0.15625, 0.125, 0.109375)]
    assert bounds.mass_split_thresholds((0.5, 0.5), (0.25, 2.0))[:6] == [2, 1.75, 1.5, 1.25, 1, 0.875]
    assert bounds.mass_split_thresholds((0.5, 0.5), (0.25, 0.75))[1] == mpf(0.625)  # strictly below a grid D
    assert bounds.mass_split_thresholds((0.5, 0.5), (0.25, 0.7500001))[1] == mpf(0.75)
    assert bounds.mass_split_thresholds((1.0, 0.0), (0.1, 9.0))[0] == mpf(0.1)  # D over the support
    assert bounds.mass_split_thresholds((0.5, 0.5), (0.0, 0.0)) == [0]
    assert bounds.mass_split_thresholds((0.5, 0.5), (1.0, math.inf)) == [mpf("inf")]
    assert len(bounds.mass_split_thresholds((0.5, 0.5), (0.3, 0.7))) == bounds.MASS_SPLIT_LEVELS == 12
    assert len(bounds.mass_split_thresholds((0.5, 0.5), (0.3, 0.7), levels=1)) == 1
    with pytest.raises(ValueError, match="levels"):
        bounds.mass_split_thresholds((0.5, 0.5), (0.3, 0.7), levels=0)


def test_infinite_radius():
    """An infinite c on the support: CS = inf; MS = 1 (only g = D = inf: tanh(inf) = 1); an infinite
    c above an explicit threshold makes that threshold's value inf."""
    scores, c = (0.0, 1.0), (math.inf, 1.0)
    for impl in (golden, independent):
        assert mpmath.isinf(to_mpf(impl.chi_square_from_scores(scores, c)))
        assert to_mpf(impl.mass_split_from_scores(scores, c)) == 1
        assert mpmath.isinf(to_mpf(impl.mass_split_from_scores(scores, c, [1.0])))


def test_masked_tokens_play_no_part():
    base_cs = golden.chi_square_from_scores((0.0, 1.0), (0.5, 0.2))
    base_ms = golden.mass_split_from_scores((0.0, 1.0), (0.5, 0.2))
    assert golden.chi_square_from_scores((0.0, 1.0, NEG_INF), (0.5, 0.2, 30.0)) == base_cs
    assert golden.mass_split_from_scores((0.0, 1.0, NEG_INF), (0.5, 0.2, 30.0)) == base_ms


# ----------------------------------------------------------------------------- golden vs the fourth implementation


@given(cell=cells(), data=st.data())
def test_golden_agrees_with_independent_at_explicit_thresholds(cell, data):
    """MS at drawn thresholds (ties with radii, negative, beyond D): golden vs decimal, 40 digits."""
    thresholds = data.draw(threshold_lists(cell.c))
    assert agree(golden.mass_split_from_scores(cell.scores, cell.c, thresholds),
                 independent.mass_split_from_scores(cell.scores, cell.c, thresholds))


@pytest.mark.parametrize("d", [1.0, 0.75, 0.7, 2.0**-40, 3e-300, 700.0])
def test_default_grid_agrees_on_grid_edges(d):
    """Radii on, just below and just above grid values (and tiny or huge D): both implementations
    pick the same sets (exact comparisons, each its own grid arithmetic) and agree to 40 digits."""
    with mpmath.workdps(30):
        grid = [float(g) for g in bounds.mass_split_thresholds((1.0,), (d,))]
    scores = (0.0, 0.3, -0.2, 1.0, -1.0, 0.5)
    c = (d, grid[1], math.nextafter(grid[2], 0.0), math.nextafter(grid[4], math.inf), grid[7], grid[11] / 2)
    assert agree(golden.mass_split_from_scores(scores, c), independent.mass_split_from_scores(scores, c))


@pytest.mark.parametrize("d", [1.0, 0.75, 0.7, 2.0**-40, 3e-300, 700.0])
def test_independent_grid_matches_the_spec_grid(d):
    """The decimal implementation's low sets are {c <= g_k} for the spec's thresholds g_k: each g_k
    itself is inside, the next float above it outside (grids derived separately: integer ratios vs
    mpmath frexp)."""
    from decimal import Decimal

    with mpmath.workdps(30):
        grid = [float(g) for g in bounds.mass_split_thresholds((1.0,), (d,))]
    low_sets = independent._default_split_sets(Decimal(d))
    assert len(low_sets) == len(grid)
    for g, inside in zip(grid[1:], low_sets[1:]):
        assert inside(Decimal(g)) and not inside(Decimal(math.nextafter(g, math.inf))), g


# ----------------------------------------------------------------------------- input checks


@pytest.mark.parametrize("thresholds, message", [((), "thresholds: must hold at least one"),
                                                  ((0.1, float("nan")), "thresholds: contains NaN")])
def test_mass_split_rejects_bad_thresholds(thresholds, message):
    with pytest.raises(ValueError, match=message):
        bounds.bound_mass_split((0.5, 0.5), (0.1, 0.2), thresholds)

"""The executable spec of the meter's bounds (registry T1, P1, P1r, MN, RC, CS, MS, L4, UNSOUND).

Implementations: ``spec/bounds.py`` (statements), ``spec/golden.py`` (50-digit mpmath golden),
``spec/independent.py`` (fourth implementation, ``decimal``, from the definitions).
Oracles: the golden true TV and exhaustive sup over the box; the fourth implementation.
Domain: scores in [-40, 40] with ties and ``-inf`` masks, S <= 8 (S <= 6 for the exhaustive sup),
radii in [0, 12] plus 0, 1e-30, 1e-8, 50, 700; errors in the box, biased to its vertices.
Tolerances: ``TV <= bound`` up to 1e-45 relative (both 50-digit); golden vs fourth 40 digits.
Every property is checked per input, never in aggregate (docs/design.md "The meter and the risk score").
"""
import ast
from pathlib import Path

import mpmath
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpmath import mpf

from tests.oracles import (
    EDGE_CELLS,
    NEG_INF,
    Cell,
    agree,
    agree_all,
    at_most,
    box_errors,
    cells,
    distributions,
    interior_errors,
    radius_lists,
    score_lists,
    to_mpf,
    with_edge_cells,
)
from witcert.spec import bounds, golden, independent
from witcert.spec.registry import by_key

SPEC_DIR = Path(__file__).resolve().parents[1] / "spec"
SOUND = bounds.SOUND_BOUNDS
KEY_OF_BOUND = {"eform": "T1", "two_sided": "P1", "retention": "P1r", "maxnorm": "MN", "competitor": "RC",
                "chi_square": "CS", "mass_split": "MS"}


def _hypotheses_hold(name: str, cell: Cell) -> bool:
    """hypotheses_<name> on the golden p~ of ``cell``, checked at 50 digits (|sum p~ - 1| <= 1e-45)."""
    with mpmath.workdps(50):
        return bounds.HYPOTHESES[name](golden.softmax(cell.scores), cell.c, cell.eps, tol=mpf("1e-45"))


# ----------------------------------------------------------------------------- the known-false form


def test_unsound_counterexample_is_violated_while_sound_bounds_hold():
    """UNSOUND vs golden TV at p~ = (1/2, 1/2), c = (0.1, 0.1), eps = (0.1, -0.1) (docs/design.md "The meter and the risk score")."""
    scores, c, eps = (0.0, 0.0), (0.1, 0.1), (0.1, -0.1)
    p_tilde = golden.softmax(scores)
    assert p_tilde == (mpf("0.5"), mpf("0.5"))
    assert bounds.hypotheses_unsound_dispersion(p_tilde, c, eps)  # its hypotheses hold ...
    true_tv = golden.tv_from_scores(scores, eps)
    unsound = golden.unsound_dispersion_from_scores(scores, c)
    assert mpmath.nstr(true_tv, 5) == "0.049834"
    assert mpmath.nstr(unsound, 4) == "0.006423"
    assert true_tv > unsound  # ... and its conclusion fails
    for name in ("eform", "two_sided", "retention", "maxnorm"):
        assert bounds.HYPOTHESES[name](p_tilde, c, eps)
        assert true_tv <= golden.BOUNDS_FROM_SCORES[name](scores, c), name
    assert agree(independent.tv_from_scores(scores, eps), true_tv)
    assert agree(independent.unsound_dispersion_from_scores(scores, c), unsound)


def test_registry_rows_name_these_mirrors():
    """Registry rows of this area point at the functions defined here."""
    for name, key in KEY_OF_BOUND.items():
        assert by_key(key).spec == f"witcert.spec.bounds.bound_{name}"
    assert by_key("UNSOUND").spec == "witcert.spec.bounds.bound_unsound_dispersion"
    assert by_key("UNSOUND").lean is None
    assert by_key("L4").spec == "witcert.spec.bounds.a_merge"


# ----------------------------------------------------------------------------- soundness, per input


@given(cell=cells())
@with_edge_cells
def test_every_sound_bound_dominates_true_tv(cell):
    """For each sound statement (T1, P1, P1r, MN, RC): its hypotheses hold at this eps in the box
    and bound_<name> (golden) >= golden TV. Then the orderings P1r <= T1 (the first argument of
    P1r's min sums to T1) and MN <= RC, and meter = min(1, T1, P1, MN) >= TV."""
    true_tv = golden.tv_from_scores(cell.scores, cell.eps)
    g = {}
    for name in SOUND:
        assert _hypotheses_hold(name, cell), name
        g[name] = golden.BOUNDS_FROM_SCORES[name](cell.scores, cell.c)
        assert at_most(true_tv, g[name]), name
    assert at_most(g["retention"], g["eform"])
    assert at_most(g["maxnorm"], g["competitor"])
    meter = golden.meter_from_scores(cell.scores, cell.c)
    assert meter == min(mpf(1), g["eform"], g["two_sided"], g["maxnorm"], g["chi_square"], g["mass_split"])
    assert at_most(true_tv, meter)


@given(size=st.integers(1, 8), data=st.data())
def test_sound_bounds_on_distributions_drawn_directly(size, data):
    """spec.bounds at 50 digits on a p~ drawn directly (zeros = masked, tiny masses): every sound
    bound >= tv_perturbed at an eps in the box (tolerance 1e-45 relative)."""
    with mpmath.workdps(50):
        p_tilde = data.draw(distributions(size))
        c = data.draw(radius_lists(size))
        eps = data.draw(box_errors(c))
        true_tv = bounds.tv_perturbed(p_tilde, eps)
        for name in SOUND:
            assert bounds.HYPOTHESES[name](p_tilde, c, eps), name
            assert at_most(true_tv, bounds.BOUNDS[name](p_tilde, c)), name


@pytest.mark.parametrize("d", [1e-20, 1e-3, 0.1, 1.0, 5.0, 20.0, 50.0])
def test_two_point_extremal_attains_tanh_half(d):
    """MN is tight: uniform c = D, mass 1/(1 + e^D) pushed up by eps = (-D, +D) gives tanh(D/2).

    Oracle: mpmath tanh at 50 digits; tolerance 30 digits (the brief's).
    """
    scores, c, eps = (0.0, d), (d, d), (-d, d)  # softmax(0, D) = (1/(1+e^D), e^D/(1+e^D))
    with mpmath.workdps(50):
        target = mpmath.tanh(mpf(d) / 2)
    assert agree(golden.tv_from_scores(scores, eps), target, digits=30)
    assert agree(golden.sup_box_tv_exhaustive(scores, c), target, digits=30)
    assert agree(golden.maxnorm_from_scores(scores, c), target, digits=30)
    assert agree(independent.tv_from_scores(scores, eps), target, digits=30)


@given(d=st.floats(1e-12, 60.0))
def test_two_point_extremal_attains_tanh_half_for_any_d(d):
    """As above over a range of D, 40 digits."""
    with mpmath.workdps(50):
        target = mpmath.tanh(mpf(d) / 2)
    assert agree(golden.tv_from_scores((0.0, d), (-d, d)), target)


def test_infinite_radius_gives_trivial_meter():
    """An infinite c on an unmasked token (overflow): A-based bounds inf, tanh 1, meter 1."""
    scores, c = (0.0, 1.0), (float("inf"), 1.0)
    for impl in (golden, independent):
        assert to_mpf(impl.meter_from_scores(scores, c)) == 1
        for name in ("eform", "two_sided", "retention", "unsound_dispersion"):
            assert mpmath.isinf(to_mpf(impl.BOUNDS_FROM_SCORES[name](scores, c)))
        assert to_mpf(impl.maxnorm_from_scores(scores, c)) == 1
    assert agree(golden.sup_box_tv_exhaustive(scores, c), independent.sup_box_tv_exhaustive(scores, c))


def test_masked_tokens_play_no_part():
    """A masked token's c and eps change nothing (they are dropped; D is over the support)."""
    base = golden.meter_from_scores((0.0, 1.0), (0.5, 0.2))
    assert golden.meter_from_scores((0.0, 1.0, NEG_INF), (0.5, 0.2, 30.0)) == base
    assert golden.tv_from_scores((0.0, 1.0, NEG_INF), (0.5, 0.2, 30.0)) == golden.tv_from_scores((0.0, 1.0), (0.5, 0.2))


# ----------------------------------------------------------------------------- golden vs the fourth implementation

GOLDEN_OF = {
    "a_plus": golden.a_plus_from_scores,
    "a_minus": golden.a_minus_from_scores,
    "meter": golden.meter_from_scores,
    **golden.BOUNDS_FROM_SCORES,
}
"""Golden of every quantity of (scores, c) that ``independent.quantities`` also returns."""


@given(cell=cells())
@with_edge_cells
def test_golden_agrees_with_independent(cell):
    """Every quantity: golden (mpmath, cancellation-free) vs fourth (decimal, literal), 40 digits."""
    s, c, e = cell.scores, cell.c, cell.eps
    fourth = independent.quantities(s, c, e)
    assert agree_all(golden.softmax(s), fourth["p_tilde"])
    assert agree(golden.normaliser_from_scores(s, e), fourth["normaliser"])
    assert agree_all(golden.p_from_scores(s, e), fourth["p"])
    assert agree(golden.tv_from_scores(s, e), fourth["tv"])
    for name, gold in GOLDEN_OF.items():
        assert agree(gold(s, c), fourth[name]), name


@pytest.mark.parametrize("cell", EDGE_CELLS[:4], ids=str)
def test_independent_wrappers_return_its_joint_evaluation(cell):
    """The per-quantity functions of the fourth implementation are views of ``quantities``."""
    joint = independent.quantities(cell.scores, cell.c, cell.eps)
    assert agree_all(independent.softmax(cell.scores), joint["p_tilde"])
    assert agree(independent.tv_from_scores(cell.scores, cell.eps), joint["tv"])
    assert agree_all(independent.p_from_scores(cell.scores, cell.eps), joint["p"])
    assert agree(independent.normaliser_from_scores(cell.scores, cell.eps), joint["normaliser"])
    assert agree(independent.meter_from_scores(cell.scores, cell.c), joint["meter"])
    assert agree(independent.a_plus_from_scores(cell.scores, cell.c), joint["a_plus"])
    assert agree(independent.a_minus_from_scores(cell.scores, cell.c), joint["a_minus"])
    for name, fourth in independent.BOUNDS_FROM_SCORES.items():
        assert agree(fourth(cell.scores, cell.c), joint[name]), name


def test_golden_tv_is_the_literal_definition():
    """golden.tv (50 digits) = 1/2 sum |p - q| on exact inputs; decimal agrees."""
    p, q = (0.25, 0.5, 0.25), (0.5, 0.125, 0.375)
    assert golden.tv(p, q) == mpf("0.375")
    assert agree(independent.tv(p, q), mpf("0.375"))


@given(cell=cells(max_size=6))
def test_cancellation_free_tv_equals_literal_tv(cell):
    """spec.bounds.tv_perturbed vs the literal tv(perturbed(p~, eps), p~), both at 120 digits; tolerance
    1e-110 absolute (the literal form cancels, so its error is absolute)."""
    with mpmath.workdps(120):
        p_tilde = bounds.softmax(cell.scores)
        literal = bounds.tv(bounds.perturbed(p_tilde, cell.eps), p_tilde)
        direct = bounds.tv_perturbed(p_tilde, cell.eps)
        assert abs(literal - direct) <= mpf("1e-110")  # the literal form's absolute rounding


# ----------------------------------------------------------------------------- the exhaustive sup over the box


@st.composite
def small_cells_with_interior(draw):
    scores = draw(score_lists(1, 6))
    c = draw(radius_lists(len(scores)))
    return Cell(scores, c, draw(interior_errors(c)))


@given(cell=small_cells_with_interior())
@with_edge_cells
def test_sup_box_between_true_tv_and_every_sound_bound(cell):
    """Exhaustive sup (golden) >= TV at an eps in the box and <= every sound bound;
    the maximising vertex attains it; the fourth implementation's sup agrees (40 digits)."""
    sup, inside = golden.sup_box_argmax_exhaustive(cell.scores, cell.c)
    assert at_most(golden.tv_from_scores(cell.scores, cell.eps), sup)
    for name in SOUND:
        assert at_most(sup, golden.BOUNDS_FROM_SCORES[name](cell.scores, cell.c)), name
    assert agree(sup, independent.sup_box_tv_exhaustive(cell.scores, cell.c))
    if all(r < float("inf") for r in cell.c):
        vertex = tuple(-r if t in inside else r for t, r in enumerate(cell.c))
        assert agree(golden.tv_from_scores(cell.scores, vertex), sup)


@given(scores=score_lists(1, 6), data=st.data())
def test_sup_box_dominates_every_vertex(scores, data):
    """The sup is a max over vertices: no drawn vertex exceeds it."""
    c = data.draw(radius_lists(len(scores)))
    vertex = data.draw(box_errors(c, vertex=True))
    assert at_most(golden.tv_from_scores(scores, vertex), golden.sup_box_tv_exhaustive(scores, c))


def test_sup_box_refuses_large_s():
    with pytest.raises(ValueError, match="scores: 21 unmasked"):
        golden.sup_box_tv_exhaustive([0.0] * 21, [0.1] * 21)
    assert golden.sup_box_tv_exhaustive([0.0] * 3 + [NEG_INF] * 30, [0.1] * 33) > 0  # masked don't count


# ----------------------------------------------------------------------------- L4: refinement and split-KV merge


def _merged_and_whole_a(scores, c, cuts):
    """(A merged from the partitions cut at ``cuts``, unsplit A), at 50 digits."""
    with mpmath.workdps(50):
        whole = bounds.a_plus(bounds.softmax(scores), c)
        parts = []
        for lo, hi in zip([0, *cuts], [*cuts, len(scores)]):
            lse = bounds.logsumexp(scores[lo:hi])
            masked = lse == -mpmath.inf  # then A_j is ignored: give it a poison value
            a_j = mpf("nan") if masked else bounds.a_plus(bounds.softmax(scores[lo:hi]), c[lo:hi])
            parts.append((lse, a_j))
        return bounds.a_merge(parts), whole


@given(scores=score_lists(2, 10), data=st.data())
def test_a_merge_equals_unsplit_a(scores, data):
    """L4 (WitCert.block_sum_eq_token_sum): A merged over split partitions with LSE weights equals
    the unsplit A (50 digits; tolerance 40)."""
    c = data.draw(radius_lists(len(scores)))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(scores) - 1), max_size=3)))
    merged, whole = _merged_and_whole_a(scores, c, cuts)
    assert agree(merged, whole)


def test_a_merge_gives_an_all_masked_partition_weight_zero():
    merged, whole = _merged_and_whole_a((NEG_INF, NEG_INF, 0.5, 1.0), (1.0, 2.0, 0.25, 0.5), [2])
    assert agree(merged, whole)


@given(scores=score_lists(2, 10), data=st.data())
def test_blockwise_a_equals_per_token_a(scores, data):
    """L4 refinement: with c_t = u_b for every token of block b, sum_b mass_b e^{u_b} = A."""
    cuts = sorted(data.draw(st.sets(st.integers(1, len(scores) - 1), max_size=3)))
    blocks = list(zip([0, *cuts], [*cuts, len(scores)]))
    radii = data.draw(radius_lists(len(blocks)))
    with mpmath.workdps(50):
        p_tilde = bounds.softmax(scores)
        per_token_c = [radii[b] for b, (lo, hi) in enumerate(blocks) for _ in range(lo, hi)]
        masses = [mpmath.fsum(p_tilde[lo:hi]) for lo, hi in blocks]
        assert agree(bounds.a_plus(masses, radii), bounds.a_plus(p_tilde, per_token_c))


# ----------------------------------------------------------------------------- hypotheses_* and input checks


@pytest.mark.parametrize("name", [*SOUND, "unsound_dispersion"])
def test_hypotheses_reject_inputs_outside_the_statement(name):
    hyp = bounds.HYPOTHESES[name]
    p, c = (0.25, 0.75), (0.5, 0.1)
    assert hyp(p, c, (0.5, -0.1))
    assert not hyp(p, c, (0.6, 0.0))  # |eps| above every radius
    assert not hyp((0.25, 0.7), c, (0.0, 0.0))  # not a distribution
    assert hyp((0.25, 0.7), c, (0.0, 0.0), tol=0.1)
    assert not hyp((-0.25, 1.25), c, (0.0, 0.0))  # negative probability
    assert not hyp(p, (0.5, -0.1), (0.0, 0.0))  # negative radius
    assert not hyp(p, c, (0.0,))  # wrong length
    assert hyp((0.0, 1.0), c, (7.0, 0.1))  # a zero-mass token's eps is free


def test_maxnorm_hypothesis_needs_only_the_largest_radius():
    """MN and RC assume |eps_t| <= max c; the per-token box statements assume |eps_t| <= c_t."""
    p, c, eps = (0.5, 0.5), (0.5, 0.1), (0.0, 0.4)
    assert bounds.hypotheses_maxnorm(p, c, eps) and bounds.hypotheses_competitor(p, c, eps)
    assert not bounds.hypotheses_eform(p, c, eps)


@pytest.mark.parametrize(
    "p_tilde, c, message",
    [
        ((0.5, float("nan")), (0.1, 0.1), "p_tilde: contains NaN"),
        ((0.5, -0.5), (0.1, 0.1), "p_tilde: contains a negative"),
        ((0.0, 0.0), (0.1, 0.1), "p_tilde: has no mass"),
        ((0.5, 0.5), (0.1, -0.1), "c: contains a negative"),
        ((0.5, 0.5), (0.1, float("nan")), "c: contains NaN"),
        ((0.5, 0.5), (0.1,), "c: has 1 entries"),
        ((), (), "p_tilde: must hold at least one"),
    ],
)
@pytest.mark.parametrize("name", list(bounds.BOUNDS))
def test_bounds_reject_bad_input(name, p_tilde, c, message):
    with pytest.raises(ValueError, match=message):
        bounds.BOUNDS[name](p_tilde, c)


@pytest.mark.parametrize("impl", [golden, independent], ids=["golden", "independent"])
def test_scores_inputs_are_checked(impl):
    with pytest.raises(ValueError, match="scores: every token is masked"):
        impl.tv_from_scores((NEG_INF, NEG_INF), (0.0, 0.0))
    with pytest.raises(ValueError, match=r"scores: contains \+inf"):
        impl.meter_from_scores((float("inf"), 0.0), (0.1, 0.1))
    with pytest.raises(ValueError, match="c: contains a negative"):
        impl.meter_from_scores((0.0, 0.0), (0.1, -0.1))
    with pytest.raises(ValueError, match="eps: has 1 entries"):
        impl.tv_from_scores((0.0, 0.0), (0.1,))


def test_a_merge_rejects_bad_partitions():
    with pytest.raises(ValueError, match="every partition is masked"):
        bounds.a_merge([(NEG_INF, 1.0)])
    with pytest.raises(ValueError, match="A_j"):
        bounds.a_merge([(0.0, -1.0)])


def test_bounds_follow_the_callers_precision():
    """spec.bounds computes at mp's working precision: 15 digits by default, 60 when asked."""
    with mpmath.workdps(60):
        wide = bounds.bound_eform((0.5, 0.5), (mpf(1) / 3, mpf(1) / 3))
    with mpmath.workdps(15):
        narrow = bounds.bound_eform((0.5, 0.5), (mpf(1) / 3, mpf(1) / 3))
    assert agree(narrow, wide, digits=14) and not agree(narrow, wide, digits=30)


# ----------------------------------------------------------------------------- purity of spec/


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


@pytest.mark.parametrize("path", sorted(SPEC_DIR.glob("*.py")), ids=lambda p: p.name)
def test_spec_imports_no_torch_or_numpy(path):
    """The spec is pure Python + mpmath (docs/design.md "Verification chain"): no torch, numpy, triton in spec/."""
    roots = {name.lstrip(".").split(".")[0] for name in _imported_modules(path)}
    assert not roots & {"torch", "numpy", "triton", "scipy"}, path.name


def test_independent_uses_neither_mpmath_nor_the_spec():
    """The fourth implementation is written from the definitions only: stdlib imports only."""
    imported = _imported_modules(SPEC_DIR / "independent.py")
    assert imported <= {"collections.abc", "decimal", "itertools", "math"}, imported


def test_edge_cells_are_in_the_box():
    """The pinned examples satisfy every sound statement's hypotheses."""
    for cell in EDGE_CELLS:
        assert all(_hypotheses_hold(name, cell) for name in SOUND)

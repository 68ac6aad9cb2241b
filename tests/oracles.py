"""Oracle machinery shared by the tests (no tests here), after SciPy's mpmath tests.

* ``Cell``: one (layer, head, step) input: compressed scores (``-inf`` = masked), per-token radii
  ``c`` and a logit error ``eps`` inside the box ``|eps_t| <= c_t``, all Python floats.
* Hypothesis strategies for scores, radii, box errors (biased to the vertices ``eps = +-c``,
  where TV is maximised) and whole cells; ``EDGE_CELLS`` and ``with_edge_cells`` pin the
  ``@example`` cases every property must pass: ties, ``S = 1``, all-but-one masked, huge ``c``
  (50, 700), tiny ``c`` (1e-30).
* Converters and comparisons between the golden (mpmath) and the fourth implementation
  (``decimal``): ``to_mpf``, ``agree``, ``at_most``.
"""
import math
from dataclasses import dataclass
from decimal import Decimal

import mpmath
from hypothesis import example
from hypothesis import strategies as st
from mpmath import mpf

NEG_INF = -math.inf

ORACLE_DIGITS = 40
"""Golden and fourth implementation must agree to this many significant digits (docs/design.md "Verification chain")."""
BOUND_REL_TOL = mpf("1e-45")
"""Relative slack for ``TV <= bound`` between two 50-digit values (equality is attained)."""
COMPARE_DPS = 120
"""Working digits for comparisons (above both implementations' accuracy)."""

EDGE_RADII = (0.0, 1e-30, 1e-8, 50.0, 700.0)
"""Radii every strategy draws often: zero, tiny, huge (e^700 near the fp64 limit)."""


@dataclass(frozen=True)
class Cell:
    """One meter input: ``scores`` (S,), radii ``c`` (S,) >= 0 and an error ``eps`` (S,) in the box."""

    scores: tuple[float, ...]
    c: tuple[float, ...]
    eps: tuple[float, ...]

    def __post_init__(self):
        if not len(self.scores) == len(self.c) == len(self.eps) > 0:
            raise ValueError("Cell: scores, c and eps must have the same positive length")
        if all(s == NEG_INF for s in self.scores):
            raise ValueError("Cell: every token is masked")
        if any(abs(e) > r for e, r in zip(self.eps, self.c)):
            raise ValueError("Cell: eps lies outside the box |eps| <= c")


EDGE_CELLS = (
    Cell((0.0, 0.0), (0.1, 0.1), (0.1, -0.1)),  # the UNSOUND counterexample
    Cell((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (1.0, -1.0, 1.0)),  # ties
    Cell((2.0, 2.0, -1.0), (0.5, 0.25, 2.0), (-0.5, 0.25, 2.0)),  # tie in scores, mixed radii
    Cell((3.0,), (2.0,), (2.0,)),  # S = 1: TV = 0
    Cell((NEG_INF, 1.5, NEG_INF), (1.0, 0.5, 2.0), (-1.0, 0.5, 2.0)),  # all but one masked
    Cell((0.0, 1.0, 2.0), (50.0, 50.0, 0.1), (-50.0, 50.0, 0.1)),  # huge c
    Cell((0.0, -3.0), (700.0, 700.0), (700.0, -700.0)),  # c at the fp64 exp limit
    Cell((0.0, 0.5), (1e-30, 1e-30), (1e-30, -1e-30)),  # tiny c
    Cell((0.0, 40.0, -40.0), (1e-30, 0.0, 3.0), (-1e-30, 0.0, -3.0)),  # tiny mass, tiny c, c = 0
    Cell((0.0, 0.0), (0.0, 0.0), (0.0, 0.0)),  # c = 0: every bound and TV are 0
)


def with_edge_cells(test):
    """Pin every ``EDGE_CELLS`` entry as an ``@example(cell=...)`` of a ``@given(cell=...)`` test."""
    for cell in EDGE_CELLS:
        test = example(cell=cell)(test)
    return test


# ----------------------------------------------------------------------------- strategies

_score = st.one_of(
    st.floats(-40.0, 40.0, allow_nan=False),
    st.sampled_from((0.0, 1.0, NEG_INF)),  # ties and masks
)
_radius = st.one_of(st.floats(1e-30, 12.0), st.sampled_from(EDGE_RADII))
_fraction = st.tuples(st.sampled_from((-1.0, 1.0)), st.floats(1e-6, 1.0)).map(lambda pair: pair[0] * pair[1])
_unit = st.one_of(st.sampled_from((-1.0, 1.0, 0.0)), _fraction)  # vertex-biased


def _unmask_one(scores: list[float]) -> tuple[float, ...]:
    """At least one token stays unmasked (softmax needs a finite score)."""
    if all(s == NEG_INF for s in scores):
        scores = [0.0] + scores[1:]
    return tuple(scores)


def score_lists(min_size: int = 1, max_size: int = 8) -> st.SearchStrategy[tuple[float, ...]]:
    """Compressed logits in [-40, 40], with ties and ``-inf`` masks, never all masked."""
    return st.lists(_score, min_size=min_size, max_size=max_size).map(_unmask_one)


@st.composite
def radius_lists(draw, size: int) -> tuple[float, ...]:
    """Radii ``c`` in {0} u [1e-30, 12] u {50, 700} (no subnormals: the decimal oracle would need
    ~650 digits); uniform (``c_t = D``) a third of the time."""
    if draw(st.integers(0, 2)) == 0:
        return (draw(_radius),) * size
    return tuple(draw(st.lists(_radius, min_size=size, max_size=size)))


@st.composite
def box_errors(draw, c: tuple[float, ...], vertex: bool = False) -> tuple[float, ...]:
    """``eps`` with ``|eps_t| <= c_t`` (``u c`` with ``|u| <= 1`` rounds inside the box).

    ``vertex=True`` draws a vertex ``eps = +-c``; otherwise vertices are drawn often.
    """
    units = st.sampled_from((-1.0, 1.0)) if vertex else _unit
    return tuple(draw(units) * r for r in c)


@st.composite
def interior_errors(draw, c: tuple[float, ...]) -> tuple[float, ...]:
    """``eps = u c`` with ``1e-6 <= |u| <= 1`` inside the box, not biased to vertices."""
    return tuple(draw(_fraction) * r for r in c)


@st.composite
def distributions(draw, size: int) -> list[mpf]:
    """``p~`` drawn directly (not through softmax), as mpf at the caller's precision: weights in
    {0} u [1e-12, 1] (zeros are masked tokens, never all), divided by their sum."""
    weight = st.one_of(st.just(0.0), st.floats(1e-12, 1.0))
    weights = draw(st.lists(weight, min_size=size, max_size=size).filter(any))
    total = mpmath.fsum(weights)
    return [mpf(w) / total for w in weights]


@st.composite
def cells(draw, min_size: int = 1, max_size: int = 8) -> Cell:
    """A whole ``Cell``: scores, radii, and an error in the box."""
    scores = draw(score_lists(min_size, max_size))
    c = draw(radius_lists(len(scores)))
    return Cell(scores, c, draw(box_errors(c)))


# ----------------------------------------------------------------------------- converters and comparisons


def to_mpf(x) -> mpf:
    """An mpf, Decimal, float or int as an mpf at ``COMPARE_DPS`` digits (a Decimal via its string)."""
    with mpmath.workdps(COMPARE_DPS):
        if isinstance(x, Decimal):
            return mpf(float(x)) if x.is_infinite() else mpf(str(x))
        return mpf(x)


def agree(x, y, digits: int = ORACLE_DIGITS) -> bool:
    """``x`` and ``y`` agree to ``digits`` significant digits, relative; equal infinities agree and
    0 agrees only with an exact 0 (the golden forms true zeros exactly, the decimal oracle reports
    its rounding noise of a true zero as an exact 0)."""
    a, b = to_mpf(x), to_mpf(y)
    if mpmath.isinf(a) or mpmath.isinf(b):
        return a == b
    with mpmath.workdps(COMPARE_DPS):
        return abs(a - b) <= mpf(10) ** -digits * max(abs(a), abs(b))


def agree_all(xs, ys, digits: int = ORACLE_DIGITS) -> bool:
    """Elementwise ``agree`` over two equally long sequences."""
    xs, ys = list(xs), list(ys)
    return len(xs) == len(ys) and all(agree(x, y, digits) for x, y in zip(xs, ys))


def at_most(x, y, rel=BOUND_REL_TOL) -> bool:
    """``x <= y`` up to a relative ``rel`` of ``|y|`` (two 50-digit values; ``y`` may be ``inf``)."""
    a, b = to_mpf(x), to_mpf(y)
    with mpmath.workdps(COMPARE_DPS):
        return a <= b + rel * abs(b)


def torch_bounds_and_goldens() -> dict:
    """Each torch bound of the meter -> the 50-digit golden of the same statement (name -> (impl, oracle))."""
    import witcert
    from witcert.core import bounds
    from witcert.spec import golden

    return {
        "eform": (bounds.eform_bound, golden.eform_from_scores),
        "two_sided": (bounds.two_sided_bound, golden.two_sided_from_scores),
        "retention": (bounds.retention_bound, golden.retention_from_scores),
        "maxnorm": (bounds.maxnorm_bound, golden.maxnorm_from_scores),
        "competitor": (bounds.competitor_bound, golden.competitor_from_scores),
        "chi_square": (bounds.chi_square_bound, golden.chi_square_from_scores),
        "mass_split": (bounds.mass_split_bound, golden.mass_split_from_scores),
        "meter": (witcert.meter, golden.meter_from_scores),
    }

"""The 50-digit mpmath golden for every certificate quantity (docs/design.md "Verification chain").

One of the four independent implementations (kernel, torch, this golden, ``spec/independent``).
Inputs are the compressed logits ``scores`` (``-inf`` = masked), per-token radii ``c >= 0`` and,
for the true TV, a logit error ``eps``; floats convert exactly (``mpf(float)``). Every function
computes with ``GUARD_DPS`` guard digits over ``GOLDEN_DPS = 50`` and returns mpf values rounded
to 50 significant digits. The bounds are ``spec.bounds`` evaluated on ``p~ = softmax(scores)``,
so the golden and the spec mirror cannot drift apart; those formulas avoid cancellation,
which keeps the 50 digits relative even for radii like ``1e-30``.
"""
from collections.abc import Callable, Sequence
from functools import wraps
from itertools import product

import mpmath
from mpmath import mp, mpf

from . import bounds

GOLDEN_DPS = 50
"""Significant decimal digits of every value returned here."""
GUARD_DPS = 20
"""Extra digits carried inside, so rounding inside a formula never reaches digit 50."""
SUP_BOX_MAX_TOKENS = 20
"""``sup_box_tv_exhaustive`` enumerates ``2^S`` vertices; it refuses more unmasked tokens."""

Real = bounds.Real


def _round_out(value):
    """Round an mpf (or a tuple of them, recursively) to ``GOLDEN_DPS`` digits."""
    if isinstance(value, tuple):
        return tuple(_round_out(v) for v in value)
    if isinstance(value, list):
        return [_round_out(v) for v in value]
    if isinstance(value, mpf):
        with mp.workdps(GOLDEN_DPS):
            return +value
    return value


def _golden(fn: Callable) -> Callable:
    """Run ``fn`` at ``GOLDEN_DPS + GUARD_DPS`` digits and round its result to ``GOLDEN_DPS``."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        with mp.workdps(GOLDEN_DPS + GUARD_DPS):
            value = fn(*args, **kwargs)
        return _round_out(value)

    return wrapper


@_golden
def softmax(scores: Sequence[Real]) -> tuple[mpf, ...]:
    """``p~ = softmax(scores)`` (``-inf`` -> exactly 0)."""
    return tuple(bounds.softmax(scores))


@_golden
def tv(p: Sequence[Real], q: Sequence[Real]) -> mpf:
    """``TV(p, q) = 1/2 sum_t |p_t - q_t|`` at 50 digits (formed literally: inputs are exact)."""
    return bounds.tv(p, q)


@_golden
def normaliser_from_scores(scores: Sequence[Real], eps: Sequence[Real]) -> mpf:
    """``Z = sum_t p~_t e^{-eps_t}``, ``p~ = softmax(scores)``."""
    p, e = bounds.softmax(scores), bounds._reals("eps", eps)
    _check_same_length(p, e, "eps")
    return mpmath.fsum(pt * mpmath.exp(-et) for pt, et in zip(p, e) if pt > 0)


@_golden
def p_from_scores(scores: Sequence[Real], eps: Sequence[Real]) -> tuple[mpf, ...]:
    """Exact-key attention ``p = softmax(scores - eps)`` as ``p~_t e^{-eps_t} / Z``."""
    return tuple(bounds.perturbed(bounds.softmax(scores), eps))


@_golden
def tv_from_scores(scores: Sequence[Real], eps: Sequence[Real]) -> mpf:
    """True ``TV(softmax(scores - eps), softmax(scores))`` (``-inf`` scores are masked).

    Formed without cancellation (``spec.bounds.tv_perturbed``), so tiny errors keep 50 digits.
    """
    return bounds.tv_perturbed(bounds.softmax(scores), eps)


def _from_scores(bound: Callable[[Sequence[Real], Sequence[Real]], mpf]) -> Callable:
    """The golden of ``bound(p_tilde, c)`` taken at ``p~ = softmax(scores)``."""

    @_golden
    def golden_bound(scores: Sequence[Real], c: Sequence[Real]) -> mpf:
        return bound(bounds.softmax(scores), c)

    golden_bound.__name__ = f"{bound.__name__}_from_scores"
    golden_bound.__doc__ = f"50-digit ``{bound.__name__}`` at ``p~ = softmax(scores)``.\n\n{bound.__doc__}"
    return golden_bound


a_plus_from_scores = _from_scores(bounds.a_plus)
a_minus_from_scores = _from_scores(bounds.a_minus)
eform_from_scores = _from_scores(bounds.bound_eform)
two_sided_from_scores = _from_scores(bounds.bound_two_sided)
retention_from_scores = _from_scores(bounds.bound_retention)
maxnorm_from_scores = _from_scores(bounds.bound_maxnorm)
competitor_from_scores = _from_scores(bounds.bound_competitor)
chi_square_from_scores = _from_scores(bounds.bound_chi_square)
unsound_dispersion_from_scores = _from_scores(bounds.bound_unsound_dispersion)



@_golden
def mass_split_from_scores(scores: Sequence[Real], c: Sequence[Real], thresholds: Sequence[Real] | None = None) -> mpf:
    """50-digit ``bound_mass_split`` (MS) at ``p~ = softmax(scores)``; ``thresholds`` default to
    ``spec.bounds.mass_split_thresholds`` (``D`` and the 11 largest 2-bit-mantissa floats below it).

    Cancellation-free like the others: ``delta = sum_H p~ expm1(c) / A-_L`` with
    ``A-_L = sum_L p~ e^{-c} + p~(H)`` (positive terms), second term ``delta (delta + 2) / 2``.
    """
    return bounds.bound_mass_split(bounds.softmax(scores), c, thresholds)


@_golden
def meter_on_sets_from_scores(scores: Sequence[Real], c: Sequence[Real], low_sets: Sequence[Sequence[bool]]) -> mpf:
    """The exact meter ``min(1, T1, P1, MN, CS, MS)`` with MS over the given low sets
    (``bounds.bound_mass_split_sets``): the oracle of a meter that splits at sets of its own choosing
    (the fast path, ``witcert.fastpath.budgeted_pass.split_low_sets``)."""
    p = bounds.softmax(scores)
    return min(mpf(1), bounds.bound_eform(p, c), bounds.bound_two_sided(p, c), bounds.bound_maxnorm(p, c),
               bounds.bound_chi_square(p, c), bounds.bound_mass_split_sets(p, c, low_sets))


BOUNDS_FROM_SCORES: dict[str, Callable[[Sequence[Real], Sequence[Real]], mpf]] = {
    "eform": eform_from_scores,
    "two_sided": two_sided_from_scores,
    "retention": retention_from_scores,
    "maxnorm": maxnorm_from_scores,
    "competitor": competitor_from_scores,
    "chi_square": chi_square_from_scores,
    "mass_split": mass_split_from_scores,
    "unsound_dispersion": unsound_dispersion_from_scores,
}
"""Golden of every ``spec.bounds.bound_<name>`` from scores, by name."""


@_golden
def meter_from_scores(scores: Sequence[Real], c: Sequence[Real]) -> mpf:
    """The exact meter ``min(1, T1, P1, MN, CS, MS)`` (MS on the default thresholds).

    The torch meter (and the compiled one) are checked against this value to 1e-12 relative and
    never below it. MS at ``g = D`` is ``min(T1, P1, CS, MN)``, so the minimum is ``min(1, MS)``; every
    term is formed explicitly all the same.
    """
    p = bounds.softmax(scores)
    return min(mpf(1), bounds.bound_eform(p, c), bounds.bound_two_sided(p, c), bounds.bound_maxnorm(p, c),
               bounds.bound_chi_square(p, c), bounds.bound_mass_split(p, c))


def sup_box_tv_exhaustive(scores: Sequence[Real], c: Sequence[Real]) -> mpf:
    """Exact ``sup_{|eps_t| <= c_t} TV(softmax(scores - eps), softmax(scores))``.

    The sup is attained at a vertex ``eps = -c`` on a set ``T``, ``+c`` off it (docs/design.md "How loose, and where"):
    ``max_T [ sum_T p~ e^c / (sum_T p~ e^c + sum_{not T} p~ e^-c) - p~(T) ]``, enumerated over all
    ``2^S`` subsets of the unmasked tokens; refuses more than ``SUP_BOX_MAX_TOKENS`` of them.
    """
    return sup_box_argmax_exhaustive(scores, c)[0]


@_golden
def sup_box_argmax_exhaustive(scores: Sequence[Real], c: Sequence[Real]) -> tuple[mpf, tuple[int, ...]]:
    """``(sup, T)``: the exact sup-box TV and a maximising set ``T`` (token indices of ``scores``).

    Each vertex value is formed without cancellation:
    ``[X(T) p~(T^c) + p~(T) Y(T^c)] / [sum_T p~ e^c + sum_{T^c} p~ e^-c]`` with
    ``X = sum p~ (e^c - 1)`` and ``Y = sum p~ (1 - e^{-c})`` (all terms >= 0). A set holding a token
    with ``c_t = inf`` takes its limit ``p~(T^c)``. Subset sums come from two half tables,
    so every sum is formed fresh (no running subtraction).
    """
    p_all, radii = bounds.softmax(scores), bounds._reals("c", c)
    _check_same_length(p_all, radii, "c")
    if any(r < 0 for r in radii):
        raise ValueError("c: contains a negative radius")
    keep = [t for t, pt in enumerate(p_all) if pt > 0]
    if len(keep) > SUP_BOX_MAX_TOKENS:
        raise ValueError(
            f"scores: {len(keep)} unmasked tokens; exhaustive sup needs <= {SUP_BOX_MAX_TOKENS}"
        )
    terms = [_vertex_terms(p_all[t], radii[t]) for t in keep]
    half = len(terms) // 2
    low, high = _subset_table(terms[:half]), _subset_table(terms[half:])
    full_low, full_high = len(low) - 1, len(high) - 1
    best, best_set = mpf(0), ()
    for mask_low, mask_high in product(range(len(low)), range(len(high))):
        inside = _add(low[mask_low], high[mask_high])
        outside = _add(low[full_low ^ mask_low], high[full_high ^ mask_high])
        value = _vertex_value(inside, outside)
        if value > best:
            best, best_set = value, _members(mask_low, mask_high, half, keep)
    return best, best_set


def _vertex_terms(pt: mpf, ct: mpf) -> tuple[mpf, mpf, mpf, mpf, mpf]:
    """``(p, p e^c, p e^-c, p (e^c - 1), p (1 - e^-c))`` of one token."""
    return pt, pt * mpmath.exp(ct), pt * mpmath.exp(-ct), pt * mpmath.expm1(ct), pt * -mpmath.expm1(-ct)


def _subset_table(terms: list[tuple]) -> list[tuple[mpf, ...]]:
    """Entry ``mask``: the five sums over the tokens whose bit is set, each formed fresh."""
    table = []
    for mask in range(1 << len(terms)):
        chosen = [terms[i] for i in range(len(terms)) if mask >> i & 1]
        table.append(tuple(mpmath.fsum(column) for column in zip(*chosen)) if chosen else (mpf(0),) * 5)
    return table


def _add(a: tuple, b: tuple) -> tuple:
    return tuple(x + y for x, y in zip(a, b))


def _vertex_value(inside: tuple, outside: tuple) -> mpf:
    """``p(T) - p~(T)`` at the vertex ``eps = -c`` on ``T``, ``+c`` off it."""
    mass_in, up_in, _, grow_in, _ = inside
    mass_out, _, down_out, _, shrink_out = outside
    if mass_in == 0 or mass_out == 0:
        return mpf(0)
    if mpmath.isinf(up_in):
        return mass_out  # p(T) -> 1
    return (grow_in * mass_out + mass_in * shrink_out) / (up_in + down_out)


def _members(mask_low: int, mask_high: int, half: int, keep: list[int]) -> tuple[int, ...]:
    bits = [mask_low >> i & 1 for i in range(half)] + [mask_high >> i & 1 for i in range(len(keep) - half)]
    return tuple(t for t, bit in zip(keep, bits) if bit)


def _check_same_length(p: list, other: list, name: str) -> None:
    if len(other) != len(p):
        raise ValueError(f"{name}: has {len(other)} entries, scores has {len(p)}")

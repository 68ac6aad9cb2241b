"""A fourth implementation, written only from the definitions (docs/design.md "Verification chain").

Python ``decimal`` (no mpmath, nothing from ``spec.bounds``): every quantity is formed literally
from its definition in docs/design.md "Notation" (``p~ = softmax(l~)``, ``Z = sum p~ e^{-eps}``,
``p = p~ e^{-eps} / Z``, ``TV = 1/2 sum |p - p~|``, ``A = sum p~ e^c``, ...), with no
reformulation against cancellation. Precision is managed instead:

* A literal formula here loses at most ``guard`` digits to cancellation, where
  ``guard = L_mass + max(2 L_c, L_eps) + 10``: ``10^-L_c`` is the smallest non-zero radius,
  ``10^-L_eps`` the smallest non-zero error or difference of two errors, and ``10^-L_mass`` bounds
  the smallest unmasked probability (``e^{-(max - min score)} / S``). No non-zero quantity here is
  below ``10^-(guard - 10)`` (see ``_guard``), and the operands are O(1) after the shift by the max
  score, so the first precision resolves every non-zero value to 60 digits.
* Everything is evaluated at ``BASE_DIGITS + guard`` significant digits and again with
  ``STEP_DIGITS`` more; the result stands when the two agree to ``AGREE_DIGITS`` digits, or both
  lie below ``10^-(guard + 30)`` (then it is an exact 0: rounding noise of a true zero);
  otherwise the step is repeated, up to ``MAX_TRIES`` times.

Masked tokens (score ``-inf``) have ``p~_t = 0`` and are left out of every sum, so their ``c_t``
and ``eps_t`` play no part (``D = max c`` over the unmasked tokens). Infinite radii give the
limits: ``A = inf``, the A-based bounds ``inf``, ``tanh`` 1.
"""
import math
from collections.abc import Callable, Sequence
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal, localcontext
from itertools import product

BASE_DIGITS = 60
STEP_DIGITS = 30
MAX_TRIES = 5
AGREE_DIGITS = 50
SUP_BOX_MAX_TOKENS = 20
MASS_SPLIT_LEVELS = 12  # MS thresholds: D = max c, then the 11 largest (1 + r/4) 2^q (r = 0..3) below D

INF = Decimal("Infinity")
ZERO = Decimal(0)
Number = Decimal | float | int | str


# ----------------------------------------------------------------------------- inputs


def _decimals(name: str, values: Sequence[Number]) -> list[Decimal]:
    out = [Decimal(v) for v in values]  # a float converts exactly
    if not out:
        raise ValueError(f"{name}: must hold at least one token")
    if any(v.is_nan() for v in out):
        raise ValueError(f"{name}: contains NaN")
    return out


def _scores(scores: Sequence[Number]) -> list[Decimal]:
    s = _decimals("scores", scores)
    if any(v == INF for v in s):
        raise ValueError("scores: contains +inf")
    if all(v.is_infinite() for v in s):
        raise ValueError("scores: every token is masked (-inf)")
    return s


def _radii(c: Sequence[Number], n: int) -> list[Decimal]:
    r = _decimals("c", c)
    if len(r) != n:
        raise ValueError(f"c: has {len(r)} entries, scores has {n}")
    if any(v < 0 for v in r):
        raise ValueError("c: contains a negative radius")
    return r


def _errors(eps: Sequence[Number], s: list[Decimal]) -> list[Decimal]:
    e = _decimals("eps", eps)
    if len(e) != len(s):
        raise ValueError(f"eps: has {len(e)} entries, scores has {len(s)}")
    if any(st.is_finite() and et.is_infinite() for st, et in zip(s, e)):
        raise ValueError("eps: infinite on an unmasked token")
    return e


# ----------------------------------------------------------------------------- precision management


def _digits_below_one(x: Decimal) -> int:
    """``L`` with ``|x| >= 10^-L`` (0 for ``|x| >= 1``)."""
    return max(0, -x.copy_abs().adjusted())


def _guard(s: list[Decimal], r: list[Decimal], e: list[Decimal]) -> int:
    """Digits the literal formulas can lose on this input (module docstring).

    A non-zero quantity here is at least ``10^-(L_mass + 2 L_c)`` (the A-based ones are linear in
    ``p~ c``; the dispersion form has a ``c_bar c_max`` term) or ``10^-(L_mass + L_eps)`` (TV is
    linear in ``p~`` times the spread of ``eps``).
    """
    live = [t for t, v in enumerate(s) if v.is_finite()]
    l_c = _smallest_digits(r[t] for t in live if r[t].is_finite())
    l_eps = _smallest_digits([e[t] for t in live] + [e[t] - e[u] for t in live for u in live if t < u])
    spread = float(max(s[t] for t in live) - min(s[t] for t in live))
    l_mass = math.ceil(spread / math.log(10) + math.log10(len(live))) + 1
    return l_mass + max(2 * l_c, l_eps) + 10


def _smallest_digits(values) -> int:
    """``L`` with ``|x| >= 10^-L`` for every non-zero ``x`` of ``values`` (0 when all are >= 1 or 0)."""
    return max((_digits_below_one(x) for x in values if x != 0), default=0)


def _context(prec: int) -> Context:
    """Wide exponent range (e^700 and e^-1400 are ordinary numbers); NaN-producing operations trap."""
    return Context(prec=prec, Emax=MAX_EMAX, Emin=MIN_EMIN)


def _settle(a, b, floor: Decimal):
    """``b`` if it agrees with ``a`` (elementwise), the exact 0 for noise below ``floor``; else None."""
    if isinstance(a, tuple):
        parts = [_settle(x, y, floor) for x, y in zip(a, b)]
        return None if any(part is None for part in parts) else tuple(parts)
    if a == b and a != 0:
        return b
    if a.is_finite() and b.is_finite() and abs(a - b) <= abs(b) * Decimal(10) ** -AGREE_DIGITS:
        return b
    if a.copy_abs() < floor and b.copy_abs() < floor:
        return ZERO
    return None


def _settled(evaluate: Callable[[], object], guard: int):
    """``evaluate()`` at rising precision until two successive values settle."""
    floor = Decimal(10) ** -(guard + 30)
    previous = None
    for attempt in range(MAX_TRIES + 1):
        with localcontext(_context(BASE_DIGITS + guard + attempt * STEP_DIGITS)):
            value = evaluate()
        if previous is not None:
            settled = _settle(previous, value, floor)
            if settled is not None:
                return settled
        previous = value
    raise ArithmeticError(f"independent: no agreement to {AGREE_DIGITS} digits after {MAX_TRIES} steps")


# ----------------------------------------------------------------------------- definitions at the current precision


def _softmax(s: list[Decimal]) -> list[Decimal]:
    """``p~_t = e^{l~_t} / sum_j e^{l~_j}`` (numerator and denominator scaled by ``e^{-max}``)."""
    top = max(v for v in s if v.is_finite())
    weights = [(v - top).exp() for v in s]  # exp(-inf) = 0
    total = sum(weights, ZERO)
    return [w / total for w in weights]


def _tv(p: Sequence[Decimal], q: Sequence[Decimal]) -> Decimal:
    return sum((abs(a - b) for a, b in zip(p, q)), ZERO) / 2


def _tanh(x: Decimal) -> Decimal:
    """``tanh x = (1 - e^{-2x}) / (1 + e^{-2x})`` for ``x >= 0``."""
    t = (-2 * x).exp()
    return (1 - t) / (1 + t)


def _at_most_grid_value(num: int, den: int, index: int) -> bool:
    """``num / den <= (1 + r/4) 2^q`` for ``index = 4q + r``, exactly (integers only)."""
    q, r = divmod(index, 4)
    lhs, rhs = 4 * num, (4 + r) * den
    return lhs <= rhs << q if q >= 0 else lhs << -q <= rhs


def _default_split_sets(d: Decimal) -> list[Callable[[Decimal], bool]]:
    """Membership of the low set ``L = {c <= g}`` for the default grid: ``g = D`` (every token) and
    the ``MASS_SPLIT_LEVELS - 1`` largest numbers ``(1 + r/4) 2^q`` (``r = 0..3``, ``q`` any integer)
    strictly below ``D``; only ``D`` when ``D`` is 0 or infinite."""
    if d == 0 or d.is_infinite():
        return [lambda ct: True]
    num, den = d.as_integer_ratio()
    top = 4 * (num.bit_length() - den.bit_length())
    while not _at_most_grid_value(num, den, top):
        top += 1
    while _at_most_grid_value(num, den, top - 1):
        top -= 1  # now the least index whose value is >= D

    def below(index: int) -> Callable[[Decimal], bool]:
        return lambda ct: ct.is_finite() and _at_most_grid_value(*ct.as_integer_ratio(), index)

    return [lambda ct: True] + [below(top - k) for k in range(1, MASS_SPLIT_LEVELS)]


def _mass_split(rows: list[tuple], low_sets: list[Callable[[Decimal], bool]]) -> Decimal:
    """MS: ``min over L of [min(T1, P1, CS, tanh(D_L/2)) on c 1_L] + ((1 + delta)^2 - 1)/2``,
    ``delta = sum_H p~ (e^c - 1) / A-_L``, literally. ``rows`` are ``(p~, c, e^c, e^-c)``."""
    values = []
    for in_low in low_sets:
        low = [in_low(ct) for _, ct, _, _ in rows]
        a = sum((pt * (up if inside else 1) for (pt, _, up, _), inside in zip(rows, low)), ZERO)
        a_minus = sum((pt * (down if inside else 1) for (pt, _, _, down), inside in zip(rows, low)), ZERO)
        spread = sum((pt * ((up if inside else 1) - 1) ** 2 for (pt, _, up, _), inside in zip(rows, low)), ZERO)
        d_low = max((ct for (_, ct, _, _), inside in zip(rows, low) if inside), default=ZERO)
        first = min((a * a - 1) / 2, (a / a_minus - a_minus / a) / 2, spread.sqrt() / (2 * a_minus), _tanh(d_low / 2))
        delta = sum((pt * (up - 1) for (pt, _, up, _), inside in zip(rows, low) if not inside), ZERO) / a_minus
        values.append(first + ((1 + delta) ** 2 - 1) / 2)
    return min(values)


def _with_errors(p_tilde: list[Decimal], e: list[Decimal]) -> dict:
    """``Z``, ``p``, ``TV`` for the logit error ``eps`` (masked tokens skipped)."""
    weight = [pt * (-et).exp() if pt != 0 else ZERO for pt, et in zip(p_tilde, e)]
    z = sum(weight, ZERO)
    p = tuple(w / z for w in weight)
    return {"normaliser": z, "p": p, "tv": _tv(p, p_tilde)}


def _with_radii(p_tilde: list[Decimal], r: list[Decimal]) -> dict:
    """``A``, ``A-`` and every bound, from their definitions (masked tokens skipped)."""
    rows = [(pt, ct, up, 1 / up) for pt, ct in zip(p_tilde, r) if pt != 0 for up in [ct.exp()]]  # e^-c = 1/e^c
    a = sum((pt * up for pt, _, up, _ in rows), ZERO)
    a_minus = sum((pt * down for pt, _, _, down in rows), ZERO)
    d = max(ct for _, ct, _, _ in rows)
    out = {"a_plus": a, "a_minus": a_minus, "maxnorm": _tanh(d / 2), "competitor": _tanh(d)}
    out["mass_split"] = _mass_split(rows, _default_split_sets(d))
    if d.is_infinite():
        out.update(eform=INF, two_sided=INF, retention=INF, chi_square=INF, unsound_dispersion=INF)
    else:
        c_bar = sum((pt * ct for pt, ct, _, _ in rows), ZERO)
        spread = sum((pt * abs(ct - c_bar) for pt, ct, _, _ in rows), ZERO)
        retained = sum((pt * min(a * up - 1, max(up / a_minus - 1, 1 - down / a)) for pt, _, up, down in rows), ZERO)
        out.update(
            eform=(a * a - 1) / 2,
            two_sided=(a / a_minus - a_minus / a) / 2,
            retention=retained / 2,
            chi_square=sum((pt * (up - 1) ** 2 for pt, _, up, _ in rows), ZERO).sqrt() / (2 * a_minus),
            unsound_dispersion=(2 * d).exp() * (spread + c_bar * (d.exp() - 1)) / 2,
        )
    out["meter"] = min(Decimal(1), out["eform"], out["two_sided"], out["maxnorm"], out["chi_square"], out["mass_split"])
    return out


def _sup_box(p_tilde: list[Decimal], r: list[Decimal]) -> Decimal:
    """``max_T [sum_T p~ e^c / (sum_T p~ e^c + sum_{not T} p~ e^-c) - p~(T)]`` over every subset."""
    rows = [(pt, pt * up, pt / up) for pt, ct in zip(p_tilde, r) if pt != 0 for up in [ct.exp()]]
    best = ZERO
    for bits in product((False, True), repeat=len(rows)):
        mass = sum((row[0] for row, b in zip(rows, bits) if b), ZERO)
        up = sum((row[1] for row, b in zip(rows, bits) if b), ZERO)
        down = sum((row[2] for row, b in zip(rows, bits) if not b), ZERO)
        value = 1 - mass if up.is_infinite() else up / (up + down) - mass  # p(T) -> 1 on an infinite radius
        best = max(best, value)
    return best


# ----------------------------------------------------------------------------- public


def quantities(scores: Sequence[Number], c: Sequence[Number] | None = None, eps: Sequence[Number] | None = None) -> dict:
    """Every certificate quantity of one cell, evaluated jointly (one precision ladder).

    Keys: ``p_tilde`` always; with ``eps``: ``normaliser`` (Z), ``p``, ``tv``; with ``c``: ``a_plus``,
    ``a_minus``, ``eform``, ``two_sided``, ``retention``, ``maxnorm``, ``competitor``, ``chi_square``,
    ``mass_split`` (default grid), ``unsound_dispersion``, ``meter``.
    """
    s = _scores(scores)
    r = _radii(c, len(s)) if c is not None else [ZERO] * len(s)
    e = _errors(eps, s) if eps is not None else [ZERO] * len(s)
    keys: list[str] = []

    def evaluate() -> tuple:
        p_tilde = _softmax(s)
        found = {"p_tilde": tuple(p_tilde)}
        if eps is not None:
            found.update(_with_errors(p_tilde, e))
        if c is not None:
            found.update(_with_radii(p_tilde, r))
        keys[:] = list(found)
        return tuple(found.values())

    return dict(zip(keys, _settled(evaluate, _guard(s, r, e))))


def softmax(scores: Sequence[Number]) -> tuple[Decimal, ...]:
    """``p~ = softmax(scores)``; ``-inf`` is a masked token (probability 0)."""
    return quantities(scores)["p_tilde"]


def tv(p: Sequence[Number], q: Sequence[Number]) -> Decimal:
    """``TV(p, q) = 1/2 sum |p_t - q_t|`` (exact inputs: one evaluation at ``BASE_DIGITS`` is exact
    up to rounding of the final sum)."""
    a, b = _decimals("p", p), _decimals("q", q)
    if len(a) != len(b):
        raise ValueError(f"q: has {len(b)} entries, p has {len(a)}")
    with localcontext(_context(BASE_DIGITS)):
        return _tv(a, b)


def normaliser_from_scores(scores, eps) -> Decimal:
    """``Z = sum_t p~_t e^{-eps_t}``."""
    return quantities(scores, eps=eps)["normaliser"]


def p_from_scores(scores, eps) -> tuple[Decimal, ...]:
    """``p_t = p~_t e^{-eps_t} / Z`` (exact-key attention)."""
    return quantities(scores, eps=eps)["p"]


def tv_from_scores(scores, eps) -> Decimal:
    """``TV(p, p~)`` with ``p~ = softmax(scores)``, ``p = p~ e^{-eps} / Z``."""
    return quantities(scores, eps=eps)["tv"]


def _from_scores(key: str, doc: str) -> Callable[[Sequence[Number], Sequence[Number]], Decimal]:
    def from_scores(scores: Sequence[Number], c: Sequence[Number]) -> Decimal:
        return quantities(scores, c=c)[key]

    from_scores.__name__ = f"{key}_from_scores"
    from_scores.__doc__ = doc
    return from_scores


a_plus_from_scores = _from_scores("a_plus", "``A = sum_t p~_t e^{c_t}``.")
a_minus_from_scores = _from_scores("a_minus", "``A- = sum_t p~_t e^{-c_t}``.")
eform_from_scores = _from_scores("eform", "T1: ``1/2 (A^2 - 1)``.")
two_sided_from_scores = _from_scores("two_sided", "P1: ``1/2 (A/A- - A-/A)``.")
retention_from_scores = _from_scores(
    "retention", "P1r: ``1/2 sum p~_t min(A e^{c_t} - 1, max(e^{c_t}/A- - 1, 1 - e^{-c_t}/A))``."
)
maxnorm_from_scores = _from_scores("maxnorm", "MN: ``tanh(D/2)``, ``D = max c``.")
competitor_from_scores = _from_scores("competitor", "RC: ``tanh(D)``, ``D = max c``.")
chi_square_from_scores = _from_scores("chi_square", "CS: ``sqrt(sum p~_t (e^{c_t} - 1)^2) / (2 A-)``.")


def mass_split_from_scores(scores: Sequence[Number], c: Sequence[Number], thresholds: Sequence[Number] | None = None) -> Decimal:
    """MS: ``min_g [B_L + ((1 + delta)^2 - 1)/2]`` over the thresholds ``g`` (``L = {c <= g}``,
    ``B_L = min(T1, P1, CS, tanh(max_L c / 2))`` on ``c 1_L``, ``delta = sum_H p~ (e^c - 1) / A-_L``);
    default thresholds ``D`` and the 11 largest ``(1 + r/4) 2^q`` (``r = 0..3``) below ``D``."""
    if thresholds is None:
        return quantities(scores, c=c)["mass_split"]
    s = _scores(scores)
    r = _radii(c, len(s))
    grid = _decimals("thresholds", thresholds)
    low_sets = [lambda ct, g=g: ct <= g for g in grid]

    def evaluate() -> Decimal:
        p_tilde = _softmax(s)
        rows = [(pt, ct, ct.exp(), 1 / ct.exp()) for pt, ct in zip(p_tilde, r) if pt != 0]
        return _mass_split(rows, low_sets)

    return _settled(evaluate, _guard(s, r, [ZERO] * len(s)))


unsound_dispersion_from_scores = _from_scores(
    "unsound_dispersion", "KNOWN FALSE: ``1/2 e^{2 c_max} (E|c - c_bar| + c_bar (e^{c_max} - 1))``."
)
meter_from_scores = _from_scores("meter", "The meter ``min(1, e-form, two-sided, tanh(D/2), chi-square, mass-split)``.")

BOUNDS_FROM_SCORES: dict[str, Callable[[Sequence[Number], Sequence[Number]], Decimal]] = {
    "eform": eform_from_scores,
    "two_sided": two_sided_from_scores,
    "retention": retention_from_scores,
    "maxnorm": maxnorm_from_scores,
    "competitor": competitor_from_scores,
    "chi_square": chi_square_from_scores,
    "mass_split": mass_split_from_scores,
    "unsound_dispersion": unsound_dispersion_from_scores,
}
"""Every bound from scores, by name (same keys as ``spec.golden.BOUNDS_FROM_SCORES``)."""


def sup_box_tv_exhaustive(scores: Sequence[Number], c: Sequence[Number]) -> Decimal:
    """Exact sup of the true TV over the box ``|eps_t| <= c_t``: the max over the ``2^S`` vertices
    ``eps = -c`` on ``T``, ``+c`` off it (docs/design.md "How loose, and where"). At most ``SUP_BOX_MAX_TOKENS`` unmasked tokens."""
    s = _scores(scores)
    r = _radii(c, len(s))
    if sum(1 for v in s if v.is_finite()) > SUP_BOX_MAX_TOKENS:
        raise ValueError(f"scores: more than {SUP_BOX_MAX_TOKENS} unmasked tokens for an exhaustive sup")
    return _settled(lambda: _sup_box(_softmax(s), r), _guard(s, r, [ZERO] * len(s)))

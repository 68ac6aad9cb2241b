"""A fourth implementation, written only from the definitions (DESIGN.md §4).

Python ``decimal`` (no mpmath, nothing from ``spec.bounds``): every quantity is formed literally
from its definition in DESIGN.md §2 (``p~ = softmax(l~)``, ``Z = sum p~ e^{-eps}``,
``p = p~ e^{-eps} / Z``, ``TV = 1/2 sum |p - p~|``, ``A = sum p~ e^c``, ...), with no
reformulation against cancellation. Precision is managed instead: each quantity is evaluated at
60 significant digits, then again at twice the digits, until two successive values agree to
``AGREE_DIGITS`` digits (or ``PRECISIONS`` is exhausted). A literal formula that cancels (``A^2 - 1``
at ``c = 1e-30``) thus gets the digits it needs. A quantity whose true value is 0 never settles
relatively and is returned at the last precision (about 1e-900 of noise).

Masked tokens (score ``-inf``) have ``p~_t = 0`` and are left out of every sum, so their ``c_t``
and ``eps_t`` play no part (``D = max c`` over the unmasked tokens). Infinite radii give the
limits: ``A = inf``, the A-based bounds ``inf``, ``tanh`` 1.
"""
from collections.abc import Callable, Sequence
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal, localcontext
from itertools import product

PRECISIONS = (60, 120, 240, 480, 960)
"""Significant digits tried in turn."""
AGREE_DIGITS = 50
"""Two successive precisions agreeing to this many digits end the escalation."""

INF = Decimal("Infinity")
Number = Decimal | float | int | str


def _context(prec: int) -> Context:
    """Wide exponent range (e^700 and e^-1400 are ordinary numbers); NaN-producing operations trap."""
    return Context(prec=prec, Emax=MAX_EMAX, Emin=MIN_EMIN)


def _close(a, b) -> bool:
    if isinstance(a, tuple):
        return all(_close(x, y) for x, y in zip(a, b))
    if a == b:
        return True
    if a.is_infinite() or b.is_infinite():
        return False
    return abs(a - b) <= abs(b) * Decimal(10) ** -AGREE_DIGITS


def _settled(evaluate: Callable[[], object]):
    """``evaluate()`` at rising precision until two successive values agree."""
    previous = None
    for prec in PRECISIONS:
        with localcontext(_context(prec)):
            value = evaluate()
        if previous is not None and _close(previous, value):
            return value
        previous = value
    return value


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


def _errors(eps: Sequence[Number], n: int) -> list[Decimal]:
    e = _decimals("eps", eps)
    if len(e) != n:
        raise ValueError(f"eps: has {len(e)} entries, scores has {n}")
    return e


# ----------------------------------------------------------------------------- definitions at the current precision


def _softmax(s: list[Decimal]) -> list[Decimal]:
    """``p~_t = e^{l~_t} / sum_j e^{l~_j}`` (numerator and denominator scaled by ``e^{-max}``)."""
    top = max(v for v in s if v.is_finite())
    weights = [(v - top).exp() for v in s]  # exp(-inf) = 0
    total = sum(weights)
    return [w / total for w in weights]


def _unmasked(p: list[Decimal], *others: list[Decimal]) -> list[tuple[Decimal, ...]]:
    return [row for row in zip(p, *others) if row[0] != 0]


def _z(p: list[Decimal], e: list[Decimal]) -> Decimal:
    return sum(pt * (-et).exp() for pt, et in _unmasked(p, e))


def _perturbed(p: list[Decimal], e: list[Decimal]) -> list[Decimal]:
    z = _z(p, e)
    return [pt * (-et).exp() / z if pt != 0 else Decimal(0) for pt, et in zip(p, e)]


def _tv(p: list[Decimal], q: list[Decimal]) -> Decimal:
    return sum(abs(a - b) for a, b in zip(p, q)) / 2


def _a(p: list[Decimal], r: list[Decimal]) -> Decimal:
    return sum(pt * ct.exp() for pt, ct in _unmasked(p, r))


def _a_minus(p: list[Decimal], r: list[Decimal]) -> Decimal:
    return sum(pt * (-ct).exp() for pt, ct in _unmasked(p, r))


def _d(p: list[Decimal], r: list[Decimal]) -> Decimal:
    return max(ct for _, ct in _unmasked(p, r))


def _any_infinite(p: list[Decimal], r: list[Decimal]) -> bool:
    return any(ct.is_infinite() for _, ct in _unmasked(p, r))


def _tanh(x: Decimal) -> Decimal:
    """``tanh x = (1 - e^{-2x}) / (1 + e^{-2x})`` for ``x >= 0``."""
    t = (-2 * x).exp()
    return (1 - t) / (1 + t)


def _eform(p, r) -> Decimal:
    if _any_infinite(p, r):
        return INF
    a = _a(p, r)
    return (a * a - 1) / 2


def _two_sided(p, r) -> Decimal:
    if _any_infinite(p, r):
        return INF
    a, am = _a(p, r), _a_minus(p, r)
    return (a / am - am / a) / 2


def _retention(p, r) -> Decimal:
    if _any_infinite(p, r):
        return INF
    a, am = _a(p, r), _a_minus(p, r)
    total = sum(
        pt * min(a * ct.exp() - 1, max(ct.exp() / am - 1, 1 - (-ct).exp() / a)) for pt, ct in _unmasked(p, r)
    )
    return total / 2


def _maxnorm(p, r) -> Decimal:
    return _tanh(_d(p, r) / 2)


def _competitor(p, r) -> Decimal:
    return _tanh(_d(p, r))


def _unsound_dispersion(p, r) -> Decimal:
    if _any_infinite(p, r):
        return INF
    rows = _unmasked(p, r)
    c_max = _d(p, r)
    c_bar = sum(pt * ct for pt, ct in rows)
    spread = sum(pt * abs(ct - c_bar) for pt, ct in rows)
    return (2 * c_max).exp() * (spread + c_bar * (c_max.exp() - 1)) / 2


def _meter(p, r) -> Decimal:
    return min(Decimal(1), _eform(p, r), _two_sided(p, r), _maxnorm(p, r))


def _vertex_tv(rows: list[tuple[Decimal, Decimal]], inside: tuple[int, ...]) -> Decimal:
    """``p(T) - p~(T)`` with ``eps = -c`` on ``T`` and ``+c`` off it, from the definition of ``p``."""
    up = sum((rows[i][0] * rows[i][1].exp() for i in inside), Decimal(0))
    down = sum((pt * (-ct).exp() for i, (pt, ct) in enumerate(rows) if i not in inside), Decimal(0))
    mass = sum((rows[i][0] for i in inside), Decimal(0))
    if up.is_infinite():
        return 1 - mass  # p(T) -> 1
    return up / (up + down) - mass


def _sup_box(p, r) -> Decimal:
    rows = _unmasked(p, r)
    best = Decimal(0)
    for bits in product((0, 1), repeat=len(rows)):
        best = max(best, _vertex_tv(rows, tuple(i for i, b in enumerate(bits) if b)))
    return best


# ----------------------------------------------------------------------------- public, from scores


def softmax(scores: Sequence[Number]) -> tuple[Decimal, ...]:
    """``p~ = softmax(scores)``; ``-inf`` is a masked token (probability 0)."""
    s = _scores(scores)
    return _settled(lambda: tuple(_softmax(s)))


def tv(p: Sequence[Number], q: Sequence[Number]) -> Decimal:
    """``TV(p, q) = 1/2 sum |p_t - q_t|``."""
    a, b = _decimals("p", p), _decimals("q", q)
    if len(a) != len(b):
        raise ValueError(f"q: has {len(b)} entries, p has {len(a)}")
    return _settled(lambda: _tv(a, b))


def normaliser_from_scores(scores: Sequence[Number], eps: Sequence[Number]) -> Decimal:
    """``Z = sum_t p~_t e^{-eps_t}``."""
    s = _scores(scores)
    e = _errors(eps, len(s))
    return _settled(lambda: _z(_softmax(s), e))


def p_from_scores(scores: Sequence[Number], eps: Sequence[Number]) -> tuple[Decimal, ...]:
    """``p_t = p~_t e^{-eps_t} / Z`` (exact-key attention)."""
    s = _scores(scores)
    e = _errors(eps, len(s))
    return _settled(lambda: tuple(_perturbed(_softmax(s), e)))


def tv_from_scores(scores: Sequence[Number], eps: Sequence[Number]) -> Decimal:
    """``TV(p, p~)`` with ``p~ = softmax(scores)``, ``p = p~ e^{-eps} / Z``."""
    s = _scores(scores)
    e = _errors(eps, len(s))

    def evaluate() -> Decimal:
        p_tilde = _softmax(s)
        return _tv(_perturbed(p_tilde, e), p_tilde)

    return _settled(evaluate)


def _from_scores(quantity: Callable[[list[Decimal], list[Decimal]], Decimal], doc: str) -> Callable:
    def from_scores(scores: Sequence[Number], c: Sequence[Number]) -> Decimal:
        s = _scores(scores)
        r = _radii(c, len(s))
        return _settled(lambda: quantity(_softmax(s), r))

    from_scores.__doc__ = doc
    return from_scores


a_plus_from_scores = _from_scores(_a, "``A = sum_t p~_t e^{c_t}``.")
a_minus_from_scores = _from_scores(_a_minus, "``A- = sum_t p~_t e^{-c_t}``.")
eform_from_scores = _from_scores(_eform, "T1: ``1/2 (A^2 - 1)``.")
two_sided_from_scores = _from_scores(_two_sided, "P1: ``1/2 (A/A- - A-/A)``.")
retention_from_scores = _from_scores(
    _retention, "P1r: ``1/2 sum p~_t min(A e^{c_t} - 1, max(e^{c_t}/A- - 1, 1 - e^{-c_t}/A))``."
)
maxnorm_from_scores = _from_scores(_maxnorm, "MN: ``tanh(D/2)``, ``D = max c``.")
competitor_from_scores = _from_scores(_competitor, "RC: ``tanh(D)``, ``D = max c``.")
unsound_dispersion_from_scores = _from_scores(
    _unsound_dispersion, "KNOWN FALSE: ``1/2 e^{2 c_max} (E|c - c_bar| + c_bar (e^{c_max} - 1))``."
)
meter_from_scores = _from_scores(_meter, "The meter ``min(1, e-form, two-sided, tanh(D/2))``.")


def sup_box_tv_exhaustive(scores: Sequence[Number], c: Sequence[Number]) -> Decimal:
    """``max_T [sum_T p~ e^c / (sum_T p~ e^c + sum_{not T} p~ e^-c) - p~(T)]`` over every subset.

    At most 20 unmasked tokens.
    """
    s = _scores(scores)
    r = _radii(c, len(s))
    if sum(1 for v in s if v.is_finite()) > 20:
        raise ValueError("scores: more than 20 unmasked tokens for an exhaustive sup")
    return _settled(lambda: _sup_box(_softmax(s), r))


BOUNDS_FROM_SCORES: dict[str, Callable[[Sequence[Number], Sequence[Number]], Decimal]] = {
    "eform": eform_from_scores,
    "two_sided": two_sided_from_scores,
    "retention": retention_from_scores,
    "maxnorm": maxnorm_from_scores,
    "competitor": competitor_from_scores,
    "unsound_dispersion": unsound_dispersion_from_scores,
}
"""Every bound from scores, by name (same keys as ``spec.golden.BOUNDS_FROM_SCORES``)."""

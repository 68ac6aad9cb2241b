"""Executable statements of the meter's bounds (docs/design.md "Mathematics"; registry keys T1, P1, P1r, MN, RC, CS, MS, L4).

Pure Python + mpmath, evaluated at the caller's working precision (``mpmath.mp``); no torch,
no numpy. Each statement is a pair:

* ``hypotheses_<name>(p_tilde, c, eps, tol=None) -> bool``: the theorem's hypotheses on a
  concrete input (``p~`` a distribution, ``c >= 0``, ``eps`` in the box the statement needs);
* ``bound_<name>(p_tilde, c)``: the bound the theorem asserts on ``TV(p, p~)``, where
  ``p = perturbed(p_tilde, eps)``.

``bound_unsound_dispersion`` is the paper's KNOWN-FALSE dispersion form, kept as a
regression guard (registry key UNSOUND): it is not a theorem.

Conventions shared by every function here:

* Tokens with ``p~_t = 0`` (masked, score ``-inf``) carry no mass in ``p`` nor in ``p~``, so
  they are dropped before anything is formed: their ``c_t`` and ``eps_t`` are irrelevant
  (and ``D = max c`` is taken over the support).
* ``p~`` is divided by its own sum before use. For an exact distribution this is the
  identity; for a rounded one it keeps the rounding of ``sum p~`` from cancelling in
  ``A - 1`` (which is all of ``A`` when ``c`` is tiny).
* Every bound is formed without catastrophic cancellation (``expm1``, ``sinh``, pairwise
  sums of positive terms), so its relative error is a few units of the working precision
  even at ``c = 1e-30``.
* An infinite radius ``c_t`` on the support is not an error: the A-based bounds are then
  ``+inf`` (their limit) and ``tanh`` gives 1.
"""
from collections.abc import Callable, Sequence

import mpmath
from mpmath import mp, mpf

Real = mpf | float | int | str

SOUND_BOUNDS = ("eform", "two_sided", "retention", "maxnorm", "competitor", "chi_square", "mass_split")
"""Names of the sound statements; ``bound_<name>`` and ``hypotheses_<name>`` exist for each."""


# ----------------------------------------------------------------------------- inputs


def _reals(name: str, values: Sequence[Real]) -> list[mpf]:
    """``values`` as mpf at the working precision (a float converts exactly when prec >= 53)."""
    try:
        out = [mpf(v) for v in values]
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name}: every entry must be a real number ({err})") from err
    if not out:
        raise ValueError(f"{name}: must hold at least one token")
    if any(mpmath.isnan(v) for v in out):
        raise ValueError(f"{name}: contains NaN")
    return out


def _distribution(p_tilde: Sequence[Real]) -> list[mpf]:
    """``p~`` checked (finite, >= 0, positive sum); returned unnormalised."""
    p = _reals("p_tilde", p_tilde)
    if any(mpmath.isinf(v) for v in p):
        raise ValueError("p_tilde: contains an infinite entry")
    if any(v < 0 for v in p):
        raise ValueError("p_tilde: contains a negative probability")
    if mpmath.fsum(p) <= 0:
        raise ValueError("p_tilde: has no mass (every entry is 0)")
    return p


def _support(p_tilde: Sequence[Real], c: Sequence[Real]) -> tuple[list[mpf], list[mpf]]:
    """``(p, c)`` on the support of ``p~``, with ``p`` normalised to sum 1."""
    p = _distribution(p_tilde)
    radii = _reals("c", c)
    if len(radii) != len(p):
        raise ValueError(f"c: has {len(radii)} entries, p_tilde has {len(p)}")
    if any(r < 0 for r in radii):
        raise ValueError("c: contains a negative radius")
    total = mpmath.fsum(p)
    kept = [(pt / total, r) for pt, r in zip(p, radii) if pt > 0]
    return [pt for pt, _ in kept], [r for _, r in kept]


# ----------------------------------------------------------------------------- helpers


def softmax(scores: Sequence[Real]) -> list[mpf]:
    """``p~ = softmax(scores)``; ``-inf`` marks a masked token (probability exactly 0).

    Raises ``ValueError`` on NaN, ``+inf`` or when every score is ``-inf``.
    """
    s = _reals("scores", scores)
    if any(v == mpmath.inf for v in s):
        raise ValueError("scores: contains +inf")
    finite = [v for v in s if mpmath.isfinite(v)]
    if not finite:
        raise ValueError("scores: every token is masked (-inf)")
    top = max(finite)
    weights = [mpmath.exp(v - top) if mpmath.isfinite(v) else mpf(0) for v in s]
    total = mpmath.fsum(weights)
    return [w / total for w in weights]


def logsumexp(scores: Sequence[Real]) -> mpf:
    """``log sum_t exp(scores_t)``; ``-inf`` when every score is ``-inf`` (an empty partition)."""
    s = _reals("scores", scores)
    if any(v == mpmath.inf for v in s):
        raise ValueError("scores: contains +inf")
    finite = [v for v in s if mpmath.isfinite(v)]
    if not finite:
        return mpf("-inf")
    top = max(finite)
    return top + mpmath.log(mpmath.fsum(mpmath.exp(v - top) for v in finite))


def perturbed(p_tilde: Sequence[Real], eps: Sequence[Real]) -> list[mpf]:
    """The exact-key distribution ``p_t = p~_t e^{-eps_t} / Z``, ``Z = sum_t p~_t e^{-eps_t}``.

    ``eps_t = l~_t - l_t`` is the logit error (docs/design.md "Notation"). Tokens with ``p~_t = 0`` get
    ``p_t = 0`` whatever their ``eps_t``; ``eps`` must be finite on the support.
    """
    p = _distribution(p_tilde)
    e = _reals("eps", eps)
    if len(e) != len(p):
        raise ValueError(f"eps: has {len(e)} entries, p_tilde has {len(p)}")
    if any(pt > 0 and not mpmath.isfinite(et) for pt, et in zip(p, e)):
        raise ValueError("eps: infinite on a token with positive mass")
    top = min(et for pt, et in zip(p, e) if pt > 0)  # shift: e^{-(eps - min eps)} <= 1
    weights = [pt * mpmath.exp(top - et) if pt > 0 else mpf(0) for pt, et in zip(p, e)]
    z = mpmath.fsum(weights)
    return [w / z for w in weights]


def tv(p: Sequence[Real], q: Sequence[Real]) -> mpf:
    """Total variation ``1/2 sum_t |p_t - q_t|`` (the definition, formed literally)."""
    a, b = _reals("p", p), _reals("q", q)
    if len(a) != len(b):
        raise ValueError(f"q: has {len(b)} entries, p has {len(a)}")
    return mpmath.fsum(abs(x - y) for x, y in zip(a, b)) / 2


def _mean_abs_deviation(p: list[mpf], difference: Callable[[int, int], mpf]) -> mpf:
    """``E_p |v - E_p v|`` as a sum of positive terms (``p`` normalised).

    ``E|v - m| = 2 sum_{t in U} p_t (v_t - m)`` for ``U = {v_t > m}``, and expanding ``m``
    gives ``2 sum_{t in U, s not in U} p_t p_s (v_t - v_s)``: every term is >= 0, so no
    cancellation. ``difference(t, s)`` must return ``v_t - v_s`` accurately; ``U`` is found from
    the sign of ``v_t - m = sum_s p_s (v_t - v_s)`` (not from ``v_t > m`` on rounded values, which
    cannot separate ``v``'s closer than the working precision). A token whose sign is misread
    lies within rounding of ``m`` and moves the sum by no more than that.
    """
    n = len(p)
    diff = [[difference(t, s) for s in range(n)] for t in range(n)]  # (S, S)
    above = [mpmath.fsum(p[s] * diff[t][s] for s in range(n)) > 0 for t in range(n)]
    upper = [t for t in range(n) if above[t]]
    lower = [s for s in range(n) if not above[s]]
    return 2 * mpmath.fsum(p[t] * p[s] * diff[t][s] for t in upper for s in lower)


def tv_perturbed(p_tilde: Sequence[Real], eps: Sequence[Real]) -> mpf:
    """``TV(perturbed(p_tilde, eps), p_tilde)`` formed without cancellation.

    ``TV = 1/2 E_p~ |w/Z - 1| = E_p~|w - Z| / (2Z)`` with ``w_t = e^{-eps_t}``, ``Z = E_p~ w``;
    the mean absolute deviation is summed pairwise (``w_t - w_s = e^{-eps_s} expm1(eps_s - eps_t)``),
    so a TV of 1e-30 keeps the full working precision. Equal to ``tv(perturbed(p~, eps), p~)``.
    """
    p_raw = _distribution(p_tilde)
    e = _reals("eps", eps)
    if len(e) != len(p_raw):
        raise ValueError(f"eps: has {len(e)} entries, p_tilde has {len(p_raw)}")
    keep = [t for t, pt in enumerate(p_raw) if pt > 0]
    if any(not mpmath.isfinite(e[t]) for t in keep):
        raise ValueError("eps: infinite on a token with positive mass")
    total = mpmath.fsum(p_raw)
    p = [p_raw[t] / total for t in keep]
    err = [e[t] for t in keep]
    low = min(err)
    w = [mpmath.exp(low - et) for et in err]  # e^{-eps} scaled by e^{min eps}: TV is invariant
    z = mpmath.fsum(pt * wt for pt, wt in zip(p, w))

    def difference(t: int, s: int) -> mpf:
        return w[s] * mpmath.expm1(err[s] - err[t])

    return _mean_abs_deviation(p, difference) / (2 * z)


# ----------------------------------------------------------------------------- A and its relatives


def a_plus(p_tilde: Sequence[Real], c: Sequence[Real]) -> mpf:
    """``A = sum_t p~_t e^{c_t}`` (T1, P1). ``A >= 1``."""
    p, r = _support(p_tilde, c)
    return 1 + _a_plus_minus_one(p, r)


def a_minus(p_tilde: Sequence[Real], c: Sequence[Real]) -> mpf:
    """``A- = sum_t p~_t e^{-c_t}`` (P1). ``0 <= A- <= 1``."""
    p, r = _support(p_tilde, c)
    return _a_minus(p, r)


def _a_plus_minus_one(p: list[mpf], c: list[mpf]) -> mpf:
    """``A - 1 = sum p (e^c - 1)`` for normalised ``p``: positive terms, no cancellation."""
    return mpmath.fsum(pt * mpmath.expm1(ct) for pt, ct in zip(p, c))


def _a_minus(p: list[mpf], c: list[mpf]) -> mpf:
    """``A- = sum p e^{-c}`` summed directly (``1 - (1 - A-)`` would lose A- ~ e^{-700})."""
    return mpmath.fsum(pt * mpmath.exp(-ct) for pt, ct in zip(p, c))


def _one_minus_a_minus(p: list[mpf], c: list[mpf]) -> mpf:
    """``1 - A- = sum p (1 - e^{-c})`` for normalised ``p``: positive terms."""
    return mpmath.fsum(pt * -mpmath.expm1(-ct) for pt, ct in zip(p, c))


def _has_infinite_radius(c: list[mpf]) -> bool:
    return any(mpmath.isinf(ct) for ct in c)


def a_merge(partitions: Sequence[tuple[Real, Real]]) -> mpf:
    """Merge ``A`` over split-KV partitions with log-sum-exp weights (Lemma 4, registry L4).

    Lean: ``WitCert.block_sum_eq_token_sum``. Partition ``j`` holds the tokens ``J_j``;
    ``lse_j = log sum_{t in J_j} e^{l~_t}`` and ``A_j = sum_{t in J_j} p~^{(j)}_t e^{c_t}`` with
    ``p~^{(j)}`` the softmax within the partition. Since ``p~_t = e^{lse_j - LSE} p~^{(j)}_t``,
    ``A = sum_j e^{lse_j - LSE} A_j``, ``LSE = log sum_j e^{lse_j}``: the same weights that merge
    the attention outputs. A partition with ``lse_j = -inf`` (all masked) has weight 0 and its
    ``A_j`` is ignored.

    Parameters
    ----------
    partitions : sequence of (lse_j, A_j)

    Returns
    -------
    mpf
        The unsplit ``A`` (``+inf`` if a weighted ``A_j`` is infinite).
    """
    pairs = list(partitions)
    if not pairs:
        raise ValueError("partitions: must hold at least one partition")
    lse = _reals("partitions (lse_j)", [pair[0] for pair in pairs])
    if any(v == mpmath.inf for v in lse):
        raise ValueError("partitions (lse_j): contains +inf")
    live_lse = [l for l in lse if mpmath.isfinite(l)]
    if not live_lse:
        raise ValueError("partitions: every partition is masked (lse_j = -inf)")
    live_a = _reals("partitions (A_j)", [pair[1] for pair, l in zip(pairs, lse) if mpmath.isfinite(l)])
    if any(a < 0 for a in live_a):
        raise ValueError("partitions (A_j): contains a negative value")
    live = list(zip(live_lse, live_a))
    total = logsumexp([l for l, _ in live])
    return mpmath.fsum(mpmath.exp(l - total) * a for l, a in live)


# ----------------------------------------------------------------------------- hypotheses


def _default_tol(n: int) -> mpf:
    return 64 * n * mp.eps


def _is_distribution(p_tilde: Sequence[Real], tol: Real | None) -> list[mpf] | None:
    """``p~`` as mpf if it is a distribution within ``tol`` (|sum - 1| <= tol), else None."""
    try:
        p = _distribution(p_tilde)
    except ValueError:
        return None
    bound = _default_tol(len(p)) if tol is None else mpf(tol)
    return p if abs(mpmath.fsum(p) - 1) <= bound else None


def _box_hypotheses(p_tilde, c, eps, tol, radius_of: Callable[[list[mpf], list[mpf]], list[mpf]]) -> bool:
    """p~ a distribution, c >= 0, and ``|eps_t| <= radius_t`` on the support of p~."""
    p = _is_distribution(p_tilde, tol)
    if p is None:
        return False
    try:
        radii, e = _reals("c", c), _reals("eps", eps)
    except ValueError:
        return False
    if not len(radii) == len(e) == len(p) or any(r < 0 for r in radii):
        return False
    on_support = [t for t, pt in enumerate(p) if pt > 0]
    allowed = radius_of([radii[t] for t in on_support], [p[t] for t in on_support])
    return all(abs(e[t]) <= r for t, r in zip(on_support, allowed))


def _per_token(c: list[mpf], p: list[mpf]) -> list[mpf]:
    return c


def _uniform_max(c: list[mpf], p: list[mpf]) -> list[mpf]:
    return [max(c)] * len(c)


def hypotheses_eform(p_tilde, c, eps, tol=None) -> bool:
    """Hypotheses of T1 (``WitCert.tv_le_eform``): p~ a distribution (|sum - 1| <= tol),
    ``c >= 0`` and ``|eps_t| <= c_t`` for every token of positive mass."""
    return _box_hypotheses(p_tilde, c, eps, tol, _per_token)


def hypotheses_two_sided(p_tilde, c, eps, tol=None) -> bool:
    """Hypotheses of P1 (``WitCert.tv_le_two_sided``): the box ``|eps_t| <= c_t`` (as T1)."""
    return _box_hypotheses(p_tilde, c, eps, tol, _per_token)


def hypotheses_retention(p_tilde, c, eps, tol=None) -> bool:
    """Hypotheses of P1r (``WitCert.tv_le_retention``): the box ``|eps_t| <= c_t`` (as T1)."""
    return _box_hypotheses(p_tilde, c, eps, tol, _per_token)


def hypotheses_maxnorm(p_tilde, c, eps, tol=None) -> bool:
    """Hypotheses of MN (``WitCert.tv_le_tanh_half``): ``|eps_t| <= D = max c`` on the support
    (weaker than the per-token box: only the largest radius matters)."""
    return _box_hypotheses(p_tilde, c, eps, tol, _uniform_max)


def hypotheses_competitor(p_tilde, c, eps, tol=None) -> bool:
    """Hypotheses of RC (``WitCert.tanh_half_le_tanh`` with MN): ``|eps_t| <= max c`` (as MN)."""
    return _box_hypotheses(p_tilde, c, eps, tol, _uniform_max)


def hypotheses_chi_square(p_tilde, c, eps, tol=None) -> bool:
    """Hypotheses of CS (``WitCert.tv_le_chi_square``): the box ``|eps_t| <= c_t`` (as T1)."""
    return _box_hypotheses(p_tilde, c, eps, tol, _per_token)


def hypotheses_mass_split(p_tilde, c, eps, tol=None) -> bool:
    """Hypotheses of MS (``WitCert.tv_le_mass_split``): the box ``|eps_t| <= c_t`` (as T1), for every
    threshold set."""
    return _box_hypotheses(p_tilde, c, eps, tol, _per_token)


def hypotheses_unsound_dispersion(p_tilde, c, eps, tol=None) -> bool:
    """The hypotheses the KNOWN-FALSE dispersion form claims to need: the box ``|eps_t| <= c_t``.

    They hold on the counterexample ``p~ = (1/2, 1/2)``, ``c = (0.1, 0.1)``, ``eps = (0.1, -0.1)``,
    where the claimed conclusion fails (registry UNSOUND).
    """
    return _box_hypotheses(p_tilde, c, eps, tol, _per_token)


# ----------------------------------------------------------------------------- bounds


def bound_eform(p_tilde: Sequence[Real], c: Sequence[Real]) -> mpf:
    """T1 e-form ``1/2 (A^2 - 1)``, ``A = sum_t p~_t e^{c_t}`` (Lean ``WitCert.tv_le_eform``).

    Formed as ``1/2 (A - 1)(A + 1)`` with ``A - 1 = sum p~ expm1(c)``. Unclamped (the raw value
    is the risk score); ``+inf`` if a radius on the support is infinite.
    """
    p, r = _support(p_tilde, c)
    if _has_infinite_radius(r):
        return mpf("inf")
    a_m1 = _a_plus_minus_one(p, r)
    return a_m1 * (a_m1 + 2) / 2


def bound_two_sided(p_tilde: Sequence[Real], c: Sequence[Real]) -> mpf:
    """P1 two-sided ``1/2 (A/A- - A-/A)`` (Lean ``WitCert.tv_le_two_sided``).

    Formed as ``(A - A-)(A + A-) / (2 A A-)`` with ``A - A- = sum p~ 2 sinh(c)``;
    ``+inf`` if a radius on the support is infinite.
    """
    p, r = _support(p_tilde, c)
    if _has_infinite_radius(r):
        return mpf("inf")
    big, small = 1 + _a_plus_minus_one(p, r), _a_minus(p, r)
    gap = mpmath.fsum(pt * 2 * mpmath.sinh(ct) for pt, ct in zip(p, r))
    return gap * (big + small) / (2 * big * small)


def bound_retention(p_tilde: Sequence[Real], c: Sequence[Real]) -> mpf:
    """P1r per-token retention form (Lean ``WitCert.tv_le_retention``).

    ``1/2 sum_t p~_t min(A e^{c_t} - 1, max(e^{c_t}/A- - 1, 1 - e^{-c_t}/A))``. Each argument is
    formed as a sum of non-negative terms: ``A e^c - 1 = (A-1) e^c + expm1(c)``,
    ``e^c/A- - 1 = (expm1(c) + (1 - A-)) / A-``, ``1 - e^{-c}/A = ((A-1) - expm1(-c)) / A``.
    ``+inf`` if a radius on the support is infinite (the limit of every term).
    """
    p, r = _support(p_tilde, c)
    if _has_infinite_radius(r):
        return mpf("inf")
    a_m1, one_m_am = _a_plus_minus_one(p, r), _one_minus_a_minus(p, r)
    big, small = 1 + a_m1, _a_minus(p, r)

    def term(ct: mpf) -> mpf:
        grow = a_m1 * mpmath.exp(ct) + mpmath.expm1(ct)
        up = (mpmath.expm1(ct) + one_m_am) / small
        down = (a_m1 - mpmath.expm1(-ct)) / big
        return min(grow, max(up, down))

    return mpmath.fsum(pt * term(ct) for pt, ct in zip(p, r)) / 2


def bound_maxnorm(p_tilde: Sequence[Real], c: Sequence[Real]) -> mpf:
    """MN max-norm bound ``tanh(D/2)``, ``D = max_t c_t`` over the support (Lean
    ``WitCert.tv_le_tanh_half``). Data-independent; attained by the two-point case with mass
    ``1/(1 + e^D)`` on the token pushed up."""
    _, r = _support(p_tilde, c)
    return mpmath.tanh(max(r) / 2)


def bound_competitor(p_tilde: Sequence[Real], c: Sequence[Real]) -> mpf:
    """RC: the competitor's (Runtime-Certified [5]) ``tanh(D)``, ``D = max_t c_t``.

    Sound because ``tanh(D/2) <= tanh(D)`` (Lean ``WitCert.tanh_half_le_tanh``) and MN; looser.
    """
    _, r = _support(p_tilde, c)
    return mpmath.tanh(max(r))


def bound_chi_square(p_tilde: Sequence[Real], c: Sequence[Real]) -> mpf:
    """CS chi-square bound ``sqrt(sum_t p~_t expm1(c_t)^2) / (2 A-)`` (Lean ``WitCert.tv_le_chi_square``).

    Cauchy-Schwarz on ``TV = E_p~|w - Z| / (2Z)``, ``w = e^{-eps}``: ``E|w - Z| <= sqrt(E (w - Z)^2)
    <= sqrt(E (w - 1)^2)``, ``|e^{-eps} - 1| <= expm1(c)`` and ``Z >= A-``. First order
    ``1/2 sqrt(E_p~ c^2)``: the first order of ``tanh(c/2)`` for equal radii. Every term of the sum
    is >= 0 (``expm1`` keeps ``c = 1e-30``), ``A-`` is summed directly. Unclamped; ``+inf`` if a
    radius on the support is infinite.
    """
    p, r = _support(p_tilde, c)
    if _has_infinite_radius(r):
        return mpf("inf")
    return mpmath.sqrt(_second_moment(p, r)) / (2 * _a_minus(p, r))


def _second_moment(p: list[mpf], c: list[mpf]) -> mpf:
    """``sum p expm1(c)^2``: positive terms."""
    return mpmath.fsum(pt * mpmath.expm1(ct) ** 2 for pt, ct in zip(p, c))


MASS_SPLIT_LEVELS = 12
"""Thresholds of the default mass-split grid: ``D`` and the ``LEVELS - 1`` grid values below it."""
MASS_SPLIT_MANTISSA_BITS = 2
"""The grid: the floats with this many mantissa bits, ``(1 + r/4) 2^q`` (ratios 1.14 to 1.25)."""


def _grid_value(index: int) -> mpf:
    """Grid value ``index = 4q + r``: ``(1 + r/4) 2^q = (4 + r) 2^(q - 2)`` (exact)."""
    steps = 2**MASS_SPLIT_MANTISSA_BITS
    q, r = divmod(index, steps)
    return mpmath.ldexp(mpf(steps + r), q - MASS_SPLIT_MANTISSA_BITS)


def _grid_index(d: mpf) -> int:
    """The least ``index`` with ``_grid_value(index) >= d`` for a finite ``d > 0`` (exact)."""
    steps = 2**MASS_SPLIT_MANTISSA_BITS
    mantissa, exponent = mpmath.frexp(d)  # d = mantissa 2^exponent, 1/2 <= mantissa < 1
    q = exponent - 1  # d = (2 mantissa) 2^q, 1 <= 2 mantissa < 2
    r = int(mpmath.ceil((2 * mantissa - 1) * steps))  # exact: a float's mantissa scaled by 2^k
    return steps * q + r


def mass_split_thresholds(p_tilde: Sequence[Real], c: Sequence[Real], levels: int = MASS_SPLIT_LEVELS) -> list[mpf]:
    """The default threshold grid of MS: ``D = max c`` (the base bound) and the ``levels - 1``
    largest floats with a 2-bit mantissa strictly below ``D`` (``(1 + r/4) 2^q``: 7/8 D-ish down
    to about D/6.7 for 12 levels).

    The grid is fixed, so it needs no second pass over the tokens: a token's bucket is its radius
    rounded up to a 2-bit-mantissa float, per-bucket sums kept relative to the running max's bucket
    shift exactly when the running max moves to a higher bucket, and ``c_t <= g`` is an exact
    comparison in every binary precision (and in decimal). ``D = 0`` or ``inf`` gives ``[D]``.
    Measured (scripts/mass_split_grid.py): on SmolLM2 rtn-int8 cells, 12 levels reach coverage
    0.975 at tau = 0.2 where octave grids (``D 2^-k``) stay at 0.961 and every distinct radius as a
    threshold reaches 0.981.
    """
    if not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels: must be an integer >= 1, got {levels!r}")
    _, r = _support(p_tilde, c)
    d = max(r)
    if d == 0 or mpmath.isinf(d):
        return [d]
    top = _grid_index(d)
    return [d] + [_grid_value(top - k) for k in range(1, levels)]


def bound_mass_split(p_tilde: Sequence[Real], c: Sequence[Real], thresholds: Sequence[Real] | None = None) -> mpf:
    """MS mass-split bound, minimised over ``thresholds`` (Lean ``WitCert.tv_le_mass_split``, first
    term as in ``WitCert.tv_le_mass_split_min``).

    For a threshold ``g``: ``L = {t : c_t <= g}``, ``H`` the rest. The errors on ``L`` move first
    (bounded by ``B_L = min(T1, P1, CS, tanh(D_L/2))`` on the radii ``c 1_L``, ``D_L = max_L c``), then
    those on ``H`` (the e-form with base ``p' = p~ e^{-eps 1_L} / Z'``):
    ``MS_g = B_L + 1/2 ((1 + delta)^2 - 1)``, ``delta = sum_H p~ expm1(c) / A-_L``,
    ``A-_L = sum_L p~ e^{-c} + p~(H)``. The bound is ``min_g MS_g``; ``g = max c`` gives
    ``min(T1, P1, CS, MN)`` itself, so a grid holding ``max c`` never loses.

    Parameters
    ----------
    p_tilde, c : sequences of reals
        The distribution and the per-token radii (as every bound here).
    thresholds : sequence of reals, optional
        The thresholds ``g`` (any reals; a set ``L`` is sound for every ``g``). Default:
        ``mass_split_thresholds(p_tilde, c)``.

    Returns
    -------
    mpf
        Unclamped; sums of non-negative terms throughout (``delta (delta + 2) / 2`` for the second
        term). An infinite radius in ``H`` makes that threshold's value ``+inf``.
    """
    p, r = _support(p_tilde, c)
    if thresholds is None:
        grid = mass_split_thresholds(p, r)
    elif len(thresholds) == 0:
        raise ValueError("thresholds: must hold at least one threshold")
    else:
        grid = _reals("thresholds", thresholds)
    return min(_mass_split_at(p, r, g) for g in grid)


def bound_mass_split_sets(p_tilde: Sequence[Real], c: Sequence[Real], low_sets: Sequence[Sequence[bool]]) -> mpf:
    """MS minimised over explicit low sets ``L`` (Lean ``WitCert.tv_le_mass_split`` holds for any set).

    ``low_sets``: each a sequence of booleans, one per token of ``p_tilde`` (``True``: the token is in
    ``L``). The fast path (``witcert.fastpath.budgeted_pass``) splits at its own thresholds on its
    fp32 radii, so its oracle names the sets rather than thresholds. Value as :func:`bound_mass_split`.
    """
    if len(low_sets) == 0:
        raise ValueError("low_sets: must hold at least one set")
    weights = _distribution(p_tilde)
    keep = [pt > 0 for pt in weights]
    p, r = _support(p_tilde, c)
    on_support = set()
    for i, low in enumerate(low_sets):
        if len(low) != len(keep):
            raise ValueError(f"low_sets[{i}]: has {len(low)} entries, p_tilde has {len(keep)}")
        on_support.add(tuple(bool(x) for x, kept in zip(low, keep) if kept))  # equal sets: one evaluation
    return min(_mass_split_on(p, r, list(low)) for low in on_support)


def _mass_split_at(p: list[mpf], r: list[mpf], g: mpf) -> mpf:
    """``MS_g`` for normalised ``p`` on the support."""
    return _mass_split_on(p, r, [ct <= g for ct in r])


def _mass_split_on(p: list[mpf], r: list[mpf], low: list[bool]) -> mpf:
    """MS for the low set ``low`` (flags on the support), normalised ``p``."""
    r_low = [ct if inside else mpf(0) for ct, inside in zip(r, low)]
    first = min(bound_eform(p, r_low), bound_two_sided(p, r_low), bound_chi_square(p, r_low),
                bound_maxnorm(p, r_low))
    high = [(pt, ct) for pt, ct, inside in zip(p, r, low) if not inside]
    if not high:
        return first
    a_minus_low = mpmath.fsum([pt * mpmath.exp(-ct) for pt, ct, inside in zip(p, r, low) if inside]
                              + [pt for pt, _ in high])
    delta = mpmath.fsum(pt * mpmath.expm1(ct) for pt, ct in high) / a_minus_low
    return first + delta * (delta + 2) / 2


def bound_unsound_dispersion(p_tilde: Sequence[Real], c: Sequence[Real]) -> mpf:
    """KNOWN FALSE (registry UNSOUND, no Lean declaration): the paper's dispersion form.

    ``1/2 e^{2 c_max} (E_p~|c - c_bar| + c_bar (e^{c_max} - 1))``, ``c_bar = E_p~ c``. It is NOT an
    upper bound on TV: at ``p~ = (1/2, 1/2)``, ``c = (0.1, 0.1)``, ``eps = (0.1, -0.1)`` the true TV
    is 0.049834 and this form gives 0.006423. Kept only so a test can show it is violated
    while T1 holds. ``+inf`` if a radius on the support is infinite.
    """
    p, r = _support(p_tilde, c)
    if _has_infinite_radius(r):
        return mpf("inf")
    c_max = max(r)
    c_bar = mpmath.fsum(pt * ct for pt, ct in zip(p, r))
    dispersion = _mean_abs_deviation(p, lambda t, s: r[t] - r[s])
    return mpmath.exp(2 * c_max) * (dispersion + c_bar * mpmath.expm1(c_max)) / 2


BOUNDS: dict[str, Callable[[Sequence[Real], Sequence[Real]], mpf]] = {
    "eform": bound_eform,
    "two_sided": bound_two_sided,
    "retention": bound_retention,
    "maxnorm": bound_maxnorm,
    "competitor": bound_competitor,
    "chi_square": bound_chi_square,
    "mass_split": bound_mass_split,
    "unsound_dispersion": bound_unsound_dispersion,
}
"""Every ``bound_<name>`` by name (the sound ones are ``SOUND_BOUNDS``)."""

HYPOTHESES: dict[str, Callable[..., bool]] = {
    "eform": hypotheses_eform,
    "two_sided": hypotheses_two_sided,
    "retention": hypotheses_retention,
    "maxnorm": hypotheses_maxnorm,
    "competitor": hypotheses_competitor,
    "chi_square": hypotheses_chi_square,
    "mass_split": hypotheses_mass_split,
    "unsound_dispersion": hypotheses_unsound_dispersion,
}
"""Every ``hypotheses_<name>`` by name."""

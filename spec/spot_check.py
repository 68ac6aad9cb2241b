"""Executable statement of the spot-check certificate (docs/design.md "Spot-check certificate"; registry keys SC, SCO, SCB, SCD).

Pure Python + mpmath at the caller's working precision; no torch, no randomness. The sampled
token indices are inputs, so the library (``witcert.spot``) and this mirror can be compared on
the same draws.

Notation (docs/design.md "Notation"): ``p_t = p~_t W_t / Z`` with ``W_t = e^{-eps_t}`` and
``Z = E_p~ W``. For any constant ``Z' > 0`` (registry SC, ``WitCert.tv_le_spot_identity``)::

    TV(p, p~) <= (1/2 E_p~|W - Z'| + 1/2 |Z' - Z|) / Z'

Both unknowns are means under ``p~``. A deterministic exact set ``E`` (the tokens of largest
witness contribution ``p~_t u_t``, ``u_t = e^{c_t} - 1``) is read exactly; the rest ``R`` is
sampled with replacement from ``q_t = p~_t g_t / G``, ``g_t = u_t + |1 - Z'|``,
``G = sum_R p~_t g_t``. Because ``|W_t - 1| <= u_t`` whenever ``|eps_t| <= c_t``, the ratios
``X_t = |W_t - Z'| / g_t`` lie in ``[0, 1]`` and ``Y_t = (W_t - 1) / g_t`` in ``[-1, 1]``, and
``sum_R p~ |W - Z'| = G E_q X``, ``sum_R p~ (W - 1) = G E_q Y``. Three one-sided confidence
statements (upper on ``E_q X``, upper and lower on ``E_q Y``) at ``delta / 3`` each, each the
minimum of a betting bound and an empirical Bernstein bound at ``delta / 6`` (registry SCB),
give a bound that holds with probability ``>= 1 - delta`` (a union over six events).

The one-sided estimator (registry SCO, ``bound_spot_one_sided``, the library's default) uses
``TV = E_p~ (1 - W/Z)^+ <= E_p~ (1 - W/Z_U)^+`` for any ``Z_U >= Z``: an upper confidence bound
on ``Z`` from draws ``~ p~ (e^c - 1)``, then draws ``~ p~ (1 - e^{-c}/Z_U)^+`` bound the one-sided
mean; two statements (``delta 8/10`` and ``delta 2/10``).
"""
from collections.abc import Sequence

import mpmath
from mpmath import mpf

from .bounds import Real, _reals

BETTING_CAP = mpf(9) / 10
"""Largest ``lambda (1 - m)`` in a cell: every capital factor ``1 + lambda (m - X)`` stays >= 1/10."""
GRID_CELLS = 256
"""Cells of ``[0, 1]`` in the betting bound's search: its resolution."""
STATEMENTS = 3
"""Confidence statements per cell (upper on E X, upper and lower on E Y): ``delta / 3`` each."""


# ----------------------------------------------------------------------------- the identity


def bound_spot_identity(p_tilde: Sequence[Real], eps: Sequence[Real], z_prime: Real) -> mpf:
    """``(1/2 E_p~|W - Z'| + 1/2 |Z' - Z|) / Z'``, an upper bound on ``TV(p, p~)`` for every ``Z' > 0``.

    Lean: ``WitCert.tv_le_spot_identity``. ``W_t = e^{-eps_t}``, ``Z = E_p~ W``; ``p~`` is
    normalised here. Proof: ``W/Z - 1 = (W - Z')/Z' + W (1/Z - 1/Z')`` and
    ``E_p~ W |1/Z - 1/Z'| = |Z' - Z| / Z'``.
    """
    p, e = _reals("p_tilde", p_tilde), _reals("eps", eps)
    if len(p) != len(e):
        raise ValueError(f"eps: has {len(e)} entries, p_tilde has {len(p)}")
    zp = mpf(z_prime)
    if not zp > 0:
        raise ValueError(f"z_prime: must be > 0, got {z_prime!r}")
    total = mpmath.fsum(p)
    w = [mpmath.exp(-et) for et in e]
    z = mpmath.fsum(pt * wt for pt, wt in zip(p, w)) / total
    spread = mpmath.fsum(pt * abs(wt - zp) for pt, wt in zip(p, w)) / total
    return (spread / 2 + abs(zp - z) / 2) / zp


# ----------------------------------------------------------------------------- exact set and proposal


def witness_contributions(p_tilde: Sequence[Real], c: Sequence[Real]) -> list[mpf]:
    """``p~_t (e^{c_t} - 1)``: token ``t``'s share of ``A - 1`` (the T1 witness)."""
    p, r = _reals("p_tilde", p_tilde), _reals("c", c)
    return [pt * mpmath.expm1(ct) for pt, ct in zip(p, r)]


def exact_set(p_tilde: Sequence[Real], c: Sequence[Real], k: int) -> list[int]:
    """The ``k`` tokens of largest witness contribution, ties to the lower index, in that order."""
    contrib = witness_contributions(p_tilde, c)
    order = sorted(range(len(contrib)), key=lambda t: (-contrib[t], t))
    return order[:max(0, k)]


def proposal_weights(p_tilde: Sequence[Real], c: Sequence[Real], exact: Sequence[int], z_prime: Real) -> list[mpf]:
    """``p~_t g_t`` on the rest ``R`` (0 on the exact set), ``g_t = e^{c_t} - 1 + |1 - Z'|``."""
    p, r = _reals("p_tilde", p_tilde), _reals("c", c)
    offset = abs(1 - mpf(z_prime))
    known = set(exact)
    return [mpf(0) if t in known else pt * (mpmath.expm1(ct) + offset) for t, (pt, ct) in enumerate(zip(p, r))]


# ----------------------------------------------------------------------------- confidence bounds (SCB)


def empirical_bernstein_upper(xs: Sequence[Real], delta: Real) -> mpf:
    """Maurer & Pontil (2009), Theorem 4: an upper confidence bound on the mean of ``[0, 1]`` samples.

    ``X_1..X_n`` i.i.d. in ``[0, 1]``, ``n >= 2``: with probability ``>= 1 - delta``,
    ``E X <= mean + sqrt(2 V ln(2/delta) / n) + 7 ln(2/delta) / (3 (n - 1))``, ``V`` the unbiased
    sample variance. Returns 1 (the trivial bound) for ``n < 2``; never above 1.
    """
    x = _reals("xs", xs) if len(xs) else []
    n = len(x)
    if n < 2:
        return mpf(1)
    mean = mpmath.fsum(x) / n
    var = mpmath.fsum((v - mean) ** 2 for v in x) / (n - 1)
    log_term = mpmath.log(2 / mpf(delta))
    return min(mpf(1), mean + mpmath.sqrt(2 * var * log_term / n) + 7 * log_term / (3 * (n - 1)))


def betting_lambdas(xs: Sequence[Real], delta: Real, planned: int | None = None) -> list[mpf]:
    """Predictable plug-in bets of Waudby-Smith & Ramdas (2023, JRSS-B), Section 5, one-sided, before the cap.

    ``lambda_i = sqrt(2 ln(1/delta) / (n sigma^2_{i-1}))`` with the running estimates
    ``mu_i = (1/2 + sum_{j<=i} X_j) / (i + 1)`` and
    ``sigma^2_i = (1/4 + sum_{j<=i} (X_j - mu_j)^2) / (i + 1)``: each bet uses only earlier samples.
    ``n`` is ``planned`` when given: a constant fixed before the draws keeps the bets predictable
    for a sequence stopped at a random time (the one-sided estimator's distinct-key budget).
    """
    x = _reals("xs", xs)
    n, log_term = (len(x) if planned is None else planned), mpmath.log(1 / mpf(delta))
    lambdas, total, squares = [], mpf(0), mpf(1) / 4
    for i, v in enumerate(x):  # sigma^2_{i-1} = squares / i  (i samples seen, prior counts as one)
        sigma2 = squares / (i + 1)
        lambdas.append(mpmath.sqrt(2 * log_term / (n * sigma2)))
        total += v
        mu = (mpf(1) / 2 + total) / (i + 2)
        squares += (v - mu) ** 2
    return lambdas


def betting_log_capital(xs: Sequence[Real], lambdas: Sequence[Real], m: Real) -> mpf:
    """``log K(m) = sum_i log(1 + lambda_i (m - X_i))``: the bettor's wealth against ``E X >= m``.

    If ``E X = m`` and every factor is positive the capital is a nonnegative martingale of mean 1,
    so ``P(K(m) >= 1/delta) <= delta`` (Markov/Ville); for fixed bets ``K`` increases in ``m``.
    """
    return mpmath.fsum(mpmath.log1p(lam * (mpf(m) - v)) for lam, v in zip(lambdas, _reals("xs", xs)))


def betting_upper(xs: Sequence[Real], delta: Real, cells: int = GRID_CELLS, cap: Real = BETTING_CAP,
                  planned: int | None = None) -> mpf:
    """Waudby-Smith & Ramdas (2023) upper bound, with bets fixed per grid cell ``(m_{j-1}, m_j]``.

    In cell ``j`` the bets are ``min(plug-in, BETTING_CAP / (1 - m_{j-1}))``, so every factor is
    ``>= 1 - BETTING_CAP`` on the cell and ``K_j`` increases in ``m``: ``K_j(m_{j-1})`` is its minimum
    there. The bound is ``m_{j*-1}`` for the first cell ``j*`` from which every cell has
    ``K_j(m_{j-1}) >= 1/delta`` (1 if the last cell does not). If the mean lies in a cell
    ``j >= j*``, the capital of that cell's bets at the mean is ``>= 1/delta``: probability ``<= delta``.
    By Ville's inequality the same holds at any stopping time (``planned`` fixes the bets' ``n``).
    ``cap`` in (0, 1) replaces ``BETTING_CAP``.
    """
    if len(xs) == 0:
        return mpf(1)
    plug_in = betting_lambdas(xs, delta, planned)
    threshold = mpmath.log(1 / mpf(delta))
    for j in range(cells - 1, -1, -1):  # from the top cell down to the last one not rejected
        left = mpf(j) / cells
        bets = [min(lam, mpf(cap) / (1 - left)) for lam in plug_in]
        if betting_log_capital(xs, bets, left) < threshold:
            return mpf(1) if j == cells - 1 else mpf(j + 1) / cells
    return mpf(0)


def mean_upper(xs: Sequence[Real], delta: Real) -> mpf:
    """Upper bound on the mean of ``[0, 1]`` samples at level ``delta``: min(betting, EB) at ``delta/2`` each."""
    half = mpf(delta) / 2
    return min(betting_upper(xs, half), empirical_bernstein_upper(xs, half))


def signed_mean_interval(ys: Sequence[Real], delta: Real) -> tuple[mpf, mpf]:
    """``(lo, hi)`` for the mean of ``[-1, 1]`` samples; each side holds with probability ``>= 1 - delta``."""
    y = _reals("ys", ys) if len(ys) else []
    hi = 2 * mean_upper([(1 + v) / 2 for v in y], delta) - 1
    lo = 1 - 2 * mean_upper([(1 - v) / 2 for v in y], delta)
    return lo, hi


# ----------------------------------------------------------------------------- the certificate


def bound_spot_check(p_tilde: Sequence[Real], c: Sequence[Real], eps: Sequence[Real], exact: Sequence[int],
                     z_prime: Real, draws: Sequence[int], delta: Real) -> mpf:
    """The spot-check bound on ``TV(p, p~)`` from an exact set, a proposal and its draws.

    Registry SC (``WitCert.tv_le_spot_identity``) with the confidence bounds of SCB. Holds with
    probability ``>= 1 - delta`` over ``draws`` when they are i.i.d. from
    ``q = proposal_weights / G`` and independent of ``eps`` (drawn after the query is fixed), and
    ``|eps_t| <= c_t`` on the rest. Only ``eps`` on ``exact`` and on ``draws`` is used. ``p~`` is
    normalised here; the result is capped at 1.
    """
    p = _reals("p_tilde", p_tilde)
    total = mpmath.fsum(p)
    p = [pt / total for pt in p]
    r, e, zp = _reals("c", c), _reals("eps", eps), mpf(z_prime)
    weights = proposal_weights(p, r, exact, zp)
    g_total = mpmath.fsum(weights)
    known = set(exact)
    w = {t: mpmath.exp(-e[t]) for t in known | set(draws)}
    spread_known = mpmath.fsum(p[t] * abs(w[t] - zp) for t in known)
    z_known = mpmath.fsum(p[t] * w[t] for t in known) + mpmath.fsum(p[t] for t in range(len(p)) if t not in known)
    spread_upper, z_lo, z_hi = spread_known, z_known, z_known
    if g_total > 0:
        g = {t: mpmath.expm1(r[t]) + abs(1 - zp) for t in draws}
        per = mpf(delta) / STATEMENTS
        spread_upper += g_total * mean_upper([abs(w[t] - zp) / g[t] for t in draws], per)
        y_lo, y_hi = signed_mean_interval([(w[t] - 1) / g[t] for t in draws], per)
        z_lo, z_hi = z_known + g_total * y_lo, z_known + g_total * y_hi
    z_lo = max(z_lo, mpmath.fsum(pt * mpmath.exp(-ct) for pt, ct in zip(p, r)))  # Z >= A-
    z_hi = min(z_hi, mpmath.fsum(pt * mpmath.exp(ct) for pt, ct in zip(p, r)))  # Z <= A
    deviation = max(z_hi - zp, zp - z_lo, mpf(0))
    return min(mpf(1), (spread_upper / 2 + deviation / 2) / zp)


# ----------------------------------------------------------------------------- the one-sided estimator (SCO)

ONE_SIDED_CAP = mpf(99) / 100
"""Cap of the one-sided estimator's bets: every capital factor stays >= 1/100."""
Z_SHARE_OF_DELTA = mpf(8) / 10
"""Share of ``delta`` spent on the upper bound of ``Z``; the rest bounds the one-sided mean."""


def bound_spot_one_sided_identity(p_tilde: Sequence[Real], eps: Sequence[Real], z_upper: Real) -> mpf:
    """``E_p~ (1 - W / Z_U)^+``: an upper bound on ``TV(p, p~)`` for every ``Z_U >= Z``, equal to it at ``Z_U = Z``.

    Lean: ``WitCert.tv_le_spot_one_sided``. ``TV = sum_t (p~_t - p_t)^+`` (both sum to one) and
    ``p~_t - p_t = p~_t (1 - W_t / Z) <= p~_t (1 - W_t / Z_U)``. ``p~`` is normalised here; the
    caller supplies ``Z_U`` (this function does not check ``Z_U >= Z``: below ``Z`` it is no bound).
    """
    p, e = _reals("p_tilde", p_tilde), _reals("eps", eps)
    if len(p) != len(e):
        raise ValueError(f"eps: has {len(e)} entries, p_tilde has {len(p)}")
    zu = mpf(z_upper)
    if not zu > 0:
        raise ValueError(f"z_upper: must be > 0, got {z_upper!r}")
    total = mpmath.fsum(p)
    return mpmath.fsum(pt * max(mpf(0), 1 - mpmath.exp(-et) / zu) for pt, et in zip(p, e)) / total


SMALL = mpf(10) ** -6
"""Tokens whose sampling weight (``u`` in the ``Z`` stage, ``h`` in the one-sided one) is below this are bounded by it."""


def one_sided_z_upper(p_tilde: Sequence[Real], c: Sequence[Real], eps: Sequence[Real], exact: Sequence[int],
                      z_draws: Sequence[int], delta_z: Real, planned: int, cap: Real = ONE_SIDED_CAP) -> mpf:
    """``Z_U``: an upper confidence bound on ``Z = E_p~ W`` at level ``delta_z`` (before the fp slack).

    ``Z <= z_known + G E_q1 Y`` with ``z_known = sum_E p~ W + sum_small p~ e^c + sum_R p~`` (``small``:
    ``u < SMALL`` off the exact set ``E``, bounded by ``e^c``), ``q1 = p~ u / G`` on the rest ``R``,
    ``u = e^c - 1``, ``G = sum_R p~ u`` and ``Y = (W - 1) / u`` in ``[-1, 1]`` (``WitCert.exp_neg_sub_one_mem``).
    The betting bound on ``(1 + Y) / 2`` (``planned`` bets, ``cap``) gives ``Z_U``; no draws with
    ``G > 0`` give ``A = E_p~ e^c``; then ``Z_U`` is kept in ``[A-, A]``, where ``Z`` lies.
    ``z_draws`` i.i.d. from ``q1``, possibly stopped at a random time.
    """
    p, r, e = _normalised(p_tilde), _reals("c", c), _reals("eps", eps)
    known = set(exact)
    rest = [t for t in range(len(p)) if t not in known and p[t] > 0]
    small = [t for t in rest if mpmath.expm1(r[t]) < SMALL]
    sampled = [t for t in rest if mpmath.expm1(r[t]) >= SMALL]
    z_known = (mpmath.fsum(p[t] * mpmath.exp(-e[t]) for t in known) + mpmath.fsum(p[t] * mpmath.exp(r[t]) for t in small)
               + mpmath.fsum(p[t] for t in sampled))
    g_total = mpmath.fsum(p[t] * mpmath.expm1(r[t]) for t in sampled)
    a_plus = mpmath.fsum(pt * mpmath.exp(rt) for pt, rt in zip(p, r))
    a_minus = mpmath.fsum(pt * mpmath.exp(-rt) for pt, rt in zip(p, r))
    if g_total == 0:
        z_upper = z_known
    elif len(z_draws) == 0:
        z_upper = a_plus
    else:
        ys = [max(mpf(-1), min(mpf(1), (mpmath.exp(-e[t]) - 1) / mpmath.expm1(r[t]))) for t in z_draws]
        upper = betting_upper([(1 + y) / 2 for y in ys], delta_z, cap=cap, planned=planned)
        z_upper = z_known + g_total * (2 * upper - 1)
    return max(min(z_upper, a_plus), a_minus)


def _normalised(p_tilde: Sequence[Real]) -> list[mpf]:
    p = _reals("p_tilde", p_tilde)
    total = mpmath.fsum(p)
    return [pt / total for pt in p]


def bound_spot_one_sided(p_tilde: Sequence[Real], c: Sequence[Real], eps: Sequence[Real], exact: Sequence[int],
                         z_draws: Sequence[int], f_draws: Sequence[int], delta: Real, planned_z: int, planned_f: int,
                         cap: Real = ONE_SIDED_CAP, z_share: Real = Z_SHARE_OF_DELTA) -> mpf:
    """The one-sided spot-check bound (registry SCO) from an exact set and two stages of draws.

    1. ``Z_U = one_sided_z_upper(..., delta_z = z_share delta)``;
    2. the known set ``K = E + z_draws`` (read already); off ``K``, tokens with ``h < SMALL`` are
       bounded by ``h`` (``h_t = (1 - e^{-c_t} / Z_U)^+ >= (1 - W_t / Z_U)^+``), the others form the
       proposal ``q2 = p~ h / H``; ``f_draws`` i.i.d. from ``q2`` (fixed once stage one is),
       ``X = (1 - W / Z_U)^+ / h`` in ``[0, 1]`` (``WitCert.spot_one_sided_term_le``); the betting
       bound at ``(1 - z_share) delta`` gives ``U`` (no draws: ``U = 1``);
    3. bound ``= sum_K p~ (1 - W / Z_U)^+ + sum_small p~ h + H U``, capped at 1.

    On the event ``Z <= Z_U`` (probability ``>= 1 - z_share delta``) the identity gives
    ``TV <= E_p~ (1 - W/Z_U)^+ <= sum_K ... + sum_small ... + H E_q2 X``; conditionally on stage
    one, ``E_q2 X <= U`` fails with probability ``<= (1 - z_share) delta``. A union: ``>= 1 - delta``.
    Needs ``|eps_t| <= c_t`` on every token and the draws made after the query is fixed.
    """
    delta = mpf(delta)
    z_upper = one_sided_z_upper(p_tilde, c, eps, exact, z_draws, z_share * delta, planned_z, cap)
    p, r, e = _normalised(p_tilde), _reals("c", c), _reals("eps", eps)
    known = set(exact) | set(z_draws)

    def term(t):
        return max(mpf(0), 1 - mpmath.exp(-e[t]) / z_upper)

    def h(t):
        return max(mpf(0), 1 - mpmath.exp(-r[t]) / z_upper)

    others = [t for t in range(len(p)) if t not in known and p[t] > 0]
    bound = mpmath.fsum(p[t] * term(t) for t in known) + mpmath.fsum(p[t] * h(t) for t in others if h(t) < SMALL)
    h_total = mpmath.fsum(p[t] * h(t) for t in others if h(t) >= SMALL)
    if h_total > 0:
        if len(f_draws) == 0:
            bound += h_total
        else:
            xs = [min(mpf(1), term(t) / h(t)) for t in f_draws]
            bound += h_total * betting_upper(xs, (1 - z_share) * delta, cap=cap, planned=planned_f)
    return min(mpf(1), bound)


# ----------------------------------------------------------------------------- request budget (SCD)


def delta_per_cell(delta_req: Real, n_cells: int) -> mpf:
    """``delta_req / n_cells``: cells known in advance (Lemma 3's union over them)."""
    return mpf(delta_req) / n_cells


def delta_at_step(delta_req: Real, step: int, cells_per_step: int) -> mpf:
    """``delta_req 6 / (pi^2 k^2) / cells_per_step`` at decode step ``k >= 1`` (open-ended generation).

    ``sum_{k<n} 6 / (pi^2 k^2) <= 1`` (``WitCert.sum_step_allocation_le``), so the union over every
    step of an unbounded generation stays within ``delta_req`` (``WitCert.measure_iUnion_steps_le``).
    """
    if step < 1:
        raise ValueError(f"step: must be >= 1, got {step!r}")
    return mpf(delta_req) * 6 / (mpmath.pi ** 2 * step ** 2) / cells_per_step


# ----------------------------------------------------------------------------- adaptive rounds (SCR)


def round_shares(rounds: int, split: str = "uniform") -> list[mpf]:
    """``share_r`` of ``delta`` for rounds ``r = 1..rounds``: ``1/R`` each (``"uniform"``) or ``6 / (pi^2 r^2)``
    (``"inverse-square"``). Either sums to at most 1, so a union over the rounds run, each at ``delta share_r``
    conditionally on the rounds before it, fails with probability at most ``delta`` whatever the stopping rule."""
    if rounds < 1:
        raise ValueError(f"rounds: must be >= 1, got {rounds!r}")
    if split == "uniform":
        return [mpf(1) / rounds] * rounds
    if split == "inverse-square":
        return [6 / (mpmath.pi ** 2 * r ** 2) for r in range(1, rounds + 1)]
    raise ValueError(f"split: expected 'uniform' or 'inverse-square', got {split!r}")

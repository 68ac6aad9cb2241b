"""Attack class ``underflow``: every public bound where floating point runs out of range (issue 16, items 4-5).

Each trial is one query row, fp32 or fp64 as a user passes it, from one of these regimes:

* ``subnormal-c``: radii ``c = k sigma`` (``sigma`` the dtype's smallest subnormal, ``k`` up to 2048),
  ties among the logits;
* ``tiny-c``: radii log-uniform between ``sigma`` and ``1e6 tiny``;
* ``underflowing-mass``: logits spread over ~90..1100 below the max, so ``e^y`` underflows while
  ``e^{y + c}`` stays representable (``c`` a little below, at or above the gap);
* ``huge-offset``: a common offset 1e4..1e30 with spreads up to 1e3;
* ``exponent-rounding``: a gap ``x - max x`` too large for the dtype to hold exactly and a radius
  that brings ``y + c`` back to ~-100: the computed term underflows, the exact one need not;

with masked tokens (``-inf``, often ``c = inf`` there) mixed into a third of the rows and ``S``
from 1 to 1024. Checked per row, each against the 50-digit spec of its own statement
(``witcert.spec.bounds`` at 60 digits, on the exact values the code received): ``meter``,
``risk_score``, ``eform_bound``, ``two_sided_bound``, ``retention_bound``, ``maxnorm_bound``,
``competitor_bound``, ``chi_square_bound``, ``mass_split_bound``, and on the value side
``value_error_term`` (residuals from subnormal to 1e300), ``output_bound`` (subnormal inputs) and
``value_residual_norms`` (subnormal and huge vectors). A statement is a Lean theorem bounding the TV, so a bound at or above it is sound.
"""
import math

import torch
from mpmath import mp, mpf

from witcert.core import bounds, values
from witcert.core.metering import meter, risk_score
from witcert.verification.attacks import AttackTally
from witcert.spec import bounds as spec

NAME = "underflow"
SHARE = 0.01  # one row costs ~3-10 ms of 60-digit spec evaluations: 5,000 rows at --trials 500000
DPS = 60
_SIZES = ((1, 3), (2, 6), (3, 4), (4, 4), (5, 2), (8, 2), (12, 1), (64, 0.2), (256, 0.05), (1024, 0.01))
_ROWS_PER_BATCH = 8
_SCORE_BOUNDS = {  # name -> (implementation, statement)
    "meter": (meter, "meter"),
    "risk_score": (risk_score, "eform"),
    "eform": (bounds.eform_bound, "eform"),
    "two_sided": (bounds.two_sided_bound, "two_sided"),
    "retention": (bounds.retention_bound, "retention"),
    "maxnorm": (bounds.maxnorm_bound, "maxnorm"),
    "competitor": (bounds.competitor_bound, "competitor"),
    "chi_square": (bounds.chi_square_bound, "chi_square"),
    "mass_split": (bounds.mass_split_bound, "mass_split"),
}
_STATEMENTS = {
    "eform": spec.bound_eform,
    "two_sided": spec.bound_two_sided,
    "retention": spec.bound_retention,
    "maxnorm": spec.bound_maxnorm,
    "competitor": spec.bound_competitor,
    "chi_square": spec.bound_chi_square,
    "mass_split": spec.bound_mass_split,
}


_METER = ("maxnorm", "eform", "two_sided", "chi_square", "mass_split")  # meter = min(1, these)


def _sigma(dtype: torch.dtype) -> float:
    return 2.0**-149 if dtype == torch.float32 else 2.0**-1074


def _uniform(shape, low, high, g) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float64).uniform_(low, high, generator=g)


def _log_uniform(shape, low, high, g) -> torch.Tensor:
    return torch.exp(_uniform(shape, math.log(low), math.log(high), g))


def _subnormal_c(n, s, dtype, g):
    scores = torch.randn(n, s, generator=g, dtype=torch.float64) * _log_uniform((n, 1), 0.01, 5, g)
    scores = torch.where(torch.rand(n, 1, generator=g) < 0.3, scores.round(), scores)  # ties
    c = torch.randint(0, 2049, (n, s), generator=g).double() * _sigma(dtype)
    c = torch.where(torch.rand(n, s, generator=g) < 0.2, torch.zeros_like(c), c)
    return scores, c


def _tiny_c(n, s, dtype, g):
    scores = torch.randn(n, s, generator=g, dtype=torch.float64) * _log_uniform((n, 1), 0.01, 10, g)
    return scores, _log_uniform((n, s), _sigma(dtype), 1e6 * torch.finfo(dtype).tiny, g)


def _underflowing_mass(n, s, dtype, g):
    low = 90.0 if dtype == torch.float32 or bool(torch.rand(1, generator=g) < 0.3) else 700.0
    gap = _uniform((n, s), low, 1100.0, g)
    gap[:, 0] = _uniform((n,), 0.0, 2.0, g)  # the max token(s)
    mode = torch.randint(0, 4, (n, s), generator=g)
    c = torch.where(mode == 0, gap - _uniform((n, s), 0, 60, g),  # e^{y + c} in [e^-60, 1]
                    torch.where(mode == 1, gap + _uniform((n, s), 0, 30, g),  # above the gap
                                torch.where(mode == 2, _uniform((n, s), 0, 1, g), gap - _uniform((n, s), 60, 120, g))))
    c[:, 0] = _uniform((n,), 0.0, 0.5, g)
    order = torch.argsort(torch.rand(n, s, generator=g), dim=-1)
    return (-gap).gather(-1, order), c.clamp(min=0).gather(-1, order)


def _huge_offset(n, s, dtype, g):
    base = _log_uniform((n, 1), 1e4, 1e30, g) * torch.where(torch.rand(n, 1, generator=g) < 0.5, -1.0, 1.0)
    scores = base + torch.randn(n, s, generator=g, dtype=torch.float64) * _log_uniform((n, 1), 1, 1e3, g)
    return scores, _log_uniform((n, s), 1e-3, 1e3, g)


def _exponent_rounding(n, s, dtype, g):
    """``y = x - max`` rounds by up to half an ulp of ``m``; ``c`` brings the computed ``y + c`` to ~-100.

    Only the last token is far; with ``S = 1`` it is the max itself (then nothing rounds).
    """
    low, high = (28, 36) if dtype == torch.float32 else (57, 66)  # gaps rounding by 8..1024 (fp32)
    m = torch.exp2(_uniform((n, 1), low, high, g)).to(dtype).double()
    far = (-m * _uniform((n, 1), 0.1, 0.5, g)).to(dtype).double()
    y = (far.to(dtype) - m.to(dtype)).double()  # the gap as the dtype computes it
    c_far = (-y - _uniform((n, 1), 100, 130, g)).to(dtype).double().clamp(min=0)
    near = m - torch.rand(n, s - 1, generator=g, dtype=torch.float64) * 5  # the max and its neighbours
    near[:, :1] = m
    c_near = _uniform((n, s - 1), 0, 0.1, g) * (torch.rand(n, 1, generator=g) < 0.5)  # often exact: nothing hides the far term
    return torch.cat([near, far], dim=-1), torch.cat([c_near, c_far], dim=-1)


FAMILIES = {
    "subnormal-c": _subnormal_c,
    "tiny-c": _tiny_c,
    "underflowing-mass": _underflowing_mass,
    "huge-offset": _huge_offset,
    "exponent-rounding": _exponent_rounding,
}


def _mask(scores, c, g):
    """Mask ~30% of the tokens of every row (never all of a row); half of the masked get ``c = inf``."""
    masked = torch.rand(scores.shape, generator=g) < 0.3
    keep = torch.randint(0, scores.shape[-1], (scores.shape[0], 1), generator=g)
    masked.scatter_(-1, keep, False)
    c = torch.where(masked & (torch.rand(c.shape, generator=g) < 0.5), torch.full_like(c, math.inf), c)
    return scores.masked_fill(masked, -math.inf), c


def _residuals(shape, dtype, g) -> torch.Tensor:
    """Value residual norms: subnormal, spread over the whole range, or 0."""
    top = 300 if dtype == torch.float64 else 37
    kind = torch.randint(0, 5, shape, generator=g)
    sub = torch.randint(0, 2049, shape, generator=g).double() * _sigma(dtype)
    wide = torch.exp(_uniform(shape, -top * math.log(10), top * math.log(10), g))
    return torch.where(kind < 2, sub, torch.where(kind < 4, wide, torch.zeros(shape, dtype=torch.float64))).to(dtype)


class _Row:
    """The exact statements of one row at ``DPS`` digits, evaluated lazily (each is O(S))."""

    def __init__(self, scores: list, c: list):
        self.c, self.cache = c, {}
        with mp.workdps(DPS):
            self.p = spec.softmax(scores)

    def statement(self, name: str) -> mpf:
        if name not in self.cache:
            with mp.workdps(DPS):
                if name == "meter":
                    value = min([mpf(1)] + [self.statement(key) for key in _METER])
                else:
                    value = _STATEMENTS[name](self.p, self.c)
            self.cache[name] = value
        return self.cache[name]

    def value_term(self, rho: list) -> mpf:
        with mp.workdps(DPS):
            return mp.fsum(pt * mpf(r) for pt, r in zip(self.p, rho) if pt > 0)


def _judge(tally: AttackTally, label: str, exact: mpf, bound: float) -> None:
    """One cell: ``bound`` (as reported) against the exact value; the first violation of each bound is noted."""
    tally.cells += 1
    with mp.workdps(DPS):
        if mpf(bound) < exact:
            tally.violations += 1
            name = label.split()[0]
            if not any(note.startswith(name + " ") for note in tally.notes):
                tally.notes.append(f"{label}: bound {bound!r} < exact {mp.nstr(exact, 8)}")
        if 0 < bound < math.inf and exact < mp.inf:
            ratio = float(exact / mpf(bound))
            tally.worst_ratio = ratio if math.isnan(tally.worst_ratio) else max(tally.worst_ratio, ratio)


def _evaluate(fn, *args):
    """``fn(*args)``, or ``None`` for a clear error (counted as rejected)."""
    try:
        return fn(*args)
    except ValueError:
        return None


def _check_batch(scores: torch.Tensor, c: torch.Tensor, g: torch.Generator, tally: AttackTally, label: str) -> None:
    dtype = scores.dtype
    reported = {name: _evaluate(fn, scores, c) for name, (fn, _) in _SCORE_BOUNDS.items()}
    rho = _residuals(scores.shape, dtype, g)
    reported["value_error_term"] = _evaluate(values.value_error_term, scores, rho)
    for name, value in reported.items():
        if value is None:
            tally.rejected += scores.shape[0]
    for i in range(scores.shape[0]):
        row = _Row(scores[i].double().tolist(), c[i].double().tolist())
        for name, (_, statement) in _SCORE_BOUNDS.items():
            if reported[name] is not None:
                _judge(tally, f"{name} {label}", row.statement(statement), float(reported[name][i]))
        if reported["value_error_term"] is not None:
            _judge(tally, f"value_error_term {label}", row.value_term(rho[i].double().tolist()),
                   float(reported["value_error_term"][i]))
    _check_output_bound(reported["meter"], reported["value_error_term"], g, tally, label)
    _check_residual_norms(scores.shape, dtype, g, tally, label)


def _check_output_bound(meter, value_term, g, tally, label) -> None:
    if meter is None or value_term is None:
        return
    vmax = _residuals(meter.shape, torch.float64, g)
    got = values.output_bound(meter, value_term, vmax)
    for tv, vt, vm, b in zip(meter.double().tolist(), value_term.tolist(), vmax.tolist(), got.tolist()):
        with mp.workdps(DPS):
            exact = 2 * mpf(tv) * mpf(vm) + mpf(vt) if tv > 0 and vm > 0 else mpf(vt)
        _judge(tally, f"output_bound {label}", exact, b)


def _check_residual_norms(shape, dtype, g, tally, label) -> None:
    d = 3
    scale = _residuals((shape[0], 1, 1, 1), dtype, g).double().clamp(min=_sigma(dtype))
    v = (torch.randn(shape[0], 2, d, generator=g, dtype=torch.float64) * scale[:, 0]).to(dtype)
    v_hat = (torch.randn(shape[0], 2, d, generator=g, dtype=torch.float64) * scale[:, 0]).to(dtype)
    v, v_hat = v.unsqueeze(1), v_hat.unsqueeze(1)  # (rows, 1, 2 tokens, d)
    if not (torch.isfinite(v).all() and torch.isfinite(v_hat).all()):
        return
    got = values.value_residual_norms(v, v_hat).reshape(-1).tolist()
    pairs = zip(v.reshape(-1, d).double().tolist(), v_hat.reshape(-1, d).double().tolist())
    for (a, b), bound in zip(pairs, got):
        with mp.workdps(DPS):
            exact = mp.sqrt(mp.fsum((mpf(y) - mpf(x)) ** 2 for x, y in zip(a, b)))
        _judge(tally, f"value_residual_norms {label}", exact, bound)


def run(n: int, g: torch.Generator) -> AttackTally:
    """``n`` query rows over the regimes above (the value-side cells come on top)."""
    tally = AttackTally(NAME)
    names = list(FAMILIES)
    sizes = torch.tensor([w for _, w in _SIZES])
    done = 0
    while done < n:
        family = names[int(torch.randint(len(names), (1,), generator=g))]
        dtype = torch.float32 if bool(torch.rand(1, generator=g) < 0.5) else torch.float64
        s = _SIZES[int(torch.multinomial(sizes, 1, generator=g))][0]
        rows = min(n - done, _ROWS_PER_BATCH if s <= 64 else 1)
        scores, c = FAMILIES[family](rows, s, dtype, g)
        if bool(torch.rand(1, generator=g) < 1 / 3):
            scores, c = _mask(scores, c, g)
        _check_batch(scores.to(dtype), c.to(dtype), g, tally, f"{family} {dtype} S={s}")
        done += rows
    return tally

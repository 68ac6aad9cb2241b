"""Attack class ``split-mass``: the inputs where the chi-square (CS) and mass-split (MS) bounds bind (issue 12).

CS and MS are far below ``tanh(D/2)`` exactly when the large radii sit on little mass, so that is
where a wrong sum, a token in the wrong bucket or a lost underflow slack would show. Each row is
one query, fp32 or fp64, from one of four generators:

* ``concentrated``: most mass on a few low-``c`` tokens, a few large-``c`` tokens (up to 30) on
  masses down to ``e^-40``;
* ``equal``: every radius equal (CS meets ``tanh(c/2)``, the exact sup, to first order);
* ``edges``: radii on the MS thresholds of their own ``D`` (``witcert.spec.bounds.mass_split_thresholds``),
  one float below and one above, in the row's dtype (a token in the wrong set is caught here);
* ``underflow``: light tokens whose mass is subnormal or zero in the working dtype (``y`` down to
  ``-750`` in fp64, ``-105`` in fp32) carrying radii that lift ``e^{y + c}`` back to the normal
  range, or subnormal radii.

Checked per row, on the exact values the code received: ``meter``, ``chi_square_bound`` and
``mass_split_bound`` against the sup-box adversary's TV (``witcert.verification.adversary``, the
exact sup for ``S <= 12``, an achieved TV beyond), a near-miss re-decided by the 50-digit TV at
the adversary's vertex; and the first row of every batch (``S <= 64``): CS and MS against their own
50-digit statements (``witcert.spec.golden``), which is what their rounding must stay above.
"""
import math

import torch
from mpmath import mpf

from witcert.core import bounds
from witcert.core.metering import meter
from witcert.spec import bounds as spec
from witcert.spec import golden
from witcert.verification import adversary
from witcert.verification.attacks import AttackTally
from witcert.verification.fuzz import _golden_tv

NAME = "split-mass"
SHARE = 0.005  # ~5-15 ms a row (batched adversary, one row a batch at 50 digits): 2,500 rows at 500k
_SIZES = ((2, 2), (3, 2), (5, 2), (8, 3), (12, 3), (64, 0.5), (512, 0.1))  # (S, weight)
_ROWS_PER_BATCH = 32
_CHECKED = {"meter": meter, "chi_square": bounds.chi_square_bound, "mass_split": bounds.mass_split_bound}
_STATEMENTS = {"chi_square": golden.chi_square_from_scores, "mass_split": golden.mass_split_from_scores}


def _uniform(shape, low, high, g) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float64).uniform_(low, high, generator=g)


def _log_uniform(shape, low, high, g) -> torch.Tensor:
    return torch.exp(_uniform(shape, math.log(low), math.log(high), g))


def _heavy_light(n, s, g) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores with one to three heavy tokens and light ones ``e^-1 .. e^-40`` below, and the heavy mask."""
    heavy = torch.rand(n, s, generator=g) < 0.3
    heavy[:, 0] = True
    scores = torch.where(heavy, torch.randn(n, s, generator=g, dtype=torch.float64) * 0.5,
                         -_uniform((n, s), 1.0, 40.0, g))
    return scores, heavy


def _concentrated(n, s, dtype, g):
    scores, heavy = _heavy_light(n, s, g)
    small = _log_uniform((n, 1), 1e-6, 0.3, g) * torch.rand(n, s, generator=g, dtype=torch.float64)
    large = _log_uniform((n, s), 0.2, 30.0, g)
    few = torch.rand(n, s, generator=g) < _uniform((n, 1), 0.05, 1.0, g)  # how many light tokens carry a large c
    return scores, torch.where(heavy | ~few, small, large)


def _equal(n, s, dtype, g):
    scores = torch.randn(n, s, generator=g, dtype=torch.float64) * _log_uniform((n, 1), 0.01, 8.0, g)
    return scores, _log_uniform((n, 1), 1e-8, 20.0, g).expand(n, s)


def _neighbours(x: float, dtype: torch.dtype) -> list[float]:
    """``x`` in ``dtype`` and the floats of ``dtype`` just below and above it (as fp64 values)."""
    t = torch.tensor([x], dtype=torch.float64).to(dtype)
    down = torch.nextafter(t, torch.tensor([0.0], dtype=dtype))
    up = torch.nextafter(t, torch.tensor([math.inf], dtype=dtype))
    return [float(v) for v in (t, down, up)]


def _edges(n, s, dtype, g):
    scores, heavy = _heavy_light(n, s, g)
    c = torch.empty(n, s, dtype=torch.float64)
    d = _log_uniform((n,), 1e-3, 40.0, g)
    for row in range(n):
        d_row = float(torch.tensor(float(d[row])).to(dtype))
        grid = [float(v) for v in spec.mass_split_thresholds((1.0,), (d_row,))[1:]]
        choices = [v for value in grid for v in _neighbours(value, dtype) if 0 < v <= d_row]
        picks = torch.randint(len(choices), (s,), generator=g).tolist()
        c[row] = torch.tensor([choices[i] for i in picks], dtype=torch.float64)
        d[row] = d_row
    low = torch.where(heavy, torch.rand(n, s, generator=g, dtype=torch.float64) < 0.8, torch.zeros_like(heavy))
    c = torch.where(low, c.amin(-1, keepdim=True), c)  # heavy tokens mostly take the smallest radius
    return scores, c.scatter(-1, torch.randint(s, (n, 1), generator=g), d.unsqueeze(-1))  # D itself is a radius


def _underflow(n, s, dtype, g):
    fp32 = dtype == torch.float32
    gap = _uniform((n, s), 80.0, 105.0, g) if fp32 else _uniform((n, s), 690.0, 750.0, g)
    gap[:, 0] = _uniform((n,), 0.0, 1.0, g)
    lift = gap - _uniform((n, s), 0.0, 30.0, g)  # e^{y + c} back in the normal range
    tiny = torch.finfo(dtype).tiny * _uniform((n, s), 0.0, 4.0, g)  # subnormal or just normal
    mode = torch.randint(0, 3, (n, s), generator=g)
    c = torch.where(mode == 0, lift.clamp(min=0), torch.where(mode == 1, tiny, _uniform((n, s), 0.0, 0.05, g)))
    c[:, 0] = _uniform((n,), 0.0, 0.05, g)
    return -gap, c


_GENERATORS = (_concentrated, _equal, _edges, _underflow)


def _exceeds(exact, bound: float) -> float:
    """A float that is above ``bound`` exactly when the exact value ``exact`` (mpf) is."""
    value = float(exact)
    if exact > bound and value <= bound:
        return math.nextafter(bound, math.inf)
    return min(value, bound) if exact <= bound else value


def _check_tv(scores, c, scores64, c64, tally: AttackTally) -> None:
    """Every checked bound against the adversary's worst TV, near-misses re-decided at 50 digits."""
    sup = adversary.sup_box_tv(scores64, c64, polished=None if scores64.shape[-1] <= 64 else 4)
    vertex = sup.eps(c64)
    for fn in _CHECKED.values():
        bound = fn(scores, c).double()
        if bool(torch.isnan(bound).any()):
            tally.notes.append(f"NaN from {fn.__name__}")  # counted below: NaN reads as -1
        exact = sup.tv.clone()
        for i in ((sup.tv > bound * (1 - 1e-9)) & (bound < 1)).nonzero().flatten().tolist():
            exact[i] = _exceeds(_golden_tv(scores64[i].tolist(), vertex[i].tolist()), float(bound[i]))
        tally.add(exact, torch.nan_to_num(bound, nan=-1.0))


def _check_statements(scores, c, scores64, c64, tally: AttackTally) -> None:
    """CS and MS of one row against their 50-digit statements on the same exact inputs."""
    s_list, c_list = scores64[0].tolist(), c64[0].tolist()
    for name, statement in _STATEMENTS.items():
        bound = float(_CHECKED[name](scores[:1], c[:1]))
        tally.add(torch.tensor([_exceeds(mpf(statement(s_list, c_list)), bound)]), torch.tensor([bound]))


def run(n: int, g: torch.Generator) -> AttackTally:
    """``n`` rows (at least one batch), each checked per query; 0 violations expected."""
    tally = AttackTally(NAME)
    sizes = torch.tensor([w for _, w in _SIZES], dtype=torch.float64)
    done = batch = 0
    while done < n:
        s = _SIZES[int(torch.multinomial(sizes, 1, generator=g))][0]
        dtype = (torch.float32, torch.float64)[batch % 2]
        rows = min(_ROWS_PER_BATCH if s <= 64 else 4, n - done)
        scores64, c64 = _GENERATORS[batch % len(_GENERATORS)](rows, s, dtype, g)
        scores, c = scores64.to(dtype), c64.to(dtype).clamp(min=0)
        scores64, c64 = scores.double(), c.double()  # the exact values the code receives
        _check_tv(scores, c, scores64, c64, tally)
        if s <= 64:
            _check_statements(scores, c, scores64, c64, tally)
        done += rows
        batch += 1
    return tally

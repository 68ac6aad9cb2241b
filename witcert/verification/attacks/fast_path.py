"""Attack class ``fast-path``: the fused meter (:mod:`witcert.fastpath`) on the rows where floating point runs out.

The fused pass replaces per-operation directed rounding by an a-priori budget, so it is attacked
on the same regimes as the eager meter (:mod:`witcert.verification.attacks.underflow`: subnormal
and tiny radii, underflowing masses, huge offsets, exponents that round below the underflow
threshold, masks with ``c = inf`` on masked tokens), plus one ``long-row`` per run of at least
1,000 rows: ``S`` from 32,768 to 131,072 with an outlier radius (its 60-digit checks take minutes,
so one per run; ``tests/test_fastpath.py`` checks a 131,072-token row on every test run). Per row,
against the 60-digit statements (``witcert.spec.bounds``):
:func:`~witcert.fastpath.fused.fast_meter` against the exact minimum of the bounds it forms,
``min(1, T1, P1, MN, CS, MS)`` with MS on the pass's own low sets (:func:`formed_meter`), the fused
risk against ``T1`` and the fused value term against ``sum p~ rho``. Eager by default; the
compiled pass when ``WITCERT_COMPILE=1`` (``tests/test_fastpath.py`` runs both).
"""
import torch
from mpmath import mp, mpf

from witcert.fastpath.budgeted_pass import split_low_sets
from witcert.fastpath.fused import fast_meter, lean_cells
from witcert.spec import bounds as spec
from witcert.verification.attacks import AttackTally
from witcert.verification.attacks.underflow import DPS, FAMILIES, _judge, _mask, _residuals, _Row

NAME = "fast-path"
SHARE = 0.004  # a short row costs ~90 ms of 60-digit spec evaluations: 2,000 rows (~3 min) at --trials 500000
_SIZES = (1, 2, 3, 5, 8, 17, 64, 256)
_ROWS = 6
_LONG_MIN_ROWS = 1000  # runs this large get one long row (~2-7 min of 60-digit evaluation), halfway
_FORMED = ("eform", "two_sided", "maxnorm", "chi_square")  # the fused meter = min(1, these, MS on its sets)


def _long_row(g: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of 32k..131k tokens: small radii everywhere, one large radius on a low-mass token."""
    s = int(torch.randint(32768, 131073, (1,), generator=g))
    scores = torch.randn(1, s, generator=g, dtype=torch.float64) * 4
    c = torch.rand(1, s, generator=g, dtype=torch.float64) * 1e-3
    c[0, int(torch.randint(s, (1,), generator=g))] = 40.0
    return scores.to(dtype), c.to(dtype)


def formed_meter(row: _Row, low_sets: list) -> mpf:
    """The exact value of the meter the fused pass forms, ``min(1, T1, P1, MN, CS, MS)`` with MS on the low sets
    it splits at (``low_sets``: :func:`~witcert.fastpath.budgeted_pass.split_low_sets` of the row)."""
    with mp.workdps(DPS):
        return min([mpf(1)] + [row.statement(name) for name in _FORMED] + [spec.bound_mass_split_sets(row.p, row.c, low_sets)])


def _check(scores: torch.Tensor, c: torch.Tensor, g: torch.Generator, tally: AttackTally, label: str) -> None:
    try:
        reported = fast_meter(scores, c)
    except ValueError:
        tally.rejected += scores.shape[0]
        return
    rho = _residuals(scores.shape, scores.dtype, g)
    fused = lean_cells(scores, c, rho)
    sets = split_low_sets(scores, c)
    for i in range(scores.shape[0]):
        row = _Row(scores[i].double().tolist(), c[i].double().tolist())
        _judge(tally, f"fast_meter {label}", formed_meter(row, sets[i].tolist()), float(reported[i]))
        _judge(tally, f"fused risk {label}", row.statement("eform"), float(fused.risk[i]))
        _judge(tally, f"fused value_term {label}", row.value_term(rho[i].double().tolist()), float(fused.value_term[i]))


def run(n: int, g: torch.Generator) -> AttackTally:
    """``n`` rows over the underflow regimes and long rows, fp32 and fp64, a third of them masked."""
    tally = AttackTally(NAME)
    names = list(FAMILIES)
    done, long_pending = 0, n >= _LONG_MIN_ROWS
    while done < n:
        long_due = long_pending and done >= n // 2
        long_pending &= not long_due
        family = "long-row" if long_due else names[int(torch.randint(len(names), (1,), generator=g))]
        dtype = torch.float32 if bool(torch.rand(1, generator=g) < 0.5) else torch.float64
        if family == "long-row":
            scores, c = _long_row(g, dtype)
            label = f"long-row {dtype} S={scores.shape[-1]}"
        else:
            s = _SIZES[int(torch.randint(len(_SIZES), (1,), generator=g))]
            scores, c = FAMILIES[family](min(_ROWS, n - done), s, dtype, g)
            label = f"{family} {dtype} S={s}"
        if bool(torch.rand(1, generator=g) < 1 / 3):
            scores, c = _mask(scores, c, g)
        _check(scores.to(dtype), c.to(dtype), g, tally, label)
        done += scores.shape[0]
    return tally

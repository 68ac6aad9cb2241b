"""The fused meter pass (:mod:`witcert.fastpath`), eager and compiled, against the 50-digit golden.

Implementation: :func:`witcert.fastpath.fused.fast_meter` / :func:`~witcert.fastpath.fused.lean_cells`
(``T1``, ``P1``, ``MN`` under the a-priori budget ``FP``), eager and ``torch.compile``d.
Oracle: ``witcert.spec.golden.meter_from_scores`` (50 digits) and the 60-digit statements of the
``fast-path`` attack class. Domain: random rows, the underflow regimes (subnormal/tiny radii,
underflowing masses, huge offsets, exponent rounding), masks with ``c = inf``, fp32 and fp64,
``S`` up to 131,072. Tolerance: none below (``bound >= exact`` per query); above, the budget's
looseness against the eager meter is at most ``1e-7`` relative on these rows.
"""
import math
import warnings

import pytest
import torch
from mpmath import mp, mpf

from witcert.core.bounds import moments
from witcert.core.checks import check_scores_and_bounds
from witcert.fastpath import compiled as compiled_mod
from witcert.fastpath.budgeted_pass import REL, lean_cells_kernel
from witcert.fastpath.fused import fast_meter, lean_cells
from witcert.spec import golden
from witcert.verification.attacks import fast_path


def _rows(g, n, s, dtype, masked=True):
    scores = torch.randn(n, s, generator=g, dtype=torch.float64) * 3
    c = torch.rand(n, s, generator=g, dtype=torch.float64) * torch.tensor([1e-4, 1e-2, 0.3, 2.0, 40.0])[
        torch.randint(5, (n, 1), generator=g)]
    if masked:
        drop = torch.rand(n, s, generator=g) < 0.3
        drop[:, 0] = False
        scores = scores.masked_fill(drop, -math.inf)
        c = torch.where(drop & (torch.rand(n, s, generator=g) < 0.5), math.inf, c)
    return scores.to(dtype), c.to(dtype)


def _assert_never_below_golden(scores, c, got):
    for i in range(scores.shape[0]):
        with mp.workdps(50):
            exact = golden.meter_from_scores(scores[i].double().tolist(), c[i].double().tolist())
            assert mpf(float(got[i])) >= exact, (i, float(got[i]), mp.nstr(exact, 12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_meter_never_below_golden_and_close_to_eager(dtype):
    g = torch.Generator().manual_seed(3)
    for s in (1, 2, 7, 64, 300):
        scores, c = _rows(g, 12, s, dtype)
        got = fast_meter(scores, c)
        assert got.dtype == dtype and got.shape == (12,)
        _assert_never_below_golden(scores, c, got)
        # close to the eager base minimum min(1, T1, P1, MN) it computes (the full meter adds CS and MS)
        m = moments(*check_scores_and_bounds(scores, c))
        eager = torch.minimum(torch.minimum(m.eform(), m.two_sided()), m.maxnorm()).clamp(max=1.0)
        assert torch.all(got.double() <= eager * (1 + 1e-7) + 1e-300), (got, eager)  # tight: GROW^3 ~ 1 + 1.1e-8


def test_fast_path_attack_class_finds_no_violation():
    tally = fast_path.run(60, torch.Generator().manual_seed(5))
    assert tally.cells > 0 and tally.violations == 0, tally.notes


def test_long_row_131072_tokens_never_below_golden():
    g = torch.Generator().manual_seed(7)
    scores, c = fast_path._long_row(g, torch.float64)
    scores = torch.cat([scores, torch.randn(1, 131072 - scores.shape[-1], generator=g, dtype=torch.float64)], -1)
    c = torch.cat([c, torch.full((1, 131072 - c.shape[-1]), 1e-3, dtype=torch.float64)], -1)
    _assert_never_below_golden(scores, c, fast_meter(scores, c))


def test_value_term_keeps_underflowed_mass_times_subnormal_residual():
    """Fails before 'subnormal value-term products': ABS * rho underflowed to a reported 0 < exact."""
    scores = torch.tensor([[0.0, -1e19]], dtype=torch.float64)
    rho = torch.tensor([[0.0, 2.0**-1074]], dtype=torch.float64)
    got = lean_cells(scores, torch.zeros_like(scores), rho).value_term
    assert float(got[0]) > 0.0  # the exact value e^{-1e19} 2^-1074 / Z is positive


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="scores contains NaN"):
        fast_meter(torch.tensor([[0.0, math.nan]]), 0.1)
    with pytest.raises(ValueError, match="c must be >= 0"):
        fast_meter(torch.zeros(1, 3), -1.0)


def test_compile_choice_is_checked(monkeypatch):
    monkeypatch.setenv("WITCERT_COMPILE", "yes")
    with pytest.raises(ValueError, match="WITCERT_COMPILE"):
        compiled_mod.compile_requested()


def test_compile_failure_falls_back_to_eager_once(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(compiled_mod, "_state", {})
    with pytest.warns(RuntimeWarning, match="torch.compile unavailable"):
        assert compiled_mod.lean_cells_fn(compiled=True) is lean_cells_kernel
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert compiled_mod.lean_cells_fn(compiled=True) is lean_cells_kernel


def test_one_minus_exp_neg_within_budget():
    """``f`` at most ``4 REL`` below ``1 - e^{-c}`` (what the term budget charges it; only upper bounds use ``f``),
    and at most ``2^-26`` above (the series' truncation), c from subnormal to 800.

    The compiled kernel's use of it is covered by the golden comparisons below (tiny and subnormal radii).
    """
    from witcert.fastpath.budgeted_pass import _one_minus_exp_neg

    c = torch.cat([torch.logspace(-320, 0, 3000, dtype=torch.float64), torch.linspace(0, 800, 3001, dtype=torch.float64)])
    with mp.workdps(50):
        for t, v in zip(c.tolist(), _one_minus_exp_neg(c).tolist()):
            exact = -mp.expm1(-mpf(t))
            assert (v == 0) == (t == 0), (t, v)
            assert t == 0 or -4 * REL <= mpf(v) / exact - 1 <= 2.0**-26, (t, v)


# ----------------------------------------------------------------------------- compiled (one compile per process)


@pytest.fixture(scope="module")
def compiled_kernel():
    fn = compiled_mod.compiled_kernel()
    if fn is None:
        pytest.skip("torch.compile unavailable on this machine (the eager fallback is tested above)")
    return fn


def test_transcendental_budget(compiled_kernel):
    """The compiled code's exp and tanh against 50-digit values on a dense grid: within REL/16.

    ``REL`` (2^-40) is what the fused pass budgets for each; torch's eager libm is within 4 ulps (``FP``).
    Compiled ``expm1`` fails this (relative error 1 at 1e-20): the pass does not use it, and this
    test says so, so that a torch upgrade that fixes it is noticed.
    """
    fn = torch.compile(lambda x: (torch.exp(x), torch.tanh(x), torch.expm1(x)), dynamic=True)
    grids = (torch.linspace(-708, 709, 4001, dtype=torch.float64),
             torch.cat([torch.linspace(0, 20, 2001, dtype=torch.float64),
                        torch.logspace(-300, 1, 1000, dtype=torch.float64)]))
    for index, (x, exact) in enumerate(zip(grids, (mp.exp, mp.tanh))):
        got = fn(x)[index].tolist()
        with mp.workdps(50):
            worst = max(abs(mpf(v) / exact(mpf(t)) - 1) for t, v in zip(x.tolist(), got) if t != 0)
        assert worst <= REL / 16, (index, float(worst))
    tiny = torch.tensor([1e-20, 1e-8], dtype=torch.float64)
    assert float(fn(tiny)[2][0]) != 1e-20  # compiled expm1 still inaccurate: keep it out of the pass


def test_compiled_fast_meter_never_below_golden(compiled_kernel, monkeypatch):
    monkeypatch.setenv("WITCERT_COMPILE", "1")
    assert compiled_mod.lean_cells_fn() is compiled_kernel
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.float64):
        for s in (1, 5, 200):
            scores, c = _rows(g, 6, s, dtype)
            _assert_never_below_golden(scores, c, fast_meter(scores, c))
    tally = fast_path.run(40, torch.Generator().manual_seed(13))
    assert tally.cells > 0 and tally.violations == 0, tally.notes


def test_compiled_equals_eager_to_the_budget(compiled_kernel):
    g = torch.Generator().manual_seed(17)
    scores, c = _rows(g, 9, 4096, torch.float64)
    rho = torch.rand(9, 4096, generator=g, dtype=torch.float64)
    args = (scores, c, rho, rho)
    for a, b in zip(compiled_kernel(*args), lean_cells_kernel(*args)):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-300)

"""The fused meter pass (:mod:`witcert.fastpath`), eager and compiled, against the 50-digit golden.

Implementation: :func:`witcert.fastpath.fused.fast_meter` / :func:`~witcert.fastpath.fused.lean_cells`
(``T1``, ``P1``, ``MN``, ``CS``, ``MS`` from one fp32 pass under the a-priori budget ``FP``), eager and
``torch.compile``d. Oracle: ``witcert.spec.golden.meter_on_sets_from_scores`` (50 digits; the exact
meter with MS on the pass's own low sets, ``budgeted_pass.split_low_sets``) and the 60-digit
statements of the ``fast-path`` attack class. Domain: random rows, the underflow regimes
(subnormal/tiny radii, underflowing masses, huge offsets, exponent rounding), masks with
``c = inf``, fp32 and fp64, ``S`` up to 131,072; the budget's own constants (``exp``, ``tanh``,
``sqrt``, the ``e^c - 1`` series) measured on dense grids, eager and compiled. Tolerance: none
below (``bound >= exact`` per query); above, the budget's looseness against the eager minimum of
the unsplit bounds is at most ``1e-4`` relative on these rows.
"""
import math
import warnings

import pytest
import torch
from mpmath import mp, mpf

import witcert
from witcert.core import rounding
from witcert.core.bounds import moments
from witcert.core.checks import check_scores_and_bounds
from witcert.fastpath import budgeted_pass
from witcert.fastpath import compiled as compiled_mod
from witcert.fastpath.budgeted_pass import PassBudget, expm1_nonneg, lean_pass
from witcert.fastpath.fused import fast_meter, lean_cells
from witcert.spec import golden
from witcert.verification.attacks import fast_path
from witcert.verification.attacks.underflow import DPS, _Row


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
    sets = budgeted_pass.split_low_sets(scores, c)
    for i in range(scores.shape[0]):
        with mp.workdps(50):
            exact = golden.meter_on_sets_from_scores(scores[i].double().tolist(), c[i].double().tolist(),
                                                     sets[i].tolist())
            assert mpf(float(got[i])) >= exact, (i, float(got[i]), mp.nstr(exact, 12))


def _assert_within(values, exact_fn, rel: float, grid) -> None:
    with mp.workdps(50):
        for t, v in zip(grid.tolist(), values.tolist()):
            exact = exact_fn(mpf(t))
            assert (v == 0) == (exact == 0), (t, v)
            assert exact == 0 or abs(mpf(v) / exact - 1) <= rel, (t, v, float(mpf(v) / exact - 1))


_RADII = torch.cat([torch.logspace(-45, 0, 1500), torch.linspace(0, 64, 1501)]).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_meter_never_below_golden_and_close_to_eager(dtype):
    g = torch.Generator().manual_seed(3)
    for s in (1, 2, 7, 64, 300):
        scores, c = _rows(g, 12, s, dtype)
        got = fast_meter(scores, c)
        assert got.dtype == dtype and got.shape == (12,)
        _assert_never_below_golden(scores, c, got)
        # close to the eager minimum of the unsplit bounds, min(1, T1, P1, MN, CS), or below it (MS)
        eager = moments(*check_scores_and_bounds(scores, c)).unsplit().clamp(max=1.0)
        assert torch.all(got.double() <= eager * (1 + 1e-4) + 1e-30), (got, eager)  # fp32 terms: ~1e-5


def test_fast_meter_is_exactly_zero_without_compression():
    scores = torch.randn(3, 50, dtype=torch.float64)
    assert torch.equal(fast_meter(scores, torch.zeros_like(scores)), torch.zeros(3, dtype=torch.float64))


def test_fast_path_attack_class_finds_no_violation():
    tally = fast_path.run(60, torch.Generator().manual_seed(5))
    assert tally.cells > 0 and tally.violations == 0, tally.notes


def test_long_row_131072_tokens_never_below_golden():
    g = torch.Generator().manual_seed(7)
    scores, c = fast_path._long_row(g, torch.float64)
    scores = torch.cat([scores, torch.randn(1, 131072 - scores.shape[-1], generator=g, dtype=torch.float64)], -1)
    c = torch.cat([c, torch.full((1, 131072 - c.shape[-1]), 1e-3, dtype=torch.float64)], -1)
    # against the exact minimum of the bounds it forms (60 digits; the full golden's MS grid costs minutes here)
    row = _Row(scores[0].tolist(), c[0].tolist())
    formed = fast_path.formed_meter(row, budgeted_pass.split_low_sets(scores, c)[0].tolist())
    with mp.workdps(DPS):
        assert mpf(float(fast_meter(scores, c)[0])) >= formed


def test_value_term_keeps_underflowed_mass_times_subnormal_residual():
    """Fails before 'subnormal value-term products': ABS * rho underflowed to a reported 0 < exact."""
    scores = torch.tensor([[0.0, -1e19]], dtype=torch.float64)
    rho = torch.tensor([[0.0, 2.0**-1074]], dtype=torch.float64)
    got = lean_cells(scores, torch.zeros_like(scores), rho).value_term
    assert float(got[0]) > 0.0  # the exact value e^{-1e19} 2^-1074 / Z is positive


def test_infinite_residual_gives_an_infinite_value_term_never_nan():
    scores = torch.tensor([[0.0, -1e6]], dtype=torch.float64)  # the second mass underflows to 0
    got = lean_cells(scores, torch.zeros_like(scores), torch.tensor([[0.0, math.inf]], dtype=torch.float64))
    assert got.value_term.item() == math.inf


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
        assert compiled_mod.pick(lean_pass, budgeted_pass.probe, compiled=True) is lean_pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert compiled_mod.pick(lean_pass, budgeted_pass.probe, compiled=True) is lean_pass


def test_a_compiled_call_that_fails_later_falls_back_to_eager_once(monkeypatch):
    """A recompile limit or a toolchain error on a new shape mid-generation: the eager pass answers."""
    calls = []

    def compile_then_fail(fn, **kwargs):
        def compiled(*args):
            calls.append(len(calls))
            if len(calls) > 1:  # the probe compiles; the next shape does not
                raise RuntimeError("recompile limit")
            return fn(*args)
        return compiled

    monkeypatch.setattr(torch, "compile", compile_then_fail)
    monkeypatch.setattr(compiled_mod, "_state", {})
    fn = compiled_mod.pick(lean_pass, budgeted_pass.probe, compiled=True)
    scores, c = _rows(torch.Generator().manual_seed(2), 3, 9, torch.float64)
    args = (scores, c, torch.zeros_like(c), torch.zeros_like(c))
    with pytest.warns(RuntimeWarning, match="recompile limit"):
        got = fn(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, lean_pass(*args)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once; eager from now on
        fn(*args)
    assert len(calls) == 2


def _add_one(x):
    return x + 1.0


def test_more_graphs_than_torchs_default_limit_stay_compiled_and_the_global_limit_is_restored():
    """Twelve new shape classes (ranks 2-13) of one function: beyond torch's default of 8 graphs, each is compiled
    (torch would otherwise run the 9th on eagerly and silently), and the process-wide limit is what it was
    before each call (a user's setting kept)."""
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.utils import counters

    if compiled_mod.compiled_of(_add_one, lambda: (torch.ones(2),)) is None:
        pytest.skip("torch.compile unavailable on this machine")
    before = dynamo_config.recompile_limit
    fn = compiled_mod.compiled_of(_add_one, lambda: (torch.ones(2),))
    graphs = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rank in range(2, 14):
            assert torch.equal(fn(torch.ones((2,) * rank)), torch.full((2,) * rank, 2.0))
            assert dynamo_config.recompile_limit == before
    assert counters["stats"]["unique_graphs"] - graphs == 12
    assert compiled_mod._state[_add_one] is not None  # still the compiled function


def test_expm1_series_within_budget():
    """``g = e^c - 1`` and ``g / (1 + g)`` of the fp32 pass within ``rho_g`` and ``rho_f``, c from subnormal to 64."""
    budget = PassBudget(2)
    g = expm1_nonneg(_RADII)
    _assert_within(g, mp.expm1, budget.g, _RADII)
    _assert_within(g / (1.0 + g), lambda t: -mp.expm1(-t), budget.f, _RADII)


def test_g_max_is_above_every_computed_g():
    c = _RADII.double()
    assert torch.all(budgeted_pass._expm1_up(c) * (1 + PassBudget(2).g) >= expm1_nonneg(_RADII).double())
    with mp.workdps(50):
        assert all(mpf(v) >= mp.expm1(mpf(t)) for t, v in zip(c.tolist(), budgeted_pass._expm1_up(c).tolist()))


# ----------------------------------------------------------------------------- compiled (one compile per process)


@pytest.fixture(scope="module")
def compiled_pass():
    fn = compiled_mod.compiled_of(lean_pass, budgeted_pass.probe)
    if fn is None:
        pytest.skip("torch.compile unavailable on this machine (the eager fallback is tested above)")
    return fn


def test_compiled_transcendentals_within_budget(compiled_pass):
    """The compiled code's exp (fp32 and fp64), tanh and sqrt (fp64) against 50-digit values on dense grids.

    The pass budgets ``EXP_ULPS`` ulps for each (``rounding.exp_relative_error``); an fp32 exp whose
    result is subnormal within ``2 tiny`` absolutely. Compiled ``expm1`` fails (relative error 1 at
    ``1e-20``): the pass does not use it, and this test says so, so that a torch upgrade that fixes it
    is noticed.
    """
    fn = torch.compile(lambda x: (torch.exp(x), torch.tanh(x), torch.sqrt(x), torch.expm1(x)), dynamic=True)
    ulps64 = rounding.exp_relative_error(torch.float64)
    wide = torch.linspace(-708, 709, 4001, dtype=torch.float64)
    _assert_within(fn(wide)[0], mp.exp, ulps64, wide)
    positive = torch.cat([torch.linspace(0, 20, 2001, dtype=torch.float64),
                          torch.logspace(-300, 1, 1000, dtype=torch.float64)])
    _assert_within(fn(positive)[1], mp.tanh, ulps64, positive)
    _assert_within(fn(positive)[2], mp.sqrt, ulps64, positive)
    normal = torch.linspace(-87.3, 88.7, 8001, dtype=torch.float32)
    _assert_within(fn(normal)[0], mp.exp, rounding.exp_relative_error(torch.float32), normal)
    low = torch.linspace(-104, -87.3, 2001, dtype=torch.float32)
    with mp.workdps(50):
        worst = max(abs(mpf(v) - mp.exp(mpf(t))) for t, v in zip(low.tolist(), fn(low)[0].tolist()))
    assert worst <= 2 * budgeted_pass.TINY
    tiny = torch.tensor([1e-20, 1e-8], dtype=torch.float64)
    assert float(fn(tiny)[3][0]) != 1e-20  # compiled expm1 still inaccurate: keep it out of the pass


def test_compiled_directed_steps_on_every_dtype(compiled_pass):
    """``rounding.next_up``/``next_down``/``round_up_to`` compiled equal the eager ``nextafter`` on fp16, bf16,
    fp32 and fp64 (signed zeros, infinities, NaN, subnormals). Compiled ``torch.nextafter`` on half types
    steps in fp32 and rounds back: a compiled witness once rounded *down* to fp16 (the ``model dtypes``
    fuzz class found TV 10x above the meter); this test says so, so that a fixed torch is noticed."""
    steps = torch.compile(lambda x: (rounding.next_up(x), rounding.next_down(x)), dynamic=True, fullgraph=True)
    raw = torch.compile(lambda x: torch.nextafter(x, torch.full_like(x, math.inf)), dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(11)
    wide = torch.randn(20000, generator=g, dtype=torch.float64) * torch.logspace(-40, 40, 20000, dtype=torch.float64)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, 6e-8, 65504.0], dtype=torch.float64)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = torch.cat([wide, specials]).to(dtype)
        for got, direction in zip(steps(x), (math.inf, -math.inf)):
            expected = torch.nextafter(x, torch.full_like(x, direction))
            assert torch.equal(got.isnan(), expected.isnan())
            assert torch.equal(got[~got.isnan()], expected[~expected.isnan()]), dtype
    half = torch.cat([wide, specials]).to(torch.float16)
    assert not torch.equal(raw(half), torch.nextafter(half, torch.full_like(half, math.inf)))  # still broken upstream
    to_fp16 = torch.compile(lambda x: rounding.round_up_to(x, torch.float16), dynamic=True, fullgraph=True)
    positive = torch.rand(20000, generator=g, dtype=torch.float64) * torch.logspace(-9, 4, 20000, dtype=torch.float64)
    assert torch.all(to_fp16(positive).double() >= positive)


def test_compiled_stored_statistics_never_below_the_eager_witness():
    """The cache-write statistics as the monitor compiles them: the fp16 witness equals the eager one (rounded up;
    before the half-type step of ``rounding.next_up`` it was rounded down in about half the entries)."""
    from witcert.tier_a import observation

    compiled = compiled_mod.compiled_of(observation.stored_statistics, observation._statistics_probe)
    if compiled is None:
        pytest.skip("torch.compile unavailable on this machine")
    g = torch.Generator().manual_seed(12)
    layout = witcert.BandLayout(32, 8)
    k = torch.randn(2, 2, 40, 32, generator=g) * torch.logspace(-6, 3, 40)[:, None]
    k_hat, v = k + 1e-3 * torch.randn(k.shape, generator=g), torch.randn(k.shape, generator=g)
    (witness, *norms, finite), eager = compiled(k, k_hat, v, v + 0.01, layout), observation.stored_statistics(
        k, k_hat, v, v + 0.01, layout)
    assert witness.dtype == torch.float16 and torch.equal(witness, eager[0])  # the rounding up to fp16 is exact
    for got, expected in zip(norms, eager[1:3]):  # fp64 norms with a budget for any summation order
        assert torch.allclose(got, expected, rtol=1e-13, atol=0.0)
    assert bool(finite) and bool(eager[3])
    for name, position in (("k", 0), ("k_hat", 1), ("v", 2), ("v_hat", 3)):  # the flag the write reads once
        bad = [k, k_hat, v, v + 0.01]
        bad[position] = bad[position].clone()
        bad[position][1, 0, 3, 5] = (math.nan, math.inf)[position % 2]
        assert not bool(compiled(*bad, layout)[3]), name
        with pytest.raises(ValueError, match=f"^{name} contains"):
            observation.stored_keys(*bad, layout)


def test_compiled_expm1_series_within_budget(compiled_pass):
    fn = torch.compile(lambda x: (lambda g: (g, g / (1.0 + g)))(expm1_nonneg(x)), dynamic=True)
    g, f = fn(_RADII)
    budget = PassBudget(2)
    _assert_within(g, mp.expm1, budget.g, _RADII)
    _assert_within(f, lambda t: -mp.expm1(-t), budget.f, _RADII)


def test_compiled_fast_meter_never_below_golden(compiled_pass, monkeypatch):
    monkeypatch.setenv("WITCERT_COMPILE", "1")
    assert compiled_mod.pick(lean_pass, budgeted_pass.probe) is compiled_pass
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.float64):
        for s in (1, 5, 200):
            scores, c = _rows(g, 6, s, dtype)
            _assert_never_below_golden(scores, c, fast_meter(scores, c))
    tally = fast_path.run(40, torch.Generator().manual_seed(13))
    assert tally.cells > 0 and tally.violations == 0, tally.notes


def test_compiled_equals_eager_to_the_budget(compiled_pass):
    g = torch.Generator().manual_seed(17)
    scores, c = _rows(g, 9, 4096, torch.float64)
    rho = torch.rand(9, 4096, generator=g, dtype=torch.float64)
    args = (scores, c, rho, rho)
    for a, b in zip(compiled_pass(*args), lean_pass(*args)):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-30)


def test_value_free_pass_is_the_pass_with_zero_value_statistics(compiled_pass):
    """``rho = v_norm = None`` (no value work in the token loop) gives the meter and risk of the pass with zero
    value statistics, a zero value term and maximum, compiled and eager alike; one of the two absent is a zero."""
    g = torch.Generator().manual_seed(19)
    scores, c = _rows(g, 7, 300, torch.float32)
    zero = torch.zeros_like(c)
    for fn in (compiled_pass, lean_pass):
        free, zeros = fn(scores, c, None, None), fn(scores, c, zero, zero)
        assert all(torch.equal(a, b) for a, b in zip(free, zeros))
    assert torch.all(lean_cells(scores, c).value_term == 0)
    rho = torch.rand(7, 300, generator=g)
    with_rho = lean_cells(scores, c, rho=rho)
    assert torch.all(with_rho.value_term > 0) and torch.all(with_rho.v_norm_max == 0)
    assert torch.equal(with_rho.meter, lean_cells(scores, c).meter)


def test_every_fast_function_compiles_from_its_probe(compiled_pass):
    """A probe that does not compile would silently leave the eager function in place (with a warning)."""
    from witcert.fastpath import radius, stored_pass
    from witcert.tier_a import observation

    for fn, probe in ((radius.band_dot, radius.probe), (radius.tier_a_pass, radius.tier_a_probe),
                      (stored_pass.pass_from_logits, stored_pass.probe),
                      (observation.stored_statistics, observation._statistics_probe)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert compiled_mod.compiled_of(fn, probe) is not None, fn.__name__


def test_compiled_per_layer_pass_matches_eager_and_stays_above_the_true_tv(compiled_pass, monkeypatch):
    import witcert
    from witcert.tier_a.observation import observe_stored, stored_keys

    g = torch.Generator().manual_seed(19)
    layout = witcert.BandLayout(64)
    q, k, v = torch.randn(1, 9, 2, 64, generator=g) * 2, torch.randn(1, 3, 300, 64, generator=g), torch.randn(1, 3, 300, 64, generator=g)
    k_hat, v_hat = witcert.get_scheme("rtn-int4")(k), witcert.get_scheme("rtn-int4")(v)
    stored = stored_keys(k, k_hat, v, v_hat, layout)
    eager = observe_stored(q, stored, layout, truth=(k, v, v_hat), fused=True)
    monkeypatch.setenv("WITCERT_COMPILE", "1")
    compiled = observe_stored(q, stored, layout, truth=(k, v, v_hat), fused=True)
    # the mass split's fp32 low-set sums round differently compiled: within their gamma (300 tokens: 1.8e-5)
    assert torch.allclose(compiled.meter, eager.meter, rtol=1e-5)
    assert torch.allclose(compiled.output_bound, eager.output_bound, rtol=1e-5)
    assert torch.all(compiled.true_tv <= compiled.meter) and torch.all(compiled.true_output_error <= compiled.output_bound)


def test_fused_meter_takes_the_mass_split_on_its_own_sets():
    """One large radius on one token of 64 (uniform ``p~``): splitting it off beats every unsplit bound; the fused
    meter forms that split (below the eager unsplit minimum), never below the exact meter on its sets."""
    scores = torch.zeros(1, 64, dtype=torch.float64)
    c = torch.full((1, 64), 0.01, dtype=torch.float64)
    c[0, 5] = 1.0
    got = fast_meter(scores, c)
    unsplit = moments(*check_scores_and_bounds(scores, c)).unsplit()
    assert float(got[0]) < 0.9 * float(unsplit[0])
    assert budgeted_pass.split_low_sets(scores, c)[0, :, 5].tolist() == [False] * len(budgeted_pass.SPLIT_FRACTIONS)
    _assert_never_below_golden(scores, c, got)
    # the eager MS takes tanh(max_L c / 2) = tanh(0.005) on the low set, the pass min(g, D) = 0.875 (so CS_L):
    # measured 0.11% above the eager meter here, within 1%
    assert float(got[0]) <= float(witcert.meter(scores, c)[0]) * (1 + 1e-2)


def test_compiled_per_layer_pass_radius_covers_every_logit_exactly(compiled_pass):
    """The monitor's compiled per-layer pass (its logits one fp64 GEMM, its rounding bound Hoelder's): per token,
    ``c_t >= |scores_t - sm q . k_t|`` against the exact keys in rational arithmetic, query and key entries
    from ``1e-30`` to ``1e30``, zero rows, fp32 and fp64 inputs, a mask; and its meter at least the eager one's
    radius-for-radius (the same pass)."""
    from fractions import Fraction

    from witcert.fastpath import stored_pass as sp
    from witcert.tier_a.observation import stored_keys

    assert compiled_mod.compiled_of(sp.pass_from_logits, sp.probe) is not None
    g = torch.Generator().manual_seed(29)
    layout = witcert.BandLayout(16, 4)
    for dtype, magnitude in ((torch.float32, 1.0), (torch.float32, 1e-30), (torch.float64, 1e30), (torch.float64, 1e-3)):
        q = (torch.randn(1, 2, 3, 16, generator=g, dtype=torch.float64) * magnitude).to(dtype)
        k = (torch.randn(1, 2, 20, 16, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, 20, dtype=torch.float64)[:, None]).to(dtype)
        q[0, 1, 2] = 0.0
        k_hat = witcert.get_scheme("rtn-int4")(k)
        stored = stored_keys(k, k_hat, k, k_hat, layout)
        keep = torch.rand(1, 2, 3, 20, generator=g) < 0.8
        keep[..., 0] = True
        scale = 16**-0.5
        out = sp.stored_pass(q, k_hat, layout, stored.witness, keep, stored.value_residual[..., None, :],
                             stored.value_norm[..., None, :], sp.pass_constants(16, scale, 0.2, 0.05), compiled=True)
        scores, c = out[0], out[1]
        for h in range(2):
            for r in range(3):
                for t in range(20):
                    if not keep[0, h, r, t]:
                        assert scores[0, h, r, t] == -math.inf
                        continue
                    exact = Fraction(scale) * sum(Fraction(float(a)) * Fraction(float(b)) for a, b in zip(q[0, h, r], k[0, h, t]))
                    assert Fraction(float(c[0, h, r, t])) >= abs(Fraction(float(scores[0, h, r, t])) - exact), (dtype, h, r, t)
        eager = sp.stored_pass(q, k_hat, layout, stored.witness, keep, stored.value_residual[..., None, :],
                               stored.value_norm[..., None, :], sp.pass_constants(16, scale, 0.2, 0.05), compiled=False)
        assert torch.allclose(out[2], eager[2], rtol=1e-5) and out[7].dtype == out[8].dtype == torch.bool


def test_compiled_round_up_to_fp32_never_rounds_down_on_this_cpu():
    """A compiled fp64 -> fp32 round-up selects fp32 lanes by an fp64 comparison; torch 2.13's AVX2 vectorised code
    selected the wrong lanes (half of the values rounded down, run by ``make test-other-cpu``), so the fast path
    compiles to scalar code wherever its probe finds that (``compile_options``). Every value through ``compiled_of``,
    on either CPU: at least its input, and the eager result to the bit."""
    def up(x64):
        return rounding.round_up_to(x64, torch.float32)

    compiled = compiled_mod.compiled_of(up, lambda: (torch.rand(10, dtype=torch.float64),))
    if compiled is None:
        pytest.skip("torch.compile unavailable on this machine")
    g = torch.Generator().manual_seed(3)
    x = torch.rand(10007, generator=g, dtype=torch.float64) * torch.logspace(-40, 38, 10007, dtype=torch.float64)
    x = torch.cat([x, -x])
    got = compiled(x)
    assert torch.equal(got, up(x))
    assert bool((got.double() >= x).all())
    assert compiled_mod.compile_options() in (None, {"cpp.simdlen": 1})

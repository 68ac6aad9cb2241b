"""The compiled functions that had no compiled-against-eager test on edge shapes, swept (``WITCERT_COMPILE=1``,
:mod:`witcert.fastpath.compiled`), and the one found wrong compiled kept eager.

Functions: the spot check's dense row terms (:mod:`witcert.spot.batched`: ``_row_sums``, ``_z_weights``,
``_z_known``, ``_h_terms``), the cache-write statistics (:func:`witcert.tier_a.observation.stored_statistics`), the vLLM plugin's
written-token statistics (:func:`witcert.integrations.vllm.written.lossy_written`) and zero-witness short cut
(:func:`witcert.integrations.vllm.decode_pass.exact_cells`; both modules import without vLLM), and the fused meter
pass ``lean_pass`` on single rows. The others have their own: ``band_dot``/``tier_a_pass`` (test_fast_radius),
``lean_pass``/``pass_from_logits`` (test_fastpath), ``_norms`` (test_pair_statistics), the packed decoders
(test_packed_decode), ``_holds`` (test_group_check), ``tier_b_kernel`` (test_fast_tier_b), ``decode_pass``
(tests/vllm/test_decode_pass), the grid searches (eager, test_spot_grid_search). ``spot.batched._prepared`` forms
``log(e^c - 1)`` and the small radii eager: compiled, ``expm1`` is ``exp - 1``, so ``log(e^c - 1)`` came out
``-inf`` for tiny radii and the exact set was ranked otherwise (``test_prepared_runs_eager_...``).

Domain: 1, 2 and 3 rows and tokens besides 17 (the probes' sizes are 2 and 3; a size of 1 is its own graph),
one visible token in a row of ``-inf``, logits of 300 (weights underflow), radii from 0 and 1e-20 to 250 and
``inf``, zeros, equal pairs, fp32/fp16/bf16 (and fp64) entries over their whole range, NaN and inf; every
compiled call with RuntimeWarning an error (a fallback to eager fails the test).
Oracles and tolerances, none depending on a summation order: outputs of one IEEE operation per entry (selections,
products, quotients) bit-equal to eager; an ``exp`` or ``log`` within ``EXP_ULPS`` ulps each side (the library's
assumption, :mod:`witcert.core.rounding`); a sum of ``n`` non-negative terms within ``2 n`` units of roundoff
of eager's (each order is within ``n u`` of the exact sum) -- below ``1e-12`` relative here, under the spot
check's ``ROUNDING = 1e-9``; an upper bound (witness, norm, meter, risk) at least the exact value in rational or
50-digit arithmetic and at most a rounding step or ``2^-40`` above eager's.
"""
import math
import warnings
from fractions import Fraction

import pytest
import torch
from mpmath import mp, mpf

from witcert.core import rounding
from witcert.fastpath import compiled as compiled_mod
from witcert.integrations.vllm import decode_pass, written
from witcert.spot import batched
from witcert.spot.cell import Z_FLOOR
from witcert.tier_a import observation
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.score_rounding import _TINY

U = 2.0**-53  # fp64 unit roundoff
EXP_REL = 2 * rounding.EXP_ULPS * 2 * U  # two results each within EXP_ULPS ulps (an ulp <= 2u) of the exact value
ROWS, TOKENS = (1, 2, 3), (1, 2, 3, 17)
LAYOUT = BandLayout(64, 16)


def _plain(x):
    return x + 1.0


@pytest.fixture(scope="module")
def compiler():
    """Skip where ``torch.compile`` does not work at all (the eager fallback is tested in test_fastpath)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if compiled_mod.compiled_of(_plain, lambda: (torch.ones(2),)) is None:
            pytest.skip("torch.compile unavailable on this machine")


def _compiled(fn, probe):
    """``fn`` compiled from its probe; every call runs with RuntimeWarning an error (a fallback is a failure)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fast = compiled_mod.compiled_of(fn, probe)
    assert fast is not None, fn.__name__

    def call(*args):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            return fast(*args)
    return call


def _assert_near(got, want, rel, absolute=0.0, what=""):
    """Same dtype, shape, NaNs and infinities; finite entries within ``rel |want| + absolute``."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.isnan(), want.isnan()), what
    special = got.isinf() | want.isinf()
    assert torch.equal(got[special], want[special]), what
    keep = ~special & ~want.isnan()
    diff = (got[keep] - want[keep]).abs()
    limit = rel * want[keep].abs() + absolute
    assert bool((diff <= limit).all()), (what, float((diff - limit).max()))


# ----------------------------------------------------------------------------------------- spot: dense row terms


def _cells(case: str, n: int, s: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed logits and radii (n, s) fp64 of one edge case, at least one visible token per row."""
    scores = torch.randn(n, s, generator=g, dtype=torch.float64) * 3
    c = torch.rand(n, s, generator=g, dtype=torch.float64) * 0.5
    if case == "one visible":
        keep = torch.zeros(n, s, dtype=torch.bool)
        keep[torch.arange(n), torch.randint(s, (n,), generator=g)] = True
        scores = scores.masked_fill(~keep, -math.inf)
    elif case == "masked":
        drop = torch.rand(n, s, generator=g) < 0.4
        drop[:, -1] = False
        scores = scores.masked_fill(drop, -math.inf)
        c = torch.where(drop & (torch.rand(n, s, generator=g) < 0.5), math.inf, c)
    elif case == "wide":  # masses underflow; radii from 2.5e-20 to 250, some infinite
        scores = scores * 100
        c = 10.0 ** (torch.rand(n, s, generator=g, dtype=torch.float64) * 22 - 20) * 2.5
        c = torch.where(torch.rand(n, s, generator=g) < 0.15, math.inf, c)
    elif case == "tiny":  # every radius small (e^c - 1 < SMALL)
        c = 10.0 ** (torch.rand(n, s, generator=g, dtype=torch.float64) * 13 - 20)
    elif case == "zeros":
        scores, c = torch.zeros(n, s, dtype=torch.float64), torch.zeros(n, s, dtype=torch.float64)
    return scores, c


SPOT_CASES = ("plain", "one visible", "masked", "wide", "tiny", "zeros")


def _spot_inputs(g):
    """Every (case, rows, tokens): the eager prepared terms, a known set and its offsets ``x`` within the radii."""
    for case in SPOT_CASES:
        for n in ROWS:
            for s in TOKENS:
                scores, c = _cells(case, n, s, g)
                visible, log_p, p, log_u, e_minus, small, a_minus, a_plus, _ = batched._prepared(scores, c)
                known = visible & (torch.rand(n, s, generator=g) < 0.4)
                spread = torch.where(torch.isinf(c), 5.0, c)
                x = torch.where(known, (2 * torch.rand(n, s, generator=g, dtype=torch.float64) - 1) * spread, 0.0)
                yield (case, n, s), dict(visible=visible, log_p=log_p, p=p, log_u=log_u, e_minus=e_minus,
                                         small=small, a_minus=a_minus, a_plus=a_plus, c=c, known=known, x=x)


def _sum_rel(s: int) -> float:
    """Two summation orders of ``s`` non-negative terms, each term within the exp's ulps of the other's."""
    return 2 * s * U + 2 * EXP_REL


def test_row_sums_compiled_match_eager_on_edge_rows(compiler):
    """The contribution ``log p~ + log(e^c - 1)`` (one addition, selections) bit-equal: the exact set is ranked as
    eager ranks it; ``p~`` and ``e^{-c}`` one exp each; ``A-`` and ``A`` sums of exps."""
    fast = _compiled(batched._row_sums, batched._row_sums_probe)
    for where, t in _spot_inputs(torch.Generator().manual_seed(4)):
        args = (t["log_p"], t["c"], t["visible"], t["log_u"])
        (p, e_minus, a_minus, a_plus, contribution) = fast(*args)
        (p_e, e_minus_e, a_minus_e, a_plus_e, contribution_e) = batched._row_sums(*args)
        _assert_near(contribution, contribution_e, 0.0, 0.0, ("contribution", where))  # NaN alike where masked
        _assert_near(p, p_e, EXP_REL, 2.0**-1074, ("p", where))
        _assert_near(e_minus, e_minus_e, EXP_REL, 2.0**-1074, ("e_minus", where))
        for name, got, want in (("A-", a_minus, a_minus_e), ("A", a_plus, a_plus_e)):
            _assert_near(got, want, _sum_rel(where[2]) + EXP_REL, where[2] * 2.0**-1070, (name, where))
        assert torch.equal(torch.isinf(a_plus), torch.isinf(a_plus_e)), where  # an infinite radius: A = inf alike


def test_z_weights_compiled_match_eager_on_edge_rows(compiler):
    fast = _compiled(batched._z_weights, batched._z_weights_probe)
    for where, t in _spot_inputs(torch.Generator().manual_seed(1)):
        args = (t["log_p"], t["log_u"], t["visible"], t["known"], t["small"])
        (total, weights), (total_e, weights_e) = fast(*args), batched._z_weights(*args)
        _assert_near(weights, weights_e, EXP_REL, 2.0**-1074, ("weights", where))
        _assert_near(total, total_e, _sum_rel(where[2]) + EXP_REL, where[2] * 2.0**-1070, ("G", where))
        sampled = t["visible"] & ~t["known"] & ~t["small"]
        assert torch.all(weights[~sampled] == 0), where  # only the sampled tokens carry weight


def test_z_known_compiled_match_eager_on_edge_rows(compiler):
    fast = _compiled(batched._z_known, batched._z_known_probe)
    for where, t in _spot_inputs(torch.Generator().manual_seed(2)):
        args = (t["log_p"], t["c"], t["visible"], t["known"], t["small"], t["x"])
        _assert_near(fast(*args), batched._z_known(*args), _sum_rel(where[2]), where[2] * 2.0**-1070,
                     ("z_known", where))


def test_h_terms_compiled_match_eager_on_edge_rows(compiler):
    """``h`` and the weights ``p~ h`` are one quotient and one product per token: bit-equal. The total's terms
    ``1 - e^{x - log Z_U}`` carry the exp's and the log's error absolutely (``|log Z_U|`` ulps of the exponent)."""
    fast = _compiled(batched._h_terms, batched._h_terms_probe)
    for where, t in _spot_inputs(torch.Generator().manual_seed(3)):
        finite_a = torch.where(torch.isfinite(t["a_plus"]), t["a_plus"], 2 * t["a_minus"] + 1)
        for z in (finite_a, t["a_minus"], (finite_a + t["a_minus"]) / 2):
            z_upper = z.clamp(min=where[2] * Z_FLOOR)  # a resolved row's (batched._Cells.round)
            args = (t["p"], t["e_minus"], t["visible"], t["known"], t["x"], z_upper)
            (total, h_total, weights, h) = fast(*args)
            (total_e, h_total_e, weights_e, h_e) = batched._h_terms(*args)
            assert torch.equal(h, h_e) and torch.equal(weights, weights_e), where
            _assert_near(h_total, h_total_e, _sum_rel(where[2]), where[2] * 2.0**-1070, ("H", where))
            mass = float(t["p"].sum(-1).max())
            log_z = float(torch.log(z_upper).abs().max())
            _assert_near(total, total_e, 0.0, mass * (_sum_rel(where[2]) + (2 + log_z) * EXP_REL), ("total", where))


def test_prepared_runs_eager_under_witcert_compile_and_ranks_the_exact_set_by_contribution(monkeypatch):
    """``WITCERT_COMPILE=1`` compiles the spot check's row terms but not ``_prepared``. Compiled (torch 2.13, AVX-512
    and AVX2 code alike), its ``expm1`` is ``exp - 1``: ``log(e^c - 1)`` of radii 1e-20 and 1e-17 came out ``-inf``
    (eager: -46.05 and -39.14), so the exact set ranked token 0 above token 1, whose contribution ``p~ (e^c - 1)``
    is the larger (order 3, 2, 0, 1 against eager's 3, 2, 1, 0): other keys read than the eager and one-cell forms
    read. Here the order is the contributions' and a whole check creates no compiled ``_prepared``."""
    from witcert.spot import TableLogits, check_cells

    monkeypatch.setenv("WITCERT_COMPILE", "1")
    monkeypatch.setattr(compiled_mod, "_state", {})
    scores = torch.tensor([[0.0, -1.0, -2.0, 0.5]], dtype=torch.float64)
    c = torch.tensor([[1e-20, 1e-17, 1e-12, 0.3]], dtype=torch.float64)
    cells = batched._Cells(scores, c, None, None, (1.0, 0.0, 0.5), keys=4)
    assert cells.order.tolist() == [[3, 2, 1, 0]]
    assert cells.log_u[0, :2].tolist() == pytest.approx([math.log(1e-20), math.log(1e-17)], rel=1e-12)
    wide, radii = scores.repeat(1, 8), c.repeat(1, 8)
    result = check_cells(wide, radii, TableLogits(wide + radii / 2), keys=8, delta=1e-3,
                         generator=torch.Generator().manual_seed(0))
    assert 0 < float(result.bound[0]) <= 1 and int(result.keys_read[0]) <= 8
    assert batched._prepared not in compiled_mod._state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if compiled_mod.compiled_of(_plain, lambda: (torch.ones(2),)) is not None:  # the row terms still compile
            assert compiled_mod._state.get(batched._z_weights) is not None
            assert compiled_mod._state.get(batched._z_known) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lean_pass_compiled_never_below_golden_on_single_rows(compiler, dtype):
    """The fused meter pass on one row (its own graph; test_fastpath sweeps six rows at a time, the probe two) of
    each edge case and token count: the compiled meter at least the 50-digit exact meter on the pass's low sets."""
    from witcert.fastpath import budgeted_pass
    from witcert.spec import golden

    fast = _compiled(budgeted_pass.lean_pass, budgeted_pass.probe)
    g = torch.Generator().manual_seed(7)
    for case in SPOT_CASES:
        for n in (1,):
            for s in TOKENS:
                scores, c = _cells(case, n, s, g)
                c = torch.where(torch.isinf(c) & torch.isfinite(scores), 50.0, c)  # inf only where masked
                scores, c = scores.to(dtype), c.to(dtype)
                meter = fast(scores, c, None, None)[0]
                assert meter.shape == (n,) and bool(((meter >= 0) & (meter <= 1)).all()), (case, n, s)
                sets = budgeted_pass.split_low_sets(scores, c)
                for i in range(n):
                    with mp.workdps(50):
                        exact = golden.meter_on_sets_from_scores(scores[i].double().tolist(), c[i].double().tolist(),
                                                                 sets[i].tolist())
                        assert mpf(float(meter[i])) >= exact, (case, n, s, i, float(meter[i]), mp.nstr(exact, 12))


# -------------------------------------------------------------------------------------- exact rational oracles


def _band_norms_squared(a: torch.Tensor, b: torch.Tensor, layout: BandLayout) -> list:
    """Exact ``||(b - a)_band||^2`` (Fractions) of each row (..., d) -> [[band, ...], ...] over the flattened rows."""
    bands = layout.split(torch.arange(layout.head_dim, dtype=torch.float64)).long().tolist()
    rows_a, rows_b = a.double().reshape(-1, layout.head_dim).tolist(), b.double().reshape(-1, layout.head_dim).tolist()
    out = []
    for ra, rb in zip(rows_a, rows_b):
        diff = [Fraction(y) - Fraction(x) for x, y in zip(ra, rb)]
        out.append([sum(diff[i] * diff[i] for i in band) for band in bands])
    return out


def _norms_squared(x: torch.Tensor) -> list:
    return [sum(Fraction(v) ** 2 for v in row) for row in x.double().reshape(-1, x.shape[-1]).tolist()]


def _assert_upper(bound: torch.Tensor, exact_squares: list, what):
    """Every ``bound`` (flattened) squared at least its exact sum of squares (``inf`` bounds anything)."""
    for i, (b, e) in enumerate(zip(bound.double().reshape(-1).tolist(), exact_squares)):
        assert b == math.inf or Fraction(b) ** 2 >= e, (what, i, b, float(e))


def _steps_up(x: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        x = rounding.next_up(x)
    return x


def _whole_range(shape, dtype, g):
    """Entries over ``dtype``'s range (subnormals to near its largest), as ``test_pair_statistics`` draws them."""
    info = torch.finfo(dtype)
    low, high = {torch.float32: (-149, 127), torch.float16: (-24, 15), torch.bfloat16: (-133, 127),
                 torch.float64: (-300, 300)}[dtype]
    exponent = torch.randint(low, high, shape, generator=g).double()
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 2.0**exponent).clamp(-info.max, info.max).to(dtype)


def _pairs(shape, dtype, g):
    """Exact and reconstructed tensors: whole-range entries and differences, a zero row and an exact one."""
    exact = _whole_range(shape, dtype, g)
    near = (exact.double() + _whole_range(shape, dtype, g).double()).clamp(
        -torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    near[..., 0, :8] = exact[..., 0, :8]  # an exact band
    exact[..., -1, :] = 0
    near[..., -1, :] = 0  # a token stored exactly: witness 0
    return exact, near


# ------------------------------------------------------------------------------------------ cache-write statistics

WRITE_SHAPES = ((1, 1, 1, 64), (1, 2, 2, 64), (1, 2, 3, 64), (2, 3, 17, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_stored_statistics_compiled_bound_the_exact_norms_on_edge_shapes(compiler, dtype):
    fast = _compiled(observation.stored_statistics, observation._statistics_probe)
    g = torch.Generator().manual_seed(4)
    shapes = WRITE_SHAPES if dtype != torch.float64 else WRITE_SHAPES[::3]
    for shape in shapes:
        for layout in ((LAYOUT, BandLayout(64, 8, "interleaved")) if dtype == torch.float32 else (LAYOUT,)):
            k, k_hat = _pairs(shape, dtype, g)
            v, v_hat = _pairs(shape, dtype, g)
            got, want = fast(k, k_hat, v, v_hat, layout), observation.stored_statistics(k, k_hat, v, v_hat, layout)
            where = (dtype, shape, layout.rope)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), where
            witness, rho, v_norm, finite = got
            assert bool(finite) and bool(want[3]), where
            _assert_upper(witness, [x for row in _band_norms_squared(k, k_hat, layout) for x in row], where)
            assert torch.all(witness <= _steps_up(want[0], 1)), where  # tight: one fp16 step of eager's
            assert torch.all(witness[..., -1, :] == 0), where  # stored exactly
            _assert_upper(rho, [sum(row) for row in _band_norms_squared(v, v_hat, layout)], where)
            _assert_upper(v_norm, _norms_squared(v), where)
            rho_tight = want[1] * (1 + 2.0**-40) + 2.0**-1070 if dtype == torch.float64 else _steps_up(want[1], 1)
            assert torch.all(rho <= rho_tight) and torch.all(v_norm <= want[2] * (1 + 2.0**-40) + 2.0**-1070), where


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_stored_statistics_compiled_flag_a_non_finite_entry(compiler, dtype):
    fast = _compiled(observation.stored_statistics, observation._statistics_probe)
    for shape in WRITE_SHAPES[:2]:
        base = [torch.ones(shape, dtype=dtype) for _ in range(4)]
        assert bool(fast(*base, LAYOUT)[3])
        for position in range(4):
            for bad in (math.nan, math.inf, -math.inf):
                args = [x.clone() for x in base]
                args[position][..., -1, 3] = bad
                assert not bool(fast(*args, LAYOUT)[3]), (shape, position, bad)


# ------------------------------------------------------------------------------- vLLM: written tokens, short cut


@pytest.mark.parametrize("exact_dtype", [torch.float32, torch.bfloat16])
def test_lossy_written_compiled_bound_the_exact_residual(compiler, exact_dtype):
    """Keys bit-equal to eager (a selection); witness and key norms upper bounds, ``inf``/0 where not finite."""
    fast = _compiled(written.lossy_written, lambda: written._probe(LAYOUT))
    g = torch.Generator().manual_seed(5)
    for n in (1, 2, 3):
        for heads in (1, 2):
            exact, _ = _pairs((n, heads, 64), exact_dtype, g)
            kept = (exact.double() * (1 + 1e-3 * torch.randn(exact.shape, generator=g, dtype=torch.float64))).float()
            kept[0, 0, :4] = exact[0, 0, :4].float()
            if n > 1:
                kept[1, -1, 7] = (math.nan, math.inf)[heads - 1]  # a key the cache holds as not finite
                exact[-1, 0, 2] = -math.inf if exact_dtype == torch.float32 else exact[-1, 0, 2]
            (keys, witness, norms), (keys_e, witness_e, norms_e) = (fast(exact, kept, LAYOUT),
                                                                   written.lossy_written(exact, kept, LAYOUT))
            where = (n, heads, exact_dtype)
            assert torch.equal(keys, keys_e) and witness.dtype == torch.float16 and norms.dtype == torch.float64
            assert witness.stride() == witness_e.stride(), where
            finite = torch.isfinite(kept).all(-1) & torch.isfinite(exact).all(-1)
            assert torch.all(witness[~finite] == math.inf) and torch.all(keys[~finite] == 0), where
            squares = _band_norms_squared(torch.where(finite[..., None], exact.double(), 0.0), keys, LAYOUT)
            _assert_upper(witness, [x for row in squares for x in row], where)
            _assert_upper(norms, _norms_squared(keys), where)
            assert torch.all(witness <= _steps_up(witness_e, 1)) and torch.all(norms <= norms_e * (1 + 2.0**-40))


def _exact_c(q_row: list, norm_max: float, constants: torch.Tensor) -> mpf:
    """The reference's rounding term at the largest key norm, in 50-digit arithmetic at the exact ``||q||``
    (:func:`witcert.tier_a.score_rounding.score_rounding_linear` before its rounding up)."""
    coefficients = decode_pass._coefficients(constants, 1)
    a_m, a_l, a_0, b_m, b_0, out_m, u_out, h_out = (mpf(float(x)) for x in (*coefficients[:6], *coefficients[6]))
    q_norm = mp.sqrt(mp.fsum(mpf(v) ** 2 for v in q_row))
    rate = (max(a_m, b_m) * out_m + u_out) * mpf(float(constants[0])) * q_norm
    constant = max(max((q_norm + mpf(norm_max)) * mp.sqrt(len(q_row)) * a_l + a_0, mpf(_TINY)), max(b_0, mpf(_TINY)))
    return rate * mpf(norm_max) + constant * out_m + max(h_out, mpf(_TINY)) + mpf(_TINY)


@pytest.mark.parametrize("shape", [(1, 1, 1, 64), (2, 2, 3, 64), (3, 1, 2, 128), (2, 1, 1, 64)])
def test_exact_cells_compiled_above_the_exact_short_cut(compiler, shape):
    """``meter >= c/2 >= tanh(c/2)`` and ``risk >= (e^{2c} - 1)/2`` at the exact rounding term ``c``; within
    ``2^-30`` of eager (the short cut's own lift of the query norm is ``2^-30``)."""
    fast = _compiled(decode_pass.exact_cells, decode_pass._exact_probe)
    g = torch.Generator().manual_seed(6)
    constants = decode_pass.pass_constants(shape[-1], shape[-1] ** -0.5)
    for magnitude in (1.0, 1e-30, 1e30, 0.0):
        q = torch.randn(shape, generator=g) * magnitude
        for norm_max in (torch.zeros(shape[:2], dtype=torch.float64), torch.full(shape[:2], 7.5, dtype=torch.float64),
                         torch.rand(shape[:2], generator=g, dtype=torch.float64) * 1e4):
            (meter, risk), (meter_e, risk_e) = (fast(q, norm_max, constants),
                                                decode_pass.exact_cells(q, norm_max, constants))
            where = (shape, magnitude)
            assert meter.shape == meter_e.shape == shape[:3] and meter.dtype == risk.dtype == torch.float64, where
            _assert_near(meter, meter_e, 2.0**-30, 0.0, ("meter", where))
            _assert_near(risk, risk_e, 2.0**-30, 0.0, ("risk", where))
            with mp.workdps(50):
                for (r, h, m), value in zip(torch.cartesian_prod(*map(torch.arange, shape[:3])).reshape(-1, 3).tolist(),
                                            meter.reshape(-1).tolist()):
                    c = _exact_c(q[r, h, m].double().tolist(), float(norm_max[r, h]), constants)
                    assert mpf(value) >= min(mpf(1), c / 2), (where, r, h, m)
                    assert mpf(float(risk[r, h, m])) >= mp.expm1(2 * c) / 2, (where, r, h, m)

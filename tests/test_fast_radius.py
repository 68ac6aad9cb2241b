"""The fast path's fp32 Tier A radius (:func:`witcert.fastpath.radius.fast_logit_bound`, ``T2`` under ``FP``).

Implementation: one fp32 band dot over the fp16 witness, eager and ``torch.compile``d. Oracles:
``witcert.spec.bands.bound_band_witness`` (60 digits, exact arithmetic on the stored witness) and
:func:`witcert.logit_bound` (fp64, directed rounding). Domain: random layouts and vectors (fp32 and
fp64 queries, tiny to large), tiny scales, zero query bands, infinite witness entries, GQA shapes.
Tolerance: none below the exact bound; above it at most ``(B + 14) 2^-23`` relative (or the fp32
normal floor), and an infinite witness entry gives ``inf`` (never NaN).
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import mp, mpf

import witcert
from witcert.fastpath import budgeted_pass
from witcert.fastpath import compiled as compiled_mod
from witcert.fastpath import radius
from witcert.fastpath.fused import lean_cells, tier_a_cells
from witcert.fastpath.radius import fast_logit_bound
from witcert.spec import bands as spec
from witcert.spec import golden

LAYOUTS = [(8, 2), (16, 4), (64, 16), (128, 16)]
SCALES = [None, 1.0, 0.125, 2.0**-140]
_floats = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=64)


@st.composite
def _case(draw):
    head_dim, bands = draw(st.sampled_from(LAYOUTS))
    layout = witcert.BandLayout(head_dim, bands, draw(st.sampled_from(("rotate_half", "interleaved"))))
    vectors = [draw(st.lists(_floats, min_size=head_dim, max_size=head_dim)) for _ in range(3)]
    magnitude = draw(st.sampled_from([1.0, 1e-30, 1e20]))
    return layout, [x * magnitude for x in vectors[0]], vectors[1], vectors[2]


@settings(max_examples=80, deadline=None)  # each example runs a 60-digit spec evaluation
@given(_case(), st.sampled_from(SCALES))
def test_fast_radius_never_below_the_exact_bound(case, sm_scale):
    layout, q, k, k_hat = case
    w = witcert.witness_of(torch.tensor(k, dtype=torch.float64), torch.tensor(k_hat, dtype=torch.float64), layout)
    for dtype in (torch.float32, torch.float64):
        qt = torch.tensor(q, dtype=torch.float64).to(dtype)
        c = fast_logit_bound(qt[None, None], w[None, None], layout, sm_scale)
        assert c.dtype == torch.float32 and c.shape == (1, 1, 1)
        with mp.workdps(60):
            bound = spec.bound_band_witness(qt.double().tolist(), w.tolist(), layout.bands, layout.rope, sm_scale)
            assert mpf(c.item()) >= bound
            slack = (layout.bands + 14) * mpf(2) ** -23  # the lift, and fp32 round-ups of norm and scale
            assert mpf(c.item()) <= bound * (1 + slack) + mpf(2) ** -126 + mpf(2) ** -100 * sum(map(mpf, w.tolist())) * 2


def test_fast_radius_close_to_logit_bound_on_gqa_shapes():
    g = torch.Generator().manual_seed(1)
    layout = witcert.BandLayout(64, 16)
    q = torch.randn(2, 9, 3, 64, generator=g)
    k = torch.randn(2, 3, 300, 64, generator=g)
    w = witcert.witness_of(k, k + 0.01 * torch.randn(k.shape, generator=g), layout)
    fast, library = fast_logit_bound(q, w, layout), witcert.logit_bound(q, w, layout)
    assert fast.shape == library.shape == (2, 9, 3, 300)
    assert torch.all(fast.double() >= library.double() * (1 - 2.0**-22))  # both above the exact value
    assert torch.all(fast.double() <= library.double() * (1 + 2.0**-17))


@pytest.mark.parametrize("rows", range(1, 10))
def test_every_row_count_stays_above_the_exact_dot_and_keeps_its_shape(rows):
    """The kernel pads query rows to a multiple of 4 for the CPU sgemm: each real row still above its exact
    dot (fp64 of the same inputs, every product exact), the padding never returned, an inf row still inf."""
    g = torch.Generator().manual_seed(rows)
    norms = torch.rand(2, rows, 16, generator=g) * torch.logspace(-30, 30, 16)[torch.randperm(16, generator=g)]
    norms = norms.clamp(min=2.0**-100)
    w = (torch.rand(2, 700, 16, generator=g) * 10).half()
    w[0, :5] = 0  # exact zero tokens: zero radius
    c = radius.radius_kernel(norms, w)
    assert c.shape == (2, rows, 700) and c.dtype == torch.float32
    exact = norms.double() @ w.double().transpose(-1, -2)
    assert torch.all(c.double() >= exact) and torch.all(c[0, :, :5] == 0)
    norms[1, -1, 3] = math.inf
    c = radius.radius_kernel(norms, w)
    assert torch.all(c[1, -1] == math.inf) and torch.all(torch.isfinite(c[0])) and not torch.isnan(c).any()


def test_infinite_witness_gives_inf_never_nan():
    layout = witcert.BandLayout(8, 2)
    w = torch.tensor([[[1.0, math.inf], [0.5, 0.25]]], dtype=torch.float16)[None]  # (1, 1, 2, 2)
    for q in (torch.ones(1, 1, 1, 8), torch.tensor([[[[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]]]])):  # zero band 2 too
        c = fast_logit_bound(q, w, layout, 1.0)[0, 0, 0]
        assert math.isinf(c[0].item()) and math.isfinite(c[1].item())


def test_query_beyond_fp32_gives_inf_never_nan():
    """An fp64 query whose band norm overflows fp32 meets a zero witness entry: ``inf * 0`` must not be NaN."""
    layout = witcert.BandLayout(8, 2)
    w = torch.tensor([[[0.0, 0.0], [1.0, 0.0]]], dtype=torch.float16)[None]  # (1, 1, 2, 2)
    c = fast_logit_bound(torch.full((1, 1, 1, 8), 1e300, dtype=torch.float64), w, layout)[0, 0, 0]
    assert torch.isinf(c).all()  # token 0: exact value 0, trivial inf (sound); token 1: 1.4e300 overflows


def _overflow_band_case():
    """Issue 28: an fp64 query whose band-0 norm overflows fp32, over a witness infinite in band 0 for token 0
    (zero elsewhere): the eager bound is ``[inf, 0, 0]``; a zeroed norm against the inf entry gave NaN."""
    layout = witcert.BandLayout(8, 2)
    q = torch.zeros(1, 2, 1, 8, dtype=torch.float64)
    q[..., [0, 1, 4, 5]] = 1e300  # band 0 (rotate_half pairs (0, 4), (1, 5)): norm 2e300, beyond fp32
    w = torch.zeros(1, 1, 3, 2, dtype=torch.float16)
    w[0, 0, 0, 0] = math.inf
    scores = torch.tensor([0.5, 0.0, -0.25], dtype=torch.float64).expand(1, 2, 1, 3).contiguous()
    return layout, q, w, scores


@pytest.mark.parametrize("compiled", [False, True])
def test_query_beyond_fp32_over_an_infinite_witness_band_is_inf_meter_one_risk_inf(compiled, monkeypatch):
    """The fast radius is ``inf`` (never NaN) on every token of such a row, at or above ``logit_bound``, and the
    cell it feeds reports meter 1 and risk ``inf``, eager and compiled (``WITCERT_COMPILE=1``)."""
    if compiled and compiled_mod.compiled_of(radius.tier_a_pass, radius.tier_a_probe) is None:
        pytest.skip("torch.compile unavailable on this machine")
    monkeypatch.setenv("WITCERT_COMPILE", "1" if compiled else "0")
    layout, q, w, scores = _overflow_band_case()
    c = fast_logit_bound(q, w, layout)
    eager = witcert.logit_bound(q, w, layout)
    assert eager[0, 0, 0].tolist() == [math.inf, 0.0, 0.0]
    assert not torch.isnan(c).any() and torch.isinf(c).all()
    cells = tier_a_cells(scores, q, w, layout)
    assert torch.equal(cells.meter, torch.ones(1, 2, 1, dtype=cells.meter.dtype))
    assert torch.isinf(cells.risk).all() and (cells.risk > 0).all()
    assert not torch.isnan(lean_cells(scores, c).meter).any()


def test_split_overflow_replaces_inf_by_the_floor_and_marks_the_row():
    x = torch.tensor([[1.0, math.inf], [2.0, 3.0]])
    finite, overflow = radius.split_overflow(x, 2.0**-100)
    assert finite.tolist() == [[1.0, 2.0**-100], [2.0, 3.0]] and overflow.tolist() == [[math.inf], [0.0]]


def test_other_witness_dtypes_take_logit_bound():
    layout = witcert.BandLayout(8, 2)
    q, w = torch.randn(1, 2, 1, 8), torch.rand(1, 1, 5, 2, dtype=torch.float32)
    assert torch.equal(fast_logit_bound(q, w, layout), witcert.logit_bound(q, w, layout))


def test_bad_input_names_the_argument():
    """The same checks as ``logit_bound``: a negative witness entry would lower ``c`` below the exact bound."""
    layout = witcert.BandLayout(8, 2)
    with pytest.raises(ValueError, match="w .*B=2"):
        fast_logit_bound(torch.randn(1, 1, 1, 8), torch.rand(1, 1, 5, 3).half(), layout)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        fast_logit_bound(torch.randn(1, 3, 1, 8), torch.rand(1, 2, 5, 2).half(), layout)
    with pytest.raises(ValueError, match="negative"):
        fast_logit_bound(torch.randn(1, 1, 1, 8), -torch.rand(1, 1, 5, 2).half(), layout)
    with pytest.raises(ValueError, match="q contains NaN"):
        fast_logit_bound(torch.full((1, 1, 1, 8), math.nan), torch.rand(1, 1, 5, 2).half(), layout)


def test_compiled_radius_matches_eager_and_stays_above():
    """The band dot compiled (the loop over a band-major witness) against the eager one (one BLAS call)."""
    compiled_kernel = compiled_mod.compiled_of(radius.band_dot, radius.probe)
    if compiled_kernel is None:
        pytest.skip("torch.compile unavailable on this machine")
    g = torch.Generator().manual_seed(3)
    layout = witcert.BandLayout(64, 16)
    q = torch.randn(1, 9, 1, 64, generator=g) * 30
    k = torch.randn(1, 3, 2048, 64, generator=g)
    w = witcert.witness_of(k, k + 0.02 * torch.randn(k.shape, generator=g), layout)
    norms = radius.scaled_query_norms(q, layout, 64**-0.5, 3)[0]  # (3 kv heads, 3 rows, 16 bands)
    norms[0, 0, 0] = math.inf  # an overflowing row: inf, never NaN
    assert w.transpose(-1, -2).is_contiguous()  # witness_of stores band-major: the layout the loop reads
    eager, compiled = radius.radius_kernel(norms, w[0]), compiled_kernel(*radius.lifted_norms(norms, 16), w[0])  # (3, 3, 2048)
    assert torch.isinf(compiled[0, 0]).all() and torch.isinf(eager[0, 0]).all()
    finite_rows = torch.ones(3, 3, dtype=torch.bool)
    finite_rows[0, 0] = False
    assert torch.allclose(compiled[finite_rows], eager[finite_rows], rtol=2.0**-20, atol=0.0)
    library = witcert.logit_bound(q, w, layout).double().reshape(3, 3, 2048)
    assert torch.all(compiled.double()[finite_rows] >= library[finite_rows] * (1 - 2.0**-22))


# ----------------------------------------------------------------------------- the Tier A cell in one pass


def _gqa_cell(g: torch.Generator, s: int):
    """4 query heads on 2 kv heads, one query each, ``s`` tokens (a third masked, token 0 kept), d = 16, B = 4."""
    layout = witcert.BandLayout(16, 4)
    q = torch.randn(1, 4, 1, 16, generator=g, dtype=torch.float64) * 3
    k = torch.randn(1, 2, s, 16, generator=g, dtype=torch.float64)
    k_hat = k + 0.05 * torch.randn(k.shape, generator=g, dtype=torch.float64)
    w = witcert.witness_of(k, k_hat, layout)
    scores = (q @ k_hat.repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.25  # (1, 4, 1, s)
    drop = torch.rand(scores.shape, generator=g) < 0.3
    drop[..., 0] = False
    return layout, q, w, scores.masked_fill(drop, -math.inf)


@pytest.mark.parametrize("compiled", [False, True])
def test_tier_a_cells_is_the_two_calls_in_one_pass_and_never_below_golden(compiled, monkeypatch):
    """``tier_a_cells`` forms the radius inside the pass: the meter of ``lean_cells(scores, fast_logit_bound(...))``
    (bit for bit eager; to the budget compiled), and per row never below the 50-digit meter at the exact
    Theorem-2 radius (60-digit band norms of the query against the stored witness), MS on the pass's sets."""
    if compiled and compiled_mod.compiled_of(radius.tier_a_pass, radius.tier_a_probe) is None:
        pytest.skip("torch.compile unavailable on this machine")
    monkeypatch.setenv("WITCERT_COMPILE", "1" if compiled else "0")
    layout, q, w, scores = _gqa_cell(torch.Generator().manual_seed(29), 24)
    for dtype in (torch.float32, torch.float64):
        cells = tier_a_cells(scores.to(dtype), q.to(dtype), w, layout, 0.25)
        c = fast_logit_bound(q.to(dtype), w, layout, 0.25)  # kept fp32
        two_calls = lean_cells(scores.to(dtype), c, checked=True)
        sets = budgeted_pass.split_low_sets(scores.to(dtype), c)  # where the pass splits (MS)
        assert cells.meter.shape == (1, 4, 1)
        if compiled:
            assert torch.allclose(cells.meter, two_calls.meter, rtol=1e-6, atol=0.0)
        else:
            assert torch.equal(cells.meter, two_calls.meter) and torch.equal(cells.risk, two_calls.risk)
        for h in range(4):
            row = scores[0, h, 0].to(dtype).double().tolist()
            with mp.workdps(60):
                exact_c = [spec.bound_band_witness(q[0, h, 0].to(dtype).double().tolist(), w[0, h // 2, t].tolist(),
                                                   4, layout.rope, 0.25) for t in range(24)]
                exact = golden.meter_on_sets_from_scores(row, exact_c, sets[0, h, 0].tolist())
                assert mpf(cells.meter[0, h, 0].item()) >= exact


def test_tier_a_cells_takes_the_two_calls_where_one_pass_does_not_apply():
    """One token, one row or a non-fp16 witness: the two calls themselves (the same bounds)."""
    layout, q, w, scores = _gqa_cell(torch.Generator().manual_seed(31), 9)
    cases = [(scores[..., :1], q, w[..., :1, :]), (scores[:, :1], q[:, :1], w[:, :1]), (scores, q, w.float())]
    for s, qq, ww in cases:
        expected = lean_cells(s, fast_logit_bound(qq, ww, layout)).meter
        assert torch.equal(tier_a_cells(s, qq, ww, layout).meter, expected)


def test_tier_a_cells_checks_its_arguments():
    layout, q, w, scores = _gqa_cell(torch.Generator().manual_seed(37), 9)
    with pytest.raises(ValueError, match="scores must be"):
        tier_a_cells(scores[..., :8], q, w, layout)
    with pytest.raises(ValueError, match="scores contains NaN"):
        tier_a_cells(torch.full_like(scores, math.nan), q, w, layout)
    with pytest.raises(ValueError, match="negative"):
        tier_a_cells(scores, q, -w, layout)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        tier_a_cells(scores[:, :3], q[:, :3], w, layout)


def test_tier_a_cells_folds_several_queries_per_head_as_the_two_calls_do():
    """Tq = 3 queries on each of 4 query heads over 2 kv heads: each (head, query) row is matched to its own
    radius (the fold of ``q`` and of ``scores`` agree), bit for bit the two calls eagerly."""
    g = torch.Generator().manual_seed(41)
    layout = witcert.BandLayout(16, 4)
    q = torch.randn(2, 4, 3, 16, generator=g) * torch.tensor([0.1, 1.0, 10.0])[:, None]  # rows of different size
    k = torch.randn(2, 2, 30, 16, generator=g)
    w = witcert.witness_of(k, k + 0.05 * torch.randn(k.shape, generator=g), layout)
    scores = torch.randn(2, 4, 3, 30, generator=g)
    cells = tier_a_cells(scores, q, w, layout)
    two_calls = lean_cells(scores, fast_logit_bound(q, w, layout), checked=True)
    assert cells.meter.shape == (2, 4, 3) and torch.equal(cells.meter, two_calls.meter)
    assert torch.unique(cells.meter).numel() > 12  # the rows really differ: a misfold would show

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
from witcert.fastpath import compiled as compiled_mod
from witcert.fastpath import radius
from witcert.fastpath.radius import fast_logit_bound
from witcert.spec import bands as spec

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
    """The radius kernel as the per-layer pass compiles it (``fast_logit_bound`` itself calls it eagerly)."""
    compiled_kernel = compiled_mod.compiled_of(radius.radius_kernel, radius.probe)
    if compiled_kernel is None:
        pytest.skip("torch.compile unavailable on this machine")
    g = torch.Generator().manual_seed(3)
    layout = witcert.BandLayout(64, 16)
    q = torch.randn(1, 9, 1, 64, generator=g) * 30
    k = torch.randn(1, 3, 2048, 64, generator=g)
    w = witcert.witness_of(k, k + 0.02 * torch.randn(k.shape, generator=g), layout)
    norms = radius.scaled_query_norms(q, layout, 64**-0.5, 3)[0]  # (3 kv heads, 3 rows, 16 bands)
    norms[0, 0, 0] = math.inf  # an overflowing row: inf, never NaN
    eager, compiled = radius.radius_kernel(norms, w[0]), compiled_kernel(norms, w[0])  # (3, 3, 2048)
    assert torch.isinf(compiled[0, 0]).all() and torch.isinf(eager[0, 0]).all()
    finite_rows = torch.ones(3, 3, dtype=torch.bool)
    finite_rows[0, 0] = False
    assert torch.allclose(compiled[finite_rows], eager[finite_rows], rtol=2.0**-20, atol=0.0)
    library = witcert.logit_bound(q, w, layout).double().reshape(3, 3, 2048)
    assert torch.all(compiled.double()[finite_rows] >= library[finite_rows] * (1 - 2.0**-22))

"""Tier A: band layout, sound fp16 witness, logit bound (Lemma 1 ``L1``, Theorem 2 ``T2``).

Implementations: ``witcert.BandLayout``, ``witcert.witness_of``, ``witcert.logit_bound``,
``witcert.apply_rope``. Oracle: the spec mirror ``witcert.spec.bands`` (mpmath, 50 digits),
fed the exact values of the floats. Domain and tolerance are declared per test.
"""
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mpmath import mp, mpf

import witcert
from witcert.spec import bands as spec

# ----------------------------------------------------------------------------- oracle machinery

LAYOUTS = [(8, 1), (8, 2), (8, 4), (16, 4), (64, 16), (128, 16), (128, 8)]
ROPES = ("rotate_half", "interleaved")
FP16_MAX = 65504.0


def exact_band_norms(x_hat, x, bands, rope) -> list[mpf]:
    """The exact band norms of ``x_hat - x`` for floats (mpmath; subtraction is exact there)."""
    with mp.workdps(60):
        residual = [mpf(a) - mpf(b) for a, b in zip(x_hat, x)]
        return spec.band_norms(residual, bands, rope)


def fp16_grid_value(exponent: int, mantissa: int) -> float:
    """A positive fp16 value ``(1 + m/1024) 2^e`` (normal) as a Python float."""
    return (1 + mantissa / 1024) * 2.0**exponent


def spread_norm(norm: float, n: int, seed: int) -> list[float]:
    """``n`` fp64 coordinates whose Euclidean norm is close to ``norm`` (random direction)."""
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(n, generator=gen, dtype=torch.float64)
    return (direction / direction.norm() * norm).tolist()


floats_fp64 = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=64)


@st.composite
def layout_and_vectors(draw, n_vectors=2):
    """A layout and ``n_vectors`` fp64 vectors of its head dim."""
    head_dim, bands = draw(st.sampled_from(LAYOUTS))
    rope = draw(st.sampled_from(ROPES))
    vectors = [draw(st.lists(floats_fp64, min_size=head_dim, max_size=head_dim)) for _ in range(n_vectors)]
    return witcert.BandLayout(head_dim, bands, rope), vectors


# ----------------------------------------------------------------------------- BandLayout


@pytest.mark.parametrize("head_dim,bands", LAYOUTS)
@pytest.mark.parametrize("rope", ROPES)
def test_layout_index_matches_spec_and_holds_whole_pairs(head_dim, bands, rope):
    """Implementation BandLayout.index; oracle spec.band_coordinates; exact equality."""
    layout = witcert.BandLayout(head_dim, bands, rope)
    assert layout.index.tolist() == spec.band_coordinates(head_dim, bands, rope)
    assert sorted(layout.index.flatten().tolist()) == list(range(head_dim))
    pairs = {tuple(p) for p in spec.pair_coordinates(head_dim, rope)}
    for row in layout.index.tolist():
        assert {(row[i], row[i + 1]) for i in range(0, len(row), 2)} <= pairs


@pytest.mark.parametrize("head_dim,bands", LAYOUTS)
@pytest.mark.parametrize("rope", ROPES)
def test_split_is_the_gather_by_index(head_dim, bands, rope):
    """``split`` forms bands by reshape and permute (no gather): entry for entry ``x[..., index]``, any leading dims."""
    layout = witcert.BandLayout(head_dim, bands, rope)
    x = torch.randn(2, 3, 5, head_dim, dtype=torch.float64)
    for view in (x, x.transpose(1, 2), x[0, 0]):
        assert torch.equal(layout.split(view), view[..., layout.index])


def test_layout_conventions_spelled_out():
    """rotate_half pairs (j, j + d/2); interleaved pairs (2j, 2j+1) (docs/design.md "Tier A: the band witness")."""
    assert witcert.BandLayout(8, 2, "rotate_half").index.tolist() == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert witcert.BandLayout(8, 2, "interleaved").index.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert witcert.BandLayout(128).pairs_per_band == 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(head_dim=80, bands=16), "must divide"),
        (dict(head_dim=64, bands=3), "must divide"),
        (dict(head_dim=7, bands=1), "even"),
        (dict(head_dim=0), "positive"),
        (dict(head_dim=64, bands=0), "positive"),
        (dict(head_dim=64, rope="neox"), "rope"),
    ],
)
def test_layout_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        witcert.BandLayout(**kwargs)


@given(layout_and_vectors(1))
def test_band_norms_match_spec(case):
    """Implementation BandLayout.band_norms (fp64); oracle spec.band_norms; rel tol 1e-13."""
    layout, (x,) = case
    got = layout.band_norms(torch.tensor(x, dtype=torch.float64)).tolist()
    want = spec.band_norms(x, layout.bands, layout.rope)
    for g, w in zip(got, want):
        assert abs(mpf(g) - w) <= mpf("1e-13") * w + mpf("1e-300")


# ----------------------------------------------------------------------------- witness_of (L1, T2 input)


@given(layout_and_vectors(2))
@example((witcert.BandLayout(8, 2), [[0.0] * 8, [-0.0] * 8]))
@example((witcert.BandLayout(8, 4), [[1e-300, 0, 0, 0, 0, 0, 0, 1e-310], [0.0] * 8]))
def test_witness_never_below_exact_norm(case):
    """Implementation witness_of; oracle exact mpmath band norms; domain |x| <= 1e3 + tiny; no tolerance."""
    layout, (k, k_hat) = case
    w = witcert.witness_of(torch.tensor(k, dtype=torch.float64), torch.tensor(k_hat, dtype=torch.float64), layout)
    assert w.dtype == torch.float16
    for wb, exact in zip(w.tolist(), exact_band_norms(k_hat, k, layout.bands, layout.rope)):
        assert mpf(wb) >= exact
        assert (exact == 0) == (wb == 0)  # a zero residual band stores exactly 0


@given(
    exponent=st.integers(-14, 15),
    mantissa=st.integers(0, 1023),
    rel=st.sampled_from([2.0**-52, 2.0**-45, 2.0**-40, 2.0**-30, 2.0**-20, 2.0**-12]),
    n=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**16),
)
def test_witness_rounds_up_just_above_fp16_boundary(exponent, mantissa, rel, n, seed):
    """Adversarial fp16 round-up: band norm = h (1 + rel) just above an fp16 value h, where
    round-to-nearest returns h (too small). Oracle: exact mpmath norm; no tolerance."""
    h = fp16_grid_value(exponent, mantissa)
    coords = spread_norm(h * (1 + rel), 2 * n, seed)
    layout = witcert.BandLayout(2 * n, 1, "interleaved")
    zeros = [0.0] * (2 * n)
    w = witcert.witness_of(torch.tensor(zeros, dtype=torch.float64)[None], torch.tensor(coords, dtype=torch.float64)[None], layout)
    exact = exact_band_norms(coords, zeros, 1, "interleaved")[0]
    assert mpf(w.item()) >= exact
    nearest = torch.tensor(float(exact), dtype=torch.float64).half().item()
    if mpf(nearest) < exact:  # the witness is the next fp16 up, never the nearest below
        assert w.item() > nearest


def test_witness_round_up_single_coordinate_boundaries():
    """Residual exactly one ulp(fp64) above every fp16 normal value in [1, 2): witness is next fp16."""
    h = torch.arange(1024, dtype=torch.float64) / 1024 + 1  # fp16 values in [1, 2)
    above = torch.nextafter(h, torch.full_like(h, math.inf))
    k_hat = torch.zeros(1024, 2, dtype=torch.float64)
    k_hat[:, 0] = above
    w = witcert.witness_of(torch.zeros_like(k_hat), k_hat, witcert.BandLayout(2, 1))[:, 0]
    assert (w.double() >= above).all()
    assert (w.double() > h).all()


def test_witness_overflow_is_inf_not_error():
    """Norm above fp16 range -> inf (trivial bound, docs/design.md "Scope of the guarantee": overflow is not an error)."""
    layout = witcert.BandLayout(2, 1)
    k = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    k_hat = torch.tensor([[65504.0, 1.0], [3e38, 0.0]])
    w = witcert.witness_of(k, k_hat, layout)
    assert torch.isinf(w).all()
    c = witcert.logit_bound(torch.tensor([[[0.0, 0.0]]]), w[None], layout, 1.0)  # (1, 1, 2)
    assert (c == 0).all()  # a zero query band meets an inf witness: exact contribution 0
    assert torch.isinf(witcert.logit_bound(torch.tensor([[[1.0, 0.0]]]), w[None], layout, 1.0)).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_witness_low_precision_inputs(dtype):
    """fp16/bf16/fp32 keys: witness >= the fp64 norm of the residual of the given values (rel 0)."""
    gen = torch.Generator().manual_seed(3)
    k = (torch.randn(4, 33, 64, generator=gen) * 30).to(dtype)
    k_hat = (k.float() + torch.randn(4, 33, 64, generator=gen) * 0.1).to(dtype)
    layout = witcert.BandLayout(64, 16)
    w = witcert.witness_of(k, k_hat, layout)
    exact = layout.band_norms(k_hat.double() - k.double())
    assert w.shape == (4, 33, 16) and (w.double() >= exact).all()


@pytest.mark.parametrize(
    "k,k_hat,match",
    [
        (torch.zeros(3, 8), torch.zeros(3, 6), "last dim"),
        (torch.zeros(3, 8), torch.zeros(2, 8), "differs"),
        (torch.full((3, 8), math.nan), torch.zeros(3, 8), "k contains NaN"),
        (torch.zeros(3, 8), torch.full((3, 8), math.inf), "k_hat contains Inf"),
        (torch.zeros(3, 8, dtype=torch.int32), torch.zeros(3, 8, dtype=torch.int32), "floating"),
    ],
)
def test_witness_rejects_bad_input(k, k_hat, match):
    with pytest.raises(ValueError, match=match):
        witcert.witness_of(k, k_hat, witcert.BandLayout(8, 2))


# ----------------------------------------------------------------------------- logit_bound (T2)


@settings(max_examples=100)  # each example runs two 60-digit spec evaluations
@given(layout_and_vectors(3), st.sampled_from([None, 1.0, 0.125, 0.0883883476483184]))
def test_logit_bound_sound_and_tight_against_spec(case, sm_scale):
    """Implementation logit_bound(witness_of); oracle spec.logit_error and bound_band_witness
    (exact real arithmetic on the stored fp16 witness); sound with no tolerance, and within
    rel 1e-12 of the spec bound on the same witness."""
    layout, (q, k, k_hat) = case
    w = witcert.witness_of(torch.tensor(k, dtype=torch.float64), torch.tensor(k_hat, dtype=torch.float64), layout)
    for dtype in (torch.float64, torch.float32):
        qt = torch.tensor(q, dtype=torch.float64).to(dtype)
        c = witcert.logit_bound(qt[None, None], w[None, None], layout, sm_scale)  # one head, one query, one token
        assert c.dtype == dtype and c.shape == (1, 1, 1)
        q_exact = qt.double().tolist()
        residual = [mpf(a) - mpf(b) for a, b in zip(k_hat, k)]
        with mp.workdps(60):
            bound = spec.bound_band_witness(q_exact, w.tolist(), layout.bands, layout.rope, sm_scale)
            eps = spec.logit_error(q_exact, residual, sm_scale)
            assert spec.hypotheses_band_witness(residual, w.tolist(), layout.bands, layout.rope)
            assert eps <= bound  # Theorem 2 itself, in the spec
            assert mpf(c.item()) >= bound  # the torch value never below the exact bound
            slack = mpf("1e-12") if dtype == torch.float64 else mpf("2.5e-7")
            # logit_bound lifts a nonzero band norm below 2^-500 to 2^-500 (an upper bound that keeps the
            # products against fp16 witnesses out of the subnormals): a query that tiny is loose by that much
            scale = mpf(1) / mp.sqrt(layout.head_dim) if sm_scale is None else mpf(sm_scale)
            lift = 2 * mpf(2) ** -500 * scale * sum(map(mpf, w.tolist()))
            # an fp32 result in the subnormal range is rounded up by up to two steps of 2^-149 (absolute, not
            # relative: hypothesis found a bound of 9.33e-43 reported 4.5e-46 above the exact one)
            floor = mpf("1e-300") if dtype == torch.float64 else 2 * mpf(2) ** -149
            assert mpf(c.item()) <= bound * (1 + slack) + floor + lift


def test_logit_bound_tight_for_aligned_query():
    """Per band q_b parallel to r_b: |q.r| = sum ||q_b|| ||r_b||, so c/|eps| -> 1 (up to fp16)."""
    gen = torch.Generator().manual_seed(0)
    layout = witcert.BandLayout(128, 16)
    r = torch.randn(500, 128, generator=gen, dtype=torch.float64)
    alpha = torch.rand(500, 16, generator=gen, dtype=torch.float64)
    q = (layout.split(r) / layout.band_norms(r)[..., None] * alpha[..., None]).flatten(-2)
    q = q[:, torch.argsort(layout.index.flatten())]  # back to coordinate order
    w = witcert.witness_of(torch.zeros_like(r), r, layout)
    c = witcert.logit_bound(q[None], w[None], layout, 0.1)[0]  # one head: 500 queries x 500 tokens
    assert c.shape == (500, 500)
    eps = 0.1 * (q * r).sum(-1)
    diag = c.diagonal()
    assert (diag >= eps.abs()).all()
    assert (diag / eps.abs()).max() < 1 + 2.0**-9  # only fp16 round-up separates them


@pytest.mark.parametrize("hkv,groups", [(1, 1), (2, 3), (4, 2)])
def test_logit_bound_gqa_layout(hkv, groups):
    """q (Hq, Tq, d) against w (Hkv, S, B) (GQA inside) equals the per-query-head loop h -> h // G."""
    gen = torch.Generator().manual_seed(1)
    layout = witcert.BandLayout(64, 8)
    tq, s = 5, 7
    q = torch.randn(hkv * groups, tq, 64, generator=gen)
    k = torch.randn(hkv, s, 64, generator=gen)
    w = witcert.witness_of(k, k + 0.01 * torch.randn(hkv, s, 64, generator=gen), layout)
    batched = witcert.logit_bound(q, w, layout)  # (Hq, Tq, S)
    assert batched.shape == (hkv * groups, tq, s)
    for h in range(hkv * groups):
        single = witcert.logit_bound(q[h][None], w[h // groups][None], layout)[0]  # (Tq, S)
        torch.testing.assert_close(batched[h], single, rtol=0, atol=0)


@pytest.mark.parametrize(
    "q,w,sm_scale,match",
    [
        (torch.zeros(1, 1, 8), torch.zeros(1, 3, 2), None, None),
        (torch.zeros(1, 1, 6), torch.zeros(1, 3, 2), None, "last dim"),
        (torch.zeros(1, 1, 8), torch.zeros(1, 3, 3), None, "B=2"),
        (torch.zeros(1, 1, 8), -torch.ones(1, 3, 2), None, "negative"),
        (torch.zeros(1, 1, 8), torch.full((1, 3, 2), math.nan), None, "NaN"),
        (torch.full((1, 1, 8), math.nan), torch.zeros(1, 3, 2), None, "q contains NaN"),
        (torch.zeros(1, 1, 8), torch.zeros(1, 3, 2), -1.0, "sm_scale"),
        (torch.zeros(1, 1, 8), torch.zeros(1, 3, 2), math.inf, "sm_scale"),
        (torch.zeros(8), torch.zeros(3, 2), None, "explicit query-head and query axes"),
        (torch.zeros(2, 8), torch.zeros(2, 3, 2), None, "explicit query-head and query axes"),
        (torch.zeros(2, 1, 8), torch.zeros(3, 2), None, "same leading dims"),
        (torch.zeros(3, 2, 1, 8), torch.zeros(1, 2, 3, 2), None, "same leading dims"),
        (torch.zeros(3, 1, 8), torch.zeros(2, 3, 2), None, "multiple of kv heads"),
    ],
)
def test_logit_bound_input_checks(q, w, sm_scale, match):
    layout = witcert.BandLayout(8, 2)
    if match is None:
        assert (witcert.logit_bound(q, w, layout, sm_scale) == 0).all()
        return
    with pytest.raises(ValueError, match=match):
        witcert.logit_bound(q, w, layout, sm_scale)


def test_default_scale_rounds_up():
    """Default sm_scale covers the real 1/sqrt(d): c >= the spec bound with scale 1/sqrt(d) exactly."""
    layout = witcert.BandLayout(128, 16)
    q = torch.ones(1, 1, 128, dtype=torch.float64)
    w = torch.ones(1, 1, 16, dtype=torch.float16)
    c = witcert.logit_bound(q, w, layout)
    assert mpf(c.item()) >= spec.bound_band_witness([1.0] * 128, [1.0] * 16, 16)


# ----------------------------------------------------------------------------- Lemma 1 (RoPE)

rope_cases = st.tuples(
    st.sampled_from(LAYOUTS),
    st.sampled_from(ROPES),
    st.sampled_from([10000.0, 500000.0, 1e6, 100.0, 10.0]),
    st.integers(0, 2**31 - 1),
)


@settings(max_examples=60)
@given(rope_cases)
def test_rope_preserves_band_norms(case):
    """L1: ||(R_n x)_b|| = ||x_b|| at random positions, any rope_theta, both conventions.
    Implementation apply_rope + band_norms (fp64); oracle: the unrotated norms; rel tol 1e-12."""
    (head_dim, bands), rope, theta, seed = case
    gen = torch.Generator().manual_seed(seed)
    layout = witcert.BandLayout(head_dim, bands, rope)
    x = torch.randn(2, 24, head_dim, generator=gen, dtype=torch.float64) * 10
    positions = torch.randint(0, 131072, (24,), generator=gen)
    rotated = witcert.apply_rope(x, positions, rope, theta)
    torch.testing.assert_close(layout.band_norms(rotated), layout.band_norms(x), rtol=1e-12, atol=1e-300)


def test_rope_matches_spec_rotation():
    """apply_rope (fp64) against spec.rotate (mpmath) at a large position; abs tol 1e-9 (angle ~1e5 rad)."""
    x = [float(i % 7) - 3 for i in range(16)]
    for rope in ROPES:
        got = witcert.apply_rope(torch.tensor([x], dtype=torch.float64), torch.tensor([123457]), rope, 500000.0)
        want = spec.rotate(x, 123457, rope, 500000.0)
        assert max(abs(mpf(g) - w) for g, w in zip(got[0].tolist(), want)) < 1e-9


def test_rope_convention_mismatch_breaks_invariance():
    """Negative control: bands built for the wrong pair convention are NOT rotation invariant."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 128, generator=gen, dtype=torch.float64)
    rotated = witcert.apply_rope(x, torch.arange(64) * 37, "rotate_half")
    wrong = witcert.BandLayout(128, 16, "interleaved")
    assert not torch.allclose(wrong.band_norms(rotated), wrong.band_norms(x), rtol=1e-3)


@settings(max_examples=60)
@given(rope_cases)
def test_witness_pre_and_post_rope_bound_each_other(case):
    """L1 for the stored witness: w(post-RoPE residual) >= exact pre-RoPE band norms, and the
    pre-RoPE witness with the rotation's rounding (L1fp, fp64 RoPE) >= norms of the post-RoPE
    residual. Oracle: fp64 norms (rel err 1e-15 << the witness inflation); no tolerance."""
    (head_dim, bands), rope, theta, seed = case
    gen = torch.Generator().manual_seed(seed)
    layout = witcert.BandLayout(head_dim, bands, rope)
    k = torch.randn(2, 50, head_dim, generator=gen, dtype=torch.float64) * 5
    k_hat = witcert.get_scheme("rtn-int4")(k)
    pos = torch.randint(0, 65536, (50,), generator=gen)
    k_rot, k_hat_rot = witcert.apply_rope(k, pos, rope, theta), witcert.apply_rope(k_hat, pos, rope, theta)
    w_pre = witcert.witness_of(k, k_hat, layout, rope_dtype=torch.float64).double()
    w_post = witcert.witness_of(k_rot, k_hat_rot, layout).double()
    assert (w_post >= layout.band_norms(k_hat - k)).all()
    assert (w_pre >= layout.band_norms(k_hat_rot - k_rot)).all()
    assert ((w_post == w_pre).double().mean()) > 0.9  # equal after fp16 round-up almost always


def test_post_rope_witness_bounds_every_position_query():
    """T2 with L1fp: a pre-RoPE witness (fp64 RoPE slack) bounds |q_m . (R_n r)| at any query position m."""
    gen = torch.Generator().manual_seed(9)
    layout = witcert.BandLayout(64, 16, "interleaved")
    k = torch.randn(1, 30, 64, generator=gen, dtype=torch.float64)
    k_hat = witcert.get_scheme("fp8-e5m2")(k)
    w = witcert.witness_of(k, k_hat, layout, rope_dtype=torch.float64)  # (1, S, B), pre-RoPE
    pos = torch.randint(0, 10000, (30,), generator=gen)
    r_post = witcert.apply_rope(k_hat, pos, "interleaved") - witcert.apply_rope(k, pos, "interleaved")
    q = witcert.apply_rope(torch.randn(1, 20, 64, generator=gen, dtype=torch.float64), torch.arange(20) * 999, "interleaved")
    c = witcert.logit_bound(q, w, layout, 0.125)[0]  # (20, 30)
    eps = 0.125 * q[0] @ r_post[0].T
    assert (eps.abs() <= c).all()

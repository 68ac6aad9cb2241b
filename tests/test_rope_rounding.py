"""Lemma 1 in floating point (``L1fp``): a witness stored before RoPE, RoPE computed in the cache dtype.

Implementations: ``witcert.witness_of(..., rope_dtype=...)`` (``witcert.tier_a.rotary.rounded_rotation_witness``,
``rotation_rounding``), ``witcert.apply_rope`` (both arithmetics), the attack class
``witcert.verification.attacks.rope_frame``. Oracles: HF Llama's own rotary embedding and
``apply_rotary_pos_emb`` (transformers 5.23); the spec mirror ``witcert.spec.bands``
(``bound_rounded_rotation``, ``rotate_rounded``: every rounding emulated exactly at 50+ digits);
fp64 band norms, logit errors and TV over the keys as actually rotated. Domain: fp16, bf16,
fp32 (and fp64) rotations, both pair conventions, massive channels up to 6e4, positions up to
``2^17``, rope_theta 1e4..1e6. Tolerance: none (witnesses and meters must bound every cell).
"""
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import mp, mpf

import witcert
from witcert.verification.attacks import rope_frame
from witcert.tier_a.rotary import rotation_rounding
from witcert.spec import bands as spec

HALF = (torch.float16, torch.bfloat16)
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROPES = ("rotate_half", "interleaved")
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}


def massive_keys(seed: int, dtype, s: int = 256, d: int = 128, size: float = 1000.0):
    """Keys (1, S, d) with one massive channel (3) of about ``size``."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, s, d, generator=g)
    k[..., 3] += size
    return k.to(dtype)


def true_tv(exact_logits, scores):
    return 0.5 * (torch.softmax(exact_logits, -1) - torch.softmax(scores, -1)).abs().sum(-1)


# ----------------------------------------------------------------------------- the reproduction


def test_reviewer_case_pre_rope_witness_needs_the_rotation_slack():
    """Issue 16 item 1: fp16 keys, massive channel ~1000, kvquant-4bit, BandLayout(128, 64),
    apply_rope in fp16 at positions ~2,200; queries on the massive channel.

    Negative control: the plain pre-RoPE witness is below the rotated residual on thousands of
    bands and the meter below the exact TV. With ``rope_dtype=torch.float16`` (absent before the
    fix) every band, every logit error and every meter bounds its exact value."""
    layout = witcert.BandLayout(128, 64, "rotate_half")
    k = massive_keys(0, torch.float16)
    k_hat = witcert.get_scheme("kvquant-4bit")(k)
    pos = torch.arange(2200, 2200 + k.shape[-2])
    k_rot, k_hat_rot = witcert.apply_rope(k, pos).double(), witcert.apply_rope(k_hat, pos).double()
    norms = layout.band_norms(k_hat_rot - k_rot)
    plain = witcert.witness_of(k, k_hat, layout).double()
    assert (norms > plain).sum() > 1000  # the hole: Lemma 1 fails in fp16

    w = witcert.witness_of(k, k_hat, layout, rope_dtype=torch.float16)
    assert (norms <= w.double()).all()
    q = torch.zeros(4, 128, dtype=torch.float64)
    q[:, 3] = torch.tensor([1.0, 3.0, 10.0, 30.0])
    q[:, 67] = q[:, 3] / 2
    scale = 128**-0.5
    scores, exact = scale * q @ k_hat_rot[0].T, scale * q @ k_rot[0].T
    c = witcert.logit_bound(q[None], w, layout, scale)[0]  # (4, S)
    assert ((exact - scores).abs() <= c).all()
    assert (true_tv(exact, scores) <= witcert.meter(scores, c)).all()
    plain_meter = witcert.meter(scores, witcert.logit_bound(q[None], plain, layout, scale)[0])
    assert (true_tv(exact, scores) > plain_meter).any()  # meter below TV without the slack


# ----------------------------------------------------------------------------- constants (A1)-(A2)


@pytest.mark.parametrize("dtype", [*CACHE_DTYPES, torch.float64])
def test_constants_equal_the_spec(dtype):
    """Implementation rotation_rounding; oracle spec.rotation_rounding (exact mpf); no tolerance."""
    model = rotation_rounding(dtype)
    eta, kappa, alpha0 = spec.rotation_rounding(NAMES[dtype])
    assert (mpf(model.eta), mpf(model.kappa), mpf(model.alpha0)) == (eta, kappa, alpha0)
    assert model.max_finite == torch.finfo(dtype).max


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_cos_sin_radius_assumption_a1(dtype, theta):
    """(A1) on HF Llama's own cos/sin: sqrt(c~^2 + s~^2) <= 1 + eta at every 7th position up to
    2^17 and 4096 positions from 10^6 (every pair of d = 128: 1.4M values). Oracle: the fp64
    radius of the values HF computes; no tolerance. The worst case is well inside the margin
    (measured: < 1 u in fp16/bf16, < 2 u in fp32; (A1) allows 8 u)."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128, rope_theta=theta)
    emb = LlamaRotaryEmbedding(config)
    positions = torch.cat([torch.arange(0, 2**17, 7), torch.arange(10**6, 10**6 + 4096)])
    cos, sin = emb(torch.zeros(1, dtype=dtype), positions[None])
    worst = float(torch.sqrt(cos.double() ** 2 + sin.double() ** 2).max()) - 1
    u = torch.finfo(dtype).eps / 2
    assert worst <= rotation_rounding(dtype).eta
    assert worst <= 2 * u


def _pairs(n, dtype, g):
    """Pairs (a, b) spanning 2^-30..6e4 (fp16: massive and subnormal values) and cos/sin in ``dtype``."""
    top = 6e4 if dtype == torch.float16 else 1e30
    mag = torch.exp(torch.empty(n, 2, dtype=torch.float64).uniform_(math.log(2**-30), math.log(top), generator=g))
    ab = (mag * torch.randn(n, 2, generator=g, dtype=torch.float64).sign()).to(dtype)
    angle = torch.empty(n, dtype=torch.float32).uniform_(-1e5, 1e5, generator=g)
    return ab, torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_component_rounding_assumption_a2_exact_emulation(dtype):
    """(A2): |a' - (a c~ - b s~)| <= kappa (|a c~| + |b s~|) + alpha0 per component, for the spec's
    exact emulation of HF's arithmetic (``rotate_rounded``: every rounding at 50+ digits).
    Oracle: mpmath; no tolerance. Also checks torch's fp16/bf16/fp32 arithmetic equals the spec."""
    g = torch.Generator().manual_seed(7)
    ab, cos, sin = _pairs(300, dtype, g)
    eta, kappa, alpha0 = spec.rotation_rounding(NAMES[dtype])
    torch_rot = witcert.apply_rope  # noqa: F841 (documents the arithmetic compared below)
    with mp.workdps(80):
        for (a, b), c, s in zip(ab.double().tolist(), cos.double().tolist(), sin.double().tolist()):
            got = spec.rotate_rounded([a, b], [c], [s], "interleaved", NAMES[dtype])
            first = torch.tensor(a, dtype=dtype) * torch.tensor(c, dtype=dtype) - torch.tensor(b, dtype=dtype) * torch.tensor(s, dtype=dtype)
            assert float(got[0]) == float(first)  # torch's arithmetic is the emulated one
            for value, ideal, size in ((got[0], mpf(a) * c - mpf(b) * s, abs(mpf(a) * c) + abs(mpf(b) * s)),
                                       (got[1], mpf(b) * c + mpf(a) * s, abs(mpf(b) * c) + abs(mpf(a) * s))):
                assert abs(value - ideal) <= kappa * size + alpha0


@pytest.mark.parametrize("dtype", HALF)
def test_component_rounding_assumption_a2_fp32_then_cast(dtype):
    """(A2) for apply_rope's default arithmetic (fp32 products and sums, one cast to ``dtype``).
    Oracle: fp64 of the ideal value (exact: products of an fp16/bf16 and an fp32 value, their
    difference within fp64's range and precision for these magnitudes is rounded once, far
    below kappa); no tolerance."""
    g = torch.Generator().manual_seed(8)
    ab, _, _ = _pairs(4000, dtype, g)
    angle = torch.empty(4000, dtype=torch.float32).uniform_(-1e5, 1e5, generator=g)
    cos, sin = torch.cos(angle), torch.sin(angle)  # fp32, as apply_rope uses them
    a, b = ab[:, 0].float(), ab[:, 1].float()
    got = (a * cos - b * sin).to(dtype).double()
    ideal = a.double() * cos.double() - b.double() * sin.double()
    size = (a.double() * cos.double()).abs() + (b.double() * sin.double()).abs()
    model = rotation_rounding(dtype)
    assert ((got - ideal).abs() <= model.kappa * size * (1 - 1e-12) + model.alpha0).all()


# ----------------------------------------------------------------------------- the witness (L1fp)


@st.composite
def l1fp_cases(draw):
    dtype = draw(st.sampled_from([*CACHE_DTYPES, torch.float64]))
    return dtype, draw(st.sampled_from(ROPES)), draw(st.sampled_from([(8, 1), (8, 4), (16, 2)])), draw(st.integers(0, 2**31 - 1))


@settings(max_examples=40, deadline=None)
@given(l1fp_cases())
def test_witness_is_at_least_the_spec_bound(case):
    """witness_of(rope_dtype) >= spec.bound_rounded_rotation of the exact mpmath band norms (per
    band), and >= the band norm of the residual after the spec's exact rounded rotation at a
    random position. Oracle: mpmath (50 digits); no tolerance."""
    dtype, rope, (d, bands), seed = case
    rnd = random.Random(seed)
    k = torch.tensor([[rnd.gauss(0, 1) * 10 ** rnd.uniform(-3, 3) for _ in range(d)]], dtype=torch.float64).to(dtype)
    k_hat = (k.double() * (1 + 0.05 * torch.randn(1, d, generator=torch.Generator().manual_seed(seed)))).to(dtype)
    layout = witcert.BandLayout(d, bands, rope)
    w = witcert.witness_of(k, k_hat, layout, rope_dtype=dtype)[0].double().tolist()
    kl, khl = k[0].double().tolist(), k_hat[0].double().tolist()
    residual = [b - a for a, b in zip(kl, khl)]
    name, pairs = NAMES[dtype], d // (2 * bands)
    angles = [rnd.uniform(-1e5, 1e5) for _ in range(d // 2)]  # one angle per pair: (A1)
    cos = [float(torch.tensor(math.cos(t)).to(dtype)) for t in angles]
    sin = [float(torch.tensor(math.sin(t)).to(dtype)) for t in angles]
    rot = spec.rotate_rounded(kl, cos, sin, rope, name)
    rot_hat = spec.rotate_rounded(khl, cos, sin, rope, name)
    after = spec.band_norms([x - y for x, y in zip(rot_hat, rot)], bands, rope)
    for b, (rn, kn, khn) in enumerate(zip(spec.band_norms(residual, bands, rope), spec.band_norms(kl, bands, rope),
                                          spec.band_norms(khl, bands, rope))):
        assert w[b] >= spec.bound_rounded_rotation(rn, kn, khn, pairs, name)
        assert w[b] >= after[b]


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_hf_llama_rotation_end_to_end(dtype):
    """HF Llama's rotary embedding and apply_rotary_pos_emb (the real code) in ``dtype`` at
    positions 1e5.., massive channels, four schemes: every band of the rotated residual <= the
    pre-RoPE witness, every logit error <= c_t, every meter >= the exact TV (fp64). Also:
    apply_rope(compute_dtype=dtype) is HF's rotation bit for bit."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128, rope_theta=500000.0)
    emb = LlamaRotaryEmbedding(config)
    layout = witcert.BandLayout(128, 16, "rotate_half")
    size = 2e4 if dtype == torch.float16 else 3e5
    k = massive_keys(3, dtype, s=64, size=size)[None]  # (1, 1, S, d)
    pos = (100000 + torch.arange(64) * 17)[None]
    cos, sin = emb(k, pos)
    q = torch.randn(1, 1, 6, 128, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    q[..., 3] *= 50
    scale = 128**-0.5
    for scheme in ("kvquant-4bit", "rtn-int8", "fp8-e4m3", "rtn-int4"):
        k_hat = witcert.get_scheme(scheme)(k)
        _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
        _, k_hat_rot = apply_rotary_pos_emb(k_hat, k_hat, cos, sin)
        assert torch.equal(k_rot, witcert.apply_rope(k, pos[0], "rotate_half", 500000.0, compute_dtype=dtype))
        w = witcert.witness_of(k, k_hat, layout, rope_dtype=dtype)[0, 0]  # (S, B)
        r = (k_hat_rot.double() - k_rot.double())[0, 0]
        assert (layout.band_norms(r) <= w.double()).all(), scheme
        qq = q[0, 0] / q[0, 0].norm(dim=-1, keepdim=True) * (40 / float(k_rot.double().norm(dim=-1).max()))
        scores, exact = scale * qq @ k_hat_rot[0, 0].double().T, scale * qq @ k_rot[0, 0].double().T
        c = witcert.logit_bound(qq[None], w[None], layout, scale)[0]
        assert ((exact - scores).abs() <= c).all(), scheme
        assert (true_tv(exact, scores) <= witcert.meter(scores, c)).all(), scheme


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("compute", ["model", "fp32"])
def test_interleaved_rotation_end_to_end(dtype, compute):
    """GPT-J pairs, apply_rope in the cache dtype or fp32 + cast, positions up to 1.3e5, kivi-2bit
    and sign-1bit: every rotated residual band <= the pre-RoPE witness. Oracle: fp64 norms."""
    layout = witcert.BandLayout(64, 8, "interleaved")
    k = massive_keys(5, dtype, s=64, d=64, size=3e3)
    pos = torch.randint(0, 130000, (64,), generator=torch.Generator().manual_seed(6))
    for scheme in ("kivi-2bit", "sign-1bit"):
        k_hat = witcert.get_scheme(scheme)(k)
        w = witcert.witness_of(k, k_hat, layout, rope_dtype=dtype)
        rot = lambda x: witcert.apply_rope(x, pos, "interleaved", 10000.0, dtype if compute == "model" else None)  # noqa: E731
        r = rot(k_hat).double() - rot(k).double()
        assert (layout.band_norms(r) <= w.double()).all(), scheme


def test_witness_with_rotation_slack_is_position_invariant_and_default_unchanged():
    """The slack depends on band norms only: rotating the (fp64) inputs leaves it essentially
    unchanged; without rope_dtype the witness is the plain one (no slack)."""
    layout = witcert.BandLayout(64, 8)
    g = torch.Generator().manual_seed(9)
    k = torch.randn(3, 20, 64, generator=g, dtype=torch.float64)
    k_hat = k + 0.01 * torch.randn(3, 20, 64, generator=g, dtype=torch.float64)
    w = witcert.witness_of(k, k_hat, layout, rope_dtype=torch.float16).double()
    pos = torch.arange(20) * 1009
    w_rot = witcert.witness_of(witcert.apply_rope(k, pos), witcert.apply_rope(k_hat, pos), layout,
                               rope_dtype=torch.float16).double()
    torch.testing.assert_close(w_rot, w, rtol=2e-3, atol=0)  # one fp16 step at most
    plain = witcert.witness_of(k, k_hat, layout).double()
    assert (w > plain).all() and torch.equal(plain, witcert.witness_of(k, k_hat, layout, None).double())


def test_overflowing_rotation_gives_the_trivial_witness():
    """fp16 keys whose rotation may exceed 65504 (a pair (5e4, 5e4) rotates to ~7.1e4 at 45
    degrees): witness inf although the slack itself is finite; (2e4, 2e4) stays finite."""
    layout = witcert.BandLayout(8, 4)  # one pair per band
    big = torch.tensor([[[5e4, 0, 0, 0, 5e4, 0, 0, 0]]], dtype=torch.float16)
    w = witcert.witness_of(big, big, layout, rope_dtype=torch.float16)[0, 0]
    assert torch.isinf(w[0]) and torch.isfinite(w[1:]).all()
    rotated = witcert.apply_rope(big, torch.tensor([1]), "rotate_half", 1.0, compute_dtype=torch.float16)
    assert torch.isinf(rotated).any()  # 1 rad: (5e4 cos 1 - 5e4 sin 1, ...) overflows indeed
    fine = witcert.witness_of(big * 0.4, big * 0.4, layout, rope_dtype=torch.float16)
    assert torch.isfinite(fine).all() and (fine > 0).all()  # the exact token still gets its slack


def test_bad_rope_dtype_is_rejected():
    k = torch.zeros(1, 2, 8)
    for bad in ("float16", torch.int8, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="rope_dtype"):
            witcert.witness_of(k, k, witcert.BandLayout(8, 2), rope_dtype=bad)
    with pytest.raises(ValueError, match="compute_dtype"):
        witcert.apply_rope(torch.zeros(2, 8), torch.arange(2), compute_dtype=torch.int32)
    with pytest.raises(ValueError, match="rope_dtype"):
        spec.rotation_rounding("float8")


def test_spec_rounding_emulation_matches_torch_casts():
    """Oracle check: spec.round_to_format equals torch's round-to-nearest-even casts from fp64
    (fp16 through fp32, as torch does) on random and tie values, and overflows like IEEE."""
    g = torch.Generator().manual_seed(10)
    values = torch.exp(torch.empty(2000, dtype=torch.float64).uniform_(-80, 40, generator=g)) * torch.randn(2000, generator=g, dtype=torch.float64).sign()
    for dtype in (torch.bfloat16, torch.float32):
        want = values.to(dtype).double().tolist()
        assert [float(spec.round_to_format(v, NAMES[dtype])) for v in values.tolist()] == want
    small = values.clamp(-6e4, 6e4).float()  # exact in fp32, so one rounding to fp16
    assert [float(spec.round_to_format(v, "float16")) for v in small.double().tolist()] == small.half().double().tolist()
    assert spec.round_to_format(65519.99, "float16") == 65504 and spec.round_to_format(65520, "float16") == mp.inf
    assert spec.round_to_format(2.0**-25, "float16") == 0 and spec.round_to_format(3 * 2.0**-26, "float16") == 2.0**-24


def test_rope_frame_attack_finds_the_class_and_no_violation(monkeypatch):
    """The fuzz class (batches of 8 here: 4 configurations): 0 violations with the slack; with
    the witness of the unrotated keys (no slack) it finds violations by itself."""
    monkeypatch.setattr(rope_frame, "BATCH", 8)
    tally = rope_frame.run(32, torch.Generator().manual_seed(0))
    assert tally.cells > 0 and tally.violations == 0, tally.notes
    original = rope_frame.witness_of
    monkeypatch.setattr(rope_frame, "witness_of", lambda k, k_hat, layout, rope_dtype=None: original(k, k_hat, layout))
    assert rope_frame.run(32, torch.Generator().manual_seed(0)).violations > 0

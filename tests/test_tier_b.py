"""Tier B certificate: spec statements L2s/L2/L2v/L3/TB and the torch bound (``witcert.tier_b.certificate``).

Implementation: ``witcert.tier_b_logit_bound`` and ``witcert.tier_b.certificate.tier_b_terms``. Oracles:
``witcert.spec.dither`` at 40 digits (composition of the bound), the true logit error of the
dequantized cache (soundness), and the binomial law for the request-level count.
Domain: synthetic caches with and without massive pairs, fp32, fp16 and bf16 sources and key
dtypes (the dtype the dequantized keys are read in, registry "DB"), fp16 subnormal and
overflowing keys, one-hot, dense and residual-aligned queries. Tolerances: torch >= spec and within 1e-6 above it; zero
deterministic violations; the request count within the binomial tail of ``delta_req``.
"""
import math

import mpmath
import pytest
import torch
from hypothesis import example, given, strategies as st
from mpmath import mp
from scipy import stats

from witcert import DitheredInt8, meter, tier_b_logit_bound
from witcert.tier_b.counters import StandaloneCounter
from witcert.spec import dither as spec
from witcert.tier_b.certificate import (delta_local, deterministic_branch, deterministic_delta, outlier_error_bound,
                            tier_b_terms)

# ------------------------------------------------------------------ spec statements


@given(st.floats(0, 60))
@example(0.0)
@example(1e-300)
@example(2.5)
def test_sinh_bound_L2s(x):
    # the margin x^5 (1/72 - 1/120) is relative x^4/180: resolve it (40 digits alone cannot below x ~ 1e-10)
    digits = 40 + (0 if x == 0 else int(4 * max(0.0, -math.log10(x))))
    with mp.workdps(digits):
        assert mpmath.sinh(x) <= spec.sinh_bound(x)


@given(st.floats(-40, 40), st.floats(1e-3, 10))
@example(0.0, 1.0)
def test_uniform_mgf_L2(lam, a):
    # the margin is relative y^4/180 at y = lam a: resolve it (40 digits alone cannot below y ~ 1e-10; a
    # random hypothesis run found lam = 2.2e-16, a = 2.5, the two sides equal to 1e-63)
    y = abs(lam * a)
    digits = 40 + (0 if y == 0 else int(4 * max(0.0, -math.log10(y))))
    with mp.workdps(digits):
        assert spec.uniform_mgf(lam, a) <= spec.uniform_mgf_bound(lam, a)


@pytest.mark.parametrize("lam, a", [(0.0, 1.0), (3.0, 0.5), (-25.0, 2.0)])
def test_uniform_mgf_is_the_integral(lam, a):
    with mp.workdps(40):
        integral = mpmath.quad(lambda x: mpmath.exp(lam * x), [-a, a]) / (2 * a)
        assert abs(spec.uniform_mgf(lam, a) / integral - 1) < mpmath.mpf(10) ** -30


@pytest.mark.parametrize("n_points", [2, 3, 16, 2**24])
@pytest.mark.parametrize("lam", [0.1, 3.0, 40.0, -7.0])
def test_dither_grid_mgf_is_below_the_continuous_uniform(n_points, lam):
    """The centred residual on the dither grid (spacing 1/N, N points) obeys Lemma 2's bound."""
    with mp.workdps(40):
        step = mpmath.mpf(1) / n_points
        continuous = spec.uniform_mgf(lam, (1 - step) / 2 + step / 2)
        assert spec.grid_mgf(lam, n_points, step) <= continuous <= spec.uniform_mgf_bound(lam, mpmath.mpf(1) / 2)


@pytest.mark.parametrize("s", ["1", "0.003", "517.5"])
def test_proxy_is_the_variance_L2v(s):
    with mp.workdps(40):
        assert abs(spec.uniform_variance(mpmath.mpf(s) / 2) / spec.proxy_variance(s) - 1) < mpmath.mpf(10) ** -30


def test_request_budget_L3():
    assert delta_local(1e-2, 30, 8, 100) == pytest.approx(1e-2 / 24000, rel=1e-15)
    with mp.workdps(40):
        loc = spec.delta_local("0.01", 30, 8, 100)
        assert loc * 30 * 8 * 100 <= mpmath.mpf("0.01") * (1 + mpmath.mpf(10) ** -35)
    with pytest.raises(ValueError, match="delta_req"):
        delta_local(0.0, 1, 1, 1)
    with pytest.raises(ValueError, match="n_heads"):
        delta_local(0.1, 1, 0, 1)


# ------------------------------------------------------------------ oracle machinery


def synthetic_keys(shape, massive=False, seed=0, dtype=torch.float32):
    """Gaussian keys with per-token amplitude; ``massive`` adds a massive RoPE pair (3, 3 + d/2)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * (0.5 + torch.rand(*shape[:-1], 1, generator=gen))
    if massive:
        half = shape[-1] // 2
        x[..., 3] += 60.0
        x[..., 3 + half] -= 45.0
    return x.to(dtype)


def true_logit_error(q, x_hat, x, sm):
    """``eps = sm q . (x^ - x)`` in fp64 (the quantity every bound must dominate)."""
    return sm * (q.double() @ (x_hat.double() - x.double()).transpose(-1, -2))


def key_magnitudes(store, h, t, key_dtype):
    """``m_c`` of one token: ``s_c (|n_c| + 1/2)``, and ``|x16_c|`` on outlier channels unless the keys are fp16."""
    scale = store.scale_per_element()[h, t].double()
    magnitude = scale * (store.payload[h, t].double().abs() + 0.5)
    if key_dtype != "float16":
        for c, value in zip(store.outlier_channels()[h, t].tolist(), store.outliers[h, t].double().tolist()):
            magnitude[c] = abs(value)
    return magnitude.tolist()


def spec_bound_of_token(q, store, h, i, t, sm, delta_loc, mode, key_dtype="float32"):
    """The spec composition for one (head, query, token), from the store's exact fp16 data."""
    scale = store.scale_per_element()[h, t].tolist()
    channels = store.outlier_channels()[h, t].tolist()
    return spec.logit_bound(q[h, i].double().tolist(), scale, sm, store.n_tokens, delta_loc,
                            [q[h, i, c].item() for c in channels], store.outliers[h, t].double().tolist(),
                            store.source_dtype == torch.float16, mode,
                            key_magnitudes(store, h, t, key_dtype), key_dtype)


# ------------------------------------------------------------------ torch vs spec


@pytest.mark.parametrize("mode", ["min", "u", "delta"])
@pytest.mark.parametrize("config, dtype", [(dict(), torch.float32), (dict(outlier_pairs=2), torch.float32),
                                           (dict(granularity="block-channel", block=16, outlier_pairs=1), torch.float16)])
def test_torch_bound_is_the_spec_bound_rounded_up(mode, config, dtype):
    x = synthetic_keys((2, 40, 64), massive=True, seed=1, dtype=dtype)
    counter = StandaloneCounter(request=0, layer=0)
    store = DitheredInt8(**config).quantize(x, counter)
    q = synthetic_keys((2, 3, 64), seed=2)
    q[0, 0] = 0.0
    q[0, 0, 7] = 5.0  # one-hot: Delta wins
    c = tier_b_logit_bound(q, store, 1e-4, mode=mode)
    with mp.workdps(40):
        for h, i, t in [(0, 0, 0), (0, 1, 39), (1, 2, 17), (1, 0, 5)]:
            ref = spec_bound_of_token(q, store, h, i, t, 0.125, 1e-4, mode)
            assert c[h, i, t].item() >= ref
            assert c[h, i, t].item() <= ref * (1 + mpmath.mpf(1e-6))


KEY_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.mark.parametrize("mode", ["min", "delta"])
@pytest.mark.parametrize("key_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("config", [dict(), dict(granularity="block-channel", block=16, outlier_pairs=1)])
def test_half_precision_keys_bound_is_the_spec_bound_rounded_up(mode, key_dtype, config):
    """Implementation: ``tier_b_logit_bound(key_dtype=...)``; oracle: ``spec.logit_bound`` with the
    final-cast term at 40 digits; domain: one-hot and dense queries, fp16/bf16 keys, outliers;
    tolerance: torch >= spec, within 1e-6 above."""
    dtype = KEY_DTYPES[key_dtype]
    x = synthetic_keys((2, 40, 64), massive=True, seed=21, dtype=dtype)
    store = DitheredInt8(**config).quantize(x, StandaloneCounter(request=0, layer=0, seed=3))
    q = synthetic_keys((2, 3, 64), seed=22)
    q[0, 0] = 0.0
    q[0, 0, 3] = 5.0  # one-hot on the massive channel (an outlier channel when m = 1)
    c = tier_b_logit_bound(q, store, 1e-4, mode=mode, key_dtype=dtype)
    with mp.workdps(40):
        for h, i, t in [(0, 0, 0), (0, 1, 39), (1, 2, 17), (1, 0, 5)]:
            ref = spec_bound_of_token(q, store, h, i, t, 0.125, 1e-4, mode, key_dtype)
            assert c[h, i, t].item() >= ref
            assert c[h, i, t].item() <= ref * (1 + mpmath.mpf(1e-6))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("massive", [False, True])
def test_deterministic_branch_covers_the_cast_to_the_model_dtype(dtype, massive):
    """Issue 16 item 2. Implementation: ``mode="delta"`` with ``key_dtype`` = the dtype the keys are
    dequantized to (the HF layer's choice: the model dtype); oracle: the fp64 logit error of those
    keys against the exact keys, per (query, token); domain: one-hot queries on every channel
    (the tightest case of ``Delta_t``), fp16/bf16/fp32 keys; tolerance: none. Before the fix the
    bound assumed fp32 keys: bf16 errors reached 1.87x it."""
    x = synthetic_keys((2, 128, 64), massive=massive, seed=23, dtype=dtype) * 3
    counter = StandaloneCounter(request=0, layer=0, seed=4)
    quantizer = DitheredInt8()
    store = quantizer.quantize(x, counter)
    keys = quantizer.dequantize(store, counter, dtype=dtype)
    q = torch.eye(64).expand(2, 64, 64)
    eps = true_logit_error(q, keys, x, 0.125).abs()
    c = tier_b_logit_bound(q, store, 1e-3, mode="delta", key_dtype=dtype).double()
    assert (eps <= c).all(), f"{int((eps > c).sum())} tokens, worst |eps|/c = {float((eps / c).max()):.4f}"
    assert (eps / c).max() > 0.9  # the one-hot queries make the branch nearly tight


def test_fp16_subnormal_keys_need_the_subnormal_floor():
    """Implementation: the fp16 final cast's ``eta/2 = 2^-25`` term; oracle: fp64 error of the fp16
    keys; domain: an fp32 cache read as fp16 keys in the fp16 subnormal range (scales of a few
    ``2^-24``), where half an ulp is the absolute ``2^-25``, not ``2^-11 |y|``; tolerance: none."""
    g = torch.Generator().manual_seed(24)
    x = (torch.rand(1, 64, 32, generator=g) - 0.5) * 2.0**-18  # fp32 values, |x| < 32 fp16 subnormal steps
    counter = StandaloneCounter(request=0, layer=0, seed=5)
    store = DitheredInt8().quantize(x, counter)
    assert (store.scales.double() < 2.0**-14).all()
    keys = DitheredInt8().dequantize(store, counter, dtype=torch.float16)
    q = torch.eye(32).unsqueeze(0)
    eps = true_logit_error(q, keys, x, 1.0).abs()
    c = tier_b_logit_bound(q, store, 1e-3, sm_scale=1.0, mode="delta", key_dtype=torch.float16).double()
    assert (eps <= c).all()
    no_floor = deterministic_delta(q, store, 1.0) * (1 + 2.0**-11 * 128)  # normal-range rounding only
    assert (eps > no_floor).any()


def test_deterministic_branch_is_the_spec_statement_DB():
    """Implementation: ``witcert.tier_b.certificate.deterministic_branch``; oracle: ``spec.deterministic_branch``
    (the DB statement ``sm sum |q_c| (s_c/2 + e_c)``) with ``e_c`` assembled per element from the
    documented terms; domain: bf16 keys with outliers; tolerance: 1e-12 relative (fp64 sums)."""
    x = synthetic_keys((1, 24, 64), massive=True, seed=25, dtype=torch.bfloat16)
    store = DitheredInt8(outlier_pairs=1).quantize(x, StandaloneCounter(request=0, layer=0, seed=6))
    q = synthetic_keys((1, 2, 64), seed=26)
    torch_db = deterministic_branch(q, store, 0.125, key_dtype=torch.bfloat16)
    outlier_error = outlier_error_bound(store)
    with mp.workdps(40):
        for i, t in [(0, 0), (1, 23), (0, 11)]:
            s = store.scale_per_element()[0, t].tolist()
            magnitudes = key_magnitudes(store, 0, t, "bfloat16")
            e = [mpmath.mpf(sc) * (spec.Q_LEVELS + mpmath.mpf(1) / 2) * (2 * spec.FP32_UNIT + spec.FP32_UNIT**2)
                 + spec.key_cast_bound(m, "bfloat16") + mpmath.mpf(o)
                 for sc, m, o in zip(s, magnitudes, outlier_error[0, t].tolist())]
            ref = spec.deterministic_branch(q[0, i].double().tolist(), s, e, 0.125)
            assert abs(torch_db[0, i, t].item() / ref - 1) < 1e-12


def test_keys_that_may_overflow_fp16_get_the_trivial_bound():
    """An fp16 cache near 65504: ``dequantize`` to fp16 raises (the value would be inf) and the
    bound is inf for a query that reads that channel, finite for one that does not."""
    x = torch.zeros(1, 2, 32, dtype=torch.float16)
    x[0, :, 0] = 65504.0
    x[0, :, 1] = -65504.0
    x[0, :, 2] = 1.0
    counter = StandaloneCounter(request=0, layer=0, seed=7)
    store = DitheredInt8().quantize(x, counter)
    q = torch.zeros(1, 2, 32)
    q[0, 0, 0] = 1.0
    q[0, 1, 2] = 1.0
    c = tier_b_logit_bound(q, store, 1e-3, mode="delta", key_dtype=torch.float16)
    assert torch.isinf(c[0, 0]).all() and torch.isfinite(c[0, 1]).all()
    assert meter(torch.zeros(2), c[0, 0].double()).item() == 1.0
    with pytest.raises(ValueError, match="overflows"):
        DitheredInt8().dequantize(store, counter, dtype=torch.float16)
    assert torch.isfinite(DitheredInt8().dequantize(store, counter)).all()  # fp32 keys hold it


def test_deterministic_branch_holds_for_every_query_including_adaptive_ones():
    x = synthetic_keys((4, 64, 64), massive=True, seed=3)
    counter = StandaloneCounter(request=1, layer=2)
    quantizer = DitheredInt8(outlier_pairs=2)
    store = quantizer.quantize(x, counter)
    residual = quantizer.dequantize(store, counter).double() - x.double()  # (H, S, d)
    aligned = torch.sign(residual[:, :8]) * store.scale_per_element()[:, :8]  # adversary sees the dither
    queries = torch.cat([aligned, synthetic_keys((4, 8, 64), seed=4).double(), torch.eye(64)[:8].expand(4, 8, 64)], 1)
    eps = true_logit_error(queries, x + residual, x, 0.125)
    c_delta = tier_b_logit_bound(queries, store, 1e-3, mode="delta")
    c_min = tier_b_logit_bound(queries, store, 1e-3)
    assert (eps.abs() <= c_delta).all()
    diagonal = torch.arange(8)
    # the aligned (adaptive) query for token t breaks u_t at t: outside Tier B's non-adaptive scope
    u_only = tier_b_logit_bound(queries, store, 1e-3, mode="u")
    assert (eps.abs()[:, diagonal, diagonal] > u_only[:, diagonal, diagonal]).all()
    assert (eps.abs()[:, 8:] <= c_min[:, 8:]).all()


# ------------------------------------------------------------------ request-level soundness

N_REQUESTS, N_LAYERS, N_HEADS, N_TOKENS, N_STEPS, HEAD_DIM = 200, 2, 2, 64, 4, 64
DELTA_REQ = 1e-2


def request_violations(massive, outlier_pairs, modes=("u", "min")):
    """Per bound branch: requests (of N_REQUESTS, one dither stream each) with any |eps_t| > c_t."""
    shape = (N_REQUESTS, N_LAYERS, N_HEADS, N_TOKENS, HEAD_DIM)
    x = synthetic_keys(shape[1:], massive=massive, seed=9).expand(shape)  # same keys, fresh dither
    q = synthetic_keys((N_LAYERS, N_HEADS, N_STEPS, HEAD_DIM), seed=10)
    counter = StandaloneCounter(request=torch.arange(N_REQUESTS).view(-1, 1), layer=torch.arange(N_LAYERS))
    quantizer = DitheredInt8(outlier_pairs=outlier_pairs)
    store = quantizer.quantize(x, counter)
    eps = true_logit_error(q, quantizer.dequantize(store, counter), x, 1 / math.sqrt(HEAD_DIM)).abs()
    loc = delta_local(DELTA_REQ, N_LAYERS, N_HEADS, N_STEPS)
    counts = {}
    for mode in modes:
        c = tier_b_logit_bound(q.expand(N_REQUESTS, *q.shape), store, loc, mode=mode)
        counts[mode] = (int((eps > c).flatten(1).any(1).sum()), float((eps / c).max()))
    return counts


def binomial_ceiling(n, p, alpha=1e-3):
    """Smallest k with P(Bin(n, p) >= k) <= alpha (the rule-of-three's two-sided cousin)."""
    return int(stats.binom.isf(alpha, n, p)) + 1


@pytest.mark.parametrize("massive, outlier_pairs", [(False, 0), (True, 2)])
def test_request_level_soundness(massive, outlier_pairs):
    counts = request_violations(massive, outlier_pairs)
    for mode, (bad, worst) in counts.items():
        print(f"mode={mode} massive={massive} m={outlier_pairs}: {bad}/{N_REQUESTS} requests with a violation "
              f"(rule of three: rate <= {3 / N_REQUESTS:.3f} at 95% if 0); max |eps|/c = {worst:.3f}")
        assert bad <= binomial_ceiling(N_REQUESTS, DELTA_REQ)


# ------------------------------------------------------------------ meter and inputs


def test_meter_on_tier_b_bounds_dominates_the_true_tv():
    x = synthetic_keys((2, 64, 64), massive=True, seed=12)
    counter = StandaloneCounter(request=5, layer=0)
    quantizer = DitheredInt8(outlier_pairs=2)
    store = quantizer.quantize(x, counter)
    q = synthetic_keys((2, 4, 64), seed=13) * 3
    x_hat = quantizer.dequantize(store, counter)
    exact, compressed = (q.double() @ k.double().transpose(-1, -2) / 8 for k in (x, x_hat))
    tv = 0.5 * (torch.softmax(exact, -1) - torch.softmax(compressed, -1)).abs().sum(-1)
    bound = meter(compressed, tier_b_logit_bound(q, store, 1e-3).double())
    assert (tv <= bound).all()


def test_bad_query_and_budget_are_rejected():
    store = DitheredInt8().quantize(torch.zeros(1, 4, 32), StandaloneCounter(request=0, layer=0))
    with pytest.raises(ValueError, match="NaN or Inf"):
        tier_b_logit_bound(torch.full((1, 1, 32), float("nan")), store, 1e-3)
    with pytest.raises(ValueError, match="head dim"):
        tier_b_logit_bound(torch.zeros(1, 1, 16), store, 1e-3)
    with pytest.raises(ValueError, match="delta_loc"):
        tier_b_logit_bound(torch.zeros(1, 1, 32), store, 0.0)
    with pytest.raises(ValueError, match="mode"):
        tier_b_logit_bound(torch.zeros(1, 1, 32), store, 1e-3, mode="max")
    with pytest.raises(ValueError, match="key_dtype"):
        tier_b_logit_bound(torch.zeros(1, 1, 32), store, 1e-3, key_dtype=torch.int8)
    with pytest.raises(ValueError, match="key_dtype"):
        tier_b_logit_bound(torch.zeros(1, 1, 32), store, 1e-3, key_dtype="bf16")
    with pytest.raises(ValueError, match="explicit query-head and query axes"):
        tier_b_logit_bound(torch.zeros(1, 32), store, 1e-3)  # (H, d): no query axis, ambiguous
    with pytest.raises(ValueError, match="same leading dims"):
        tier_b_logit_bound(torch.zeros(2, 1, 1, 32), store, 1e-3)
    for key_dtype in KEY_DTYPES.values():  # all-zero cache: exact in every key dtype
        assert (tier_b_logit_bound(torch.ones(1, 1, 32), store, 1e-3, key_dtype=key_dtype) == 0).all()


def test_terms_have_the_documented_order():
    x = synthetic_keys((2, 64, 64), seed=14)
    store = DitheredInt8().quantize(x, StandaloneCounter(request=0, layer=0))
    terms = tier_b_terms(synthetic_keys((2, 1, 64), seed=15), store, 1e-5)
    assert (terms.beta <= terms.delta * 2.0**-23).all() and (terms.rho <= terms.delta * 1e-4).all()
    assert terms.u.shape == (2, 1, 64) and (terms.outlier == 0).all()

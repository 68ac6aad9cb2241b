"""Tier B certificate: spec statements L2s/L2/L2v/L3/TB and the torch bound (``witcert.tier_b``).

Implementation: ``witcert.tier_b_logit_bound`` and ``witcert.tier_b.tier_b_terms``. Oracles:
``witcert.spec.dither`` at 40 digits (composition of the bound), the true logit error of the
dequantized cache (soundness), and the binomial law for the request-level count.
Domain: synthetic caches with and without massive pairs, fp32 and fp16 sources, one-hot,
dense and residual-aligned queries. Tolerances: torch >= spec and within 1e-6 above it; zero
deterministic violations; the request count within the binomial tail of ``delta_req``.
"""
import math

import mpmath
import pytest
import torch
from hypothesis import example, given, strategies as st
from mpmath import mp
from scipy import stats

from witcert import DitheredInt8, StandaloneCounter, meter, tier_b_logit_bound
from witcert.spec import dither as spec
from witcert.tier_b import delta_local, tier_b_terms

# ------------------------------------------------------------------ spec statements


@given(st.floats(0, 60))
@example(0.0)
@example(1e-300)
@example(2.5)
def test_sinh_bound_L2s(x):
    with mp.workdps(40):
        assert mpmath.sinh(x) <= spec.sinh_bound(x)


@given(st.floats(-40, 40), st.floats(1e-3, 10))
@example(0.0, 1.0)
def test_uniform_mgf_L2(lam, a):
    with mp.workdps(40):
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


def spec_bound_of_token(q, store, h, i, t, sm, delta_loc, mode):
    """The spec composition for one (head, query, token), from the store's exact fp16 data."""
    scale = store.scale_per_element()[h, t].tolist()
    channels = store.outlier_channels()[h, t].tolist()
    return spec.logit_bound(q[h, i].double().tolist(), scale, sm, store.n_tokens, delta_loc,
                            [q[h, i, c].item() for c in channels], store.outliers[h, t].double().tolist(),
                            store.source_dtype == torch.float16, mode)


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
        tier_b_logit_bound(torch.full((1, 32), float("nan")), store, 1e-3)
    with pytest.raises(ValueError, match="head dim"):
        tier_b_logit_bound(torch.zeros(1, 16), store, 1e-3)
    with pytest.raises(ValueError, match="delta_loc"):
        tier_b_logit_bound(torch.zeros(1, 32), store, 0.0)
    with pytest.raises(ValueError, match="mode"):
        tier_b_logit_bound(torch.zeros(1, 32), store, 1e-3, mode="max")
    assert (tier_b_logit_bound(torch.ones(1, 32), store, 1e-3) == 0).all()  # all-zero cache: exact


def test_terms_have_the_documented_order():
    x = synthetic_keys((2, 64, 64), seed=14)
    store = DitheredInt8().quantize(x, StandaloneCounter(request=0, layer=0))
    terms = tier_b_terms(synthetic_keys((2, 64), seed=15), store, 1e-5)
    assert (terms.beta <= terms.delta * 2.0**-23).all() and (terms.rho <= terms.delta * 1e-4).all()
    assert terms.u.shape == (2, 64) and (terms.outlier == 0).all()

"""Value side (``witcert.core.values``) and the observatory primitive ``witcert.observe``.

Implementations: ``value_residual_norms``, ``value_error_term``, ``output_bound``,
``joint_pass``, ``observe``. Oracles: mpmath (``witcert.spec.bounds.softmax`` at 50 digits) for
``sum p~ rho``; per-head and truncated re-runs for GQA and masking (rel tol 1e-12); fp64 truth
for the output error. Domain: ``tests.oracles.score_lists`` (ties, ``-inf`` masks, [-40, 40]).
"""
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mpmath import mp, mpf

import witcert
from tests.oracles import score_lists
from witcert.core import values
from witcert.spec import bounds as spec_bounds

LAYOUT = witcert.BandLayout(32, 4)

# ----------------------------------------------------------------------------- oracle machinery


def exact_value_term(scores, rho) -> mpf:
    """``sum_t p~_t rho_t`` at 50 digits."""
    with mp.workdps(50):
        return mp.fsum(p * mpf(r) for p, r in zip(spec_bounds.softmax(scores), rho))


def small_layer(seed: int, hq: int = 4, hkv: int = 2, tq: int = 6, s: int = 40):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, tq, 32, generator=gen) * 2
    k = torch.randn(hkv, s, 32, generator=gen)
    v = torch.randn(hkv, s, 32, generator=gen)
    return q, k, v


@witcert.register_scheme("test-identity", replace=True)
def identity(x):
    """Test scheme: exact reconstruction (no error)."""
    return x.clone()


# ----------------------------------------------------------------------------- values


@st.composite
def scores_and_rho(draw):
    """Compressed logits (ties, masks) and value residual norms in [0, 1e3] of the same length."""
    scores = draw(score_lists(1, 10))
    rho = draw(st.lists(st.floats(0, 1e3), min_size=len(scores), max_size=len(scores)))
    return scores, rho


@settings(max_examples=150)
@given(scores_and_rho())
@example(([3.0], [2.5]))  # S = 1
@example(([-math.inf, 1.5, -math.inf], [1e3, 0.5, 7.0]))  # all but one masked
@example(([0.0, 0.0, 0.0], [1.0, 0.0, 1e-30]))  # ties, tiny rho
@example(([40.0, -40.0], [0.0, 1e3]))  # huge spread: the big rho carries ~e^-80 mass
def test_value_term_never_below_exact(case):
    """value_error_term >= sum p~ rho exactly (mpmath), and within rel 1e-9 of it."""
    scores, rho = case
    got = values.value_error_term(torch.tensor(scores, dtype=torch.float64), torch.tensor(rho, dtype=torch.float64))
    exact = exact_value_term(scores, rho)
    assert mpf(got.item()) >= exact
    assert mpf(got.item()) <= exact * (1 + mpf("1e-9")) + mpf("1e-300")


def test_value_residual_norms_round_up():
    """fp32 rho is rounded up: >= the exact (mpmath) norm of the fp32 residual; fp64 stays fp64."""
    gen = torch.Generator().manual_seed(7)
    v = torch.randn(300, 4, generator=gen)
    v_hat = v + torch.randn(300, 4, generator=gen) * torch.logspace(-6, 2, 300)[:, None]
    rho = values.value_residual_norms(v, v_hat)
    assert rho.dtype == torch.float32
    with mp.workdps(50):
        for r, a, b in zip(rho.tolist(), v.tolist(), v_hat.tolist()):
            assert mpf(r) >= mp.sqrt(mp.fsum((mpf(y) - mpf(x)) ** 2 for x, y in zip(a, b)))
    assert values.value_residual_norms(v.double(), v_hat.double()).dtype == torch.float64


def test_output_bound_formula_and_tightness():
    """2 TV max||v|| + sum p~ rho; tight (ratio ~1) when every value moves by the same vector."""
    torch.testing.assert_close(
        values.output_bound(*torch.tensor([0.1, 0.5, 3.0], dtype=torch.float64)),
        torch.tensor(1.1, dtype=torch.float64), rtol=1e-13, atol=0,  # rounding.up slack ~1.4e-14
    )
    q, k, v = small_layer(0)
    shift = torch.randn(32)
    obs = witcert.observe(q, k, v, "test-identity", LAYOUT, v_hat=v + shift)
    assert (obs.true_output_error <= obs.output_bound).all()
    assert (obs.output_bound / obs.true_output_error).max() < 1 + 1e-6


def test_joint_pass_definitions():
    jp = values.joint_pass(torch.tensor([0.1, 0.3, 0.1]), torch.tensor([0.01, 0.01, 0.2]), torch.tensor([1.0, 1.0, 1.0]))
    assert jp.pass_k.tolist() == [True, False, True]
    assert jp.pass_v.tolist() == [True, True, False]
    assert jp.joint.tolist() == [True, False, False]
    with pytest.raises(ValueError, match="tau_k"):
        values.joint_pass(torch.tensor([0.1]), torch.tensor([0.0]), torch.tensor([1.0]), tau_k=-1)


# ----------------------------------------------------------------------------- observe


def test_observe_shapes_and_exact_flag():
    q, k, v = small_layer(1)
    obs = witcert.observe(q, k, v, "rtn-int4", LAYOUT)
    for name in ("meter", "risk", "output_bound", "value_term", "pass_k", "pass_v", "joint", "true_tv"):
        assert getattr(obs, name).shape == (4, 6), name
    assert obs.c.shape == (4, 6, 40)
    assert (obs.true_tv <= obs.meter).all() and (obs.meter <= 1).all()
    assert torch.equal(obs.joint, obs.pass_k & obs.pass_v)
    lean = witcert.observe(q, k, v, "rtn-int4", LAYOUT, exact=False)
    assert lean.true_tv is None and lean.true_output_error is None
    torch.testing.assert_close(lean.meter, obs.meter, rtol=0, atol=0)


def test_observe_identity_scheme_is_certified():
    q, k, v = small_layer(2)
    obs = witcert.observe(q, k, v, "test-identity", LAYOUT)
    assert (obs.meter < 1e-9).all() and (obs.true_tv == 0).all() and obs.joint.all()


@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 3), (3, 1)])
def test_observe_gqa_matches_per_head(hq, hkv):
    """Query head h reads kv head h // G: batched results equal single-head re-runs (rel 1e-12)."""
    q, k, v = small_layer(3, hq, hkv)
    k_hat, v_hat = witcert.get_scheme("kivi-2bit")(k), witcert.get_scheme("kivi-2bit")(v, role="value")
    obs = witcert.observe(q, k, v, "kivi-2bit", LAYOUT, k_hat=k_hat, v_hat=v_hat)
    g = hq // hkv
    for h in range(hq):
        kv = slice(h // g, h // g + 1)
        one = witcert.observe(q[h : h + 1], k[kv], v[kv], "kivi-2bit", LAYOUT, k_hat=k_hat[kv], v_hat=v_hat[kv])
        for name in ("meter", "output_bound", "true_tv"):
            torch.testing.assert_close(getattr(obs, name)[h], getattr(one, name)[0], rtol=1e-12, atol=0)


def test_observe_mask_equals_truncation():
    """A causal-style mask gives the same per-query results as truncating the cache (rel 1e-12)."""
    q, k, v = small_layer(4, tq=5)
    k_hat, v_hat = witcert.get_scheme("rtn-int2")(k), witcert.get_scheme("rtn-int2")(v)
    lengths = torch.tensor([1, 7, 20, 33, 40])
    mask = torch.arange(40)[None, :] < lengths[:, None]  # (Tq, S)
    obs = witcert.observe(q, k, v, "rtn-int2", LAYOUT, mask=mask, k_hat=k_hat, v_hat=v_hat)
    for i, n in enumerate(lengths.tolist()):
        cut = witcert.observe(q[:, i : i + 1], k[:, :n], v[:, :n], "rtn-int2", LAYOUT, k_hat=k_hat[:, :n], v_hat=v_hat[:, :n])
        for name in ("meter", "risk", "output_bound", "true_tv", "true_output_error"):
            torch.testing.assert_close(getattr(obs, name)[:, i], getattr(cut, name)[:, 0], rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(q=torch.zeros(3, 2, 32)), "multiple of kv heads"),
        (dict(v=torch.zeros(2, 39, 32)), "v shape"),
        (dict(q=torch.zeros(4, 2, 16)), "head_dim"),
        (dict(mask=torch.zeros(2, 40, dtype=torch.bool)), "attends no token"),
        (dict(mask=torch.ones(2, 41, dtype=torch.bool)), "broadcast"),
        (dict(scheme="nope"), "unknown scheme"),
        (dict(layout="bands"), "BandLayout"),
    ],
)
def test_observe_rejects_bad_input(kwargs, match):
    q, k, v = small_layer(5, tq=2)
    args = dict(q=q, k=k, v=v, scheme="rtn-int8", layout=LAYOUT) | kwargs
    with pytest.raises(ValueError, match=match):
        witcert.observe(**args)

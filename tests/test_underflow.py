"""Every public bound below and at the bottom of the normal range (issue 16, items 4 and 5; FP).

Implementations: ``witcert.meter``, ``witcert.risk_score``, ``witcert.core.bounds.*`` (fp32 and fp64),
``witcert.core.values.value_error_term`` / ``output_bound`` / ``value_norms``.
Oracles: ``witcert.spec.golden`` (mpmath, 50 digits) of the same statement on the exact values the
torch code received, and the exact sup-box TV (exhaustive, 50 digits) -- never an fp64 value,
which itself rounds in the subnormal range.
Domain: subnormal radii ``c = k 2^-1074`` (fp64) and ``k 2^-149`` (fp32), tiny radii, masses that
underflow in the working dtype while ``e^{y + c}`` stays representable, huge value residuals on
underflowed masses. Tolerance: none (``bound >= exact``, per query).
"""
import math

import pytest
import torch
from mpmath import mp, mpf

import witcert
from witcert.core import rounding, values
from witcert.verification.attacks import underflow
from witcert.spec import golden
from witcert.core.checks import check_scores_and_bounds
from tests.oracles import to_mpf, torch_bounds_and_goldens

SUB64, SUB32 = 2.0**-1074, 2.0**-149
PUBLIC = {**torch_bounds_and_goldens(), "risk_score": (witcert.risk_score, golden.eform_from_scores)}


def _check_row(scores: torch.Tensor, c: torch.Tensor) -> None:
    """Every public bound on one row is >= its golden and >= the exact sup-box TV."""
    s, r = scores.double().tolist(), c.double().tolist()
    sup = golden.sup_box_tv_exhaustive(s, r)
    for name, (implementation, oracle) in PUBLIC.items():
        value = to_mpf(implementation(scores.unsqueeze(0), c.unsqueeze(0)).item())
        assert value >= oracle(s, r), f"{name} below its exact value"
        assert value >= sup, f"{name} below the exact sup-box TV"


@pytest.mark.parametrize("k", [1, 3, 5, 9, 1001, 2**20 + 1])
def test_subnormal_radius_fp64_two_equal_logits(k):
    """Issue 16 item 4: c = k 2^-1074 on two equal logits gave a meter of k // 2 steps (TV: k/2)."""
    _check_row(torch.zeros(2, dtype=torch.float64), torch.full((2,), k * SUB64, dtype=torch.float64))


@pytest.mark.parametrize("k", [1, 3, 5, 1001])
def test_subnormal_radius_fp32_two_equal_logits(k):
    _check_row(torch.zeros(2), torch.full((2,), k * SUB32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_subnormal_radii_mixed_rows(dtype):
    step = SUB32 if dtype == torch.float32 else SUB64
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        s = int(torch.randint(1, 7, (1,), generator=g))
        scores = torch.randn(s, generator=g, dtype=torch.float64).to(dtype)
        c = (torch.randint(0, 40, (s,), generator=g).double() * step).to(dtype)
        _check_row(scores, c)


def test_underflowed_mass_under_a_large_radius_fp32():
    """Issue 16 item 5: e^{-110} underflows in fp32 while e^{-110 + 30} does not (exact TV 1.80e-35)."""
    _check_row(torch.tensor([0.0, -110.0]), torch.tensor([0.0, 30.0]))


def test_underflowed_mass_under_a_large_radius_fp64():
    """The fp64 analogue: e^{-800} underflows, e^{-800 + 760} does not."""
    _check_row(torch.tensor([0.0, -800.0], dtype=torch.float64), torch.tensor([0.0, 760.0], dtype=torch.float64))


def test_exponent_rounded_below_underflow_hides_no_term():
    """fp32 gap 2^30 + 2^28 + 192 rounds by 64: the computed y + c is -128 (e^{-128} = 0 in fp32), the
    exact one -64. The term's slack must follow the exponent's error (meter was 9.4e-38, TV 1.6e-28)."""
    _check_row(torch.tensor([2.0**30, -(2.0**28 + 192)]), torch.tensor([0.0, 1342177408.0]))


def test_maxnorm_of_zero_radius_is_exactly_zero():
    """Directed rounding keeps exact zeros: exact keys give a meter of 0, not one subnormal step."""
    for dtype in (torch.float32, torch.float64):
        assert witcert.meter(torch.randn(3, 5).to(dtype), torch.zeros(5, dtype=dtype)).eq(0).all()


def test_value_error_term_keeps_underflowed_mass_times_a_huge_residual():
    """p~ = e^{-800}/(1 + e^{-800}) underflows in fp64; times rho = 1e300 it is ~3.6e-48, not 0."""
    scores = torch.tensor([[0.0, -800.0]], dtype=torch.float64)
    rho = torch.tensor([[0.0, 1e300]], dtype=torch.float64)
    with mp.workdps(60):
        exact = mp.exp(-800) / (1 + mp.exp(-800)) * mpf(1e300)
    assert to_mpf(values.value_error_term(scores, rho).item()) >= exact


def test_value_error_term_subnormal_residuals():
    scores = torch.zeros(1, 2, dtype=torch.float64)
    for k in (1, 3, 7):
        rho = torch.full((1, 2), k * SUB64, dtype=torch.float64)
        assert to_mpf(values.value_error_term(scores, rho).item()) >= mpf(k) * mpf(SUB64)


def test_output_bound_subnormal_inputs():
    """2 TV max||v|| + value term, each a subnormal: the directed sum never rounds below."""
    tv, vt, vmax = torch.tensor(0.75), torch.tensor(3 * SUB64, dtype=torch.float64), torch.tensor(SUB64, dtype=torch.float64)
    exact = 2 * mpf(0.75) * mpf(SUB64) + 3 * mpf(SUB64)
    assert to_mpf(values.output_bound(tv, vt, vmax).item()) >= exact


def test_value_norms_of_subnormal_vectors():
    """||(s, s)|| = sqrt(2) s with s = 2^-1074 once came out as s."""
    v = torch.full((1, 1, 2), SUB64, dtype=torch.float64)
    exact = mp.sqrt(2) * mpf(SUB64)
    assert to_mpf(values.value_norms(v).item()) >= exact
    assert to_mpf(values.value_residual_norms(torch.zeros_like(v), v).item()) >= exact


def test_value_error_term_rejects_a_fully_masked_row():
    """A fully masked row: a clear error, as the meter gives (it was NaN)."""
    scores = torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]])
    with pytest.raises(ValueError, match="every token masked"):
        values.value_error_term(scores, torch.ones(2, 2))
    with pytest.raises(ValueError, match="every token masked"):
        witcert.meter(scores, torch.ones(2, 2))


@pytest.mark.parametrize("c", [0.1, torch.tensor(0.1), torch.tensor(0.1, dtype=torch.float64)])
def test_scalar_and_zero_dim_radius_broadcast(c):
    scores = torch.randn(2, 3, 4, dtype=torch.float64)
    full = torch.full((4,), c.item() if isinstance(c, torch.Tensor) else c, dtype=torch.float64)
    assert torch.equal(witcert.meter(scores, c), witcert.meter(scores, full))
    assert torch.equal(values.value_error_term(scores, c), values.value_error_term(scores, full))


def test_python_radius_is_rounded_up_not_to_nearest():
    """0.7 rounds *down* to fp32; a Python radius keeps the scores' dtype but never shrinks."""
    _, c = check_scores_and_bounds(torch.zeros(1, 2), [[0.7, 0.7]])
    assert c.dtype == torch.float32 and (c.double() >= 0.7).all()
    _, c = check_scores_and_bounds(torch.zeros(1, 2), 0.7)
    assert (c.double() >= 0.7).all()


@pytest.mark.parametrize("k", [0, 1, 2, 3, 1000])
def test_directed_operations_bound_the_exact_result(k):
    """rounding.add_up/mul_up/div_up/ulps_up/tanh_up and their downs, at subnormal and normal inputs."""
    x = torch.tensor([k * SUB64, 1.0 + k * 2.0**-52, 3.0 ** min(k, 600)], dtype=torch.float64)
    with mp.workdps(1200):
        exact = [mpf(v) for v in x.tolist()]
        third = mpf(1) / 3
        for i, e in enumerate(exact):
            assert mpf(rounding.add_up(x, third)[i].item()) >= e + third
            assert mpf(rounding.add_down(x, third)[i].item()) <= e + third
            assert mpf(rounding.mul_up(x, 0.5)[i].item()) >= e / 2
            assert mpf(rounding.mul_down(x, 0.5)[i].item()) <= e / 2
            assert mpf(rounding.div_up(x, 3.0)[i].item()) >= e / 3
            assert mpf(rounding.div_down(x, 3.0)[i].item()) <= e / 3
            assert mpf(rounding.tanh_up(x)[i].item()) >= mp.tanh(e)
            assert mpf(rounding.up(x)[i].item()) >= e


def test_fp64_tanh_and_expm1_accuracy_assumption():
    """``rounding.EXP_ULPS`` for the fp64 libm functions the enclosures use, against mpmath."""
    x = torch.cat([torch.logspace(-300, 2.5, 400, dtype=torch.float64), torch.tensor([SUB64, 7 * SUB64, 1e-310])])
    for fn, exact in ((torch.tanh, mp.tanh), (torch.expm1, mp.expm1), (torch.exp, mp.exp)):
        got = fn(x)
        for xi, gi in zip(x.tolist(), got.tolist()):
            with mp.workdps(40):
                assert mpf(rounding.ulps_up(torch.tensor(gi, dtype=torch.float64)).item()) >= exact(mpf(xi))


def test_underflow_attack_class_finds_nothing():
    tally = underflow.run(40, torch.Generator().manual_seed(0))
    assert tally.cells > 0 and tally.violations == 0, tally.notes

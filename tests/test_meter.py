"""The torch meter against the 50-digit golden (T1, P1, P1r, MN, RC, FP).

Implementation: ``witcert.meter``, ``witcert.risk_score`` and ``witcert.core.bounds.*`` (fp64, fp32).
Oracle: ``witcert.spec.golden`` (mpmath, 50 digits) on the exact values the torch code received.
Domain: ``tests/oracles.py`` cells (S <= 8, ties, masks, c in {0, 1e-30, ..., 700}) plus large-S
adversarial rows. Tolerance: fp64 within 1e-12 relative of the golden and never below it; fp32
never below it (its a-priori inflation is what makes that true).
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import witcert
from witcert.core import rounding
from witcert.spec import golden
from tests.oracles import cells, to_mpf, torch_bounds_and_goldens, with_edge_cells

BOUNDS = torch_bounds_and_goldens()  # torch implementation -> golden of the same statement
FP64_REL_TOL = 1e-12
FP64_MAX = torch.finfo(torch.float64).max
OVERFLOW_EDGE = {"chi_square": math.sqrt(FP64_MAX) / 1e6}  # CS is formed from its second moment, inf above ~1e154


def _row(values, dtype):
    return torch.tensor(values, dtype=torch.float64).to(dtype).unsqueeze(0)


def _golden_on(scores: torch.Tensor, c: torch.Tensor, fn):
    """Golden of ``fn`` at the exact values held by the (possibly fp32) tensors."""
    return fn(scores.double().squeeze(0).tolist(), c.double().squeeze(0).tolist())


@pytest.mark.parametrize("name", BOUNDS)
@with_edge_cells
@given(cell=cells())
def test_fp64_matches_golden(name, cell):
    implementation, oracle = BOUNDS[name]
    scores, c = _row(cell.scores, torch.float64), _row(cell.c, torch.float64)
    value = implementation(scores, c).item()
    exact = _golden_on(scores, c, oracle)
    if exact > OVERFLOW_EDGE.get(name, FP64_MAX / 1e12):  # an intermediate may overflow to inf: only soundness
        assert to_mpf(value) >= exact
        return
    assert to_mpf(value) >= exact, "fp64 bound below the exact value"
    assert to_mpf(value) <= exact * (1 + to_mpf(FP64_REL_TOL)) + to_mpf(1e-300)


@pytest.mark.parametrize("name", BOUNDS)
@with_edge_cells
@given(cell=cells())
def test_fp32_never_below_golden(name, cell):
    implementation, oracle = BOUNDS[name]
    scores, c = _row(cell.scores, torch.float32), _row(cell.c, torch.float32)
    value = implementation(scores, c)
    assert value.dtype == torch.float32
    assert to_mpf(value.item()) >= _golden_on(scores, c, oracle)


@pytest.mark.parametrize("seed", range(4))
def test_fp32_large_rows_never_below_golden(seed):
    """S = 4096, spread logits and tiny-to-moderate c: where the sum's rounding matters most."""
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(1, 4096, generator=g) * 4).float()
    c = (torch.rand(1, 4096, generator=g) * 10.0 ** (-6 + 2 * seed)).float()
    for implementation, oracle in (BOUNDS["meter"], BOUNDS["eform"], BOUNDS["two_sided"]):
        assert to_mpf(implementation(scores, c).item()) >= _golden_on(scores, c, oracle)


def test_counterexample_meter_bounds_true_tv():
    """docs/design.md "The meter and the risk score": p~ = (1/2, 1/2), c = 0.1, eps = (0.1, -0.1): TV 0.049834 <= meter."""
    scores, c = torch.zeros(1, 2, dtype=torch.float64), torch.full((1, 2), 0.1, dtype=torch.float64)
    tv = golden.tv_from_scores([0.0, 0.0], [0.1, -0.1])
    assert abs(float(tv) - 0.049834) < 1e-6
    assert to_mpf(witcert.meter(scores, c).item()) >= tv
    assert golden.unsound_dispersion_from_scores([0.0, 0.0], [0.1, 0.1]) < tv


def test_masked_tokens_are_ignored_even_with_infinite_c():
    scores = torch.tensor([[0.0, -math.inf, 1.0]])
    c = torch.tensor([[0.1, math.inf, 0.2]])
    expected = witcert.meter(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.1, 0.2]]))
    assert witcert.meter(scores, c).item() == expected.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("huge", [80.0, 100.0, 800.0, 1e30, math.inf])
def test_overflow_gives_trivial_bound_and_inf_risk_never_nan(dtype, huge):
    scores = torch.tensor([[0.0, 0.0, -2.0]], dtype=dtype)
    c = torch.tensor([[huge, 0.1, 0.0]], dtype=dtype)
    assert witcert.meter(scores, c).item() == 1.0
    risk = witcert.risk_score(scores, c).item()
    assert not math.isnan(risk) and risk > 1
    if huge > 400:
        assert risk == math.inf
    for implementation, _ in BOUNDS.values():
        assert not torch.isnan(implementation(scores, c)).any()


def test_batched_leading_dims_and_broadcast_c():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64)
    c = torch.rand(7, generator=g, dtype=torch.float64)
    batched = witcert.meter(scores, c)
    assert batched.shape == (2, 3, 5)
    one = witcert.meter(scores[1, 2, 3], c)
    assert batched[1, 2, 3].item() == one.item()


def test_half_precision_inputs_are_widened_exactly():
    scores = torch.tensor([[0.5, -1.25, 2.0]], dtype=torch.float16)
    c = torch.tensor([[0.01, 0.02, 0.03]], dtype=torch.float16)
    assert witcert.meter(scores, c).dtype == torch.float32
    assert witcert.meter(scores, c).item() == witcert.meter(scores.float(), c.float()).item()


@pytest.mark.parametrize(
    "scores, c, message",
    [
        ([[0.0, math.nan]], [[0.1, 0.1]], "scores contains NaN"),
        ([[0.0, 1.0]], [[math.nan, 0.1]], "c contains NaN"),
        ([[0.0, 1.0]], [[-0.1, 0.1]], "c must be >= 0"),
        ([[0.0, math.inf]], [[0.1, 0.1]], r"scores contains \+inf"),
        ([[-math.inf, -math.inf]], [[0.1, 0.1]], "every token masked"),
        ([[0.0, 1.0, 2.0]], [[0.1, 0.1]], "does not broadcast"),
        ([[0.0, 1.0]], [[[0.1, 0.1]], [[0.1, 0.1]]], "would enlarge scores"),
    ],
)
def test_bad_input_raises_naming_the_argument(scores, c, message):
    for implementation, _ in BOUNDS.values():
        with pytest.raises(ValueError, match=message):
            implementation(torch.tensor(scores), torch.tensor(c))


def test_integer_dtypes_are_rejected():
    with pytest.raises(ValueError, match="scores must be a floating tensor"):
        witcert.meter(torch.tensor([[1, 2]]), torch.tensor([[0.1, 0.1]]))
    with pytest.raises(ValueError, match="c must be a floating tensor"):
        witcert.meter(torch.tensor([[1.0, 2.0]]), torch.tensor([[0, 1]]))


@pytest.mark.parametrize("fn", [torch.exp, torch.expm1, torch.tanh])
def test_exp_accuracy_assumption(fn):
    """``rounding.EXP_ULPS``: fp32 exp/expm1/tanh within that many ulps of the fp64 value."""
    x = torch.cat([torch.linspace(-103, 88, 400_001), torch.logspace(-30, 1, 20_001), -torch.logspace(-30, 1, 20_001)])
    x = x.float()
    got, want = fn(x).double(), fn(x.double())
    finite = torch.isfinite(got) & (want.abs() > torch.finfo(torch.float32).tiny)
    ulp = torch.finfo(torch.float32).eps * torch.exp2(torch.floor(torch.log2(want[finite].abs())))
    assert ((got[finite] - want[finite]).abs() / ulp).max().item() <= rounding.EXP_ULPS


@settings(max_examples=50)
@given(n=st.integers(1, 1 << 20))
def test_summation_gamma_is_monotone_and_small(n):
    gamma = rounding.summation_gamma(n, torch.float32)
    assert 0 <= gamma <= rounding.summation_gamma(n + 1, torch.float32) < 0.07


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1e4, 1e10, 1e30])
@pytest.mark.parametrize("s", [7, 1024])
def test_huge_logit_offsets_never_below_golden(dtype, scale, s):
    """Logits far from 0 (where ``x - max x`` rounds): the meter still bounds the exact value."""
    g = torch.Generator().manual_seed(s)
    for _ in range(4):
        base = torch.randn(1, generator=g, dtype=torch.float64) * scale
        spread = torch.randn(1, s, generator=g, dtype=torch.float64) * 5
        scores = (base + spread).to(dtype)
        c = (torch.rand(1, s, generator=g, dtype=torch.float64) * 0.3).to(dtype)
        value = witcert.meter(scores, c).item()
        assert to_mpf(value) >= _golden_on(scores, c, golden.meter_from_scores)

"""Logits a runtime computed itself: ``witcert.score_rounding_bound`` added to ``c``.

Implementation: :func:`witcert.score_rounding_bound` (``witcert/tier_a/observation.py``).
Oracles: ``|runtime score - sm q . k^|`` with the exact sum formed by ``math.fsum`` over exact
fp64 products of the given floats (correctly rounded), and the fp64 true TV per cell. Runtimes
emulated: PyTorch's SDPA math path (``q`` and ``k`` pre-scaled by ``sqrt(sm)`` in the input dtype,
GEMM, scores in the input dtype) and an fp32 GEMM whose scores are stored in bf16/fp16. Domain:
normal, tiny and subnormal inputs, d = 64. Tolerance: none.
"""
import math

import pytest
import torch

import witcert

D = 64
SCALE = D**-0.5


def fp16_round(x):
    """A near-lossless scheme: keys rounded to fp16 and back."""
    return x.half().to(x.dtype)


def _exact_scores(q, k_hat, sm):
    """``sm q . k^`` per (query, token), each a correctly rounded fp64 sum of exact products."""
    q64, k64 = q.double()[0], k_hat.double()[0]
    out = torch.empty(q64.shape[0], k64.shape[0], dtype=torch.float64)
    for i in range(q64.shape[0]):
        products = (q64[i] * k64).tolist()  # exact: <= 2 x 24 significant bits
        out[i] = torch.tensor([math.fsum(row) for row in products], dtype=torch.float64)
    return out * sm


def _runtime(q, k_hat, sm, kind, score_dtype):
    if kind == "sdpa-math":  # q, k scaled by sqrt(sm) in their dtype, then the GEMM
        root = math.sqrt(sm)
        return (q * root) @ (k_hat * root).transpose(-1, -2)
    return ((q.float() @ k_hat.float().transpose(-1, -2)) * sm).to(score_dtype)  # fp32 GEMM, stored scores


def test_runtime_bf16_scores_need_the_helper():
    """The documented low-level recipe, ``meter(runtime scores, logit_bound(q, w))``, with bf16 scores
    and a near-lossless scheme: the meter is below TV(exact attention, runtime attention) on some
    cells (the issue: 0.0119 < 0.0147); ``c + score_rounding_bound`` is sound on every cell."""
    layout = witcert.BandLayout(D, 16)
    below = 0
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        k = torch.randn(1, 48, D, generator=g) * 2
        q = torch.randn(1, 8, D, generator=g) * 2
        k_hat = fp16_round(k)
        runtime = _runtime(q, k_hat, SCALE, "gemm", torch.bfloat16).double()
        exact = (q.double() @ k.double().transpose(-1, -2)) * SCALE
        tv = 0.5 * (torch.softmax(exact, -1) - torch.softmax(runtime, -1)).abs().sum(-1)
        c = witcert.logit_bound(q, witcert.witness_of(k, k_hat, layout), layout, SCALE).double()
        below += int((tv > witcert.meter(runtime, c)).sum())
        fixed = c + witcert.score_rounding_bound(q, k_hat, SCALE, score_dtype=torch.bfloat16)
        assert (tv <= witcert.meter(runtime, fixed)).all()
    assert below > 0  # the recipe without the helper is unsound here


@pytest.mark.parametrize("kind", ["sdpa-math", "gemm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("magnitude", [1.0, 2.0**-12, 2.0**-70])
def test_bound_covers_the_runtime_rounding(kind, dtype, magnitude):
    """Every (query, token): ``|runtime score - sm q . k^| <= score_rounding_bound`` (tiny inputs
    reach the subnormal range of fp16 and of the fp32 accumulator)."""
    if dtype == torch.float16 and magnitude < 2.0**-30:
        magnitude = 2.0**-20  # fp16 cannot hold 2^-70: its subnormals start at 2^-24
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(1, 6, D, generator=g) * 3 * magnitude).to(dtype)
    k_hat = (torch.randn(1, 20, D, generator=g) * 3 * magnitude).to(dtype)
    score_dtype = dtype if kind == "sdpa-math" else torch.bfloat16
    runtime = _runtime(q, k_hat, SCALE, kind, score_dtype)[0].double()
    error = (runtime - _exact_scores(q, k_hat, SCALE)).abs()
    bound = witcert.score_rounding_bound(q, k_hat, SCALE, score_dtype=score_dtype)[0]
    assert bound.dtype == torch.float64 and bound.shape == (6, 20)
    assert (error <= bound).all(), f"max error/bound {float((error / bound).max()):.3g}"


def test_bound_checks_its_arguments():
    q, k = torch.zeros(1, 2, D), torch.zeros(1, 3, D)
    with pytest.raises(ValueError, match="score_dtype"):
        witcert.score_rounding_bound(q, k, SCALE, score_dtype=torch.int8)
    with pytest.raises(ValueError, match="accumulate_dtype"):
        witcert.score_rounding_bound(q, k, SCALE, score_dtype=torch.bfloat16, accumulate_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="explicit query-head and query axes"):
        witcert.score_rounding_bound(q[0], k[0], SCALE, score_dtype=torch.float32)
    with pytest.raises(ValueError, match="sm_scale"):
        witcert.score_rounding_bound(q, k, -1.0, score_dtype=torch.float32)
    assert (witcert.score_rounding_bound(q, k, SCALE, score_dtype=torch.float32) >= 0).all()


@pytest.mark.parametrize("magnitude", [1.0, 2.0**-60, 2.0**40])
@pytest.mark.parametrize("scale", [SCALE, 96**-0.5])
def test_linear_form_covers_an_fp32_gemm_scaled_in_fp32(magnitude, scale):
    """``score_rounding_linear``: every (query, token) of an fp32 GEMM scaled by ``fl32(scale)`` in fp32 is within
    ``rate ||k^_t|| + floor`` of ``scale q . k^`` (exact rationals: the products and their sum, times the exact
    scale), with ``rate``/``floor`` from upper bounds on the norms (the vLLM plugin's pass)."""
    from fractions import Fraction

    from witcert.tier_a.score_rounding import score_rounding_coefficients, score_rounding_linear

    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 5, D, generator=g) * magnitude
    k_hat = torch.randn(1, 40, D, generator=g) * magnitude
    k_hat[0, 3] *= 1e3  # one key far larger than the rest: the rate, not the largest norm, sets each token's term
    runtime = ((q @ k_hat.transpose(-1, -2)) * torch.tensor(scale, dtype=torch.float32))[0].double()
    coefficients = score_rounding_coefficients(D, scale, torch.float32, torch.float32, torch.float32)
    q_norm = torch.linalg.vector_norm(q[0], dim=-1, dtype=torch.float64) * (1 + 2.0**-30)
    k_norm = torch.linalg.vector_norm(k_hat[0], dim=-1, dtype=torch.float64) * (1 + 2.0**-30)
    rate, floor = score_rounding_linear(q_norm, k_norm.max(), D, scale, coefficients)
    bound = rate[:, None] * k_norm[None, :] + floor[:, None]
    for i in range(5):
        for t in range(40):
            exact = Fraction(scale) * sum(Fraction(a) * Fraction(b) for a, b in zip(q[0, i].tolist(),
                                                                                     k_hat[0, t].tolist()))
            assert abs(Fraction(runtime[i, t].item()) - exact) <= Fraction(bound[i, t].item()), (i, t)
    assert (bound < 1e-4 * (q_norm[:, None] * k_norm[None, :] * scale) + 1e-30).all()  # tight: fp32 rounding only

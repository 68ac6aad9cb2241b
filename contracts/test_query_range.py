"""Contract: radii and meter over the whole fp32 range of the query (T2, TB, T1, P1, MN).

The kernel reads fp16/bf16/fp32 queries and forms every radius from them (band norms, sums of
``|q|`` and ``q^2``); it must stay an upper bound, and tight, from fp32 subnormals to near
fp32's maximum, not only at typical magnitudes.

Implementation: ``decode_attention`` (Tier A) and ``decode_attention_packed`` (Tier B) on fp32
queries, problems from ``witcert.verification.attacks.kernel_range`` (one batch row, one kv head, 16 query
heads; see its docstring for the scale-free construction).
Oracles:

* the exact per-token radius at 50 digits (``witcert.spec.bands.bound_band_witness``,
  ``witcert.spec.dither.logit_bound``), from single-token problems (``D = max_t c_t = c_t``);
* the torch reference radius (``witcert.logit_bound``, ``witcert.tier_b_logit_bound``: fp64,
  rounded up to fp32) and meter (``witcert.meter``);
* the exact logit errors ``eps_t`` (fp64 from the residual) and the exact TV
  (``kernel_range.exact_tv``, resolved down to ``1e-30`` and below).

Domain: every channel at ``10^e`` for ``e`` in ``EXPONENTS`` (-38: fp32 subnormal entries; 37:
entries up to ``3e37``), one exponent per band / per scale group (``band-mixed``) and per
channel (``channel-mixed``), zero bands and zero queries (``kernel_range.queries``); Tier A
with fp16 witnesses over O(1) keys (the radius itself spans ``1e-40 .. 1e40``) and fp32
witnesses over scale-free keys (a peaked softmax, residuals at the vertices of Theorem 2's
box, so the exact TV is close to the meter); Tier B ``min`` (token-group, token, block-channel
scales) and ``delta`` with fp16 outliers of an fp32 source; queries of ``+-3e38``.
Tolerances: the kernel radius lies in ``[exact, exact (1 + RADIUS_EXCESS)]`` or is the fp32
normal floor ``2^-126`` (or ``inf`` where ``exact`` exceeds fp32); against the reference, the
reference's own round-up (one fp32 ulp) is allowed below. The meter is never below the exact
TV; against the reference meter, twice ``contract_oracles.relative_budget`` plus the kernel's
logit-rounding term ``4 delta_max`` and the enclosure's absolute underflow term, as in
``test_kernel_vs_reference.py``.
"""
import functools
import math

import mpmath
import pytest
import torch

import witcert
from contract_oracles import relative_budget
from witcert.verification.attacks import kernel_range as kr
from witcert.kernels.certificate import RADIUS_EXCESS
from witcert.kernels.merge import STAT_DELTA_MAX, stat_column
from witcert.spec import bands as spec_bands
from witcert.spec import dither as spec_dither
from witcert.tier_b.certificate import tier_b_logit_bound

EXPONENTS = (-38, -30, -22, -12, 0, 12, 22, 30, 37)
SCALE_FREE = (-38, -30, -22, -12, 0, 12, 22, 30, 36)  # keys at 10^-e fit fp32 (1e+-36)
REGIMES = EXPONENTS + ("band-mixed", "channel-mixed")
FP32_TINY = 2.0**-126
FP32_MAX = torch.finfo(torch.float32).max
CONFIGS = ("A-fp16-witness", "A-fp32-scale-free", "B-min", "B-delta-outliers")
# the interpreter's numpy warns where a huge query overflows an fp32 product to inf (by design)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered")


def _problem(config, regime, seq, seed):
    g = torch.Generator().manual_seed(seed)
    if config == "A-fp16-witness":
        return kr.tier_a_problem(g, regime, seq, scale_free=False, witness_dtype=torch.float16)
    if config == "A-fp32-scale-free":  # a lead of ~11 in logits: A - 1 ~ 1e-4, TV/meter ~ 1 - 2e-4
        return kr.tier_a_problem(g, regime, seq, scale_free=True, witness_dtype=torch.float32, peak=(28.0, 32.0))
    if config == "B-min":
        return kr.tier_b_problem(g, regime, seq, mode="min", outlier_pairs=0)
    problem = kr.tier_b_problem(g, regime, seq, mode="delta", outlier_pairs=2, key_dtype=torch.float32)
    assert problem["plan"].outlier_slack  # fp16 outliers of an fp32 source: o_t > 0
    return problem


@functools.lru_cache(maxsize=None)
def _single_token(config, regime):
    """A one-token problem and the kernel's radius of that token per head (16,), fp64."""
    problem = _problem(config, regime, 1, seed=REGIMES.index(regime) + 10 * CONFIGS.index(config))
    return problem, kr.kernel_attention(problem).certificate.c_max[0]


def _exact_radius(problem) -> list:
    """Per head, the token's exact radius at 50 digits (spec mirrors of T2 and TB)."""
    q = problem["q"].double().tolist()
    exact = [mpmath.inf] * kr.HEADS
    if problem["witness"] is not None:
        w = problem["witness"][0].double().tolist()
        exact = [spec_bands.bound_band_witness(qh, w, kr.BANDS, problem["layout"].rope, kr.SM_SCALE) for qh in q]
    if problem["tier"] == "B":
        store = problem["store"]
        scale = store.scale_per_element()[0, 0, 0].tolist()
        chans = store.outlier_channels()[0, 0, 0].tolist()
        x16 = store.outliers[0, 0, 0].double().tolist()
        source_fp16 = store.source_dtype == torch.float16
        for h, qh in enumerate(q):
            tier_b = spec_dither.logit_bound(qh, scale, kr.SM_SCALE, 1, kr.DELTA_LOC, [qh[c] for c in chans], x16,
                                             source_fp16, problem["mode"])
            exact[h] = min(exact[h], tier_b)
    return exact


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("config", CONFIGS)
def test_radius_is_exact_rounded_up_at_every_magnitude(config, regime):
    problem, kernel = _single_token(config, regime)
    with mpmath.workdps(50):
        for h, exact in enumerate(_exact_radius(problem)):
            c = mpmath.mpf(float(kernel[h]))
            assert c >= exact, f"head {h}: kernel radius {float(c):.6g} below the exact {float(exact):.6g}"
            ceiling = max(exact * (1 + mpmath.mpf(RADIUS_EXCESS)), mpmath.mpf(FP32_TINY))
            assert c <= ceiling or (c == mpmath.inf and ceiling > FP32_MAX), f"head {h}: radius above its round-up"


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("config", CONFIGS)
def test_radius_matches_the_reference_and_covers_the_logit_error(config, regime):
    problem, kernel = _single_token(config, regime)
    q = problem["q"]
    reference = torch.full_like(kernel, math.inf)
    if problem["witness"] is not None:
        reference = witcert.logit_bound(q[None], problem["witness"][None], problem["layout"], sm_scale=kr.SM_SCALE)[0, :, 0]
    if problem["tier"] == "B":
        tier_b = tier_b_logit_bound(q.view(1, 1, kr.HEADS, kr.HEAD_DIM), problem["store"], kr.DELTA_LOC,
                                    sm_scale=kr.SM_SCALE, mode=problem["mode"])
        reference = torch.minimum(reference, tier_b.reshape(kr.HEADS).double())
    reference = reference.double()
    assert bool((kernel >= reference * (1 - 2.0**-23)).all()), "kernel radius below the reference"
    assert bool((kernel <= torch.clamp(reference * (1 + RADIUS_EXCESS), min=FP32_TINY)).all())
    assert bool((kr.exact_eps(problem)[:, 0].abs() <= kernel).all()), "a logit error exceeds the kernel radius"


@functools.lru_cache(maxsize=None)
def _scale_free_rows(exponent):
    problem = _problem("A-fp32-scale-free", exponent, 24, seed=100 + SCALE_FREE.index(exponent))
    return problem, kr.kernel_attention(problem, splits=2)


@pytest.mark.parametrize("exponent", SCALE_FREE)
def test_meter_is_never_below_the_exact_tv_at_every_magnitude(exponent):
    """Peaked attention, head 0's errors at a vertex of the box: its exact TV is within 0.1% of
    the meter at most magnitudes (where the kernel's own logit rounding does not dominate)."""
    problem, run = _scale_free_rows(exponent)
    scores = kr.SM_SCALE * problem["q"].double() @ problem["k"].double().T
    tv = kr.exact_tv(scores, kr.exact_eps(problem))
    meter = run.certificate.meter[0].double()
    assert bool((tv <= meter).all()), f"TV above the meter: worst {(tv / meter).max().item():.6f}"
    assert bool((tv > 0).any()), "the problem no longer has a logit error"


@pytest.mark.parametrize("exponent", SCALE_FREE)
def test_meter_matches_the_reference_at_every_magnitude(exponent):
    problem, run = _scale_free_rows(exponent)
    q64 = problem["q"].double()
    compressed = kr.SM_SCALE * q64 @ problem["k_hat"].T  # the keys the kernel read, fp64 logits
    radius = witcert.logit_bound(q64[None], problem["witness"][None], problem["layout"], sm_scale=kr.SM_SCALE)[0]
    reference = witcert.meter(compressed, radius)
    seq = compressed.shape[-1]
    budget = 2 * relative_budget(seq, 2, float(run.certificate.c_max.max()))
    delta = stat_column(run.stats, STAT_DELTA_MAX)[0]
    meter = run.certificate.meter[0].double()
    underflow = 64 * seq * FP32_TINY
    assert bool((meter <= reference * (1 + budget) * (1 + 4 * delta) + 4 * delta + underflow).all())
    assert bool((meter >= reference * (1 - budget)).all()), "kernel meter far below the reference"


@pytest.mark.parametrize("exponent", [-38, -30, -22, 22])
def test_tier_b_meter_is_never_below_the_exact_tv_for_extreme_queries(exponent):
    g = torch.Generator().manual_seed(200 + exponent)
    problem = kr.tier_b_problem(g, exponent, 40, mode="min", outlier_pairs=0)
    run = kr.kernel_attention(problem, splits=2)
    scores = kr.SM_SCALE * problem["q"].double() @ problem["k"].double().T
    tv = kr.exact_tv(scores, kr.exact_eps(problem))
    assert bool((tv <= run.certificate.meter[0].double()).all())
    assert bool((kr.exact_eps(problem).abs().amax(-1) <= run.certificate.c_max[0]).all())


@pytest.mark.parametrize("tier", ["A", "B"])
def test_queries_near_fp32_overflow_give_the_trivial_bound_never_nan(tier):
    """``|q| = 3e38`` over O(1) keys: the logit rounding (and the radius) overflow fp32 -> meter 1, risk inf."""
    g = torch.Generator().manual_seed(7)
    if tier == "A":
        problem = kr.tier_a_problem(g, 0, 12, scale_free=False, witness_dtype=torch.float16)
    else:
        problem = kr.tier_b_problem(g, 0, 12, mode="delta", outlier_pairs=0)
    q0 = problem["q"].double()
    problem = dict(problem, q=(torch.sign(q0) * 3e38).float())  # every channel +-3e38, none zero...
    problem["q"][problem["q"] == 0] = 3e38  # ...including the zeroed ones
    cert = kr.kernel_attention(problem).certificate
    assert not bool(torch.isnan(cert.meter).any() | torch.isnan(cert.c_max).any() | torch.isnan(cert.risk).any())
    assert bool((cert.meter == 1).all()) and bool(torch.isinf(cert.risk).all())

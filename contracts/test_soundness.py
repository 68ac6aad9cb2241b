"""Contract: the kernel's meter is a sound bound in every cell (T1, P1, MN with T2 / TB radii).

Implementation: ``witcert.kernels.decode_attention`` / ``decode_attention_packed`` (fp32
accumulation, fp64 logits, a-priori rounding slack).
Oracle: the true TV between attention over the exact keys and over the compressed keys, in
fp64 (``contract_oracles.true_tv``), and the sup-box adversary ``witcert.verification.adversary.sup_box_tv`` over the
torch reference radius (the worst logit error the radius admits).
Domain: ``contract_oracles.CASES`` -- 14 cases x 18 cells: Tier A over five schemes, both RoPE
conventions, ``S = 1`` rows, ties, peaked attention, logits ~1e4, residuals aligned with the
query so that Theorem 2 is tight (errors at the box's vertices), radii from 1e-9 to capped
(> 64); Tier B min / Delta branches, token-group and block-channel scales, fixed outliers, fp32
inputs, paged counters, with a Tier A witness.
Tolerance: none. Every cell, 0 violations (validated per query, never in aggregate).
The Tier B ``u`` branch holds on the dither event (probability >= 1 - delta_loc per cell);
``Delta`` and Tier A hold for every query.
"""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import witcert
from witcert.verification.adversary import sup_box_tv
from witcert.kernels.decode_attention import decode_attention

from contract_oracles import CASES, case, tier_a_case, compressed_scores, exact_scores, kernel_run, reference_radius, true_tv


# The adversary evaluates an achieved TV in fp64: with c = 0 it returns rounding noise such as
# 1.1e-16 instead of 0. 64 * 2^-53 covers its sums over S <= 128 terms of size <= 1; the kernel
# meter's own slack is ~1e-7, so the tolerance cannot hide a real violation.
ADVERSARY_FP64_NOISE = 64 * 2.0**-53


@pytest.mark.parametrize("name", CASES)
def test_true_tv_below_kernel_meter_in_every_cell(name):
    c = case(name)
    meter = kernel_run(name).certificate.meter.double()  # (B, Hq)
    tv = true_tv(c)
    violations = (tv > meter).sum().item()
    assert violations == 0, f"{name}: {violations} cells with TV > meter; worst {(tv - meter).max().item():.3e}"
    assert bool(((meter >= 0) & (meter <= 1)).all()), f"{name}: meter outside [0, 1]"


@pytest.mark.parametrize("name", CASES)
def test_radius_hypothesis_holds_per_token(name):
    """|eps_t| <= c_t for every live token (Theorem 2 / Tier B hypothesis, fp64 logits)."""
    c = case(name)
    compressed, exact = compressed_scores(c), exact_scores(c)
    live = compressed > float("-inf")
    eps = torch.where(live, compressed - torch.where(live, exact, 0.0), 0.0)
    assert bool((eps.abs() <= reference_radius(c)).all()), f"{name}: a token's logit error exceeds its radius"


@pytest.mark.parametrize("name", CASES)
def test_sup_box_adversary_below_kernel_meter(name):
    """The adversary's worst TV over the whole box |eps| <= c stays below the kernel's meter."""
    c = case(name)
    meter = kernel_run(name).certificate.meter.double()
    worst = sup_box_tv(compressed_scores(c), reference_radius(c)).tv
    violations = (worst > meter + ADVERSARY_FP64_NOISE).sum().item()
    assert violations == 0, f"{name}: sup-box TV above the meter in {violations} cells"


def test_capped_radius_reports_the_trivial_bound():
    """Radii beyond the in-kernel cap give meter 1 and risk inf, never NaN (overflow rule)."""
    cert = kernel_run("A-capped-radius").certificate
    capped = cert.c_max >= 64
    assert bool(capped.any()), "the case no longer exercises the cap"
    assert bool((cert.meter[capped] == 1).all())
    assert bool(torch.isinf(cert.risk[capped]).all())
    assert not bool(torch.isnan(cert.meter).any())


@settings(max_examples=10)  # each example runs the interpreted kernel (~1 s)
@given(seed=st.integers(0, 2**16), seq=st.integers(1, 40), q_scale=st.sampled_from([0.0, 0.3, 1.0, 4.0, 20.0]),
       noise=st.sampled_from([1e-6, 1e-3, 0.05, 0.5]), splits=st.integers(1, 4),
       rope=st.sampled_from(["rotate_half", "interleaved"]))
@example(seed=0, seq=1, q_scale=1.0, noise=0.05, splits=4, rope="rotate_half")  # S = 1, empty splits
@example(seed=1, seq=40, q_scale=20.0, noise=0.5, splits=1, rope="interleaved")  # peaked, large radii
def test_random_problems_true_tv_below_kernel_meter(seed, seq, q_scale, noise, splits, rope):
    c = tier_a_case("random", None, seed=seed, seq=seq, q_scale=q_scale, noise=noise, rope=rope)
    meter = decode_attention(c.q, c.k_hat, c.v, c.witness, c.layout, num_splits=splits).certificate.meter.double()
    assert int((true_tv(c) > meter).sum()) == 0

"""Contract: the kernel agrees with the torch reference on output, lse, A, D and the meter.

Implementation: ``witcert.kernels.decode_attention`` / ``decode_attention_packed``.
Oracle: fp64 attention over the same compressed keys; the torch certificate
``witcert.core.bounds.moments`` / ``witcert.meter`` on fp64 logits with the torch radius
(``witcert.logit_bound``, ``witcert.tier_b_logit_bound``).
Domain: ``contract_oracles.CASES``.
Tolerances (each justified where it is used):

* output: the kernel rounds the softmax weights to the value dtype (fp16) for the ``p V``
  product: ``|delta o| <= 2^-11 sum_t p_t |v_t| <= 2^-11 max |v|``; fp32 accumulation adds
  ~1e-6 relative. We allow ``2^-10 max |v|``.
* lse: ``l`` carries the kernel's stated per-term error ``mass_error`` plus the exponent term
  ``4.1 u ln S``; ``|delta lse| <= 2 (those)`` (the logits themselves are fp64).
* ``A - 1``: the kernel is an upper bound (never below the fp64 value with the reference
  radius, less the reference's one-ulp fp32 round-up of ``c``), and above the reference by at
  most ``kernel_relative_budget`` (its enclosure and radius round-up, stated in
  ``kernels/certificate.py``) plus the enclosure's absolute underflow term (``4 S tiny`` per
  moment, ~1e-35: it is what the kernel reports when ``c = 0``) plus ``2 delta_max``, the
  kernel's bound on its own fp64 logit rounding (``A <= e^delta (1 + k/l)``; ~1e-13 for logits
  of size 10, ~1e-9 for logits of size 1e4).
* ``D``: the same radius, rounded up by the reference (at most one fp32 ulp over its fp64
  value) and by the kernel (``RADIUS_EXCESS``, or the fp32 normal floor ``2^-126``):
  ``[1 - 2^-23, 1 + RADIUS_EXCESS]`` times the reference.
* meter: the kernel reports ``min(1, T1, P1, MN, CS)``, a function of ``A - 1``, ``1 - A-``,
  ``D`` and ``sum p~ expm1(c)^2`` whose relative sensitivity is at most 2 (CS: half that of the
  second moment, whose radius sensitivity is twice that of ``A - 1``, plus that of ``A-``), so
  twice the ``A`` budget above the reference's same minimum (both sides are sound upper bounds:
  neither is "the truth"; a square root turns the absolute underflow term into its root), and
  never far below the reference's full meter (which adds MS, so is at most that minimum).
* CS takes effect: where the reference's CS is below its base meter ``min(1, T1, P1, MN)``, so
  is the kernel's meter (up to the same budget).
"""
import pytest
import torch

from contract_oracles import (CASES, case, compressed_scores, delta_max, exact_a_minus_one, kernel_relative_budget,
                              kernel_run, reference_attention, reference_base_meter, reference_meter, reference_moments,
                              reference_unsplit_meter,
                              reference_radius)
from witcert.kernels.certificate import ARG_ERROR, RADIUS_EXCESS, KernelRounding

FP32_ULP = 2.0**-23


@pytest.mark.parametrize("name", CASES)
def test_output_matches_fp64_attention(name):
    c = case(name)
    out = kernel_run(name).out.double()
    tolerance = 2.0**-10 * c.v.double().abs().max().item()
    assert (out - reference_attention(c)).abs().max().item() <= tolerance


@pytest.mark.parametrize("name", CASES)
def test_lse_matches_fp64(name):
    c = case(name)
    shape = KernelRounding(max_seq_len=c.k.shape[2], block_n=32, num_splits=3, head_dim=64, bands=16)
    tolerance = 2 * (shape.mass_error() + ARG_ERROR * torch.log(torch.tensor(float(c.k.shape[2]))).item())
    reference = torch.logsumexp(compressed_scores(c), -1)
    assert (kernel_run(name).lse - reference).abs().max().item() <= tolerance


@pytest.mark.parametrize("name", CASES)
def test_a_minus_one_is_an_upper_bound_close_to_the_reference(name):
    c = case(name)
    cert = kernel_run(name).certificate
    live = cert.c_max < 64  # capped rows report the trivial bound instead (test_soundness)
    scores, radius = compressed_scores(c), reference_radius(c)
    floor = exact_a_minus_one(scores, radius * (1 - FP32_ULP))
    assert bool((cert.a_minus_one[live] >= floor[live]).all()), "kernel A - 1 below the fp64 value"
    reference = reference_moments(c).k_hi
    underflow = 16 * c.k.shape[2] * torch.finfo(torch.float32).tiny  # the enclosure's absolute term
    delta = delta_max(name)  # A <= e^delta (1 + k/l): the kernel's own logit rounding
    ceiling = reference * (1 + kernel_relative_budget(name)) * (1 + 2 * delta) + 2 * delta + underflow
    assert bool((cert.a_minus_one[live] <= ceiling[live]).all()), "kernel A - 1 above its stated budget"


@pytest.mark.parametrize("name", CASES)
def test_max_radius_matches_reference(name):
    c = case(name)
    cert = kernel_run(name).certificate
    reference = reference_radius(c).amax(-1)
    assert bool((cert.c_max >= reference * (1 - FP32_ULP)).all())
    assert bool((cert.c_max <= torch.clamp(reference * (1 + RADIUS_EXCESS), min=2.0**-126)).all())


@pytest.mark.parametrize("name", CASES)
def test_meter_matches_reference(name):
    c = case(name)
    kernel = kernel_run(name).certificate.meter.double()
    reference, unsplit = reference_meter(c), reference_unsplit_meter(c)
    budget = 2 * kernel_relative_budget(name)
    underflow = (64 * c.k.shape[2] * torch.finfo(torch.float32).tiny) ** 0.5  # CS: the root of the moment's term
    delta = delta_max(name)
    ceiling = unsplit * (1 + budget) * (1 + 4 * delta) + 4 * delta + underflow
    assert bool((kernel <= ceiling).all()), "kernel meter above its stated budget"
    assert bool((kernel >= reference * (1 - budget)).all()), "kernel meter far below the reference"


@pytest.mark.parametrize("name", ["B-min-standalone", "B-delta-paged-outliers-fp32", "A-tiny-c"])
def test_kernel_meter_takes_the_chi_square_bound(name):
    """On spread radii (Tier B, tiny c) CS is below the base meter: the kernel's meter follows it."""
    kernel = kernel_run(name).certificate.meter.double()
    base, unsplit = reference_base_meter(case(name)), reference_unsplit_meter(case(name))
    assert bool((unsplit < 0.95 * base).all()), "case no longer exercises CS"
    assert bool((kernel <= unsplit * (1 + 2 * kernel_relative_budget(name))).all())


@pytest.mark.parametrize("name", ["A-rtn-int4", "B-min-standalone"])
def test_certificate_does_not_change_the_attention(name):
    """certify=False runs the same attention code path: identical output and lse."""
    on, off = kernel_run(name), kernel_run(name, certify=False)
    assert torch.equal(on.out, off.out) and torch.equal(on.lse, off.lse)
    assert off.certificate is None

"""Contract: the elementary fp32 operations the kernel's rounding budget assumes (FP).

``kernels/certificate.py`` assumes one ``tl.exp`` is within ``EXP_ULPS`` ulps and bounds the
in-kernel ``e^x - 1`` / ``1 - e^{-x}`` (``kernels/expm1.py``) by ``expm1_relative_error``.
Implementation: those ``@triton.jit`` helpers, as the platform runs them (the interpreter here;
the same test compiles for CUDA on a GPU, where it checks ``ex2.approx``).
Oracle: fp64 ``exp`` / ``expm1`` of the same fp32 inputs (fp64 error ~1e-16, negligible).
Domain: a sweep of 20001 arguments over [-87, 64] (``exp``) and [1e-30, 64] log-spaced plus a
dense band around the branch point 1/2 (``expm1`` helpers).
Tolerance: the assumed bounds themselves.
"""
import torch
import triton
import triton.language as tl

from witcert.kernels.expm1 import expm1_nonneg, expm1_relative_error, one_minus_exp_neg
from witcert.core.rounding import exp_relative_error

UNIT = 2.0**-24
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _elementary_kernel(x_ptr, exp_ptr, em1_ptr, om_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(exp_ptr + offs, tl.exp(x), mask=mask)
    x_pos = tl.abs(x)
    tl.store(em1_ptr + offs, expm1_nonneg(x_pos), mask=mask)
    tl.store(om_ptr + offs, one_minus_exp_neg(x_pos), mask=mask)


def _run(x: torch.Tensor):
    x = x.to(DEVICE, torch.float32).contiguous()
    outs = [torch.empty_like(x) for _ in range(3)]
    _elementary_kernel[(triton.cdiv(x.numel(), 1024),)](x, *outs, x.numel(), BLOCK=1024)
    return x.double().cpu(), [o.double().cpu() for o in outs]


def test_exp_within_the_assumed_ulps():
    x, (exp, _, _) = _run(torch.linspace(-87.0, 64.0, 20001))
    relative = ((exp - torch.exp(x)) / torch.exp(x)).abs().max().item()
    assert relative <= exp_relative_error(torch.float32)


def test_expm1_helpers_within_their_bound():
    x = torch.cat([torch.logspace(-30, 1.806, 8000), torch.linspace(0.49, 0.51, 2001)])
    x, (_, em1, om) = _run(x)
    bound = expm1_relative_error(UNIT, exp_relative_error(torch.float32))
    assert ((em1 - torch.expm1(x)) / torch.expm1(x)).abs().max().item() <= bound
    assert ((om + torch.expm1(-x)) / -torch.expm1(-x)).abs().max().item() <= bound

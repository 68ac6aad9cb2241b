"""Sound enclosures of sums computed in floating point (registry key ``FP``).

The meter's moments are sums of non-negative per-token terms that the code computes in the
working dtype (fp32, as a kernel would, or fp64). To report a bound that is never below the
exact-arithmetic value, every sum is enclosed a priori:

* per-token relative error ``rho_t`` of a computed term ``tau^_t`` (exp/expm1 rounding, the
  rounding of ``y_t = x_t - max x`` and of ``y_t + c_t``, which enter the exponent), so that
  the exact term lies in ``tau^_t [1 - rho_t, 1 + rho_t]`` for normal-range results;
* the accumulation of ``S`` non-negative terms in *any* order: relative error at most
  ``gamma_{S-1} = (S-1)u / (1 - (S-1)u)`` (Higham, *Accuracy and Stability*, Thm. 4.4 applies to
  every summation tree);
* underflow: a term that lands in the subnormal range is off by at most ``2 tiny`` absolutely
  (``tiny`` = smallest normal), ``4 S tiny`` in all covers both exp branches.

Assumption, checked by ``tests/test_meter.py::test_exp_accuracy_assumption``: ``exp``,
``expm1`` and ``tanh`` of the working dtype are accurate to ``EXP_ULPS`` ulps (torch CPU uses
SLEEF/glibc at <= 1 ulp; CUDA's ``expf`` <= 2 ulps).

The enclosure itself is evaluated in fp64 from the exact fp64 images of the computed terms,
with explicit directed slack factors (``FP64_SLACK``) so that its own rounding cannot undercut it.
"""
import torch

EXP_ULPS = 4  # assumed worst-case ulps of exp / expm1 / tanh in the working dtype
FP64_SLACK = 2.0**-48  # covers a handful of fp64 roundings in the enclosure arithmetic


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = 2^-p`` for a ``p``-bit significand: 2^-24 (fp32), 2^-53 (fp64)."""
    return torch.finfo(dtype).eps / 2


def exp_relative_error(dtype: torch.dtype) -> float:
    """Relative error bound of one exp/expm1 evaluation: ``EXP_ULPS`` ulps, an ulp being <= 2u."""
    return EXP_ULPS * 2 * unit_roundoff(dtype)


def summation_gamma(n_terms: int, dtype: torch.dtype) -> float:
    """``gamma_{n-1}``: relative error bound for summing ``n`` non-negative terms in any order."""
    nu = max(n_terms - 1, 0) * unit_roundoff(dtype)
    if nu >= 0.5:
        raise ValueError(f"{n_terms} tokens are too many for a sound {dtype} sum (need (S-1)u < 1/2)")
    return nu / (1 - nu)


def term_relative_error(exponent_error: torch.Tensor, n_ops: int, dtype: torch.dtype) -> torch.Tensor:
    """``rho_t`` for a term ``exp(e^_t) * r`` whose exponent is off by at most ``exponent_error``.

    ``n_ops`` counts the elementary exp/expm1 evaluations and products that round the term;
    each contributes at most ``exp_relative_error`` (products: ``u``, smaller). Uses
    ``(1+a)(1+b) <= e^{a+b}`` so that ``|exact/computed - 1| <= expm1(sum)``.
    """
    budget = exponent_error + n_ops * exp_relative_error(dtype)
    if bool((budget <= 1).all()):  # expm1(b) <= b (1 + b) on [0, 1]: a multiply-add, not an expm1 pass
        return budget * (1 + budget) * (1 + FP64_SLACK)
    return torch.expm1(budget) * (1 + FP64_SLACK)


def _weighted_error(terms: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """``sum_t rho_t tau^_t`` in fp64, with zero terms contributing nothing (even if rho is inf)."""
    weighted = (terms.double() * rho).nan_to_num_(nan=0.0)  # 0 * inf (an empty term) counts 0
    n = terms.shape[-1]
    return weighted.sum(-1) * (1 + (n + 4) * 2.0**-52)


def sum_upper(terms: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """fp64 upper bound on the exact sum of the true terms behind ``terms`` (..., S) -> (...)."""
    dtype, n = terms.dtype, terms.shape[-1]
    computed = terms.sum(-1).double()  # the accumulation the code actually does, in the working dtype
    gamma = summation_gamma(n, dtype)
    underflow = 4 * n * torch.finfo(dtype).tiny
    upper = (computed / (1 - gamma) + _weighted_error(terms, rho) + underflow) * (1 + FP64_SLACK)
    return torch.where(torch.isfinite(computed), upper, torch.full_like(upper, float("inf")))


def sum_lower(terms: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """fp64 lower bound (>= 0) on the exact sum of the true terms behind ``terms`` (..., S) -> (...)."""
    dtype, n = terms.dtype, terms.shape[-1]
    computed = terms.sum(-1).double()
    gamma = summation_gamma(n, dtype)
    underflow = 4 * n * torch.finfo(dtype).tiny
    lower = (computed / (1 + gamma) - _weighted_error(terms, rho) - underflow) * (1 - FP64_SLACK)
    return lower.clamp(min=0.0)


def round_up_to(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast an fp64 upper bound to ``dtype`` without ever rounding it down."""
    y = x64.to(dtype)
    if dtype == torch.float64:
        return y
    below = y.double() < x64
    return torch.where(below, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def up(x: torch.Tensor, n_ops: int = 4) -> torch.Tensor:
    """Inflate a non-negative fp64 result of ``n_ops`` correctly-or-nearly rounded operations."""
    return x * (1 + n_ops * FP64_SLACK)

"""Euclidean norms computed without overflow or underflow, and their fp64 upper bounds.

Both Tier A (band norms of keys, residuals and queries) and the value side of the meter
(residual norms of values) need ``||x||`` from above; the lower layer owns it.

Rounding of :func:`norms_upper_fp64`: for ``n`` terms the fp64 relative error of a scaled norm
is below ``(n + 10) u`` with ``u = 2^-53`` (subtraction, scaling, squares, any-order summation
``gamma_{n-1}``, sqrt, rescale); the inflation ``1 + (n + 16) 2^-52`` covers it with a factor
two to spare. Overflow gives ``inf``: the trivial bound.
"""
import torch

_U = 2.0**-52  # twice the fp64 unit roundoff: the margin unit of the inflation


def scaled_norms(x: torch.Tensor) -> torch.Tensor:
    """Euclidean norms over the last axis (..., n) -> (...), in ``x``'s dtype.

    Divides by the max-abs entry first (as ``hypot`` does), so squares neither overflow nor
    underflow; an all-zero vector has norm exactly 0 and an infinite entry gives ``inf``.
    """
    peak = x.abs().amax(dim=-1, keepdim=True)  # (..., 1), exact
    scaled = x / torch.where(peak > 0, peak, torch.ones_like(peak))  # entries in [-1, 1]
    norms = peak.squeeze(-1) * torch.sqrt((scaled * scaled).sum(dim=-1))
    return torch.where(torch.isinf(peak.squeeze(-1)), peak.squeeze(-1), norms)


def norms_upper_fp64(x64: torch.Tensor) -> torch.Tensor:
    """fp64 Euclidean norms over the last axis (..., n) -> (...), each >= the exact norm.

    The vector is divided by its max-abs entry first (:func:`scaled_norms`), so squares neither
    overflow nor lose everything to underflow; an exactly-zero vector has norm exactly zero.
    Inflated by ``1 + (n + 16) 2^-52`` (the module docstring's error budget).
    """
    norms = scaled_norms(x64)  # (...)
    return norms * (1.0 + (x64.shape[-1] + 16) * _U)

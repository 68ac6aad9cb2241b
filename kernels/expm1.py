"""``e^x - 1`` and ``1 - e^{-x}`` for ``x >= 0`` inside Triton, without cancellation (T1, P1).

The meter's moments are carried as ``k = A - 1 = sum p~ (e^{c} - 1)`` and
``j = 1 - A- = sum p~ (1 - e^{-c})`` (as in ``witcert.core.bounds``), so that a small ``c`` does not
cancel to nothing. Triton has no ``expm1``; here it is a degree-8 Taylor polynomial (Horner) for
``x <= 1/2`` and ``exp`` otherwise.

Relative error: :func:`expm1_relative_error`
(``witcert.core.rounding.series_expm1_relative_error``, where the analysis is written out; the
fused CPU pass ``witcert.fastpath.budgeted_pass`` evaluates the same polynomial in torch), one bound
covering both helpers and both branches.
"""
import triton
import triton.language as tl

from witcert.core.rounding import series_expm1_relative_error

POLY_LIMIT = tl.constexpr(0.5)


def expm1_relative_error(u: float, eps_exp: float) -> float:
    """Relative error bound of :func:`expm1_nonneg` and :func:`one_minus_exp_neg`."""
    return series_expm1_relative_error(u, eps_exp)


@triton.jit
def expm1_nonneg(x):
    """``e^x - 1`` for ``x >= 0`` (fp32), relative error below :func:`expm1_relative_error`."""
    poly = 1.0 + x * (1.0 / 7.0) * (1.0 + x * (1.0 / 8.0))
    poly = 1.0 + x * (1.0 / 6.0) * poly
    poly = 1.0 + x * (1.0 / 5.0) * poly
    poly = 1.0 + x * (1.0 / 4.0) * poly
    poly = 1.0 + x * (1.0 / 3.0) * poly
    poly = 1.0 + x * (1.0 / 2.0) * poly
    small = x * poly  # x (1 + x/2 (1 + x/3 (... (1 + x/8))))
    large = tl.exp(x) - 1.0
    return tl.where(x <= POLY_LIMIT, small, large)


@triton.jit
def one_minus_exp_neg(x):
    """``1 - e^{-x}`` for ``x >= 0`` (fp32), relative error below :func:`expm1_relative_error`."""
    poly = 1.0 - x * (1.0 / 7.0) * (1.0 - x * (1.0 / 8.0))
    poly = 1.0 - x * (1.0 / 6.0) * poly
    poly = 1.0 - x * (1.0 / 5.0) * poly
    poly = 1.0 - x * (1.0 / 4.0) * poly
    poly = 1.0 - x * (1.0 / 3.0) * poly
    poly = 1.0 - x * (1.0 / 2.0) * poly
    small = x * poly  # x (1 - x/2 (1 - x/3 (... (1 - x/8))))
    large = 1.0 - tl.exp(-x)
    return tl.where(x <= POLY_LIMIT, small, large)

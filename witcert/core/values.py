"""Value side of Tier A: residual norms, the output bound and the joint pass event.

Values carry no RoPE; ``rho_t = ||v^_t - v_t||``. With ``y = sum_t p_t v_t`` (exact) and
``y^ = sum_t p~_t v^_t`` (compressed),

    ``y - y^ = sum_t (p_t - p~_t) v_t + sum_t p~_t (v_t - v^_t)``,

so ``||y - y^|| <= 2 TV max_t ||v_t|| + sum_t p~_t rho_t`` (docs/design.md "Value side"; it is
deterministic given ``p~``, so the joint event spends no probabilistic budget).

The joint event is ``pass_K and pass_V`` with

- ``pass_K``: the key-side meter ``<= tau_K`` (default 0.2);
- ``pass_V``: the value term ``sum_t p~_t rho_t <= tau_V max_t ||v_t||`` (default 0.05), i.e. the
  value error relative to the largest value norm, the same unit in which ``tau_K`` buys at most
  ``2 tau_K max_t ||v_t||`` of output error (paper, "choosing tau"). Under both,
  ``||y - y^|| <= (2 tau_K + tau_V) max_t ||v_t||``.

Every returned bound is an fp64 upper bound on the exact-arithmetic value (``witcert.core.rounding``).
"""
from dataclasses import dataclass

import torch

from witcert.core import rounding
from witcert.core.rounding import round_up_to
from witcert.core.checks import check_scores_and_bounds
from witcert.core.norms import norms_upper_fp64


@dataclass(frozen=True)
class JointPass:
    """Boolean masks of the joint event (same shape as the meter)."""

    pass_k: torch.Tensor
    pass_v: torch.Tensor
    joint: torch.Tensor

    def __post_init__(self):
        if not (self.pass_k.shape == self.pass_v.shape == self.joint.shape):
            raise ValueError("pass_k, pass_v and joint must have one shape")


def value_residual_norms(v: torch.Tensor, v_hat: torch.Tensor) -> torch.Tensor:
    """``rho_t >= ||v^_t - v_t||`` for ``v``, ``v_hat`` (..., S, d) -> (..., S).

    fp64 for fp64 input, fp32 otherwise, rounded up (never below the exact norm, subnormal norms included).
    """
    check_value_pair(v, v_hat)
    return residual_norms(v, v_hat)


def residual_norms(v: torch.Tensor, v_hat: torch.Tensor) -> torch.Tensor:
    """:func:`value_residual_norms` on checked input (no host synchronisation)."""
    rho = norms_up(v_hat.to(torch.float64) - v.to(torch.float64))  # (..., S); the difference rounds relatively
    return round_up_to(rho, torch.float64 if v.dtype == torch.float64 else torch.float32)


def value_norms(v: torch.Tensor) -> torch.Tensor:
    """``>= ||v_t||`` for ``v`` (..., S, d) -> (..., S), fp64."""
    check_value_pair(v, v)
    return norms_up(v.to(torch.float64))


def norms_up(x64: torch.Tensor) -> torch.Tensor:
    """``norms_upper_fp64`` plus one ulp-step lift: its final product and inflation round to nearest,
    which below the normal range can drop up to a ``2^-1074`` step each (``||(s, s)||`` came out as ``s``)."""
    return rounding.ulps_up(norms_upper_fp64(x64), 1)


def value_error_term(scores: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """fp64 upper bound on ``sum_t p~_t rho_t`` with ``p~ = softmax(scores)`` (..., S) -> (...).

    ``scores`` are the compressed logits (``-inf`` masks a token; a fully masked row is an error,
    as for the meter); ``rho`` (broadcastable, a scalar too) the value residual norms. Softmax
    rounding is enclosed with ``witcert.core.rounding`` (``FP``); a mass that underflowed keeps its
    absolute slack through the product with ``rho``, however large ``rho`` is.
    """
    scores, rho64 = _scores_and_weights(scores, rho, "rho")
    scores, dtype = scores.double(), torch.float64  # fp64 throughout: one rounding model
    live = scores > float("-inf")
    y = scores - scores.amax(-1, keepdim=True)  # (..., S) <= 0
    u_ratio = rounding.unit_roundoff(dtype) / (1 - rounding.unit_roundoff(dtype))
    y_err = torch.where(live, y.abs() * u_ratio, torch.zeros_like(y))
    mass = rounding.Terms.of_exp(torch.exp(y), y, y_err, 1, live)  # (..., S) unnormalised p~
    rho64 = torch.where(live, rho64, torch.zeros_like(rho64))  # a masked token carries no mass
    weighted = rounding.sum_up(rounding.mul_up(mass.upper(), rho64))  # inf rho on a live token stays inf
    return rounding.div_up(weighted, rounding.sum_lower(mass))


def max_value_norm(v_norms: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``max_t ||v_t||`` over the unmasked tokens of each row: (..., S) -> (...), fp64."""
    scores, v64 = _scores_and_weights(scores, v_norms, "v_norms")
    return torch.where(scores > float("-inf"), v64, torch.zeros_like(v64)).amax(-1)


def output_bound(tv_bound: torch.Tensor, value_term: torch.Tensor, v_norm_max: torch.Tensor) -> torch.Tensor:
    """``||y - y^|| <= 2 TV max_t ||v_t|| + sum_t p~_t rho_t`` (docs/design.md "Value side").

    Parameters are upper bounds: ``tv_bound >= TV(p, p~)`` (the meter), ``value_term`` from
    :func:`value_error_term`, ``v_norm_max`` from :func:`max_value_norm`. Returns fp64, rounded up
    (directed operations: sound in the subnormal range too); a zero factor gives 0 even against inf.
    """
    tv = torch.as_tensor(tv_bound).double()
    vt = torch.as_tensor(value_term).double()
    vmax = torch.as_tensor(v_norm_max).double()
    for name, x in (("tv_bound", tv), ("value_term", vt), ("v_norm_max", vmax)):
        if torch.isnan(x).any() or (x < 0).any():
            raise ValueError(f"{name} must be >= 0 and not NaN")
    return output_bound_of(tv, vt, vmax)


def output_bound_of(tv: torch.Tensor, value_term: torch.Tensor, v_norm_max: torch.Tensor) -> torch.Tensor:
    """:func:`output_bound` on checked fp64 tensors (no host synchronisation)."""
    return rounding.add_up(rounding.mul_up(rounding.mul_up(tv, v_norm_max), 2.0), value_term)


def joint_pass(
    meter: torch.Tensor, value_term: torch.Tensor, v_norm_max: torch.Tensor, tau_k: float = 0.2, tau_v: float = 0.05
) -> JointPass:
    """The joint event ``pass_K and pass_V`` (see the module docstring for the definitions)."""
    check_thresholds(tau_k, tau_v)
    # compared in fp64, where tau is exact (an fp32 comparison would round tau, maybe up)
    pass_k = torch.as_tensor(meter).double() <= tau_k
    pass_v = torch.as_tensor(value_term).double() <= rounding.mul_down(float(tau_v), torch.as_tensor(v_norm_max).double())
    pass_k, pass_v = torch.broadcast_tensors(pass_k, pass_v)
    return JointPass(pass_k, pass_v, pass_k & pass_v)


def check_thresholds(tau_k, tau_v) -> None:
    """``tau_k``, ``tau_v``: real numbers ``>= 0`` (``ValueError`` naming the argument)."""
    for name, tau in (("tau_k", tau_k), ("tau_v", tau_v)):
        if not (isinstance(tau, (int, float)) and tau >= 0):
            raise ValueError(f"{name} must be a number >= 0, got {tau!r}")


def check_value_pair(v: torch.Tensor, v_hat: torch.Tensor, finite: bool = True) -> None:
    """``v`` and ``v_hat`` (..., S, d): floating, finite (read only when ``finite``), one shape (``ValueError``
    naming the argument)."""
    for name, x in (("v", v), ("v_hat", v_hat)):
        if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x) or x.dim() < 2:
            raise ValueError(f"{name} must be a floating tensor (..., S, d)")
        if finite and not torch.isfinite(x).all():
            raise ValueError(f"{name} contains NaN or Inf")
    if v.shape != v_hat.shape:
        raise ValueError(f"v_hat shape {tuple(v_hat.shape)} differs from v shape {tuple(v.shape)}")


def _scores_and_weights(scores, weights, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The meter's input checks (``witcert.core.checks``) with ``weights`` in the role of ``c``; weights as fp64."""
    scores, weights = check_scores_and_bounds(scores, weights, c_name=name)
    return scores, weights.double()

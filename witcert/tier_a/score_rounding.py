"""The rounding of logits a runtime computes, as a bound to add to ``c`` (registry key ``SR``).

Theorem 1 needs ``c_t >= |given logit - exact logit|``; :func:`witcert.logit_bound` covers the
compression error in exact arithmetic, and logits computed in floating point carry their own
rounding on top. :func:`score_rounding_bound` bounds it for the ways runtimes compute scores;
:func:`score_rounding_from` is its arithmetic on checked fp64 tensors (what the fused per-layer
pass, :mod:`witcert.fastpath.stored_pass`, compiles).
"""
import functools
import math

import torch

from witcert.core import rounding
from witcert.tier_a.witness import check_head_pairing

SCORE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TINY = 2.0**-1022  # the smallest normal fp64 (> 16 subnormal steps)


def score_rounding_bound(q: torch.Tensor, k_hat: torch.Tensor, sm_scale: float, *,
                         score_dtype: torch.dtype, accumulate_dtype: torch.dtype = torch.float32,
                         input_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``>= |runtime score - sm_scale q . k^_t|``, to add to ``c`` for logits a runtime computed (..., Hq, Tq, S).

    For users who bring their own logits: Theorem 1 needs ``c_t >= |given logit - exact logit|``;
    :func:`witcert.logit_bound` covers ``|sm_scale q . (k^_t - k_t)|`` in exact arithmetic only, and a
    runtime's own scores carry their rounding on top (bf16 scores: about ``2^-9`` of the score).

    Parameters
    ----------
    q : Tensor (..., Hq, Tq, d)
        The queries exactly as the runtime held them (e.g. bf16 values).
    k_hat : Tensor (..., Hkv, S, d)
        The keys the runtime read (the compressed cache's reconstruction), same leading dims.
    sm_scale : float
        The softmax scale the runtime applies (a Python float, e.g. ``module.scaling``).
    score_dtype : torch.dtype
        The dtype the runtime's scores are stored in (fp16, bf16, fp32 or fp64).
    accumulate_dtype : torch.dtype
        The dtype of its dot-product accumulation (fp32 for fp16/bf16/fp32 GEMMs; fp64).
    input_dtype : torch.dtype, optional
        The dtype ``q`` and ``k^`` are held in (default: their promoted dtype).

    Returns
    -------
    Tensor (..., Hq, Tq, S), fp64, rounded up.

    Notes
    -----
    Arithmetic covered (both ways kernels apply the scale): either (a) ``q`` and ``k^`` are each
    multiplied by ``fl(sqrt(sm_scale))`` and rounded to ``input_dtype`` (PyTorch's SDPA math
    path), or (b) the scale multiplies the accumulated dot; products and sums in
    ``accumulate_dtype`` in any order; the result rounded to ``score_dtype``. (:func:`observe_stored`'s
    own fp64 logits are case (b) with every dtype fp64.) With ``M_t = sum_c
    |q_c k^_tc|``, ``u`` the unit roundoffs and ``h`` the smallest subnormal of each dtype (twice its rounding
    error below the normal range):

    - (a): ``P = sm M (2 e + e^2) + h_in sqrt(sm) (2 + e) (||q||_1 + ||k^_t||_1) + d h_in^2`` with
      ``e = (1 + u_acc)^2 (1 + u_in) - 1`` (the square root and the product rounded in the
      accumulator, the cast to the input dtype), then the dot: ``gamma_d (sm M + P) + d h_acc``;
    - (b): ``sm (gamma_d M + d h_acc)(1 + u_acc) + u_acc sm M + h_acc``;
    - the final cast: ``(1 + u_out) max(a, b) + u_out sm M + h_out``.

    ``gamma_d = d u_acc / (1 - d u_acc)`` (Higham, Thm. 3.1, any summation order). Every step
    has its constants rounded up and is evaluated in fp64, inflated a priori for that evaluation.
    """
    for name, dt in (("score_dtype", score_dtype), ("accumulate_dtype", accumulate_dtype)):
        if dt not in SCORE_DTYPES:
            raise ValueError(f"{name} must be one of {SCORE_DTYPES}, got {dt!r}")
    if accumulate_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"accumulate_dtype must be float32 or float64 (an fp16/bf16 accumulation is not covered), "
                         f"got {accumulate_dtype!r}")
    for name, x in (("q", q), ("k_hat", k_hat)):
        if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
            raise ValueError(f"{name} must be a floating tensor")
        if not torch.isfinite(x).all():
            raise ValueError(f"{name} contains NaN or Inf")
    if q.shape[-1] != k_hat.shape[-1]:
        raise ValueError(f"q head dim {q.shape[-1]} differs from k_hat head dim {k_hat.shape[-1]}")
    hkv, groups = check_head_pairing(q.shape, k_hat.shape, "q", "k_hat")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not 0 < sm_scale < float("inf"):
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")
    input_dtype = torch.promote_types(q.dtype, k_hat.dtype) if input_dtype is None else input_dtype
    if input_dtype not in SCORE_DTYPES:
        raise ValueError(f"input_dtype must be one of {SCORE_DTYPES}, got {input_dtype!r}")
    d = q.shape[-1]
    lead, tq, s = q.shape[:-3], q.shape[-2], k_hat.shape[-2]
    coefficients = score_rounding_coefficients(d, float(sm_scale), input_dtype, accumulate_dtype, score_dtype)
    q_folded = q.to(torch.float64).reshape(*lead, hkv, groups * tq, d)  # kv head's query heads folded
    bound = score_rounding_from(q_folded, k_hat.to(torch.float64), float(sm_scale), coefficients)
    return bound.reshape(*lead, hkv * groups, tq, s)


def bias_rounding_bound(biased: torch.Tensor) -> torch.Tensor:
    """``>= |fl(s + b) - (s + b)|`` for fp64 logits ``biased = fl(s + b)``: an additive mask or bias ``b`` added in fp64.

    An attention mask with soft values (or a ``position_bias``) enters both the exact and the compressed
    logits (it changes ``p~``, never ``eps_t``); adding it to the fp64 scores rounds once more. One fp64
    addition errs by at most ``u |s + b| <= 2^-52 |fl(s + b)|`` and is exact when its result is subnormal;
    the product by ``2^-52`` is exact above ``2^-970`` and rounded up here (:func:`witcert.core.rounding.next_up`)
    below. ``-inf`` (masked) entries get 0. Shape and dtype of ``biased`` (fp64).
    """
    slack = rounding.next_up(biased.abs() * 2.0**-52)
    return torch.where(torch.isneginf(biased), torch.zeros_like(slack), slack)


def score_rounding_from(q64: torch.Tensor, k_hat64: torch.Tensor, sm_scale: float, coefficients: tuple,
                        per_row: bool = False) -> torch.Tensor:
    """:func:`score_rounding_bound`'s arithmetic on checked fp64 tensors: ``q64`` (..., Q, d) against ``k_hat64``
    (..., S, d) -> (..., Q, S), with :func:`score_rounding_coefficients`. No host synchronisation
    (the fused per-layer pass compiles it).

    ``per_row``: one bound per query row, (..., Q, 1), valid for every token of the row: ``M_t`` is taken from
    above by Hoelder's ``||q||_inf max_t ||k^_t||_1`` (no second dot product, no per-token arithmetic), for the
    fp64 logits of the per-layer pass, where ``M_t`` enters only with coefficients near ``d 2^-53`` (the bound
    moves by about ``1e-14`` of the row's largest ``sm M``); every coefficient is non-negative, so a larger
    ``M_t`` gives a larger bound. Its evaluation (a ``d``-term sum, a maximum and one product) rounds no more
    than the dot it replaces, so the same inflation covers it."""
    q_abs, k_abs = q64.abs(), k_hat64.abs()
    q_l1, k_l1 = q_abs.sum(-1, keepdim=True), k_abs.sum(-1).unsqueeze(-2)  # (..., Q, 1), (..., 1, S)
    k_l1_max = k_l1.amax(-1, keepdim=True)  # (..., 1, 1)
    if per_row:
        sm_m = (q_abs.amax(-1, keepdim=True) * k_l1_max) * sm_scale  # (..., Q, 1) >= sm M_t for every t
    else:
        sm_m = dot_rows(q_abs, k_abs) * sm_scale  # (..., Q, S): sm M, to fp64 rounding
    # The absolute terms (a_l, a_0, b_0, h_out: near 2^-1074 for fp64 logits) are taken per row, at the row's
    # largest ||k^_t||_1, and lifted to the smallest normal fp64: a subnormal operand costs x86 a microcode
    # assist per element (measured 40x an fp64 multiply), and no per-element operation here sees one.
    # A larger absolute term gives a larger bound; the roundings are the ones the inflation below covers.
    return _bound_of(sm_m, q_l1 + k_l1_max, coefficients, q64.shape[-1])


def score_rounding_linear(q_norm: torch.Tensor, k_norm_max: torch.Tensor, head_dim: int, sm_scale,
                          coefficients: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`score_rounding_from_norms` as ``rate k_norm_t + floor``: ``(rate, floor)`` (...,) fp64, rounded up, so
    that every token ``t`` with ``||k^_t|| <= k_norm_t <= k_norm_max`` has its logit's rounding bound at most
    ``rate k_norm_t + floor``; ``q_norm`` (...,) ``>= ||q||``.

    ``max(a, b) <= max(a_m, b_m) sm M_t + max(a_l l1 + a_0, b_0, tiny)`` (each case is a multiple of ``sm M_t``
    plus a constant), ``M_t <= q_norm k_norm_t`` and ``l1 <= sqrt(d) (q_norm + k_norm_max)``; the few fp64
    operations here are covered by :func:`score_rounding_from`'s inflation. For a pass that adds the bound per
    token in fp32 from one rate and one floor per query row (the vLLM plugin's decode pass), where the
    per-token form would cost fp64 arithmetic and a directed rounding per (row, token).
    """
    a_m, a_l, a_0, b_m, b_0, out_m, out_0 = coefficients
    inflate = 1 + (head_dim + 16) * 2.0**-52
    rate = rounding.next_up((torch.maximum(_tensor_of(a_m), _tensor_of(b_m)) * out_m + out_0[0]) * sm_scale
                            * q_norm * inflate)
    constant = torch.maximum(torch.clamp((q_norm + k_norm_max) * _root_up(head_dim) * a_l + a_0, min=_TINY),
                             _tensor_of(_lifted(b_0)).expand_as(q_norm))
    floor = rounding.next_up((constant * out_m + _lifted(out_0[1]) + _TINY) * inflate)
    return rate, floor


def _tensor_of(x) -> torch.Tensor:
    """A Python float or a 0-dim tensor as an fp64 tensor."""
    return x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64)


def _root_up(d: int) -> float:
    """``>= sqrt(d)`` (a Python float: a graph constant)."""
    return math.nextafter(math.nextafter(math.sqrt(d), math.inf), math.inf)


def _bound_of(sm_m: torch.Tensor, l1_sum: torch.Tensor, coefficients: tuple, d: int) -> torch.Tensor:
    """The cases of :func:`score_rounding_coefficients` at ``sm_m >= sm M_t`` and ``l1_sum >= ||q||_1 + ||k^_t||_1``,
    evaluated in fp64 and inflated a priori."""
    a_m, a_l, a_0, b_m, b_0, out_m, out_0 = coefficients
    case_a = sm_m * a_m + torch.clamp(l1_sum * a_l + a_0, min=_TINY)
    case_b = sm_m * b_m + _lifted(b_0)
    final = torch.maximum(case_a, case_b) * out_m + sm_m * out_0[0] + _lifted(out_0[1])
    # the fp64 evaluation: a d-term dot (gamma_d), then at most 8 roundings, each relative u or absolute
    # below 2^-1074: 16 subnormal steps (< _TINY) and (d + 16) u cover them; the last product rounds up by one step
    inflate = 1 + (d + 16) * 2.0**-52
    up = (final + _TINY) * inflate
    return rounding.next_up(up)


def _lifted(x):
    """``max(x, smallest normal)`` of a Python float or a 0-dim tensor (the compiled pass passes tensors)."""
    return torch.clamp(x, min=_TINY) if isinstance(x, torch.Tensor) else max(x, _TINY)


def dot_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b^T``: (..., Q, d) against (..., S, d) -> (..., Q, S), every entry a ``d``-term dot in some order.

    Eager, one BLAS call; inside a compiled graph a fused multiply-and-sum over ``d``, never the extern
    GEMM (an extern fp64 GEMM of a few query rows inside a graph was slower still). Both are what the bounds
    here assume (any order, FMA or not). The monitor's per-layer pass takes its logits from one GEMM before
    its graph instead (:mod:`witcert.fastpath.stored_pass`).
    """
    if torch.compiler.is_compiling():
        return (a.unsqueeze(-2) * b.unsqueeze(-3)).sum(-1)
    return a @ b.transpose(-1, -2)


@functools.lru_cache(maxsize=64)  # the monitor asks once per layer and step, always the same few
def score_rounding_coefficients(d: int, sm: float, input_dtype, accumulate_dtype, score_dtype) -> tuple:
    """The constants of :func:`score_rounding_bound`'s cases as upper bounds (Python floats, rounded up).

    ``case_a = a_m sm M + a_l (||q||_1 + ||k^||_1) + a_0``, ``case_b = b_m sm M + b_0``, result
    ``out_m max(a, b) + out_0[0] sm M + out_0[1]`` (see its docstring for the terms).
    """
    def up(x: float) -> float:
        return math.nextafter(x, math.inf)

    u_in, u_acc, u_out = (rounding.unit_roundoff(t) for t in (input_dtype, accumulate_dtype, score_dtype))
    h_in, h_acc, h_out = (_subnormal_step(t) for t in (input_dtype, accumulate_dtype, score_dtype))
    gamma = rounding.summation_gamma(d + 1, accumulate_dtype)  # gamma_d = d u / (1 - d u), rounded up
    root = up(up(math.sqrt(sm)))  # >= sqrt(sm)
    e = up(up(2 * u_acc + u_in) * up(up(1 + u_acc) + u_in))  # >= (1 + u_acc)^2 (1 + u_in) - 1
    e_factor = up(e * up(2 + e))  # 2e + e^2
    c_l = up(up(h_in * root) * up(2 + e))  # h_in sqrt(sm) (2 + e)
    c_0 = up(d * up(h_in * h_in)) if h_in * h_in > 0 else up(d * rounding.SUBNORMAL_STEP)  # d h_in^2
    one_gamma = up(1 + gamma)
    a_m = up(up(e_factor * one_gamma) + gamma)  # P (1 + gamma) + gamma sm M, P's sm M part
    a_l = up(c_l * one_gamma)
    a_0 = up(up(c_0 * one_gamma) + up(d * h_acc))
    b_m = up(up(gamma * up(1 + u_acc)) + u_acc)
    b_0 = up(up(up(sm * up(d * h_acc)) * up(1 + u_acc)) + h_acc)
    return a_m, a_l, a_0, b_m, b_0, up(1 + u_out), (u_out, h_out)


def _subnormal_step(dtype: torch.dtype) -> float:
    """The smallest positive subnormal of ``dtype``: at least twice the absolute rounding error below the
    normal range (half of it, 2^-1075 for fp64, is not an fp64 number)."""
    return torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps

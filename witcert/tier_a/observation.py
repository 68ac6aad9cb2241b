"""The observation of one layer: Tier A meter, risk, output bound (and true TV) per query.

Two entry points, one computation:

- :func:`observe` takes the exact keys and values and a scheme: it compresses them, stores
  what a compressed cache stores (:func:`stored_keys`: the band witness, Lemma 1 ``L1``, and the
  value statistics) and observes that;
- :func:`observe_stored` takes only what a compressed cache holds (reconstructed keys, witness,
  value statistics) and, optionally, the exact keys for the true TV. The transformers
  integration calls it once per layer call, batch and heads included.

Per (query head, query) it forms ``c_t`` (Theorem 2 ``T2``), the meter (``T1``/``P1``/``MN``),
the raw risk score, the value-side output bound and the joint pass event; with the exact keys,
the true TV and output error (fp64) for validation.

Which logits are certified. The compressed logits are computed here in fp64 (``scores``); the
meter bounds the TV between ``softmax(exact logits)`` and ``softmax(scores)``, the exact-arithmetic
attention over the stored keys. Its per-token radius is ``c_t + delta_t``: ``delta_t``
(:func:`score_rounding_bound` with fp64 arithmetic) bounds the fp64 rounding of ``scores_t``
against the exact ``sm_scale q . k^_t``. A runtime that computes its own logits in bf16/fp16/fp32
rounds far more; a caller metering *those* logits adds :func:`score_rounding_bound` for the
runtime's dtypes to ``c`` (Theorem 1 needs ``c_t >= |runtime logit - exact logit|``).
"""
import math
from dataclasses import dataclass

import torch

from witcert.core import rounding, values
from witcert.core.metering import meter as tv_meter
from witcert.core.metering import risk_score
from witcert.fastpath.fused import lean_cells
from witcert.fastpath.radius import fast_logit_bound
from witcert.schemes.registry import apply_scheme
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness import check_head_pairing, logit_bound, witness_of

SCORE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Observation:
    """Per (query head, query) results of :func:`observe`; shapes ``(..., Hq, Tq)`` unless noted.

    ``c`` and ``scores`` are ``(..., Hq, Tq, S)`` (per-token logit bounds, score rounding included;
    the fp64 compressed logits the meter certifies, ``-inf`` where masked); ``true_tv`` and
    ``true_output_error`` are ``None`` unless the exact keys were given. Bounds are fp64.
    """

    meter: torch.Tensor
    risk: torch.Tensor
    output_bound: torch.Tensor
    value_term: torch.Tensor
    v_norm_max: torch.Tensor
    pass_k: torch.Tensor
    pass_v: torch.Tensor
    joint: torch.Tensor
    c: torch.Tensor
    scores: torch.Tensor | None = None
    true_tv: torch.Tensor | None = None
    true_output_error: torch.Tensor | None = None

    def __post_init__(self):
        shape = self.meter.shape
        for name in ("risk", "output_bound", "value_term", "pass_k", "pass_v", "joint"):
            if getattr(self, name).shape != shape:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected {tuple(shape)}")


@dataclass(frozen=True)
class StoredKeys:
    """What a compressed cache holds for one layer and what the meter reads from it, (..., Hkv, S, ...).

    ``k_hat`` are the keys attention reads; ``witness`` (fp16, rounded up) bounds the band norms of
    ``k_hat - k`` (``L1``, ``T2``); ``value_residual >= ||v^_t - v_t||`` and ``value_norm >= ||v_t||``
    (the value side). All of it is computed once, when a token is written, from the exact key
    and value that exist at that moment (:func:`stored_keys`).
    """

    k_hat: torch.Tensor  # (..., Hkv, S, d)
    witness: torch.Tensor  # (..., Hkv, S, B) fp16
    value_residual: torch.Tensor  # (..., Hkv, S)
    value_norm: torch.Tensor  # (..., Hkv, S) fp64

    def __post_init__(self):
        lead = self.k_hat.shape[:-1]
        if self.witness.shape[:-1] != lead or self.value_residual.shape != lead or self.value_norm.shape != lead:
            raise ValueError(f"witness {tuple(self.witness.shape)}, value_residual {tuple(self.value_residual.shape)} "
                             f"and value_norm {tuple(self.value_norm.shape)} must match k_hat {tuple(self.k_hat.shape)}")


def stored_keys(k: torch.Tensor, k_hat: torch.Tensor, v: torch.Tensor, v_hat: torch.Tensor,
                layout: BandLayout) -> StoredKeys:
    """The :class:`StoredKeys` of exact ``k, v`` and their reconstructions ``k_hat, v_hat`` (..., S, d)."""
    return StoredKeys(k_hat=k_hat, witness=witness_of(k, k_hat, layout),
                      value_residual=values.value_residual_norms(v, v_hat), value_norm=values.value_norms(v))


def observe(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scheme,
    layout: BandLayout,
    sm_scale: float | None = None,
    exact: bool = True,
    tau_k: float = 0.2,
    tau_v: float = 0.05,
    mask: torch.Tensor | None = None,
    k_hat: torch.Tensor | None = None,
    v_hat: torch.Tensor | None = None,
) -> Observation:
    """Tier A observation of one layer (Lemma 1 ``L1``, Theorem 2 ``T2``, meter ``T1``).

    Parameters
    ----------
    q : Tensor (..., Hq, Tq, d)
        Queries (post-RoPE, as attention sees them), ``Hq`` query heads.
    k, v : Tensor (..., Hkv, S, d)
        Exact keys as attention reads them (post-RoPE, as computed: the witness is formed on
        them, ``L1fp`` needs no slack) and values, with the same leading dims as ``q``; the
        scheme gets private copies. GQA: ``Hq = G Hkv``; query head ``h`` reads kv head
        ``h // G`` (HF ``repeat_kv`` order).
    scheme : str or callable
        A registered scheme name or ``fn(x) -> x_hat`` (see :mod:`witcert.list_schemes`); applied
        to ``k`` with ``role="key"`` and to ``v`` with ``role="value"``.
    layout : BandLayout
        Band layout for head dim ``d`` under the model's RoPE convention.
    sm_scale : float, optional
        Softmax scale (default ``d ** -0.5``), the exact multiplier of both logits.
    exact : bool
        Also compute the true TV and output error from the exact keys (fp64).
    tau_k, tau_v : float
        Thresholds of ``pass_K`` and ``pass_V`` (:mod:`witcert.core.values`).
    mask : bool Tensor broadcastable to (..., Hq, Tq, S), optional
        ``True`` where a query attends a token (e.g. causal); every row needs one ``True``.
    k_hat, v_hat : Tensor (..., Hkv, S, d), optional
        Precomputed reconstructions (skip ``scheme`` for that side, e.g. after repair).
    """
    _check_qkv(q, k, v, layout)
    k_hat = apply_scheme(scheme, k, role="key") if k_hat is None else k_hat
    v_hat = apply_scheme(scheme, v, role="value") if v_hat is None else v_hat
    stored = stored_keys(k, k_hat, v, v_hat, layout)
    return observe_stored(q, stored, layout, sm_scale, mask=mask, truth=(k, v, v_hat) if exact else None,
                          tau_k=tau_k, tau_v=tau_v)


def observe_stored(q: torch.Tensor, stored: StoredKeys, layout: BandLayout, sm_scale: float | None = None,
                   mask: torch.Tensor | None = None, truth: tuple | None = None,
                   tau_k: float = 0.2, tau_v: float = 0.05, fused: bool = False) -> Observation:
    """Tier A observation from what a compressed cache holds (``T2``, ``T1``, value side).

    ``q`` (..., Hq, Tq, d) post-RoPE queries; ``stored`` the layer's :class:`StoredKeys`
    (..., Hkv, S, .) with the same leading dims; ``mask`` as in :func:`observe`; ``truth``
    ``(k, v, v_hat)`` the exact keys and values and the values attention reads, for the true TV
    and output error (``None``: not computed, e.g. when the exact cache is not kept). ``fused``:
    the radius from one fp32 band dot (:func:`witcert.fastpath.radius.fast_logit_bound`) and meter,
    risk and value term from one fp32 pass (:func:`witcert.fastpath.fused.lean_cells`), each under
    an a-priori rounding budget and compiled with ``WITCERT_COMPILE=1``, instead of the eager
    reference's separate passes; its meter is ``min(1, T1, P1, MN, CS)``, never below the exact value
    and at most a little above the eager full minimum, which also takes ``P1r`` and ``MS``.
    """
    hkv, groups = check_head_pairing(q.shape, stored.k_hat.shape, "q", "k_hat")
    d = q.shape[-1]
    lead, hq, tq, s = q.shape[:-3], q.shape[-3], q.shape[-2], stored.k_hat.shape[-2]
    scale = d**-0.5 if sm_scale is None else float(sm_scale)
    grouped = (*lead, hkv, groups, tq)  # query head h = kv head h // G, member h % G

    def per_query_head(x):  # (..., Hkv, G, Tq, ...) -> (..., Hq, Tq, ...)
        return None if x is None else x.reshape(*lead, hq, tq, *x.shape[len(grouped):])

    qg = q.to(torch.float64).reshape(*grouped, d)  # (..., Hkv, G, Tq, d)
    k_hat64 = stored.k_hat.to(torch.float64)
    radius = fast_logit_bound if fused else logit_bound  # the fused path's fp32 band dot (same bound, a priori)
    c = radius(q, stored.witness, layout, scale).to(torch.float64)  # (..., Hq, Tq, S)
    c = rounding.add_up(c, score_rounding_bound(q.to(torch.float64), k_hat64, scale, score_dtype=torch.float64,
                                                accumulate_dtype=torch.float64))
    keep = _mask(mask, (*lead, hq, tq, s), q.device).reshape(*grouped, s)
    scores = (_folded_matmul(qg, k_hat64.transpose(-1, -2)) * scale).masked_fill(~keep, float("-inf"))
    c = c.reshape(*grouped, s)

    rho = stored.value_residual.double()[..., None, None, :]  # (..., Hkv, 1, 1, S)
    v_norm = stored.value_norm.double()[..., None, None, :]
    if fused:  # scores and c are valid by construction: no second round of checks
        lean = lean_cells(scores, c, rho, v_norm, checked=True)
        meter, risk, value_term, v_max = lean.meter, lean.risk, lean.value_term, lean.v_norm_max
    else:
        meter = tv_meter(scores, c)  # (..., Hkv, G, Tq): the full minimum (P1r and MS too)
        risk = risk_score(scores, c)
        value_term = values.value_error_term(scores, rho)
        v_max = values.max_value_norm(v_norm, scores)
    bound = values.output_bound(meter, value_term, v_max)
    passes = values.joint_pass(meter, value_term, v_max, tau_k, tau_v)

    true_tv = true_err = None
    if truth is not None:
        true_tv, true_err = _truth(qg, *truth, scores, keep, scale)
    return Observation(
        meter=per_query_head(meter), risk=per_query_head(risk), output_bound=per_query_head(bound),
        value_term=per_query_head(value_term), v_norm_max=per_query_head(v_max),
        pass_k=per_query_head(passes.pass_k), pass_v=per_query_head(passes.pass_v),
        joint=per_query_head(passes.joint), c=per_query_head(c), scores=per_query_head(scores),
        true_tv=per_query_head(true_tv),
        true_output_error=per_query_head(true_err),
    )


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
    a_m, a_l, a_0, b_m, b_0, out_m, out_0 = _score_rounding_coefficients(d, float(sm_scale), input_dtype,
                                                                         accumulate_dtype, score_dtype)
    q_abs = q.to(torch.float64).abs().reshape(*lead, hkv, groups * tq, d)  # kv head's query heads folded
    k_abs = k_hat.to(torch.float64).abs()
    sm_m = (q_abs @ k_abs.transpose(-1, -2)) * float(sm_scale)  # (..., Hkv, G Tq, S): sm M, to fp64 rounding
    l1 = q_abs.sum(-1, keepdim=True) + k_abs.sum(-1).unsqueeze(-2)  # ||q||_1 + ||k^_t||_1
    case_a = sm_m * a_m + l1 * a_l + a_0
    case_b = sm_m * b_m + b_0
    final = torch.maximum(case_a, case_b) * out_m + sm_m * out_0[0] + out_0[1]
    # the fp64 evaluation: a d-term dot (gamma_d), then at most 8 roundings, each relative u or absolute
    # below 2^-1074: 16 subnormal steps and (d + 16) u cover them; the last product rounds up by one step
    inflate = 1 + (d + 16) * 2.0**-52
    up = (final + 16 * rounding.SUBNORMAL_STEP) * inflate
    return rounding.next_up(up).reshape(*lead, hkv * groups, tq, s)


def _score_rounding_coefficients(d: int, sm: float, input_dtype, accumulate_dtype, score_dtype) -> tuple:
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


def _folded_matmul(grouped: torch.Tensor, per_kv_head: torch.Tensor) -> torch.Tensor:
    """``(..., Hkv, G, Tq, a) @ (..., Hkv, a, b) -> (..., Hkv, G, Tq, b)`` with each kv head's ``G Tq`` rows
    folded into one matrix: one GEMM per kv head, no broadcast copy of the cache per query head."""
    *lead, groups, tq, a = grouped.shape
    folded = grouped.reshape(*lead, groups * tq, a) @ per_kv_head
    return folded.reshape(*lead, groups, tq, per_kv_head.shape[-1])


def _truth(qg, k, v, v_hat, scores, keep, scale):
    """fp64 true TV and output error ``||p v - p~ v^||``: each (..., Hkv, G, Tq)."""
    exact_scores = _folded_matmul(qg, k.to(torch.float64).transpose(-1, -2)) * scale
    p = torch.softmax(exact_scores.masked_fill(~keep, float("-inf")), dim=-1)
    p_tilde = torch.softmax(scores, dim=-1)
    tv = 0.5 * (p - p_tilde).abs().sum(-1)
    y = _folded_matmul(p, v.to(torch.float64))  # (..., Hkv, G, Tq, d)
    y_hat = _folded_matmul(p_tilde, v_hat.to(torch.float64))
    return tv, torch.linalg.vector_norm(y - y_hat, dim=-1)


def _mask(mask, shape: tuple, device) -> torch.Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError("mask must be a bool tensor (True = attend)")
    try:
        full = torch.broadcast_to(mask, shape)
    except RuntimeError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to (..., Hq, Tq, S)={shape}") from None
    if not full.any(-1).all():
        raise ValueError("mask has a query row that attends no token")
    return full.to(device)


def _check_qkv(q, k, v, layout):
    if not isinstance(layout, BandLayout):
        raise ValueError(f"layout must be a BandLayout, got {type(layout).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() < 3:
            raise ValueError(f"{name} must be a tensor (..., H, T, d) of rank >= 3, got {getattr(x, 'shape', type(x))}")
        if x.shape[-1] != layout.head_dim:
            raise ValueError(f"{name} last dim {x.shape[-1]} != layout.head_dim {layout.head_dim}")
        if not torch.is_floating_point(x) or not torch.isfinite(x).all():
            raise ValueError(f"{name} must be floating and finite")
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    check_head_pairing(q.shape, k.shape, "q", "k")

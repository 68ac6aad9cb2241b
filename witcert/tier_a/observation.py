"""The observatory primitive: Tier A meter, risk, output bound (and true TV) for one layer.

For a registered scheme, compress ``k`` and ``v``, store the band witness (Lemma 1 ``L1``), form
``c_t`` per (query head, query) (Theorem 2 ``T2``), and report the meter (``T1``/``P1``/``MN``),
the raw risk score, the value-side output bound and the joint pass event; with the exact
keys at hand, also the true TV and output error (fp64) for validation.

Rounding. The compressed logits are computed in fp64 (``scores``); the meter bounds the TV
between ``softmax(exact logits)`` and ``softmax(scores)``, the distribution actually used.
Its per-token radius is ``c_t + delta_t`` where ``delta_t = gamma_{d+2} sm_scale ||q|| ||k^_t||``
bounds the fp64 rounding of ``scores_t`` against the exact ``sm_scale q . k^_t`` (any
summation order; ~1e-13 relative, documented rather than hidden).
"""
from dataclasses import dataclass

import torch

from witcert.core import values
from witcert.tier_a.bands import BandLayout
from witcert.core.metering import meter as tv_meter
from witcert.core.metering import risk_score
from witcert.schemes.registry import apply_scheme
from witcert.tier_a.witness import logit_bound, norms_upper_fp64, witness_of

_U64 = 2.0**-53


@dataclass(frozen=True)
class Observation:
    """Per (query head, query) results of :func:`observe`; shapes ``(Hq, Tq)`` unless noted.

    ``c`` is ``(Hq, Tq, S)`` (per-token logit bounds, score rounding included); ``true_tv`` and
    ``true_output_error`` are ``None`` unless ``exact=True``. Bounds are fp64.
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
    true_tv: torch.Tensor | None = None
    true_output_error: torch.Tensor | None = None

    def __post_init__(self):
        shape = self.meter.shape
        for name in ("risk", "output_bound", "value_term", "pass_k", "pass_v", "joint"):
            if getattr(self, name).shape != shape:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected {tuple(shape)}")


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
    q : Tensor (Hq, Tq, d)
        Queries (post-RoPE, as attention sees them).
    k, v : Tensor (Hkv, S, d)
        Exact keys as attention reads them (post-RoPE, as computed: the witness is formed on
        them, ``L1fp`` needs no slack) and values; the scheme gets private copies. GQA: ``Hq = G Hkv``; query head ``h``
        reads kv head ``h // G`` (HF ``repeat_kv`` order).
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
    mask : bool Tensor broadcastable to (Hq, Tq, S), optional
        ``True`` where a query attends a token (e.g. causal); every row needs one ``True``.
    k_hat, v_hat : Tensor (Hkv, S, d), optional
        Precomputed reconstructions (skip ``scheme`` for that side, e.g. after repair).
    """
    hq, tq, d, hkv, s, groups = _check_shapes(q, k, v, layout)
    scale = d**-0.5 if sm_scale is None else float(sm_scale)
    k_hat = apply_scheme(scheme, k, role="key") if k_hat is None else k_hat
    v_hat = apply_scheme(scheme, v, role="value") if v_hat is None else v_hat

    qg = q.to(torch.float64).reshape(hkv, groups, tq, d)  # (Hkv, G, Tq, d)
    w = witness_of(k, k_hat, layout)  # (Hkv, S, B) fp16, rounded up
    c = logit_bound(qg, w[:, None, None], layout, scale)  # (Hkv, G, Tq, S)
    k_hat64 = k_hat.to(torch.float64)
    scores = scale * qg @ k_hat64[:, None].transpose(-1, -2)  # (Hkv, G, Tq, S)
    c = c + score_rounding(qg, k_hat64, scale)
    keep = _mask(mask, hq, tq, s).to(q.device).reshape(hkv, groups, tq, s)
    scores = scores.masked_fill(~keep, float("-inf"))

    meter = tv_meter(scores, c)  # (Hkv, G, Tq)
    risk = risk_score(scores, c)
    rho = values.value_residual_norms(v, v_hat).double()  # (Hkv, S)
    value_term = values.value_error_term(scores, rho[:, None, None])  # (Hkv, G, Tq)
    v_max = values.max_value_norm(values.value_norms(v)[:, None, None], scores)  # (Hkv, G, Tq)
    bound = values.output_bound(meter, value_term, v_max)
    passes = values.joint_pass(meter, value_term, v_max, tau_k, tau_v)

    true_tv = true_err = None
    if exact:
        true_tv, true_err = _truth(qg, k, v, v_hat, scores, keep, scale)
    flat = lambda x: None if x is None else x.reshape(hq, tq, *x.shape[3:])  # noqa: E731
    return Observation(
        meter=flat(meter), risk=flat(risk), output_bound=flat(bound), value_term=flat(value_term),
        v_norm_max=flat(v_max), pass_k=flat(passes.pass_k), pass_v=flat(passes.pass_v),
        joint=flat(passes.joint), c=flat(c), true_tv=flat(true_tv), true_output_error=flat(true_err),
    )


def score_rounding(qg: torch.Tensor, k_hat64: torch.Tensor, scale: float) -> torch.Tensor:
    """``delta_t >= |fl(scale q . k^_t) - scale q . k^_t|``: (Hkv, G, Tq, S), fp64.

    ``qg`` (Hkv, G, Tq, d) fp64 queries, ``k_hat64`` (Hkv, S, d) fp64 stored keys. Public: the
    Tier B tightening (:mod:`witcert.integrations.hf.cells`) adds the same slack to its bound.
    """
    d = qg.shape[-1]
    gamma = (d + 2) * _U64 / (1 - (d + 2) * _U64)
    q_norm = norms_upper_fp64(qg)  # (Hkv, G, Tq)
    k_norm = norms_upper_fp64(k_hat64)  # (Hkv, S)
    # the factor 2 is margin over gamma_{d+2} (d products and sums, then the scale multiply)
    return (2 * gamma * scale) * q_norm[..., None] * k_norm[:, None, None, :]




def _truth(qg, k, v, v_hat, scores, keep, scale):
    """fp64 true TV and output error ``||p v - p~ v^||``: each (Hkv, G, Tq)."""
    exact_scores = scale * qg @ k.to(torch.float64)[:, None].transpose(-1, -2)
    p = torch.softmax(exact_scores.masked_fill(~keep, float("-inf")), dim=-1)
    p_tilde = torch.softmax(scores, dim=-1)
    tv = 0.5 * (p - p_tilde).abs().sum(-1)
    y = p @ v.to(torch.float64)[:, None]  # (Hkv, G, Tq, d)
    y_hat = p_tilde @ v_hat.to(torch.float64)[:, None]
    return tv, torch.linalg.vector_norm(y - y_hat, dim=-1)


def _mask(mask, hq: int, tq: int, s: int) -> torch.Tensor:
    if mask is None:
        return torch.ones(hq, tq, s, dtype=torch.bool)  # moved to q's device by the caller
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError("mask must be a bool tensor (True = attend)")
    try:
        full = torch.broadcast_to(mask, (hq, tq, s))
    except RuntimeError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to (Hq, Tq, S)=({hq}, {tq}, {s})")
    if not full.any(-1).all():
        raise ValueError("mask has a query row that attends no token")
    return full


def _check_shapes(q, k, v, layout):
    if not isinstance(layout, BandLayout):
        raise ValueError(f"layout must be a BandLayout, got {type(layout).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor, got {getattr(x, 'shape', type(x))}")
        if x.shape[-1] != layout.head_dim:
            raise ValueError(f"{name} last dim {x.shape[-1]} != layout.head_dim {layout.head_dim}")
        if not torch.is_floating_point(x) or not torch.isfinite(x).all():
            raise ValueError(f"{name} must be floating and finite")
    hq, tq, d = q.shape
    hkv, s, _ = k.shape
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    if hq % hkv:
        raise ValueError(f"query heads Hq={hq} must be a multiple of kv heads Hkv={hkv} (GQA)")
    return hq, tq, d, hkv, s, hq // hkv

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
from witcert.fastpath.compiled import graph_input, pick
from witcert.fastpath.fused import lean_cells
from witcert.fastpath.stored_pass import pass_constants, stored_pass
from witcert.schemes.registry import apply_scheme
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.query_radius import read_scores
from witcert.tier_a.score_rounding import bias_rounding_bound, score_rounding_bound
from witcert.tier_a.witness import _check_key_pair, _check_layout, check_head_pairing, logit_bound, residual_witness


@dataclass(frozen=True)
class Observation:
    """Per (query head, query) results of :func:`observe`; shapes ``(..., Hq, Tq)`` unless noted.

    ``c`` and ``scores`` are ``(..., Hq, Tq, S)`` (per-token logit bounds, score rounding included, 0 where
    masked; the fp64 compressed logits the meter certifies, ``-inf`` where masked); ``true_tv`` and
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
    """The :class:`StoredKeys` of exact ``k, v`` and their reconstructions ``k_hat, v_hat`` (..., S, d):
    :func:`witcert.witness_of`, :func:`witcert.core.values.value_residual_norms` and ``value_norms``,
    checked once and computed in one function (compiled with ``WITCERT_COMPILE=1``: a cache write).

    The shapes and dtypes are checked first; finiteness is read once, from the same function's flag (one
    host synchronisation per write instead of six), and a ``False`` flag reruns the full checks for the
    error naming the argument.
    """
    _check_layout(layout)
    _check_key_pair(k, k_hat, layout, finite=False)
    values.check_value_pair(v, v_hat, finite=False)
    # one layout: a compiled graph guards on its inputs' strides (a model's transposed keys, one token or many)
    k, k_hat, v, v_hat = (graph_input(x) for x in (k, k_hat, v, v_hat))
    witness, rho, v_norm, finite = pick(stored_statistics, _statistics_probe)(k, k_hat, v, v_hat, layout)
    if not finite:
        _check_key_pair(k, k_hat, layout)
        values.check_value_pair(v, v_hat)
        raise ValueError("k, k_hat, v or v_hat contains NaN or Inf")  # the flag and the checks disagree: still refuse
    return StoredKeys(k_hat=k_hat, witness=witness, value_residual=rho, value_norm=v_norm)


def stored_statistics(k, k_hat, v, v_hat, layout: BandLayout) -> tuple[torch.Tensor, ...]:
    """``(witness, value residual norms, value norms, finite)`` of shape-checked tensors (no host
    synchronisation); ``finite`` (0-dim bool) says every entry of the four inputs is finite (the statistics
    are meaningful only then)."""
    finite = torch.isfinite(k).all() & torch.isfinite(k_hat).all() & torch.isfinite(v).all() & torch.isfinite(v_hat).all()
    return (residual_witness(k, k_hat, layout), values.residual_norms(v, v_hat), values.norms_up(v.to(torch.float64)),
            finite)


def _statistics_probe() -> tuple:
    """One request's write of two tokens (B = 1, two kv heads, d = 64 in the default 16 bands), distinct tensors."""
    return (*(torch.ones(1, 2, 2, 64) for _ in range(4)), BandLayout(64, 16))


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
                   tau_k: float = 0.2, tau_v: float = 0.05, fused: bool = False,
                   bias: torch.Tensor | None = None, q_read: torch.Tensor | None = None) -> Observation:
    """Tier A observation from what a compressed cache holds (``T2``, ``T1``, value side).

    ``q`` (..., Hq, Tq, d) post-RoPE queries; ``stored`` the layer's :class:`StoredKeys`
    (..., Hkv, S, .) with the same leading dims; ``mask`` as in :func:`observe`; ``truth``
    ``(k, v, v_hat)`` the exact keys and values and the values attention reads, for the true TV
    and output error (``None``: not computed, e.g. when the exact cache is not kept). ``fused``:
    logits, radius (one fp32 band dot, :mod:`witcert.fastpath.radius`) and meter, risk and value
    term (one fp32 pass, :mod:`witcert.fastpath.budgeted_pass`) from one function
    (:func:`witcert.fastpath.stored_pass.stored_pass`, compiled with ``WITCERT_COMPILE=1``), under
    a-priori rounding budgets, instead of the eager reference's separate passes (an fp16 witness,
    as every built-in store holds; any other dtype takes the eager path). Its meter is
    ``min(1, T1, P1, MN, CS, MS)`` with MS on four low sets of its own, never below the exact value
    and close to the eager meter (whose MS minimises over twelve thresholds). ``bias``: a finite fp64
    additive term broadcastable to (..., Hq, Tq, S) that the model adds to both logits (a soft
    attention mask, a ``position_bias``): it changes ``p~`` and no ``eps_t``, so it is added to the
    compressed and the exact logits alike, and its fp64 addition's rounding to ``c``
    (:func:`~witcert.tier_a.score_rounding.bias_rounding_bound`). ``q_read``: the query the attention kernel
    reads when it quantizes the query (..., Hq, Tq, d), ``None`` when it reads ``q``: the compressed logits are
    then ``q_read``'s and every radius gains ``|sm (q_read - q) . k^_t|`` (``QR``,
    :mod:`witcert.tier_a.query_radius`); the exact reference, and so the true TV, keeps ``q``.
    """
    hkv, groups = check_head_pairing(q.shape, stored.k_hat.shape, "q", "k_hat")
    d = q.shape[-1]
    lead, hq, tq, s = q.shape[:-3], q.shape[-3], q.shape[-2], stored.k_hat.shape[-2]
    scale = d**-0.5 if sm_scale is None else float(sm_scale)
    grouped = (*lead, hkv, groups, tq)  # query head h = kv head h // G, member h % G

    def per_query_head(x):  # (..., Hkv, G, Tq, ...) -> (..., Hq, Tq, ...)
        return None if x is None else x.reshape(*lead, hq, tq, *x.shape[len(grouped):])

    fast = fused and stored.witness.dtype == torch.float16
    qg = None if fast and truth is None else q.to(torch.float64).reshape(*grouped, d)  # (..., Hkv, G, Tq, d)
    keep = _mask(mask, (*lead, hq, tq, s), q.device).reshape(*grouped, s)
    if fast:  # inputs valid by construction: one pass, no re-checks
        values.check_thresholds(tau_k, tau_v)  # (the eager branch's joint_pass checks them itself)
        folded = (*lead, hkv, groups * tq)  # the statistics as stored (views; the pass widens them)
        results = stored_pass(
            q.reshape(*folded, d), stored.k_hat, layout, stored.witness, keep.reshape(*folded, s),
            stored.value_residual[..., None, :], stored.value_norm[..., None, :],
            pass_constants(d, scale, float(tau_k), float(tau_v)).to(q.device))
        scores, c, meter, risk, value_term, v_max, bound, pass_k, pass_v = (
            x.reshape(*grouped, *x.shape[len(folded):]) for x in results)
        passes = values.JointPass(pass_k, pass_v, pass_k & pass_v)
        if q_read is not None:  # the pass metered the exact query's logits: the kernel reads q_read's
            scores, c = _read_query(scores, c, q_read, stored.k_hat, scale, grouped)
        if bias is not None:
            scores, c = _biased(scores, c, bias, grouped)
        if bias is not None or q_read is not None:  # the cells again over the logits attention used
            lean = lean_cells(scores, c, stored.value_residual.double()[..., None, None, :],
                              stored.value_norm.double()[..., None, None, :], checked=True)
            meter, risk, value_term, v_max = lean.meter, lean.risk, lean.value_term, lean.v_norm_max
            bound = values.output_bound(meter, value_term, v_max)
            passes = values.joint_pass(meter, value_term, v_max, tau_k, tau_v)
    else:
        k_hat64 = stored.k_hat.to(torch.float64)
        rho = stored.value_residual.double()[..., None, None, :]  # (..., Hkv, 1, 1, S)
        v_norm = stored.value_norm.double()[..., None, None, :]
        c = logit_bound(q, stored.witness, layout, scale).to(torch.float64)  # (..., Hq, Tq, S)
        c = rounding.add_up(c, score_rounding_bound(q.to(torch.float64), k_hat64, scale, score_dtype=torch.float64,
                                                    accumulate_dtype=torch.float64))
        scores = (_folded_matmul(qg, k_hat64.transpose(-1, -2)) * scale).masked_fill(~keep, float("-inf"))
        c = c.reshape(*grouped, s).masked_fill(~keep, 0.0)  # as the fused pass: no bound needs a masked radius
        if q_read is not None:
            scores, c = _read_query(scores, c, q_read, stored.k_hat, scale, grouped)
        if bias is not None:
            scores, c = _biased(scores, c, bias, grouped)
        meter = tv_meter(scores, c)  # (..., Hkv, G, Tq): the full minimum (MS on the eager grid)
        risk = risk_score(scores, c)
        value_term = values.value_error_term(scores, rho)
        v_max = values.max_value_norm(v_norm, scores)
        bound = values.output_bound(meter, value_term, v_max)
        passes = values.joint_pass(meter, value_term, v_max, tau_k, tau_v)

    true_tv = true_err = None
    if truth is not None:
        true_tv, true_err = _truth(qg, *truth, scores, keep, scale, None if bias is None else _grouped(bias, grouped))
    return Observation(
        meter=per_query_head(meter), risk=per_query_head(risk), output_bound=per_query_head(bound),
        value_term=per_query_head(value_term), v_norm_max=per_query_head(v_max),
        pass_k=per_query_head(passes.pass_k), pass_v=per_query_head(passes.pass_v),
        joint=per_query_head(passes.joint), c=per_query_head(c), scores=per_query_head(scores),
        true_tv=per_query_head(true_tv),
        true_output_error=per_query_head(true_err),
    )


def _folded_matmul(grouped: torch.Tensor, per_kv_head: torch.Tensor) -> torch.Tensor:
    """``(..., Hkv, G, Tq, a) @ (..., Hkv, a, b) -> (..., Hkv, G, Tq, b)`` with each kv head's ``G Tq`` rows
    folded into one matrix: one GEMM per kv head, no broadcast copy of the cache per query head."""
    *lead, groups, tq, a = grouped.shape
    folded = grouped.reshape(*lead, groups * tq, a) @ per_kv_head
    return folded.reshape(*lead, groups, tq, per_kv_head.shape[-1])


def _grouped(bias: torch.Tensor, grouped: tuple) -> torch.Tensor:
    """``bias`` broadcastable to (..., Hq, Tq, S) as (..., Hkv, G, Tq, S) fp64."""
    s = bias.shape[-1]
    try:
        full = torch.broadcast_to(bias, (*grouped[:-3], grouped[-3] * grouped[-2], grouped[-1], s))
    except RuntimeError:
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to (..., Hq, Tq, S)") from None
    return full.reshape(*grouped, s).to(torch.float64)


def _read_query(scores: torch.Tensor, c: torch.Tensor, q_read: torch.Tensor, k_hat: torch.Tensor, scale: float,
                grouped: tuple) -> tuple:
    """The read query's logits and ``c`` plus the query term (``QR``), both (..., Hkv, G, Tq, S)."""
    if q_read.shape[-1] != k_hat.shape[-1] or q_read.numel() != math.prod(grouped) * k_hat.shape[-1]:
        raise ValueError(f"q_read must have the query's shape (..., Hq, Tq, d), got {tuple(q_read.shape)}")
    folded = (*grouped[:-2], grouped[-2] * grouped[-1])
    read, radius = read_scores(scores.reshape(*folded, -1), q_read.reshape(*folded, -1), k_hat, scale)
    return read.reshape(scores.shape), rounding.add_up(c, radius.reshape(c.shape))


def _biased(scores: torch.Tensor, c: torch.Tensor, bias: torch.Tensor, grouped: tuple) -> tuple:
    """``scores + bias`` (fp64, ``-inf`` stays masked) and ``c`` plus that addition's rounding (``SR``)."""
    bias = _grouped(bias, grouped)
    if not torch.isfinite(bias).all():
        raise ValueError("bias must be finite (mask a token with the mask, not with an infinite bias)")
    total = scores + bias
    if torch.isposinf(total).any() or (torch.isneginf(total) & ~torch.isneginf(scores)).any():
        raise ValueError("the logits plus bias overflow fp64")
    return total, rounding.add_up(c, bias_rounding_bound(total))


def _truth(qg, k, v, v_hat, scores, keep, scale, bias=None):
    """fp64 true TV and output error ``||p v - p~ v^||``: each (..., Hkv, G, Tq); ``bias`` (..., Hkv, G, Tq, S)
    is added to the exact logits (``scores``, the compressed ones, already hold it)."""
    exact_scores = _folded_matmul(qg, k.to(torch.float64).transpose(-1, -2)) * scale
    if bias is not None:
        exact_scores = exact_scores + bias
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
    if not mask.any(-1).all():  # on the mask as given: broadcasting repeats its rows
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

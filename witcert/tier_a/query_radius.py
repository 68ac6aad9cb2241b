"""The query-side radius: attention kernels that quantize the query (registry key ``QR``).

With an fp8 KV cache, FlashAttention-3 (and vLLM's other fp8 backends that take a quantized query) quantize the
query too: the logits the kernel forms are ``l~_t = sm q' . k^_t`` with ``q' = q + e``, not ``sm q . k^_t``. The
logit error against the exact ``l_t = sm q . k_t`` splits as

    l~_t - l_t = sm q . (k^_t - k_t) + sm e . k^_t,

(Lean ``WitCert.abs_logit_error_le_query_radius``; spec mirror
:mod:`witcert.spec.query_radius`), so the per-token radius is the key-side one (Theorem 2, ``T2``, from the stored witness and the *exact* query) plus
``|sm e . k^_t|``. Both ``e`` and ``k^_t`` are known when the cell is metered, so that term is not bounded by
Cauchy-Schwarz (``sm sum_b ||e_b|| ||k^_{t,b}||``, never smaller) but computed: it is the difference of two fp64
logits, ``|s'_t - s_t|`` with ``s' = fl(sm q' . k^)`` and ``s = fl(sm q . k^)``, plus their rounding
(:func:`witcert.tier_a.score_rounding.score_rounding_from`, the bound ``SR`` of fp64 logits). A key attention
never sees gets no radius.

What the monitor does with it (``witcert.monitor(..., query_format="fp8-e4m3")``): the model's attention runs
with ``q'`` (the kernel's query, simulated), the meter's compressed logits are ``s'``, and its exact reference
and the true TV use ``q``. A repaired token (the gate) is recomputed by WitCert with its exact key and the exact
query, so its radius is 0.

Formats (:data:`QUERY_FORMATS`, or any :class:`QueryFormat`):

- ``"fp8-e4m3"``: vLLM's static per-tensor query quantization, ``QuantFP8(static=True, PER_TENSOR)``
  (``vllm/model_executor/layers/quantization/input_quant_fp8.py`` at
  058397c527c7a9c773e68813657dea178a7580e4, ``forward_native``): ``codes = clamp(q * (1 / scale), -448, 448)``
  cast to E4M3 in fp32, ``q' = codes * scale`` (the kernel's ``q_descale``); ``scale`` is the layer's
  ``q_scale``, 1.0 when uncalibrated (:class:`Fp8Query` takes a calibrated one).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from witcert.core import rounding
from witcert.tier_a.score_rounding import score_rounding_coefficients, score_rounding_from

E4M3_MAX = 448.0


class QueryFormat:
    """How a kernel rounds the query: ``read(q) -> q'`` (fp64, exact), same shape as ``q`` (..., d).

    ``elementwise``: ``q'`` of each entry depends on that entry alone (a static scale), so metering a
    recorded call later (deferred metering) forms the same ``q'``; a format that is not (a dynamic scale over the
    whole call) is metered in its step.
    """

    name: str = "query format"
    elementwise: bool = False

    def read(self, q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class Fp8Query(QueryFormat):
    """vLLM's static per-tensor FP8 E4M3 query quantization with scale ``scale`` (its ``q_scale``; 1.0 uncalibrated)."""

    scale: float = 1.0
    name = "fp8-e4m3"
    elementwise = True

    def __post_init__(self):
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not 0 < self.scale < float("inf"):
            raise ValueError(f"query_format: the fp8 query scale must be a positive finite float, got {self.scale!r}")

    def read(self, q: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.scale, dtype=torch.float32, device=q.device)
        codes = (q.to(torch.float32) * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return codes.to(torch.float64) * scale.to(torch.float64)  # 4 x 24 significant bits: exact


@dataclass(frozen=True)
class CallableQuery(QueryFormat):
    """A user's ``fn(q) -> q'`` (the query the kernel really uses, same shape; checked finite on every call)."""

    fn: Callable
    elementwise = False

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", "callable")

    def read(self, q: torch.Tensor) -> torch.Tensor:
        q_read = self.fn(q.detach().clone())
        if not isinstance(q_read, torch.Tensor) or q_read.shape != q.shape:
            raise ValueError(f"query_format {self.name!r} must return a tensor of the query's shape {tuple(q.shape)}, "
                             f"got {getattr(q_read, 'shape', type(q_read).__name__)}")
        if not torch.isfinite(q_read).all():
            raise ValueError(f"query_format {self.name!r} returned NaN or Inf for a finite query")
        return q_read.detach().to(torch.float64).clone()


QUERY_FORMATS: dict[str, QueryFormat] = {"fp8-e4m3": Fp8Query()}


def query_format_of(spec) -> QueryFormat | None:
    """The :class:`QueryFormat` of ``spec``: ``None``, a name of :data:`QUERY_FORMATS`, a format, or a callable."""
    if spec is None or isinstance(spec, QueryFormat):
        return spec
    if isinstance(spec, str):
        if spec not in QUERY_FORMATS:
            raise ValueError(f"query_format {spec!r} is unknown; known: {', '.join(QUERY_FORMATS)} (or a "
                             "witcert.tier_a.query_radius.QueryFormat, or a callable q -> q')")
        return QUERY_FORMATS[spec]
    if callable(spec):
        return CallableQuery(spec)
    raise ValueError(f"query_format must be None, a name ({', '.join(QUERY_FORMATS)}), a QueryFormat or a callable "
                     f"q -> q', got {type(spec).__name__}")


def read_scores(scores: torch.Tensor, q_read: torch.Tensor, k_hat: torch.Tensor,
                sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s', r)``: the fp64 logits of the read query and the radius to add to ``c`` (``QR``, ``SR``).

    ``scores`` (..., Hkv, Q, S) are the fp64 logits ``s = fl(sm q . k^)`` of the exact query whose radius ``c``
    already covers ``|s - sm q . k^|`` (``-inf`` where masked); ``q_read`` (..., Hkv, Q, d) the read query, each
    kv head's rows folded as in ``scores``; ``k_hat`` (..., Hkv, S, d). Then ``s' = fl(sm q' . k^)`` and, with
    ``delta'`` its rounding bound, ``r = |s' - s| + 2 delta'`` makes ``c + r`` bound ``|s' - sm q . k|``:
    ``s' - l = (s' - sm q' k^) + (sm q' k^ - sm q k^) + sm q (k^ - k)``, the middle term at most
    ``|s' - s| + delta' + |s - sm q k^|``. Rounded up; 0 where masked.
    """
    masked = torch.isneginf(scores)
    read, delta = _logits(q_read, k_hat, sm_scale)
    read = read.masked_fill(masked, float("-inf"))
    radius = rounding.add_up(_apart(read, scores), rounding.mul_up(delta, 2.0))
    return read, radius.masked_fill(masked, 0.0)


def query_radius(q: torch.Tensor, q_read: torch.Tensor, k_hat: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """``>= |sm (q' - q) . k^_t|`` for every query and token (..., Hq, Tq, S), fp64, rounded up (``QR``).

    Parameters
    ----------
    q, q_read : Tensor (..., Hq, Tq, d)
        The exact query and the query the kernel reads (``q' = q + e``).
    k_hat : Tensor (..., Hkv, S, d)
        The keys attention reads; query head ``h`` reads kv head ``h // (Hq / Hkv)``.
    sm_scale : float
        The softmax scale.

    Notes
    -----
    ``|s' - s| + delta' + delta`` with ``s, s'`` the fp64 logits of ``q, q'`` and ``delta, delta'`` their rounding
    bounds (:func:`witcert.tier_a.score_rounding.score_rounding_from`).
    """
    if q.shape != q_read.shape:
        raise ValueError(f"q_read must have q's shape {tuple(q.shape)}, got {tuple(q_read.shape)}")
    for name, x in (("q", q), ("q_read", q_read), ("k_hat", k_hat)):
        if not torch.is_floating_point(x) or not torch.isfinite(x).all():
            raise ValueError(f"{name} must be a finite floating tensor")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not 0 < sm_scale < float("inf"):
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")
    *lead, hq, tq, d = q.shape
    hkv = k_hat.shape[-3]
    if hq % hkv or k_hat.shape[-1] != d:
        raise ValueError(f"q {tuple(q.shape)} and k_hat {tuple(k_hat.shape)} do not pair query heads with kv heads")
    fold = (*lead, hkv, hq // hkv * tq, d)
    exact, delta = _logits(q.reshape(fold), k_hat, sm_scale)
    read, delta_read = _logits(q_read.reshape(fold), k_hat, sm_scale)
    bound = rounding.add_up(rounding.add_up(_apart(read, exact), delta_read), delta)
    return bound.reshape(*lead, hq, tq, k_hat.shape[-2])


def _logits(q: torch.Tensor, k_hat: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``fl(sm q . k^)`` (..., Q, S) and its rounding bound (..., Q, 1), one per row (Hoelder's form)."""
    q64, k64 = q.to(torch.float64), k_hat.to(torch.float64)
    coefficients = score_rounding_coefficients(q64.shape[-1], float(sm_scale), torch.float64, torch.float64,
                                               torch.float64)
    delta = score_rounding_from(q64, k64, float(sm_scale), coefficients, per_row=True)
    return (q64 @ k64.transpose(-1, -2)) * sm_scale, delta


def _apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``>= |a - b|`` of fp64 logits (one subtraction, rounded up); 0 where both are ``-inf`` (masked)."""
    return rounding.next_up((a - b).abs().nan_to_num(0.0))

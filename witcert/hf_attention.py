"""transformers integration: the ``"witcert"`` attention implementation for HF RoPE decoders.

Registered through transformers' ``AttentionInterface`` (pinned: transformers 5.23), the
function receives post-RoPE queries and the model cache's keys/values. Those are exact, so the
stock ``DynamicCache`` is the exact shadow for free. While a :class:`Session` is active:

1. each layer's new tokens are compressed once, on write, by the registered scheme, with their
   Tier A witnesses (:class:`witcert.compressed_kv.CompressedLayer`);
2. the attention output is computed over the *stored* (compressed) keys and values, so the
   model really runs on the compressed cache (the first forward pass, the prefill, attends
   over its exact in-flight keys as a serving engine does; it is compressed for later reads);
3. for every later query the meter is formed per (layer, query head, query) from the real
   post-RoPE query (T1/P1/MN over Theorem 2's ``c_t``), with the true TV against the exact
   shadow when ``observe`` is on;
4. with a gate threshold ``tau < 1``, every cell whose meter exceeds it is repaired: its
   output is recomputed from the exact keys and values (certified gating).

Without an active session the function *is* the stock sdpa path (same call, same mask), so a
model switched to ``"witcert"`` with nothing active gives bit-identical logits; leaving a
:func:`compressed_attention` block restores the model's previous implementation.

Works for any model whose attention modules follow the Llama functional pattern (Llama, Qwen2,
Mistral, ...): ``module.layer_idx``, ``module.num_key_value_groups``, the ``rotate_half`` RoPE.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from witcert import cells
from witcert.bands import BandLayout
from witcert.compressed_kv import CompressedLayer
from witcert.schemes import get_scheme
from witcert.witness import logit_bound

ATTN_NAME = "witcert"
_ACTIVE: list["Session"] = []


@dataclass
class Session:
    """What the ``"witcert"`` attention does while active, and what it measured.

    Parameters
    ----------
    scheme : str
        A registered scheme name (``witcert schemes`` lists them).
    layout : BandLayout
        Band grouping of the model's head dim (``rotate_half`` for HF Llama-family models).
    observe : bool
        Compute the true TV against the exact shadow for every cell.
    gate_tau : float or None
        Repair cells whose meter exceeds ``gate_tau`` (certified regime: ``gate_tau < 1``).
    """

    scheme: str
    layout: BandLayout
    observe: bool = True
    gate_tau: float | None = None
    layers: dict[int, CompressedLayer] = field(default_factory=dict, repr=False)
    batches: list[cells.CellBatch] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if not isinstance(self.layout, BandLayout):
            raise ValueError(f"layout must be a BandLayout, got {type(self.layout).__name__}")
        if self.gate_tau is not None and not (0.0 < self.gate_tau < 1.0):
            raise ValueError(f"gate_tau must lie in (0, 1) for certified gating, got {self.gate_tau}")
        self._compress = get_scheme(self.scheme)  # raises on an unknown name

    def layer(self, index: int) -> CompressedLayer:
        if index not in self.layers:
            self.layers[index] = CompressedLayer(
                compress_key=lambda x: self._compress(x, role="key"),
                compress_value=lambda x: self._compress(x, role="value"),
                layout=self.layout,
            )
        return self.layers[index]

    def reset(self) -> None:
        """Forget the compressed cache (a new request); measurements are kept."""
        self.layers.clear()


def register() -> None:
    """Register ``"witcert"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_NAME, witcert_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def layout_for(model, bands: int = 16) -> BandLayout:
    """The :class:`BandLayout` of ``model``'s attention heads (HF Llama family: ``rotate_half``)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return BandLayout(head_dim=head_dim, bands=min(bands, head_dim // 2), rope="rotate_half")


@contextlib.contextmanager
def compressed_attention(model, session: Session):
    """Run ``model`` on the compressed cache described by ``session`` inside the block."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    _ACTIVE.append(session)
    try:
        yield session
    finally:
        _ACTIVE.remove(session)
        model.set_attn_implementation(previous)


def witcert_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention function (signature of transformers' ``sdpa_attention_forward``)."""
    if not _ACTIVE:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    session = _ACTIVE[-1]
    store = session.layer(module.layer_idx)
    prefill = store.length == 0 or key.shape[-2] < store.length
    store.sync(key, value)
    if prefill:  # the prefill attends over its exact in-flight keys; later reads see the store
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    output, weights = sdpa_attention_forward(
        module, query, store.k_hat, store.v_hat, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )
    scale = module.scaling if scaling is None else scaling
    batch = _measure(session, store, module.layer_idx, query, key, value, attention_mask, scale)
    if session.gate_tau is not None:
        output = _repair(output, batch, session.gate_tau)
    return output, weights


def _measure(session, store, layer_idx, query, key, value, attention_mask, scale):
    b, hq, tq, _ = query.shape
    s = key.shape[-2]
    visible = cells.visible_mask(attention_mask, b, tq, s, query.device)
    witness = store.witness[:, :, None, None]  # (B, Hkv, 1, 1, S, Bands)

    def bound(q5):
        return logit_bound(q5, witness, session.layout, sm_scale=scale)

    math = cells.measure(query, key, value, store.k_hat, bound, visible, scale, with_truth=session.observe)
    flagged = math.meter > session.gate_tau if session.gate_tau is not None else torch.zeros_like(math.meter, dtype=torch.bool)
    batch = cells.CellBatch(
        layer=layer_idx,
        positions=torch.arange(s - tq, s),
        meter=cells.flatten_heads(math.meter).cpu(),
        risk=cells.flatten_heads(math.risk).cpu(),
        true_tv=cells.flatten_heads(math.true_tv).cpu(),
        c_max=cells.flatten_heads(math.c_max).cpu(),
        repaired=cells.flatten_heads(flagged).cpu(),
    )
    session.batches.append(batch)
    return _Measured(batch=batch, exact_output=cells.flatten_heads(math.exact_output))


@dataclass(frozen=True)
class _Measured:
    batch: cells.CellBatch
    exact_output: torch.Tensor  # (B, Hq, Tq, d) fp64


def _repair(output, measured: _Measured, tau: float):
    """Replace the output of every flagged cell by exact attention (output is (B, Tq, Hq, d))."""
    flagged = measured.batch.repaired.to(output.device).transpose(1, 2)  # (B, Tq, Hq)
    if not flagged.any():
        return output
    exact = measured.exact_output.transpose(1, 2).to(output.dtype)  # (B, Tq, Hq, d)
    return torch.where(flagged[..., None], exact, output)

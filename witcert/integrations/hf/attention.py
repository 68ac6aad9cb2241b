"""transformers integration: the ``"witcert"`` attention implementation for HF RoPE decoders.

Registered through transformers' ``AttentionInterface`` (pinned: transformers 5.23), the
function receives post-RoPE queries and the model cache's keys/values. Those are exact, so the
stock ``DynamicCache`` is the exact shadow for free. While a :class:`Session` is active:

1. each layer's new tokens are compressed once, on write, by the registered scheme, with their
   Tier A witnesses (:class:`witcert.integrations.hf.compressed_cache.CompressedLayer`);
2. the attention output is computed over the *stored* (compressed) keys and values, so the
   model really runs on the compressed cache (the first forward pass, the prefill, attends
   over its exact in-flight keys as a serving engine does; it is compressed for later reads);
3. for every later query the meter is formed per (layer, query head, query) from the real
   post-RoPE query (T1/P1/MN over Theorem 2's ``c_t``), with the true TV against the exact
   shadow when ``observe`` is on;
4. with a :class:`witcert.Gate`, every cell over its threshold is repaired by paging exact
   blocks in from the shadow until its meter is below ``tau`` (certified when ``tau < 1``),
   and its output is recomputed over the repaired cache.

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

from witcert.integrations.hf import cells
from witcert.tier_a.bands import BandLayout
from witcert.integrations.hf.compressed_cache import CompressedLayer, DitheredLayer
from witcert.tier_b.counters import batch_requests, check_seed, fresh_seed
from witcert.gate.policy import Gate
from witcert.schemes.registry import get_scheme

ATTN_NAME = "witcert"
DITHERED = "dithered-int8"  # the Tier B cache (witcert.DitheredInt8), not a Tier A registry scheme
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
    gate : witcert.Gate or None
        Gate every cell and repair the fired ones from the exact shadow (block page-in).
    tier : {"A", "B"}
        ``"B"`` needs ``scheme="dithered-int8"``: the cache is the dithered INT8 store and each
        token's bound is the minimum of its Tier A witness bound and the Tier B bound.
    delta_loc : float
        Tier B per-(layer, head, step) failure budget (``witcert.tier_b.certificate.delta_local``).
    delta_sweep : dict
        Tier B only: also record the meter at these other budgets (column name -> delta_loc),
        for the risk-coverage curve across delta.
    adaptive : bool
        Set while queries depend on the dither (greedy decoding): Tier B then uses only its
        deterministic branch (``Delta_t`` plus the rounding of the keys in the model's dtype).
    seed : int or None
        Philox seed of the dithered cache. ``None`` (default): a fresh secret seed from the
        operating system's cryptographic source for every request (at construction and at every
        :meth:`reset`), readable as :attr:`dither_seed` and recorded with each cell, so a run can
        be replayed. An int fixes it: an explicit opt-in for tests and replay only, since
        anyone who knows the seed can build queries aligned with the dither.
    requests : tuple of int or None
        The request id of each batch row (distinct: each sequence gets its own dither stream;
        a row keeps its stream when the batch is reordered together with its id). ``None``:
        the row index.
    """

    scheme: str
    layout: BandLayout
    observe: bool = True
    gate: Gate | None = None
    tier: str = "A"
    delta_loc: float = 1e-7
    delta_sweep: dict = field(default_factory=dict)  # column name -> delta_loc: extra Tier B meters
    adaptive: bool = False
    seed: int | None = None
    requests: tuple[int, ...] | None = None
    layers: dict[int, CompressedLayer] = field(default_factory=dict, repr=False)
    batches: list[cells.CellBatch] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if not isinstance(self.layout, BandLayout):
            raise ValueError(f"layout must be a BandLayout, got {type(self.layout).__name__}")
        if self.gate is not None and not isinstance(self.gate, Gate):
            raise ValueError(f"gate must be a witcert.Gate or None, got {type(self.gate).__name__}")
        if self.tier not in ("A", "B"):
            raise ValueError(f"tier must be 'A' or 'B', got {self.tier!r}")
        if not 0.0 < self.delta_loc < 1.0:
            raise ValueError(f"delta_loc must lie in (0, 1), got {self.delta_loc}")
        if self.seed is not None:
            check_seed(self.seed)
        if self.requests is not None:
            self.requests = tuple(batch_requests(self.requests, len(self.requests)).tolist())
        self._seed = None
        if self.scheme == DITHERED:
            from witcert.tier_b.quantizer import DitheredInt8

            self._quantizer = DitheredInt8(rope="rotate_half")
            self._seed = self._request_seed()
        elif self.tier == "B":
            raise ValueError(f"tier B certifies the {DITHERED!r} cache only, not scheme {self.scheme!r}")
        else:
            self._compress = get_scheme(self.scheme)  # raises on an unknown name

    @property
    def dither_seed(self) -> int | None:
        """The Philox seed of the current request's dithered cache (``None`` for other schemes)."""
        return self._seed

    def _request_seed(self) -> int:
        return fresh_seed() if self.seed is None else check_seed(self.seed)

    def layer(self, index: int):
        if index in self.layers:
            return self.layers[index]
        if self.scheme == DITHERED:
            self.layers[index] = DitheredLayer(self._quantizer, layer=index, seed=self._seed, requests=self.requests)
        else:
            self.layers[index] = CompressedLayer(
                compress_key=lambda x: self._compress(x, role="key"),
                compress_value=lambda x: self._compress(x, role="value"),
            )
        return self.layers[index]

    def reset(self) -> None:
        """Forget the compressed cache (a new request; a fresh dither seed unless ``seed`` is fixed).

        Measurements are kept.
        """
        self.layers.clear()
        if self.scheme == DITHERED:
            self._seed = self._request_seed()


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
    if store.length and (key.shape[-2] < store.length or store.k_hat.shape[:2] != key.shape[:2]):
        session.reset()  # a new request reusing the session: fresh stores (and a fresh dither seed)
        store = session.layer(module.layer_idx)
    prefill = store.length == 0
    store.sync(key, value)
    if prefill:  # the prefill attends over its exact in-flight keys; later reads see the store
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    output, weights = sdpa_attention_forward(
        module, query, store.k_hat, store.v_hat, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )
    scale = module.scaling if scaling is None else scaling
    tq, s = query.shape[-2], key.shape[-2]
    visible = cells.visible_mask(attention_mask, tq, s, query.device)
    math = cells.measure(
        query, key, value, store.k_hat, store.v_hat, visible, scale, None, session.layout, exact=session.observe
    )
    extra = {}
    if session.tier == "B":
        for name, loc in session.delta_sweep.items():
            swept = cells.tighten_with_tier_b(math, query, store, loc, scale, session.adaptive)
            extra[name] = swept.cells["meter"].cpu()
        math = cells.tighten_with_tier_b(math, query, store, session.delta_loc, scale, session.adaptive)
    fired = torch.zeros_like(math.cells["meter"], dtype=torch.bool)
    if session.gate is not None:
        output, fired, paged = cells.gated_output(math, session.gate, value, store.v_hat, output)
        extra["paged_fraction"] = paged.cpu()
    dithered = isinstance(store, DitheredLayer)
    session.batches.append(
        cells.CellBatch(
            layer=module.layer_idx,
            positions=torch.arange(s - tq, s),
            repaired=fired.cpu(),
            extra=extra,
            seed=store.seed if dithered else None,
            requests=store.row_requests if dithered else None,
            **{name: t.cpu() for name, t in math.cells.items()},
        )
    )
    return output, weights

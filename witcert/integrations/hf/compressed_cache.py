"""The compressed twin of one layer's KV cache: what a compressed runtime would have stored.

Every token is compressed exactly once, when it is first written (the chunk of new tokens a
forward pass appends goes through the scheme as one tensor); old tokens are never
re-quantized. The exact keys and values stay in the model's own cache: that is the exact
shadow (and the backing store the gate repairs from). The Tier A witness of a token is a
function of (k_t, k^_t) alone (Lemma 1 / Theorem 2, ``L1``/``T2``), so
:func:`witcert.observe` recomputes it from the shadow and this store with the same fp16 values
a runtime would have stored at write time.

Chunk-wise application matters for schemes that share statistics across tokens: KIVI keys
quantize complete 32-token groups of a chunk and keep the chunk's remainder exact (so single
decode tokens stay exact); a per-tensor scale is computed per chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from witcert.schemes.registry import apply_scheme


@dataclass
class CompressedLayer:
    """Reconstructed keys and values of one layer, in write order.

    The compress callables run through :func:`witcert.schemes.registry.apply_scheme`: each gets a
    private copy of the new tokens (a scheme that quantizes in place or returns a view can
    never write into the model's cache, the exact shadow and the gate's backing data) and its
    output is checked to be a finite tensor of the same shape and dtype. A callable that
    accepts ``role`` gets ``"key"`` / ``"value"``.
    """

    compress_key: object  # callable (x) -> x_hat, role "key"
    compress_value: object  # callable (x) -> x_hat, role "value"
    k_hat: torch.Tensor | None = field(default=None, repr=False)  # (B, Hkv, S, d)
    v_hat: torch.Tensor | None = field(default=None, repr=False)  # (B, Hkv, S, d)

    def __post_init__(self):
        if not callable(self.compress_key) or not callable(self.compress_value):
            raise ValueError("compress_key and compress_value must be callables x -> x_hat")

    @property
    def length(self) -> int:
        """Number of tokens stored."""
        return 0 if self.k_hat is None else self.k_hat.shape[-2]

    def sync(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Bring the store up to the exact cache ``key``/``value`` (B, Hkv, S, d).

        Tokens beyond :attr:`length` are compressed and appended. A cache shorter than the
        store (a new request reusing the layer) restarts the store.
        """
        if key.shape != value.shape or key.dim() != 4:
            raise ValueError(f"key/value must both be (B, Hkv, S, d), got {tuple(key.shape)} and {tuple(value.shape)}")
        total = key.shape[-2]
        if total < self.length or (self.k_hat is not None and self.k_hat.shape[:2] != key.shape[:2]):
            self.reset()
        start = self.length
        if total == start:
            return
        new_k, new_v = key[..., start:, :], value[..., start:, :]  # views of the exact cache
        self.k_hat = _append(self.k_hat, apply_scheme(self.compress_key, new_k, role="key"))
        self.v_hat = _append(self.v_hat, apply_scheme(self.compress_value, new_v, role="value"))

    def reset(self) -> None:
        self.k_hat = self.v_hat = None


def _append(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=2)



@dataclass
class DitheredLayer:
    """Tier B twin of one layer: a dithered INT8 store per written chunk (:class:`witcert.DitheredInt8`).

    Every batch row is its own sequence with its own dither stream: a token's stream is keyed by
    ``(requests[b], layer, kv_head, token, channel)``, the side (K or V) and the secret ``seed``
    through :class:`witcert.tier_b.counters.StandaloneCounter`, so it is regenerated identically at read time and
    differs across rows, layers, sides and tokens. ``requests`` holds one distinct id per row
    (a row keeps its stream when the batch is reordered together with its id); ``None`` numbers
    the rows. ``seed=None`` draws a secret seed (:func:`witcert.tier_b.counters.fresh_seed`).

    The reconstruction is dequantized to the cache's dtype, the dtype attention reads the keys
    in; Tier B bounds of these keys take it as ``key_dtype`` (``witcert.tier_b.certificate``, registry "DB").
    """

    quantizer: object  # witcert.DitheredInt8
    layer: int
    seed: int | None = None
    requests: tuple[int, ...] | None = None
    k_hat: torch.Tensor | None = field(default=None, repr=False)  # (B, Hkv, S, d)
    v_hat: torch.Tensor | None = field(default=None, repr=False)
    key_stores: list = field(default_factory=list, repr=False)  # PackedStore per chunk
    row_requests: tuple[int, ...] = ()  # the request id each batch row's stream was keyed with

    def __post_init__(self):
        from witcert.tier_b.counters import check_seed, fresh_seed

        self.seed = check_seed(fresh_seed() if self.seed is None else self.seed)

    @property
    def length(self) -> int:
        return 0 if self.k_hat is None else self.k_hat.shape[-2]

    def sync(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Quantize the tokens beyond :attr:`length` (see :meth:`CompressedLayer.sync`)."""
        from witcert.tier_b.counters import StandaloneCounter, batch_requests

        if key.shape != value.shape or key.dim() != 4:
            raise ValueError(f"key/value must both be (B, Hkv, S, d), got {tuple(key.shape)} and {tuple(value.shape)}")
        total = key.shape[-2]
        if total < self.length or (self.k_hat is not None and self.k_hat.shape[:2] != key.shape[:2]):
            self.reset()
        start = self.length
        if total == start:
            return
        rows = batch_requests(self.requests, key.shape[0])
        stores = []
        for side, x in (("k", key[..., start:, :]), ("v", value[..., start:, :])):
            counter = StandaloneCounter(request=rows, layer=self.layer, seed=self.seed, side=side, token_offset=start)
            store = self.quantizer.quantize(x, counter)
            stores.append((store, self.quantizer.dequantize(store, counter, dtype=x.dtype)))
        self.row_requests = tuple(rows.tolist())
        self.key_stores.append(stores[0][0])
        self.k_hat = _append(self.k_hat, stores[0][1])
        self.v_hat = _append(self.v_hat, stores[1][1])

    def reset(self) -> None:
        self.k_hat = self.v_hat = None
        self.key_stores = []

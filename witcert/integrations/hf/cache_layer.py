"""The transformers side of a monitored cache: a cache layer over a WitCert store, and the guard.

transformers 5.23 caches are lists of per-layer objects (``Cache.layers``); a forward call
writes each layer's new keys and values through ``layer.update`` and attends over what it
returns. :class:`MonitoredLayer` is such a layer around a
:class:`witcert.integrations.hf.compressed_cache.LayerStore`: ``update`` appends the exact new
tokens to the store (compressed once, witness formed while the exact tokens exist) and returns
what attention must read: the exact in-flight tokens on the first write (the prefill, as a
serving engine attends it), the store's reconstruction afterwards.

:func:`adopt` turns a ``DynamicCache`` into a monitored one in place (same object, so a
caller that holds it, ``generate`` included, keeps using it). A cache that already holds an exact
prefix (``DynamicLayer`` tokens the model wrote outside the monitor, e.g. one prefill shared by
several schemes) is adopted too: the prefix is each store's first write, compressed once, exactly
as a monitored prefill would have written it. :func:`check_exact_layers` is the
guard: WitCert attention runs only over layers whose writes it has seen exactly. A cache layer
that quantizes (transformers' ``QuantizedLayer``/``QuantoQuantizedLayer``/``HQQQuantizedLayer``,
``Fp8QuantizedLayer``), is static, offloaded to disk or any other kind is refused with a clear error:
its keys are not the exact keys, and a "true TV" against them would certify nothing (the misuse
that once reported 0 violations on 2,160 cells while 1,005 were above the meter against the
truly exact keys).

Sliding-window models (Mistral, Gemma's local layers): a monitored layer keeps every token; the
model's own sliding-window mask (built from :meth:`MonitoredLayer.get_mask_sizes`, the full
length at offset 0) restricts attention to the window, so attention is unchanged and the meter
covers exactly the visible tokens; tokens beyond the window are not evicted.
"""
from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

EXACT_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)  # store what the model wrote (exact types, not subclasses)


class MonitoredLayer(CacheLayerMixin):
    """A transformers cache layer over a WitCert store (see the module docstring)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, store, layer_idx: int):
        super().__init__()
        self.store = store
        self.layer_idx = layer_idx
        self.read_exact = False  # the last update returned the exact in-flight tokens (nothing compressed read)
        self._last_read: tuple | None = None  # weak references to what the last update returned

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the exact new tokens; return what attention reads (B, Hkv, S, d)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.read_exact = self.store.length == 0
        self.store.append(key_states, value_states)
        read = (key_states, value_states) if self.read_exact else self.store.read()
        self._last_read = tuple(weakref.ref(x) for x in read)
        return read

    @property
    def last_read(self) -> tuple | None:
        """What the last update returned, while the forward call attending it holds it (else ``None``): a
        decode-on-read store's decoded keys are freed with that call, never held between steps."""
        read = None if self._last_read is None else tuple(ref() for ref in self._last_read)
        return None if read is None or any(x is None for x in read) else read

    @property
    def keys(self):
        """The exact keys when the store keeps them (what a ``DynamicLayer`` would hold), else ``None``."""
        exact = self.store.exact() if self.store.length else None
        return None if exact is None else exact[0]

    @keys.setter
    def keys(self, value):  # CacheLayerMixin.__init__ assigns None
        if value is not None:
            raise ValueError("a monitored cache layer's keys are written through update() only")

    @property
    def values(self):
        exact = self.store.exact() if self.store.length else None
        return None if exact is None else exact[1]

    @values.setter
    def values(self, value):
        if value is not None:
            raise ValueError("a monitored cache layer's values are written through update() only")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.store.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.store.length

    def get_max_length(self) -> int:
        return -1

    def offload(self):  # the store holds its own tensors; nothing to move
        return None

    def prefetch(self):
        return None

    def reset(self) -> None:
        raise ValueError("a monitored cache is one request: start a new request with a new cache "
                         "(witcert.monitor gives every past_key_values object its own fresh store)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise _unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        raise _unsupported("cropping the cache (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise _unsupported("repeating cache rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise _unsupported("selecting cache rows")


def _unsupported(what: str) -> ValueError:
    return ValueError(f"witcert.monitor does not support {what}: a token's witness and dither stream are tied to "
                      "its batch row; use greedy or sampled decoding")


def check_exact_layers(cache) -> None:
    """Refuse a cache WitCert cannot take as exact (ValueError naming the layer and its type).

    Accepted: ``DynamicLayer`` and ``DynamicSlidingWindowLayer`` exactly (they store what the model
    computed) and :class:`MonitoredLayer`. Everything else (quantized, static, linear-attention,
    third-party layers, subclasses) is refused: the keys it would hand WitCert are not known to be
    the exact ones.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"past_key_values must be a transformers Cache with per-layer objects, got "
                         f"{type(cache).__name__}")
    for index, layer in enumerate(layers):
        if isinstance(layer, MonitoredLayer) or type(layer) in EXACT_LAYERS:
            continue
        raise ValueError(
            f"past_key_values layer {index} is a {type(layer).__name__}: WitCert attention runs only over a cache "
            "whose writes it sees exactly (a DynamicCache). A quantized cache (QuantizedCache, quanto/HQQ/fp8 "
            "layers) holds keys that are not the exact keys, so a meter and a 'true TV' against them would "
            "certify nothing; let witcert.monitor compress the cache itself instead: to meter transformers' own "
            "QuantizedCache, pass its configuration as the scheme (scheme=\"hf-quanto-int4\", \"hf-hqq-int8\", ...; "
            "witcert schemes lists them) and no past_key_values")


def adopt(cache, make_store, n_layers: int) -> list[MonitoredLayer]:
    """Make a ``DynamicCache`` monitored in place: one :class:`MonitoredLayer` per layer.

    ``make_store(layer_idx)`` builds each layer's store. Returns the new layers. Exact tokens the
    cache already holds (plain ``DynamicLayer`` s, the same length in every layer) become each
    store's first write: the next read attends over their compressed form. A cache that is not an
    exact ``DynamicCache``, or a sliding-window layer holding tokens (it may have dropped some),
    raises.
    """
    check_exact_layers(cache)
    if not isinstance(cache, DynamicCache):
        raise ValueError(f"past_key_values must be a DynamicCache (or None), got {type(cache).__name__}")
    if any(isinstance(layer, MonitoredLayer) for layer in cache.layers):
        raise ValueError("past_key_values is already monitored (by another witcert.monitor or request)")
    if cache.layers and len(cache.layers) != n_layers:
        raise ValueError(f"past_key_values has {len(cache.layers)} layers, the model {n_layers}")
    prefix = _exact_prefix(cache)
    layers = [MonitoredLayer(make_store(i), i) for i in range(n_layers)]
    for layer, (keys, values) in zip(layers, prefix):
        layer.update(keys, values)
    cache.layers = list(layers)
    cache.layer_class_to_replicate = None
    return layers


def _exact_prefix(cache) -> list:
    """(keys, values) of every layer of a cache holding an exact prefix written outside the monitor; [] if empty."""
    for index, layer in enumerate(cache.layers):
        holds = getattr(layer, "keys", None) is not None and layer.keys.numel() > 0
        if holds and type(layer) is not DynamicLayer:
            raise ValueError(f"past_key_values layer {index} is a {type(layer).__name__} holding tokens: only a "
                             "full DynamicLayer prefix (every token kept) can be adopted")
    lengths = {layer.get_seq_length() for layer in cache.layers}
    if lengths <= {0}:
        return []
    if len(lengths) > 1:
        raise ValueError(f"past_key_values holds prefixes of different lengths per layer ({sorted(lengths)}); "
                         "start the request with an empty cache or one exact prefill")
    return [(layer.keys, layer.values) for layer in cache.layers]

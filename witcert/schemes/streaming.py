"""Streaming schemes: caches with an exact recent window and group-wise flushes (KIVI), with Tier A witnesses.

A one-tensor scheme (:mod:`witcert.schemes.registry`) is applied to each written chunk once, which
fits cache-preserving quantizers that treat tokens independently. A quantizer that groups along
tokens (KIVI's per-channel keys, quanto's axis -1, HQQ's axis 1) cannot work that way: one-token
decode chunks never fill a group, and the result depends on how the writes were chunked. A
:class:`StreamingScheme` describes the *cache* instead, one :class:`FlushPolicy` per side:

- written tokens enter an exact window; attention reads ``[reconstructed tokens, exact window]``;
- after the step has been read, the oldest ``floor(max(0, L - keep) / unit) * unit`` of the ``L``
  window tokens are flushed: quantized by the side's one-tensor quantizer (through
  :func:`witcert.schemes.registry.apply_scheme`: private copy, checked output) and never touched again.

KIVI (Liu et al., ICML 2024; :data:`witcert.schemes.builtin.KIVI_2BIT`): keys ``unit = R`` (128),
``keep = 0`` -- the window fills up to ``R`` tokens and is quantized per channel in ``R / G``
groups of ``G = 32`` tokens (a prefill of ``S`` tokens quantizes its first ``S - S mod R``);
values ``unit = 1``, ``keep = R`` -- the ``R`` newest values stay exact and each older one is
quantized per token. As in KIVI the prefill attends its exact keys and a flush follows the
attention of the step that filled the window.

Chunking independence: flush units are aligned to the first token and a quantizer whose groups
never straddle a unit (KIVI's 32-token groups inside 128-token units, per-token values) maps each
unit on its own, so the cache after ``t`` tokens is the same however the writes were chunked.

What the Tier A theorem covers. A flushed token is exact until its flush, so its witness is its
exact witness ``witness_of(k, k^)`` (computed at the flush, while the exact key exists), 0 while it
is in the window, and it never moves afterwards; :class:`witcert.tier_a.maintenance.WitnessedTensor`
does the bookkeeping (``WM`` with ``w = 0``, ``x^_old = x`` is exactly that witness). Theorem 2
(``T2``) then bounds every query's logit error on the keys attention reads; everything is on
post-RoPE keys as computed, so Lemma 1 in floating point (``L1fp``) is not needed.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from witcert.schemes.registry import apply_scheme
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.maintenance import WitnessedTensor

_STREAMING: dict[str, "StreamingScheme"] = {}


@dataclass(frozen=True)
class FlushPolicy:
    """When one side flushes: whole ``unit``-token units, at least ``keep`` newest tokens left exact."""

    unit: int
    keep: int = 0

    def __post_init__(self):
        for name, low in (("unit", 1), ("keep", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")

    def flush_count(self, window: int) -> int:
        """How many of the ``window`` oldest exact tokens to quantize now."""
        return max(0, window - self.keep) // self.unit * self.unit


@dataclass(frozen=True)
class StreamingScheme:
    """A streaming cache: a one-tensor quantizer and a :class:`FlushPolicy` per side.

    ``quantize_key`` / ``quantize_value`` map a flushed block ``(..., n, d)`` (``n`` a multiple of
    the side's ``unit``, every token exact) to its reconstruction, same shape and dtype; they are
    run through :func:`witcert.schemes.registry.apply_scheme` with ``role="key"`` / ``"value"``.
    """

    name: str
    quantize_key: Callable
    quantize_value: Callable
    key_policy: FlushPolicy
    value_policy: FlushPolicy

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        if not callable(self.quantize_key) or not callable(self.quantize_value):
            raise ValueError("quantize_key and quantize_value must be callables x -> x_hat")
        for side in ("key_policy", "value_policy"):
            if not isinstance(getattr(self, side), FlushPolicy):
                raise ValueError(f"{side} must be a FlushPolicy, got {type(getattr(self, side)).__name__}")

    def layer(self, layout: BandLayout, keep_exact: bool = False) -> "StreamingLayer":
        """An empty cache layer of this scheme."""
        return StreamingLayer(self, layout, keep_exact=keep_exact)


@dataclass
class StreamingLayer:
    """One layer of a :class:`StreamingScheme` cache: ``update`` like a transformers cache layer.

    Parameters
    ----------
    scheme : StreamingScheme
    layout : BandLayout
        Bands of the keys' head dim under the model's RoPE pair convention.
    keep_exact : bool
        Hold the exact keys/values too (:attr:`exact_keys`, :attr:`exact_values`), for validation.

    Attributes (the snapshot attention reads at the last ``update``)
    ----------------------------------------------------------------
    keys, values : Tensor (B, Hkv, S, d)
    key_witness : Tensor (B, Hkv, S, bands), float16, ``>= ||(keys - exact)_b||`` (``T2`` premise).
    value_witness : Tensor (B, Hkv, S), float16, ``>= ||values_t - exact_t||``.
    exact_keys, exact_values : Tensor or None (``keep_exact`` only).
    """

    scheme: StreamingScheme
    layout: BandLayout
    keep_exact: bool = False
    keys: torch.Tensor | None = field(default=None, init=False, repr=False)
    values: torch.Tensor | None = field(default=None, init=False, repr=False)
    key_witness: torch.Tensor | None = field(default=None, init=False, repr=False)
    value_witness: torch.Tensor | None = field(default=None, init=False, repr=False)
    exact_keys: torch.Tensor | None = field(default=None, init=False, repr=False)
    exact_values: torch.Tensor | None = field(default=None, init=False, repr=False)
    _keys: "_Side | None" = field(default=None, init=False, repr=False)
    _values: "_Side | None" = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.scheme, StreamingScheme):
            raise ValueError(f"scheme must be a StreamingScheme, got {type(self.scheme).__name__}")
        if not isinstance(self.layout, BandLayout):
            raise ValueError(f"layout must be a BandLayout, got {type(self.layout).__name__}")

    @property
    def length(self) -> int:
        """Number of tokens written."""
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new exact tokens (B, Hkv, n, d); return the keys and values attention reads now.

        The returned tensors and the witnesses in the snapshot describe this step; the flush
        that follows changes the store for the next step only.
        """
        shapes = [tuple(getattr(x, "shape", ())) for x in (key_states, value_states)]
        if len(shapes[0]) != 4 or shapes[0][:3] != shapes[1][:3]:
            raise ValueError(f"key_states/value_states must be (B, Hkv, n, d) with one (B, Hkv, n), got {shapes}")
        if self._keys is None:
            scheme = self.scheme
            self._keys = _Side("key", WitnessedTensor(self.layout, self.keep_exact), scheme.key_policy, scheme.quantize_key)
            value_bands = BandLayout(value_states.shape[-1], 1)  # one band: rho_t >= ||v^_t - v_t||
            self._values = _Side("value", WitnessedTensor(value_bands, self.keep_exact), scheme.value_policy, scheme.quantize_value)
        self._keys.store.append_exact(key_states)
        self._values.store.append_exact(value_states)
        keys, values = self._keys.store, self._values.store
        self.keys, self.key_witness, self.exact_keys = keys.recon, keys.witness, keys.exact
        self.values, self.value_witness, self.exact_values = values.recon, values.witness[..., 0], values.exact
        self._keys.flush()
        self._values.flush()
        return self.keys, self.values

    def reset(self) -> None:
        """Forget every token (a new request)."""
        self._keys = self._values = None
        self.keys = self.values = self.key_witness = self.value_witness = None
        self.exact_keys = self.exact_values = None


@dataclass
class _Side:
    """One side of a :class:`StreamingLayer`: the witnessed store and how far it has been flushed."""

    role: str
    store: WitnessedTensor
    policy: FlushPolicy
    quantize: Callable
    flushed: int = 0  # tokens [0, flushed) are quantized, the rest is the exact window

    def flush(self) -> None:
        n = self.policy.flush_count(self.store.length - self.flushed)
        if n == 0:
            return
        block = self.store.recon[..., self.flushed : self.flushed + n, :]  # exact: never flushed before
        # WM with w = 0 and x^_old = x: the exact witness, formed while the exact keys exist
        self.store.move(apply_scheme(self.quantize, block, role=self.role), self.flushed)
        self.flushed += n


def register_streaming_scheme(scheme: StreamingScheme, *, replace: bool = False) -> StreamingScheme:
    """Register ``scheme`` under ``scheme.name`` and return it (``ValueError`` if the name is taken)."""
    if not isinstance(scheme, StreamingScheme):
        raise ValueError(f"scheme must be a StreamingScheme, got {type(scheme).__name__}")
    if scheme.name in _STREAMING and not replace and _STREAMING[scheme.name] is not scheme:
        raise ValueError(f"streaming scheme {scheme.name!r} is already registered (pass replace=True to override)")
    _STREAMING[scheme.name] = scheme
    return scheme


def get_streaming_scheme(name: str) -> StreamingScheme:
    """The registered streaming scheme ``name``."""
    if name not in _STREAMING:
        raise ValueError(f"unknown streaming scheme {name!r}; known: {', '.join(sorted(_STREAMING)) or 'none'}")
    return _STREAMING[name]


def list_streaming_schemes() -> list[str]:
    """Sorted names of the registered streaming schemes."""
    return sorted(_STREAMING)

"""transformers' own quantized KV caches (``QuantizedCache``: quanto, HQQ), with maintained Tier A witnesses.

What transformers 5.23 runs (``cache_utils.QuantizedLayer.update``): the first write of a layer
(the prefill) is quantized whole while attention reads it exactly; later writes go to an exact
residual window; every step attention reads ``[dequantized history, exact window, new tokens]``;
when the window reaches ``residual_length`` tokens (default 128) the *whole* cache, dequantized
history included, is quantized again and the window emptied. A token's reconstruction therefore
moves at every flush (HQQ re-groups and moves 4-bit keys by up to whole quantization steps), and
a witness computed at the first quantization goes stale.

:class:`QuantizedCacheWitness` wraps one layer's ``update`` (and ``reorder_cache``, ``reset``) and
forms the witness on the tensors ``update`` returns, which are by construction the keys and
values attention reads:

1. the new tokens, exact post-RoPE keys as the model wrote them, are appended with witness 0;
2. the layer's own ``update`` runs and returns what attention reads now;
3. every token whose read value moved gets its witness maintained (:mod:`witcert.tier_a.maintenance`,
   ``WM``): ``w + ||(x^_new - x^_old)_b||``, rounded up. A token quantized for the first time was
   held exactly until then (``w = 0``, ``x^_old = x``), so it gets its exact witness, computed at
   the step it is quantized while its exact key exists; a re-quantized token gets the triangle
   bound, which needs no exact key. With ``keep_exact`` every moved token's witness is recomputed
   from an exact shadow instead (tighter, twice the memory).

What the Tier A theorem covers here. For the keys attention reads at a step, the stored witness
satisfies ``w_{t,b} >= ||(k^_t - k_t)_b||`` against the exact post-RoPE key ``k_t``
(``WM`` inductively over the flushes, ``witness_of``'s rounding upward); Theorem 2 (``T2``) turns it
into ``c_t >= |eps_t|`` for every query, and T1/P1/MN into the meter. No rotation follows the
witness (it is formed on post-RoPE keys as computed), so Lemma 1 in floating point (``L1fp``) is
not needed. A backend whose ``update`` returns a tensor subclass, changes the dtype, or returns a
number of tokens other than the ones written raises instead of reporting.

Values get the same treatment with one band (``rho_t >= ||v^_t - v_t||``, the value side).

In ``witcert.monitor`` (and so ``witcert observe``) a :class:`QuantizedCacheSpec` (or its name in
:data:`HF_CACHE_SCHEMES`, e.g. ``"hf-quanto-int4"``) is a cache kind: each monitored layer is a
:class:`~witcert.integrations.hf.quantized_store.QuantizedLayerStore`, transformers' own quantized layer
with its maintained witness and no decoded copy between reads (never recomputed from the exact keys, so
the meter is the one a production cache without an exact copy reports), beside an exact shadow the
monitor uses only as the oracle of the true TV and the gate. :class:`QuantizedCacheWitness`, for a
cache of one's own, holds what each ``update`` returned (its :attr:`~QuantizedCacheWitness.keys`).

Requires the optional extra ``quant`` (optimum-quanto, hqq) for the quanto and HQQ backends;
transformers' ``fp8`` backend needs nothing more and is covered the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from witcert.schemes.registry import shares_memory
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.maintenance import WitnessedTensor

BACKEND_MODULES = {"quanto": "optimum.quanto", "hqq": "hqq"}  # what each backend imports
_ATTR = "_witcert_witness"  # the attached witness, on the layer


@dataclass(frozen=True)
class QuantizedCacheSpec:
    """One configuration of transformers' ``QuantizedCache`` (quanto or HQQ): a cache kind ``witcert.monitor`` runs.

    The defaults are transformers' (``QuantizedLayer``: axis 0, groups of 64, an exact window of
    the 128 most recent tokens). :meth:`layer` builds one empty layer of it.
    """

    backend: str
    nbits: int
    axis_key: int = 0
    axis_value: int = 0
    q_group_size: int = 64
    residual_length: int = 128

    def __post_init__(self):
        if self.backend not in BACKEND_MODULES:
            raise ValueError(f"backend must be one of {tuple(BACKEND_MODULES)}, got {self.backend!r}")
        for name in ("nbits", "q_group_size", "residual_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def name(self) -> str:
        """``hf-<backend>-int<nbits>``, with the settings that differ from transformers' defaults."""
        base = f"hf-{self.backend}-int{self.nbits}"
        changed = [f"{f}={getattr(self, f)}" for f in ("axis_key", "axis_value", "q_group_size", "residual_length")
                   if getattr(self, f) != self.__dataclass_fields__[f].default]
        return f"{base}({', '.join(changed)})" if changed else base

    def layer(self):
        """An empty transformers quantized layer of this configuration (``ImportError`` naming the extra)."""
        require_backend(self.backend)
        from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

        cls = {"quanto": QuantoQuantizedLayer, "hqq": HQQQuantizedLayer}[self.backend]
        return cls(nbits=self.nbits, axis_key=self.axis_key, axis_value=self.axis_value,
                   q_group_size=self.q_group_size, residual_length=self.residual_length)


# WitCert names of transformers' QuantizedCache configurations (transformers' defaults otherwise)
HF_CACHE_SCHEMES = {
    "hf-quanto-int2": QuantizedCacheSpec("quanto", 2),
    "hf-quanto-int4": QuantizedCacheSpec("quanto", 4),
    "hf-hqq-int2": QuantizedCacheSpec("hqq", 2),
    "hf-hqq-int4": QuantizedCacheSpec("hqq", 4),
    "hf-hqq-int8": QuantizedCacheSpec("hqq", 8),
}


def cache_spec_of(scheme) -> QuantizedCacheSpec | None:
    """The :class:`QuantizedCacheSpec` ``scheme`` names or is, else ``None`` (another kind of scheme)."""
    if isinstance(scheme, QuantizedCacheSpec):
        return scheme
    return HF_CACHE_SCHEMES.get(scheme) if isinstance(scheme, str) else None


@dataclass
class QuantizedCacheWitness:
    """One layer of a transformers quantized cache, with the witnesses of what attention reads.

    Parameters
    ----------
    layer : transformers.cache_utils.BaseQuantizedLayer
        An empty layer (``QuantoQuantizedLayer``, ``HQQQuantizedLayer``, ``Fp8QuantizedLayer``).
    layout : BandLayout
        Bands of the model's head dim under its RoPE pair convention.
    keep_exact : bool
        Hold an exact shadow of keys and values: witnesses are recomputed from it (tighter) and
        :attr:`exact_keys` / :attr:`exact_values` are available for validation.

    Attributes (after each ``update``)
    ----------------------------------
    keys, values : Tensor (B, Hkv, S, d)
        Exactly the tensors the layer's ``update`` returned (what attention reads this step).
    key_witness : Tensor (B, Hkv, S, bands), float16
        ``>= ||(keys - exact keys)_b||`` per token and band (Tier A, ``T2`` premise), rounded up.
    value_witness : Tensor (B, Hkv, S), float16
        ``>= ||values_t - exact values_t||`` per token.
    """

    layer: object
    layout: BandLayout
    keep_exact: bool = False
    _keys: WitnessedTensor = field(init=False, repr=False)
    _values: WitnessedTensor | None = field(default=None, init=False, repr=False)
    _wrapped: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        from transformers.cache_utils import BaseQuantizedLayer

        if not isinstance(self.layer, BaseQuantizedLayer):
            raise ValueError(
                f"layer must be a transformers quantized cache layer (BaseQuantizedLayer), got {type(self.layer).__name__}"
            )
        if not isinstance(self.layout, BandLayout):
            raise ValueError(f"layout must be a BandLayout, got {type(self.layout).__name__}")
        if self.layer.get_seq_length() != 0:
            raise ValueError(
                "layer already holds tokens: attach the witness before the first write, while the exact keys exist"
            )
        self._keys = WitnessedTensor(self.layout, keep_exact=self.keep_exact)

    # ------------------------------------------------------------------ the store protocol

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """The wrapped layer's ``update``: witnesses of the returned keys/values, then return them."""
        if "update" not in self._wrapped:
            raise RuntimeError("the witness is not attached to its layer: call attach() before the first write")
        if self._values is None:
            self._values = WitnessedTensor(BandLayout(value_states.shape[-1], 1), keep_exact=self.keep_exact)
        self._keys.append_exact(key_states)
        self._values.append_exact(value_states)
        keys, values = self._wrapped["update"](key_states, value_states, *args, **kwargs)
        held = (key_states, value_states, *vars(self.layer).values())
        keys, values = _owned(keys, held), _owned(values, held)
        self._read(self._keys, keys, "keys")
        self._read(self._values, values, "values")
        return keys, values

    @property
    def keys(self) -> torch.Tensor | None:
        return self._keys.recon

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values.recon

    @property
    def key_witness(self) -> torch.Tensor | None:
        return self._keys.witness

    @property
    def value_witness(self) -> torch.Tensor | None:
        return None if self._values is None else self._values.witness[..., 0]

    @property
    def exact_keys(self) -> torch.Tensor | None:
        """The exact shadow (``keep_exact`` only), else ``None``."""
        return self._keys.exact

    @property
    def exact_values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values.exact

    # ------------------------------------------------------------------ wrapping

    def attach(self) -> "QuantizedCacheWitness":
        """Route the layer's ``update``, ``reorder_cache`` and ``reset`` through this witness."""
        if getattr(self.layer, _ATTR, None) is not None:
            raise ValueError("layer already has a witness attached")
        for name, wrapper in (("update", self.update), ("reorder_cache", self._reorder), ("reset", self._reset)):
            self._wrapped[name] = getattr(self.layer, name)
            setattr(self.layer, name, wrapper)
        setattr(self.layer, _ATTR, self)
        return self

    def detach(self) -> None:
        """Restore the layer's own methods (the witnesses stop following it)."""
        for name in self._wrapped:
            delattr(self.layer, name)  # the instance attribute shadowed the class method
        self._wrapped.clear()
        setattr(self.layer, _ATTR, None)

    def _reorder(self, beam_idx: torch.LongTensor) -> None:
        self._wrapped["reorder_cache"](beam_idx)
        if self._keys.recon is not None:  # transformers skips an uninitialized layer too
            self._keys.reorder(beam_idx)
            self._values.reorder(beam_idx)

    def _reset(self) -> None:
        self._wrapped["reset"]()
        self._keys.reset()
        if self._values is not None:
            self._values.reset()

    @staticmethod
    def _read(side: WitnessedTensor, read, name: str) -> None:
        """What attention reads now: maintain the witness of every token whose value moved (``WM``)."""
        if type(read) is not torch.Tensor:
            raise RuntimeError(f"the layer's update returned {name} as {type(read).__name__}, not a plain tensor")
        if read.shape != side.recon.shape or read.dtype != side.recon.dtype:
            raise RuntimeError(
                f"the layer's update returned {name} {tuple(read.shape)} {read.dtype} after {side.length} tokens "
                f"{side.recon.dtype} were written: the witness cannot be attributed (was the cache cropped, "
                "reindexed or reset behind the witness?)"
            )
        side.move(read, 0)


def is_witnessed(layer) -> bool:
    """Whether a :class:`QuantizedCacheWitness` follows this cache layer (the monitor's guard may accept it)."""
    return getattr(layer, _ATTR, None) is not None


def witness_quantized_cache(cache, layout: BandLayout, keep_exact: bool = False) -> list[QuantizedCacheWitness]:
    """Attach a :class:`QuantizedCacheWitness` to every layer of an empty transformers ``QuantizedCache``."""
    layers = getattr(cache, "layers", None)
    if not layers:
        raise ValueError(f"cache must be a transformers Cache with its layers built, got {type(cache).__name__}")
    return [QuantizedCacheWitness(layer, layout, keep_exact=keep_exact).attach() for layer in layers]


def quantized_cache(
    scheme: str, config, layout: BandLayout, keep_exact: bool = False, **cache_kwargs
) -> tuple[object, list[QuantizedCacheWitness]]:
    """A witnessed transformers ``QuantizedCache`` for a WitCert scheme name in :data:`HF_CACHE_SCHEMES`.

    ``cache_kwargs`` go to ``QuantizedCache`` (``axis_key``, ``axis_value``, ``q_group_size``,
    ``residual_length``; transformers' defaults apply otherwise: axis 0, group 64, window 128).
    Pass the cache as ``past_key_values`` to ``generate``. Raises ``ValueError`` for an unknown
    name and ``ImportError`` (naming the extra) when the backend is not installed.
    """
    if scheme not in HF_CACHE_SCHEMES:
        raise ValueError(f"unknown HF cache scheme {scheme!r}; known: {', '.join(sorted(HF_CACHE_SCHEMES))}")
    spec = HF_CACHE_SCHEMES[scheme]
    require_backend(spec.backend)
    from transformers.cache_utils import QuantizedCache

    cache = QuantizedCache(spec.backend, config, nbits=spec.nbits, **cache_kwargs)
    return cache, witness_quantized_cache(cache, layout, keep_exact=keep_exact)


def require_backend(backend: str) -> None:
    """Raise ``ImportError`` with the install command when ``backend``'s package is missing."""
    import importlib.util

    module = BACKEND_MODULES.get(backend)
    if module is None:
        raise ValueError(f"backend must be one of {tuple(BACKEND_MODULES)}, got {backend!r}")
    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        raise ImportError(
            f"the {backend!r} KV-cache backend needs the optional extra 'quant' (optimum-quanto, hqq): "
            "DISABLE_CUDA=1 pip install --no-deps -r requirements-quant.txt (`make install` does)"
        )


def _owned(read, held: tuple):
    """``read`` (what the layer's ``update`` returned), or a copy when it shares memory with a tensor someone
    else may write again: the model's in-flight keys or values (transformers returns them themselves on
    a layer's first write) or a tensor the layer holds (its exact window). Otherwise it is a fresh
    ``torch.cat`` result nothing else references, and the witness may hold it as it is."""
    if type(read) is not torch.Tensor:
        return read  # _read raises with the type
    tensors = [t for part in held for t in (part if isinstance(part, (tuple, list)) else (part,))
               if isinstance(t, torch.Tensor) and t.numel()]
    if any(shares_memory(read, t) for t in tensors if type(t) is torch.Tensor):
        return read.clone()
    return read

"""The per-layer store of a monitored cache: what one layer holds, and what the meter reads from it.

A store is small on purpose (:class:`LayerStore`, the protocol every kind of store meets):

- ``append(key, value)``: the exact new tokens of one forward call (B, Hkv, T, d), compressed
  once, on write; the Tier A witness and the value statistics are formed right then, while the
  exact tokens exist (Lemma 1 ``L1`` / Theorem 2 ``T2``);
- ``read()``: the keys and values attention reads (B, Hkv, S, d), in the model's dtype;
- ``stored()``: :class:`witcert.tier_a.observation.StoredKeys` (reconstruction, witness, value
  statistics): everything the meter needs;
- ``exact()``: the exact keys and values when the store keeps them (the shadow the true TV and
  the in-memory gate use), else ``None``. It must hold only what the model computed, never a
  reconstruction: that is what makes it the oracle;
- ``memory()``: the bytes it holds, by part, against the exact cache of the same tokens.

:class:`CompressedLayer` is the store for every WitCert scheme: a codec
(:mod:`witcert.integrations.hf.codecs`) holds the compressed chunks, in the packed form where
one exists. With ``keep_exact`` it also keeps the exact keys and values (and caches the decoded
reconstruction, so reads cost nothing); without it, it holds only the packed chunks and the
witness and decodes on read (the memory saving), and the exact tokens go, if anywhere, to a
:class:`witcert.gate.backing_store.BackingStore` on the host for the gate.

Chunk-wise application matters for schemes that share statistics across tokens: KIVI keys
quantize complete 32-token groups of a chunk and keep the chunk's remainder exact (so single
decode tokens stay exact); a per-tensor scale is computed per chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Protocol

import torch

from witcert.core.rounding import round_up_to
from witcert.gate.backing_store import BackingStore
from witcert.integrations.hf.codecs import nbytes, owned_codec
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.observation import StoredKeys, stored_keys
from witcert.tier_a.witness import cat_tokens


@dataclass(frozen=True)
class MemoryAccount:
    """Bytes one store (or a sum of stores) holds, by part, and what the exact cache would hold.

    ``compressed``: the compressed keys and values as stored (packed codes, scales, fp8 values,
    or reconstructions); ``witness``: the Tier A witness and the value statistics;
    ``decoded``: a cached decoded copy of the reconstruction (only with the exact cache kept);
    ``exact_shadow``: exact keys and values kept on the device; ``exact_cache``: the bytes an
    uncompressed cache of the same tokens holds; ``backing_host``: exact blocks in the gate's
    host (or file) backing store, not on the device.
    """

    compressed: int = 0
    witness: int = 0
    decoded: int = 0
    exact_shadow: int = 0
    exact_cache: int = 0
    backing_host: int = 0

    @property
    def held(self) -> int:
        """Bytes the cache holds on the device: compressed + witness + decoded copy + exact shadow."""
        return self.compressed + self.witness + self.decoded + self.exact_shadow

    @property
    def saved(self) -> int:
        """``exact_cache - held``: negative when the monitored cache holds more than the exact one."""
        return self.exact_cache - self.held

    def __add__(self, other: "MemoryAccount") -> "MemoryAccount":
        return MemoryAccount(*(getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__))


class LayerStore(Protocol):
    """What the monitor needs from the store of one layer (see the module docstring)."""

    @property
    def length(self) -> int: ...

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None: ...

    def read(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def stored(self) -> StoredKeys: ...

    def exact(self) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def memory(self) -> MemoryAccount: ...


@dataclass
class CompressedLayer:
    """The store of one layer for any WitCert codec (Tier A schemes and the Tier B dithered cache).

    Parameters
    ----------
    codec : a codec of :mod:`witcert.integrations.hf.codecs` (``encode``/``decode``/``nbytes``)
    layout : BandLayout
        Bands of the witness.
    keep_exact : bool
        Keep the exact keys and values (true TV, in-memory gate) and the decoded reconstruction.
    backing : BackingStore or None
        Write every exact token there too (the production gate's page-in source).
    backing_key : hashable
        The backing-store stream of this layer.
    """

    codec: object
    layout: BandLayout
    keep_exact: bool = True
    backing: BackingStore | None = None
    backing_key: Hashable = 0
    key_chunks: list = field(default_factory=list, repr=False)  # codec-packed, in write order (joined where the codec can)
    value_chunks: list = field(default_factory=list, repr=False)
    _dtype: torch.dtype | None = field(default=None, repr=False)
    _stats: dict = field(default_factory=dict, repr=False)  # witness, value_residual, value_norm, (B, Hkv, S, ...)
    _exact: dict = field(default_factory=dict, repr=False)  # "k", "v" when kept
    _decoded: dict = field(default_factory=dict, repr=False)  # "k", "v" when kept
    _length: int = field(default=0, repr=False)

    def __post_init__(self):
        for name in ("encode", "decode", "nbytes"):
            if not callable(getattr(self.codec, name, None)):
                raise ValueError(f"codec must have an {name} method, got {type(self.codec).__name__}")
        if not isinstance(self.layout, BandLayout):
            raise ValueError(f"layout must be a BandLayout, got {type(self.layout).__name__}")
        if self.backing is not None and not isinstance(self.backing, BackingStore):
            raise ValueError(f"backing must be a BackingStore or None, got {type(self.backing).__name__}")
        self.codec = owned_codec(self.codec)  # a user codec's outputs are copied before a witness is formed

    @property
    def length(self) -> int:
        """Tokens stored."""
        return self._length

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Compress the exact new tokens ``key``/``value`` (B, Hkv, T, d) once and store them with their witness.

        The codec gets private copies (:func:`witcert.schemes.registry.apply_scheme` for schemes,
        :class:`witcert.integrations.hf.codecs.OwnedCodec` for user codecs): it can never write into the
        model's tensors, and what it returns is owned by this store before the witness is formed.
        """
        if not isinstance(key, torch.Tensor) or key.shape != getattr(value, "shape", None) or key.dim() != 4:
            raise ValueError(f"key/value must both be (B, Hkv, T, d), got {getattr(key, 'shape', key)} and "
                             f"{getattr(value, 'shape', value)}")
        if self._dtype is not None and (key.dtype != self._dtype or key.shape[:2] != self._stats["witness"].shape[:2]):
            raise ValueError(f"key {tuple(key.shape)} / {key.dtype} does not continue the stored "
                             f"{tuple(self._stats['witness'].shape[:2])} / {self._dtype} cache")
        if key.shape[-2] == 0:
            return
        start = self._length
        k_packed = self.codec.encode(key, "key", start)
        v_packed = self.codec.encode(value, "value", start)
        k_hat, v_hat = self.codec.decode(k_packed, key.dtype), self.codec.decode(v_packed, value.dtype)
        new = stored_keys(key, k_hat, value, v_hat, self.layout)
        _add_chunk(self.codec, self.key_chunks, k_packed)
        _add_chunk(self.codec, self.value_chunks, v_packed)
        held = [self._stats["witness"]] if "witness" in self._stats else []
        self._stats["witness"] = cat_tokens(*held, new.witness)  # band-major: the layout the fast band dot reads
        # the value norm (fp64) is kept rounded up to fp32: 4 bytes per token per head, still >= ||v_t||
        _extend(self._stats, value_residual=new.value_residual, value_norm=round_up_to(new.value_norm, torch.float32))
        if self.keep_exact:
            _extend(self._exact, k=key.detach().clone(), v=value.detach().clone())
            _extend(self._decoded, k=k_hat, v=v_hat)
        if self.backing is not None:
            self.backing.write(self.backing_key, key.detach(), value.detach())
        self._dtype = key.dtype
        self._length = start + key.shape[-2]

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values attention reads (B, Hkv, S, d): the decoded copy, or every chunk decoded now."""
        if not self._length:
            raise ValueError("the store is empty: nothing was appended")
        if self._decoded:
            return self._decoded["k"], self._decoded["v"]
        keys = torch.cat([self.codec.decode(p, self._dtype) for p in self.key_chunks], dim=-2)
        vals = torch.cat([self.codec.decode(p, self._dtype) for p in self.value_chunks], dim=-2)
        return keys, vals

    def stored(self, k_hat: torch.Tensor | None = None) -> StoredKeys:
        """:class:`StoredKeys` of every token (``k_hat``: the keys just read, to skip a second decode)."""
        k_hat = self.read()[0] if k_hat is None else k_hat
        return StoredKeys(k_hat=k_hat, **self._stats)

    def exact(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The exact keys and values (B, Hkv, S, d) as the model computed them, when kept."""
        return (self._exact["k"], self._exact["v"]) if self._exact else None

    def memory(self) -> MemoryAccount:
        """Bytes held, by part (:class:`MemoryAccount`)."""
        if not self._length:
            return MemoryAccount()
        itemsize = torch.empty((), dtype=self._dtype).element_size()
        b, hkv, _, bands = self._stats["witness"].shape
        backing = 0
        if self.backing is not None and self.backing_key in self.backing:
            backing = self.backing.length(self.backing_key) * b * hkv * self.layout.head_dim * itemsize * 2
        return MemoryAccount(
            compressed=sum(self.codec.nbytes(p) for p in (*self.key_chunks, *self.value_chunks)),
            witness=nbytes(*self._stats.values()),
            decoded=nbytes(*self._decoded.values()),
            exact_shadow=nbytes(*self._exact.values()),
            exact_cache=2 * b * hkv * self._length * self.layout.head_dim * itemsize,
            backing_host=backing,
        )


def _add_chunk(codec, chunks: list, packed) -> None:
    """Append ``packed``, joined to the last chunk where the codec can (an optional ``join(first, second)``)."""
    join = getattr(codec, "join", None)
    if chunks and callable(join):
        chunks[-1] = join(chunks[-1], packed)
    else:
        chunks.append(packed)


def _extend(parts: dict, **new: torch.Tensor) -> None:
    """Append each tensor along the token axis (2) of the stored one."""
    for name, tensor in new.items():
        parts[name] = tensor if name not in parts else torch.cat([parts[name], tensor], dim=2)

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
- ``memory()``: the bytes it holds, by part, against the exact cache of the same tokens
  (:class:`~witcert.integrations.hf.memory.MemoryAccount`).

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

import threading
from dataclasses import dataclass, field
from typing import Hashable, Protocol

import torch

from witcert.fastpath.group_check import group_bound_holds
from witcert.fastpath.pair_statistics import NARROW_INPUTS, pair_norms, pair_statistics
from witcert.gate.backing_store import BackingStore
from witcert.integrations.hf.codecs import owned_codec
from witcert.integrations.hf.memory import MemoryAccount
from witcert.integrations.hf.packed_history import PackedPair
from witcert.integrations.hf.token_buffer import TokenBuffer, split_pair
from witcert.core.values import value_norms
from witcert.tier_a.bands import BandLayout
from witcert.core.rounding import round_up_to
from witcert.tier_a.derived_witness import (
    check_error_bound, derived_norms, group_band_norms, group_counts, pack_nibbles, relative_codes, relative_witness,
    unpack_nibbles, witness_of_norms)
from witcert.tier_a.witness import band_major
from witcert.tier_a.observation import StoredKeys, stored_keys
from witcert.tier_a.witness_code import WitnessCode


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
    backing_values : bool
        Write the exact values to ``backing`` too (default): the gate repairs with them; the request audit
        (:mod:`witcert.audit`) reads exact keys only, and halves the store's writes without them.
    statistics : bool
        Form the witness and the value statistics (default). ``False``: a store nothing meters (the exact request
        audit, :mod:`witcert.audit.exact`, reads exact keys instead): no statistics are formed or held, and
        :meth:`stored` raises.
    witness_code : WitnessCode
        How the witness and the value statistics are kept (fp16, or one byte per band norm; always
        rounded up: :mod:`witcert.tier_a.witness_code`), or derived at every read from the codec's
        elementwise error bound (``witness_code.derived``; the codec must have ``error_bound``, ``DW``).

    Every per-token tensor (packed codes where the codec names its token axes, witness, value
    statistics, exact shadow, decoded copy) grows in place in a
    :class:`~witcert.integrations.hf.token_buffer.TokenBuffer`: a write copies its own tokens, never
    the history. The witness and value statistics of written tokens are formed on the first
    :meth:`stored` after them (one call for every token written since), from the exact tokens and
    their decodes held until then: the same values as forming them at each write, for one call
    instead of one per step. The history is append-only (:attr:`append_only`): a token's stored
    form never changes once written, so any later read of the first ``s`` tokens is what a read at
    length ``s`` returned.
    """

    codec: object
    layout: BandLayout
    keep_exact: bool = True
    backing: BackingStore | None = None
    backing_key: Hashable = 0
    backing_values: bool = True
    statistics: bool = True
    witness_code: WitnessCode = field(default_factory=WitnessCode)
    append_only: bool = field(default=True, init=False)  # a token's stored form never changes once written
    lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)  # writes vs a flush
    _packed: PackedPair = field(init=False, repr=False)
    _dtype: torch.dtype | None = field(default=None, repr=False)
    _heads: tuple | None = field(default=None, repr=False)  # (B, Hkv) of the first write
    _stats: dict = field(default_factory=dict, repr=False)  # witness (band-major), value_residual, value_norm
    _exact: TokenBuffer | None = field(default=None, repr=False)  # (2, B, Hkv, S, d) keys and values, when kept
    _decoded: TokenBuffer | None = field(default=None, repr=False)  # (2, B, Hkv, S, d) their decodes, when kept
    _unsettled: list = field(default_factory=list, repr=False)  # (exact pair, decoded pair) of writes, no witness yet
    _unbacked: list = field(default_factory=list, repr=False)  # exact pairs of writes not yet in ``backing``
    _settled: int = field(default=0, repr=False)  # tokens whose witness and value statistics are formed
    _length: int = field(default=0, repr=False)

    def __post_init__(self):
        for name in ("encode", "decode", "nbytes"):
            if not callable(getattr(self.codec, name, None)):
                raise ValueError(f"codec must have an {name} method, got {type(self.codec).__name__}")
        if not isinstance(self.layout, BandLayout):
            raise ValueError(f"layout must be a BandLayout, got {type(self.layout).__name__}")
        if self.backing is not None and not isinstance(self.backing, BackingStore):
            raise ValueError(f"backing must be a BackingStore or None, got {type(self.backing).__name__}")
        if not isinstance(self.witness_code, WitnessCode):
            raise ValueError(f"witness_code must be a WitnessCode, got {type(self.witness_code).__name__}")
        self.codec = owned_codec(self.codec)  # a user codec's outputs are copied before a witness is formed
        self._packed = PackedPair(self.codec)
        if self.witness_code.derived and not self._packed.bounded:
            raise ValueError(f"witness_bits={self.witness_code.bits} (a witness derived from the codec's error bound) "
                             "needs a codec with "
                             f"error_bound(packed, decoded); {_codec_name(self.codec)} has none: store the witness "
                             "(witness_bits=8 or 16)")
        if self.keep_exact:
            self._exact, self._decoded = TokenBuffer(-2), TokenBuffer(-2)

    @property
    def length(self) -> int:
        """Tokens stored."""
        return self._length

    @property
    def kv_heads(self) -> int:
        """Key/value heads of the tokens stored (of the first write)."""
        if self._heads is None:
            raise ValueError("the store is empty: nothing was appended")
        return self._heads[1]

    @property
    def key_chunks(self) -> list:
        """The packed key chunks, in write order (one, grown in place, for a codec with token axes)."""
        return self._packed.chunks(0)

    @property
    def value_chunks(self) -> list:
        return self._packed.chunks(1)

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Compress the exact new tokens ``key``/``value`` (B, Hkv, T, d) once and store them (witness on the next
        :meth:`stored`).

        The codec gets private copies (:func:`witcert.schemes.registry.apply_scheme` for schemes,
        :class:`witcert.integrations.hf.codecs.OwnedCodec` for user codecs): it can never write into the
        model's tensors, and what it returns is owned by this store before the witness is formed.
        """
        if not isinstance(key, torch.Tensor) or key.shape != getattr(value, "shape", None) or key.dim() != 4:
            raise ValueError(f"key/value must both be (B, Hkv, T, d), got {getattr(key, 'shape', key)} and "
                             f"{getattr(value, 'shape', value)}")
        if self._dtype is not None and (key.dtype != self._dtype or tuple(key.shape[:2]) != self._heads):
            raise ValueError(f"key {tuple(key.shape)} / {key.dtype} does not continue the stored "
                             f"{self._heads} / {self._dtype} cache")
        if key.shape[-2] == 0:
            return
        with self.lock:
            self._append(key.detach(), value.detach())

    def _append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        start = self._length
        exact = torch.stack([key, value])  # (2, B, Hkv, T, d): the store's own copy of the exact tokens
        decoded = self._packed.add(exact, start)  # None: decoded from the history when needed
        if self.keep_exact:
            self._exact.append(exact)
            self._decoded.append(self._packed.decode(key.dtype, start) if decoded is None else decoded)
        elif self.statistics:
            self._unsettled.append((exact, decoded))
        if self.backing is not None:  # written by the next read of it or settle (write_backing): one write per run
            self._unbacked.append(exact)  # the store's own copy (held for the witness too until the next settle)
        self._dtype, self._heads = key.dtype, tuple(key.shape[:2])
        self._length = start + key.shape[-2]

    def write_backing(self) -> None:
        """Write the exact tokens appended since the last call to the host backing store, in one write.

        Every reader of the backing store calls it first (the checks and repairs of a metered pass,
        :func:`witcert.integrations.hf.attention.attend`), and every settle does, so the tokens waiting are only
        ever those whose exact copies the store holds anyway for their witness (no byte held beyond them); a row
        read that was never written still raises (:class:`witcert.gate.backing_store.NeverWrittenError`). One
        write per run of steps instead of one per step: the checksums and the copy in one pass each.
        """
        with self.lock:
            waiting, self._unbacked = self._unbacked, []
            if waiting and self.backing is not None:
                pair = _cat_tokens(waiting)
                self.backing.write(self.backing_key, pair[0], pair[1] if self.backing_values else None)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values attention reads (B, Hkv, S, d): the decoded copy, or every chunk decoded now."""
        if not self._length:
            raise ValueError("the store is empty: nothing was appended")
        with self.lock:
            return self._read()

    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        pair = self._decoded.view() if self.keep_exact else self._packed.decode(self._dtype)
        return pair[0], pair[1]

    def stored(self, k_hat: torch.Tensor | None = None) -> StoredKeys:
        """:class:`StoredKeys` of every token (``k_hat``: the keys just read, to skip a second decode)."""
        if not self.statistics:
            raise ValueError("stored: this store forms no witness (statistics=False: a store nothing meters)")
        with self.lock:
            if self.witness_code.derived:
                return self._derived_stored(k_hat)
            self._settle()
            k_hat = self._read()[0] if k_hat is None else k_hat
            witness, rho, v_norm = self.witness_code.readable(*(self._stats[name].view() for name in _STATS))
            # band-major: what the fast band dot reads
            return StoredKeys(k_hat=k_hat, witness=witness.transpose(-1, -2), value_residual=rho, value_norm=v_norm)

    def exact(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The exact keys and values (B, Hkv, S, d) as the model computed them, when kept."""
        return split_pair(self._exact)

    def memory(self) -> MemoryAccount:
        """Bytes held, by part (:class:`MemoryAccount`), every written token's witness formed."""
        if not self._length:
            return MemoryAccount()
        with self.lock:
            self._settle()
        itemsize = torch.empty((), dtype=self._dtype).element_size()
        b, hkv = self._heads
        buffers = [*self._stats.values(), *(x for x in (self._decoded, self._exact) if x is not None)]
        return MemoryAccount(
            compressed=self._packed.nbytes(),
            witness=sum(buffer.nbytes() for buffer in self._stats.values()),
            decoded=0 if self._decoded is None else self._decoded.nbytes(),
            exact_shadow=0 if self._exact is None else self._exact.nbytes(),
            exact_cache=2 * b * hkv * self._length * self.layout.head_dim * itemsize,
            reserved=self._packed.reserved() + sum(buffer.reserved() for buffer in buffers),
            **backing_bytes(self.backing, self.backing_key),
        )

    def _derived_stored(self, k_hat: torch.Tensor | None) -> StoredKeys:
        """:meth:`stored` with the witness derived from the codec's error bound (``DW``): the bounds checked for the
        tokens written since the last call, then reduced to band norms (from the scales alone where the codec
        declares them per channel group; else against the history decoded once)."""
        pair = None if self._packed.grouped and k_hat is not None else self._read_pair()
        with torch.no_grad():
            self._settle(pair)
            keys, values = self._derived_norms(pair)
            if self.witness_code.relative:
                witness, rho = self._relative_stats(keys, values)
            else:
                witness, rho = witness_of_norms(keys), round_up_to(values, torch.float32)
        return StoredKeys(k_hat=pair[0] if k_hat is None else k_hat, witness=witness, value_residual=rho,
                          value_norm=self._stats["value_norm"].view().float())

    def _read_pair(self) -> torch.Tensor:
        return self._decoded.view() if self.keep_exact else self._packed.decode(self._dtype)

    def _derived_norms(self, pair: torch.Tensor | None, start: int = 0,
                       groups: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp64 upper band norms of the codec's bounds of the tokens from ``start`` on: keys (B, Hkv, S', bands),
        values (B, Hkv, S') (``DW``); ``groups``: their bounds per channel group, where already formed."""
        if self._packed.grouped:
            if groups is None:  # (2, B, Hkv, S', G): cheap, from the scales of those tokens alone
                groups = self._packed.group_error_bound(self._dtype, start)
            counts = group_counts(self.layout, groups.shape[-1])
            whole = group_counts(BandLayout(self.layout.head_dim, 1), groups.shape[-1])
            return group_band_norms(groups[0], counts), group_band_norms(groups[1], whole)[..., 0]
        bound = self._packed.error_bound(pair)  # (2, B, Hkv, S, d) fp64
        bound = bound.narrow(-2, start, bound.shape[-2] - start)
        return derived_norms(bound[0], self.layout), derived_norms(bound[1], None)

    def _new_bounds(self, start: int, n: int, pair: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(decoded, fp64 bounds)`` (2, B, Hkv, n, d) of the tokens ``start .. start + n``: the bounds elementwise,
        or per channel group (2, B, Hkv, n, G) where the codec declares them so (:attr:`PackedPair.grouped`)."""
        if self._packed.grouped:
            decoded = pair.narrow(-2, start, n) if pair is not None else (
                self._decoded.view().narrow(-2, start, n) if self.keep_exact else self._packed.decode(self._dtype, start))
            return decoded, self._packed.group_error_bound(self._dtype, start).narrow(-2, 0, n)
        pair = self._read_pair() if pair is None else pair
        return pair.narrow(-2, start, n), self._packed.error_bound(pair).narrow(-2, start, n)

    def _check_new_bounds(self, exact: torch.Tensor, decoded: torch.Tensor, bound: torch.Tensor) -> None:
        """Refuse the codec (``ValueError`` naming it) unless ``|x - x^| <= e`` for every new channel (``DW``'s
        hypothesis): per channel group in one pass where the bounds are per group, elementwise otherwise (and for
        the message, where a group's check fails)."""
        if self._packed.grouped:
            if group_bound_holds(exact, decoded, bound):
                return
            bound = bound.repeat_interleave(self.layout.head_dim // bound.shape[-1], dim=-1)
        check_error_bound(exact, decoded, bound, _codec_name(self.codec))

    def _settle(self, pair: torch.Tensor | None = None) -> None:
        """Form the witness and value statistics of the tokens written since the last call (one call for all)."""
        self.write_backing()  # before the exact tokens held for the witness are dropped
        if self._settled == self._length:
            return
        if not self.statistics:  # nothing held for a witness (the exact shadow, when kept, stays)
            self._settled = self._length
            return
        if self.witness_code.derived:
            return self._settle_derived(pair)
        exact, decoded = self._unsettled_pairs()
        with torch.no_grad():  # statistics of stored tokens, whatever grad mode the caller is in
            witness, rho, v_norm = _written_statistics(exact, decoded, self.layout)
        self._unsettled, self._settled = [], self._length
        code = self.witness_code  # every stored value rounded up: still >= the norm it stands for
        _grow(self._stats, axis=-1, witness=code.witness(witness.transpose(-1, -2)),
              value_residual=code.residual(rho), value_norm=code.norm(v_norm))

    def _settle_derived(self, pair: torch.Tensor | None) -> None:
        """Derived mode: check ``|x - x^| <= error bound`` for every new token (``ValueError`` naming the codec where
        the codec's declaration fails: never a witness from a violated bound) and keep only ``||v_t||`` (and, at 4
        bits, the fractions of the derived witness)."""
        with torch.no_grad():
            start, n = self._settled, self._length - self._settled
            exact = self._exact.view().narrow(-2, start, n) if self.keep_exact else _cat_tokens([e for e, _ in self._unsettled])
            decoded, bound = self._new_bounds(start, n, pair)
            self._check_new_bounds(exact, decoded, bound)
            self._unsettled, self._settled = [], self._length
            if not self.witness_code.relative:
                _grow(self._stats, axis=-1, value_norm=self.witness_code.norm(value_norms(exact[1])))
                return
            keys, rho, v_norm = _written_norms(exact, decoded, self.layout)
            groups = bound if self._packed.grouped else None  # the new tokens' bounds per channel group, formed once
            _grow(self._stats, axis=-1, value_norm=self.witness_code.norm(v_norm),
                  **self._relative_codes(keys, rho, start, groups))

    def _relative_codes(self, keys: torch.Tensor, rho: torch.Tensor, start: int, groups: torch.Tensor | None) -> dict:
        """``witness_bits=4``: each band norm ``keys`` (fp64 upper, (..., n, B)) of the new tokens' residuals as a 4-bit
        fraction of the derived witness (nibbles, band-major (..., ceil(B/2), n)), each value residual norm ``rho``
        as an 8-bit fraction of its derived bound (``groups``: the new tokens' bounds per channel group, if any)."""
        derived_keys, derived_values = self._derived_norms(None if self._packed.grouped else self._read_pair(), start,
                                                           groups)
        codes = relative_codes(keys, derived_keys, 16).transpose(-1, -2)  # (..., B, n)
        if codes.shape[-2] % 2:
            codes = torch.cat([codes, torch.zeros_like(codes[..., :1, :])], dim=-2)
        return {"witness": pack_nibbles(codes), "value_residual": relative_codes(rho, derived_values, 256)}

    def _relative_stats(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp16 witness (band-major) and fp32 value residual the stored fractions of the derived norms stand for."""
        codes = unpack_nibbles(self._stats["witness"].view())[..., :self.layout.bands, :].transpose(-1, -2)
        witness = relative_witness(codes, keys, 16, torch.float16)
        rho = relative_witness(self._stats["value_residual"].view(), values, 256, torch.float32)
        return band_major(witness), rho

    def _unsettled_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact and decoded (2, B, Hkv, n, d) of the tokens without statistics: from the kept buffers, else the
        writes held since (and their decodes, from the history where it decodes a range)."""
        start, n = self._settled, self._length - self._settled
        if self.keep_exact:
            return self._exact.view().narrow(-2, start, n), self._decoded.view().narrow(-2, start, n)
        exact = _cat_tokens([e for e, _ in self._unsettled])
        if self._packed.ranged:
            return exact, self._packed.decode(self._dtype, start)
        return exact, _cat_tokens([d for _, d in self._unsettled])


_STATS = ("witness", "value_residual", "value_norm")  # per-token statistics, band-major witness first


def _codec_name(codec) -> str:
    return getattr(codec, "name", None) or type(getattr(codec, "inner", codec)).__name__


def backing_bytes(backing: BackingStore | None, key: Hashable) -> dict:
    """``MemoryAccount`` fields of one layer's backing stream: its allocated bytes, in host memory or in files."""
    if backing is None or key not in backing:
        return {}
    return {"backing_files" if backing.directory is not None else "backing_host": backing.stream_nbytes(key)}


def _written_statistics(exact: torch.Tensor, decoded: torch.Tensor,
                        layout: BandLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(witness, rho, v_norm)`` of written tokens, keys and values stacked (2, B, Hkv, n, d) (``L1``, ``T2``): one
    pass over both stacks where the model dtype is at most fp32 (:func:`~witcert.fastpath.pair_statistics.
    pair_statistics`), the general statistics otherwise and wherever an entry is not finite (their error)."""
    if exact.dtype in NARROW_INPUTS and decoded.dtype == exact.dtype:
        witness, rho, v_norm, finite = pair_statistics(exact, decoded, layout)
        if bool(finite):
            return witness, rho, v_norm
    new = stored_keys(exact[0], decoded[0], exact[1], decoded[1], layout)  # raises on a non-finite entry
    return new.witness, new.value_residual, new.value_norm


def _written_norms(exact: torch.Tensor, decoded: torch.Tensor,
                   layout: BandLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 upper norms ``(keys (B, Hkv, n, bands), rho, v_norm)`` of written tokens' residuals and values, keys and
    values stacked (2, B, Hkv, n, d) (``DW``'s relative codes): one pass where the model dtype is at most fp32
    (:func:`~witcert.fastpath.pair_statistics.pair_norms`), the general norms otherwise and wherever an entry is not
    finite (``value_norms`` raises naming it)."""
    if exact.dtype in NARROW_INPUTS and decoded.dtype == exact.dtype:
        keys, rho, v_norm, finite = pair_norms(exact, decoded, layout)
        if bool(finite):
            return keys, rho, v_norm
    v_norm = value_norms(exact[1])
    residual = decoded.double() - exact.double()
    return derived_norms(residual[0], layout), derived_norms(residual[1], None), v_norm


def _cat_tokens(parts: list) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


def _grow(parts: dict, axis: int = -2, **new: torch.Tensor) -> None:
    """Append each tensor to the :class:`TokenBuffer` ``parts[name]`` along ``axis`` (made at the first call)."""
    for name, tensor in new.items():
        if name not in parts:
            parts[name] = TokenBuffer(axis)
        parts[name].append(tensor)

"""The monitor's store over one of transformers' quantized layers (quanto, HQQ): packed between reads (WM, T2).

transformers' ``QuantizedLayer.update`` (5.23) holds a quantized history ``Q`` and an exact window, and
every call returns ``[dequantize(Q), window, new tokens]``, decoded afresh; when the window fills (and at
the first write, the prefill) it quantizes everything it just returned into a new ``Q``, read from the
next call on. :class:`QuantizedLayerStore` keeps only what that layer keeps (the packed ``Q``, the window)
plus the witnesses: no decoded copy between reads. The keys a call returned are referenced weakly, so
they are freed with the forward call that attended them, as in a stock ``QuantizedCache``.

Which witness describes which read. Tokens move only where ``Q`` was rebuilt, and they move to
``dequantize(Q)`` at the next read. So when an update rebuilds ``Q`` the store decodes it once (a
transient copy, once per flush) and forms the witness of the next read right away, while the values
it replaces are the ones just returned: ``w' = w + ||(dequantize(Q) - returned)_b||`` rounded up
(:func:`witcert.tier_a.maintenance.maintained_witness`, ``WM``; a token returned exactly has ``w = 0``
and gets its exact witness). That witness becomes the current one at the next update; new tokens
enter with witness 0 (they are read exactly). The witness never uses the exact shadow, so
``keep_exact=True`` reports the meter production reports. Decoding is deterministic (checked at the
first rebuild): the next read's prefix is the decode the witness was formed on.

Values are witnessed the same way with one band (``rho_t``); the value norms are formed on write.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Hashable

import torch

from witcert.core.values import value_norms
from witcert.integrations.hf.compressed_cache import backing_bytes
from witcert.integrations.hf.memory import MemoryAccount
from witcert.integrations.hf.quantized_cache import QuantizedCacheSpec
from witcert.integrations.hf.token_buffer import TokenBuffer, split_pair
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.maintenance import maintained_witness
from witcert.tier_a.observation import StoredKeys
from witcert.tier_a.witness import band_major, cat_tokens
from witcert.tier_a.witness_code import WitnessCode


@dataclass
class _Side:
    """The witness of one side (keys or values): of the current read, and of the next one after a rebuild."""

    layout: BandLayout
    code: WitnessCode
    current: torch.Tensor | None = None  # (B, H, S, bands) stored form, band-major: describes the last read
    following: torch.Tensor | None = None  # the same after a rebuild of Q: describes the next read's prefix

    def enter(self, n_new: int, like: torch.Tensor) -> None:
        """An update returned ``n_new`` new tokens exactly (witness 0) after every token held (the read
        after a rebuild takes the witness formed at it)."""
        held = self.following if self.following is not None else self.current
        zeros = self.code.witness(torch.zeros(*like.shape[:2], n_new, self.layout.bands, dtype=torch.float16,
                                              device=like.device))
        self.current = zeros if held is None else cat_tokens(held, zeros)
        self.following = None

    def rebuilt(self, returned: torch.Tensor, decoded: torch.Tensor) -> None:
        """``Q`` now holds every returned token and the next read gives ``decoded`` for them (``WM``)."""
        w16 = self.code.decoded(self.current)
        self.following = self.code.witness(band_major(maintained_witness(w16, returned, decoded, self.layout)))

    def released(self) -> None:
        """The last read is freed: the witness of the next read is the only one needed from now on."""
        if self.following is not None:
            self.current, self.following = self.following, None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.current, self.following) if t is not None)


@dataclass
class QuantizedLayerStore:
    """The monitor's store of one layer (``LayerStore`` protocol) over a transformers quantized layer.

    ``append`` runs the layer's own ``update``; ``read`` returns exactly what that ``update`` returned
    (while the forward call that attends it holds it), so the model attends over transformers' cache and
    the meter describes it. The value norms ``>= ||v_t||`` are formed on write from the exact values.
    ``keep_exact`` keeps an exact shadow for the true TV and the in-memory gate only (the witness never
    uses it); ``backing`` receives every exact token (the production gate's page-in source).
    """

    spec: QuantizedCacheSpec
    layout: BandLayout
    keep_exact: bool = True
    backing: object = None  # witcert.gate.backing_store.BackingStore
    backing_key: Hashable = 0
    backing_values: bool = True  # False: exact keys only (the request audit reads no values)
    witness_code: WitnessCode = field(default_factory=WitnessCode)
    layer: object = field(init=False, repr=False)  # transformers' QuantizedLayer of the spec
    _keys: _Side = field(init=False, repr=False)
    _values: _Side | None = field(default=None, init=False, repr=False)
    _value_norm: TokenBuffer = field(default_factory=lambda: TokenBuffer(-1), init=False, repr=False)
    _exact: TokenBuffer | None = field(default=None, init=False, repr=False)  # (2, B, Hkv, S, d) when kept
    _last: tuple | None = field(default=None, init=False, repr=False)  # weak references to the last read
    _handoff: tuple | None = field(default=None, init=False, repr=False)  # the last read, until read() returns it
    _checked: bool = field(default=False, init=False, repr=False)  # decode determinism checked
    _length: int = field(default=0, init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.spec, QuantizedCacheSpec):
            raise ValueError(f"spec must be a QuantizedCacheSpec, got {type(self.spec).__name__}")
        if not isinstance(self.witness_code, WitnessCode):
            raise ValueError(f"witness_code must be a WitnessCode, got {type(self.witness_code).__name__}")
        if self.witness_code.derived:
            raise ValueError(f"{self.spec.name}: witness_bits={self.witness_code.bits} derives the witness from a "
                             "codec's elementwise error "
                             "bound; transformers' quantized layers declare none: store the witness (witness_bits=8 "
                             "or 16)")
        self.layer = self.spec.layer()
        self._keys = _Side(self.layout, self.witness_code)
        if self.keep_exact:
            self._exact = TokenBuffer(-2)

    @property
    def length(self) -> int:
        return self._length

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write the exact new tokens (B, Hkv, T, d) through the layer's ``update``; witnesses follow."""
        if not isinstance(key, torch.Tensor) or key.shape != getattr(value, "shape", None) or key.dim() != 4:
            raise ValueError(f"key/value must both be (B, Hkv, T, d), got {getattr(key, 'shape', key)} and "
                             f"{getattr(value, 'shape', value)}")
        if key.shape[-2] == 0:
            return
        if self._values is None:
            self._values = _Side(BandLayout(value.shape[-1], 1), self.witness_code)
        self._value_norm.append(self.witness_code.norm(value_norms(value)))  # >= ||v_t||
        if self.keep_exact:  # copied before the backend sees the tensors
            self._exact.append(torch.stack([key.detach(), value.detach()]))
        if self.backing is not None:
            self.backing.write(self.backing_key, key.detach(), value.detach() if self.backing_values else None)
        held = self.layer._quantized_keys if self._length else None
        keys, values = self.layer.update(key, value)
        _check_returned(keys, values, self._length + key.shape[-2], key)
        for side, read in ((self._keys, keys), (self._values, values)):
            side.enter(key.shape[-2], read)
        if self.layer._quantized_keys is not held:  # rebuilt (the prefill, or a flush): the next read moves
            decoded = self._decoded_history()
            self._keys.rebuilt(keys, decoded[0])
            self._values.rebuilt(values, decoded[1])
        self._last = (weakref.ref(keys), weakref.ref(values))
        self._handoff = (keys, values)  # held until read() hands them out (then only weakly)
        self._length += key.shape[-2]

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the layer's last ``update`` returned (B, Hkv, S, d), while its forward call holds it; afterwards
        the keys a read would return now, decoded afresh from the quantized history and the exact window."""
        if not self._length:
            raise ValueError("the store is empty: nothing was appended")
        handoff, self._handoff = self._handoff, None
        last = handoff or self._last_read()
        return last if last is not None else self._decoded_state()

    def stored(self, k_hat: torch.Tensor | None = None) -> StoredKeys:
        """The read keys, their witnesses and the value statistics (``k_hat``: the keys :meth:`read` returned)."""
        last = self._last_read()
        keys = self.read()[0] if k_hat is None else k_hat
        if last is None:  # freed with its forward call: a read now is a fresh decode, after any rebuild
            self._release()
        if last is not None and keys is last[0] or last is None and k_hat is None:
            witness, rho = self._keys.current, self._values.current
        else:
            raise ValueError("k_hat must be the keys this store's layer returned last (the witnessed tensor)")
        witness, rho, v_norm = self.witness_code.readable(witness, rho[..., 0], self._value_norm.view())
        return StoredKeys(k_hat=keys, witness=witness, value_residual=rho, value_norm=v_norm)

    def exact(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The exact keys and values as the model wrote them (``keep_exact``), else ``None``."""
        return split_pair(self._exact)

    def memory(self) -> MemoryAccount:
        """Bytes held: the layer's quantized history and exact window (compressed), the witnesses and value
        norms, the exact shadow; and the host backing store. Nothing decoded is held between reads."""
        if not self._length:
            return MemoryAccount()
        if self._last_read() is None:
            self._release()
        layer = self.layer
        b, hkv = self._value_norm.view().shape[:2]
        itemsize = torch.empty((), dtype=layer.dtype).element_size()
        buffers = [self._value_norm, *(() if self._exact is None else (self._exact,))]
        return MemoryAccount(
            compressed=_bytes(layer._quantized_keys, layer._quantized_values, layer.keys, layer.values),
            witness=self._keys.nbytes() + self._values.nbytes() + self._value_norm.nbytes(),
            exact_shadow=0 if self._exact is None else self._exact.nbytes(),
            exact_cache=2 * b * hkv * self._length * self.layout.head_dim * itemsize,
            reserved=sum(buffer.reserved() for buffer in buffers),
            **backing_bytes(self.backing, self.backing_key),
        )

    def _release(self) -> None:
        """Nothing holds the last read any more: drop the witness that described it where a rebuild replaced it."""
        self._handoff = None
        for side in (self._keys, self._values):
            side.released()

    def _last_read(self) -> tuple | None:
        if self._last is None:
            return None
        keys, values = self._last[0](), self._last[1]()
        return None if keys is None or values is None else (keys, values)

    def _decoded_history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``dequantize(Q)`` of keys and values (a transient decode), checked deterministic once."""
        layer = self.layer
        decoded = layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)
        if not self._checked:
            again = layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)
            if not all(torch.equal(a, b) for a, b in zip(decoded, again)):
                raise RuntimeError(f"{self.spec.name}: dequantizing the same quantized history twice gave different "
                                   "values; the witness is formed on one decode and attention reads another")
            self._checked = True
        return decoded

    def _decoded_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[dequantize(Q), window]``: what the layer's next update returns before its new tokens."""
        layer = self.layer
        keys, values = self._decoded_history()
        if layer.keys is not None and layer.keys.dim() == 4 and layer.keys.shape[-2]:
            keys, values = torch.cat([keys, layer.keys], dim=-2), torch.cat([values, layer.values], dim=-2)
        return keys, values


def _check_returned(keys, values, length: int, written: torch.Tensor) -> None:
    """Refuse what the witness cannot attribute: a tensor subclass, another dtype, another number of tokens."""
    for name, read in (("keys", keys), ("values", values)):
        if type(read) is not torch.Tensor:
            raise RuntimeError(f"the layer's update returned {name} as {type(read).__name__}, not a plain tensor")
        if read.shape[:2] != written.shape[:2] or read.shape[-2] != length or read.dtype != written.dtype:
            raise RuntimeError(f"the layer's update returned {name} {tuple(read.shape)} {read.dtype} after {length} "
                               f"tokens {written.dtype} were written: the witness cannot be attributed")


def _bytes(*parts) -> int:
    """Bytes of the tensors inside ``parts`` (tuples, dicts, tensor subclasses such as quanto's QTensor)."""
    total = 0
    for part in parts:
        if isinstance(part, (tuple, list)):
            total += _bytes(*part)
        elif isinstance(part, dict):
            total += _bytes(*part.values())
        elif isinstance(part, torch.Tensor):
            if type(part) is not torch.Tensor and hasattr(part, "__tensor_flatten__"):
                names, _ = part.__tensor_flatten__()
                total += _bytes(*(getattr(part, name) for name in names))
            else:
                total += part.numel() * part.element_size()
    return total

"""What a compressed cache holds of one role (keys or values): the codec's packed chunks, in write order.

A codec that names the token axis of its packed form (``token_axes``: one axis per tensor of its
packed tuple, ``None`` for an entry that is not per token, or one axis for a packed tensor) is held
in :class:`~witcert.integrations.hf.token_buffer.TokenBuffer` s: every write lands in place and the
history is one packed chunk, decoded in one call, with no per-step ``cat`` (:class:`IntCodes`,
:class:`Reconstruction`). Any other codec keeps one chunk per write, joined to the last one where it
has a ``join`` (checked lossless for user codecs, :class:`~witcert.integrations.hf.codecs.OwnedCodec`).

Why growing in place is the same as joining: a per-token packed form decodes token by token, so
the chunk grown in place decodes to the chunks' decodes one after the other, bit for bit
(``tests/test_token_buffer.py``); the witness of each token was formed against its own decode.

:class:`PackedPair` holds a layer's keys and values: one history of both, stacked, where the codec
treats the two alike (``roles_alike``: :class:`~witcert.integrations.hf.codecs.IntCodes`, which ignores
the role), so a step encodes and a read decodes keys and values in one call each; one history per
role otherwise.

A production store decodes its whole history at every read. For integer codes under
``WITCERT_COMPILE=1`` that read is one compiled pass over the growing buffers as they lie
(:mod:`witcert.fastpath.packed_decode`), bit for bit the codec's decode, so attention and the meter
read the very keys each token's witness was formed on; nothing decoded is kept between reads.

A codec with ``error_bound(packed, decoded)`` (elementwise bounds on its reconstruction error, ``DW``) gets
them for the whole history from :meth:`PackedPair.error_bound`, chunk by chunk against the decoded history
(each chunk's token count is kept for that); one with ``group_error_bound(packed, dtype)`` (bounds constant
over channel groups, from its scales) from :meth:`PackedPair.group_error_bound`, with no decode.
"""
from __future__ import annotations

import torch

from witcert.fastpath.compiled import compile_requested
from witcert.fastpath.packed_decode import FUSED_DTYPES, held_decode
from witcert.integrations.hf.codecs import IntCodes
from witcert.integrations.hf.token_buffer import TokenBuffer


class PackedHistory:
    """The packed chunks of one role of one layer (see the module docstring)."""

    def __init__(self, codec):
        self.codec = codec
        self.axes = getattr(codec, "token_axes", None)
        self.chunks: list = []  # packed chunks in write order (one, grown in place, when the codec has token axes)
        self.lengths: list[int] = []  # tokens of each chunk (of the one chunk when the codec has token axes)
        self._buffers: list[TokenBuffer | None] | None = None

    def add(self, packed, dtype: torch.dtype, tokens: int = 0) -> None:
        """Append one written chunk of ``tokens`` tokens (``dtype``: the model dtype its tokens decode to)."""
        if self.axes is None:
            self._add_chunk(packed, tokens)
        elif isinstance(self.axes, int):
            self.chunks = [self._grow(0, self.axes, packed, dtype)]
        else:
            if not isinstance(packed, tuple) or len(packed) != len(self.axes):
                raise ValueError(f"codec {type(self.codec).__name__} declares token_axes {self.axes} but encoded a "
                                 f"{type(packed).__name__} of {len(packed) if isinstance(packed, tuple) else 1} parts")
            self.chunks = [tuple(part if axis is None else self._grow(i, axis, part, dtype)
                                 for i, (axis, part) in enumerate(zip(self.axes, packed)))]

    def decode(self, dtype: torch.dtype, start: int = 0) -> torch.Tensor:
        """The tokens held from ``start`` on, decoded (..., S - start, d) (``start > 0`` needs token axes)."""
        fused = self._fused_decode(dtype, start)
        if fused is not None:
            return fused
        if start:
            if self.axes is None:
                raise ValueError("a history of whole chunks decodes from its first token only")
            chunk = self.chunks[0]
            if isinstance(self.axes, int):
                chunk = chunk.narrow(chunk.dim() + self.axes, start, chunk.shape[self.axes] - start)
            else:
                chunk = tuple(p if a is None else p.narrow(p.dim() + a, start, p.shape[a] - start)
                              for a, p in zip(self.axes, chunk))
            return self.codec.decode(chunk, dtype)
        decoded = [self.codec.decode(p, dtype) for p in self.chunks]
        return decoded[0] if len(decoded) == 1 else torch.cat(decoded, dim=-2)

    def _fused_decode(self, dtype: torch.dtype, start: int) -> torch.Tensor | None:
        """The whole history of integer codes in one compiled pass over the buffers as they lie
        (:func:`~witcert.fastpath.packed_decode.held_decode`, bit for bit ``IntCodes.decode``), where
        ``WITCERT_COMPILE=1`` asks for it; ``None``: the codec's own decode.

        Only whole-history reads of two tokens or more take it: a compiled graph specializes a start or
        length of 0 or 1, so one graph serves every read of a request; a range (the witness of the tokens
        written since the last one, a few per flush) is small and decodes eagerly, compiling nothing mid-request.
        """
        if start or type(self.codec) is not IntCodes or not self._buffers or not compile_requested():
            return None
        codes, amax = self._buffers[0], self._buffers[1]
        if (dtype not in FUSED_DTYPES or amax.data.dtype not in FUSED_DTYPES or codes.length != amax.length
                or codes.length < 2):
            return None
        return held_decode(codes.data, amax.data, codes.length, self.codec.bits, dtype, compiled=True)

    def error_bound(self, decoded: torch.Tensor) -> torch.Tensor:
        """The codec's elementwise fp64 bounds (``DW``) of every token held, against ``decoded`` (..., S, d), this
        history decoded; each chunk's bound broadcast to its tokens."""
        parts = decoded.split(self.lengths, dim=-2) if self.axes is None else (decoded,)
        bounds = [self.codec.error_bound(p, d).expand_as(d) for p, d in zip(self.chunks, parts)]
        return bounds[0] if len(bounds) == 1 else torch.cat(bounds, dim=-2)

    def group_error_bound(self, dtype: torch.dtype, start: int = 0) -> torch.Tensor:
        """The codec's fp64 bounds per channel group (..., S - start, G) of the tokens held from ``start`` on
        (``group_error_bound``: from the stored scales, no decode; token by token, so a range's bounds are those
        of the range's scales alone)."""
        if start and isinstance(self.axes, tuple):
            chunk = tuple(p if a is None else p.narrow(p.dim() + a, start, p.shape[a] - start)
                          for a, p in zip(self.axes, self.chunks[0]))
            return self.codec.group_error_bound(chunk, dtype)
        bounds = [self.codec.group_error_bound(p, dtype) for p in self.chunks]
        bound = bounds[0] if len(bounds) == 1 else torch.cat(bounds, dim=-2)
        return bound.narrow(-2, start, bound.shape[-2] - start) if start else bound

    def nbytes(self) -> int:
        return sum(self.codec.nbytes(p) for p in self.chunks)

    def reserved(self) -> int:
        """Bytes the growable buffers allocated beyond the tokens held."""
        return sum(buffer.reserved() for buffer in self._buffers or () if buffer is not None)

    def _grow(self, index: int, axis: int, part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self._buffers is None:
            self._buffers = [None] * (1 if isinstance(self.axes, int) else len(self.axes))
        buffer = self._buffers[index]
        if buffer is None:
            buffer = self._buffers[index] = TokenBuffer(axis)
        elif part.dtype != buffer.data.dtype:
            # a reconstruction narrowed per chunk (fp8 for one write, the model dtype for the next): both hold
            # values of the model dtype exactly, so the history moves to it once, losslessly
            buffer.widen(dtype)
            part = part.to(dtype)
        return buffer.append(part)

    def _add_chunk(self, packed, tokens: int) -> None:
        join = getattr(self.codec, "join", None)
        if self.chunks and callable(join):
            self.chunks[-1] = join(self.chunks[-1], packed)
            self.lengths[-1] += tokens
        else:
            self.chunks.append(packed)
            self.lengths.append(tokens)


class PackedPair:
    """A layer's keys and values as a codec packs them (see the module docstring)."""

    def __init__(self, codec):
        self.codec = codec
        self.alike = bool(getattr(codec, "roles_alike", False)) and getattr(codec, "token_axes", None) is not None
        self.histories = [PackedHistory(codec)] if self.alike else [PackedHistory(codec), PackedHistory(codec)]

    @property
    def ranged(self) -> bool:
        """Whether any range of tokens decodes from the history (token axes), not only the whole of it."""
        return self.histories[0].axes is not None

    def add(self, pair: torch.Tensor, start: int) -> torch.Tensor | None:
        """Encode one write, keys and values stacked (2, B, Hkv, T, d); returns their decodes, stacked, where the
        history cannot decode a range later (whole chunks), else ``None``."""
        tokens = pair.shape[-2]
        if self.alike:
            self.histories[0].add(self.codec.encode(pair, "key", start), pair.dtype, tokens)
            return None
        packed = [self.codec.encode(pair[0], "key", start), self.codec.encode(pair[1], "value", start)]
        for history, chunk in zip(self.histories, packed):
            history.add(chunk, pair.dtype, tokens)
        return None if self.ranged else torch.stack([self.codec.decode(p, pair.dtype) for p in packed])

    def decode(self, dtype: torch.dtype, start: int = 0) -> torch.Tensor:
        """Keys and values from ``start`` on, decoded and stacked (2, B, Hkv, S - start, d)."""
        if self.alike:
            return self.histories[0].decode(dtype, start)
        return torch.stack([history.decode(dtype, start) for history in self.histories])

    @property
    def grouped(self) -> bool:
        """Whether the codec declares its error bounds per channel group (``group_error_bound``, from its scales)."""
        return callable(getattr(self.codec, "group_error_bound", None))

    @property
    def bounded(self) -> bool:
        """Whether the codec declares error bounds (``error_bound`` or ``group_error_bound``: a witness can be derived)."""
        return self.grouped or callable(getattr(self.codec, "error_bound", None))

    def group_error_bound(self, dtype: torch.dtype, start: int = 0) -> torch.Tensor:
        """fp64 bounds per channel group (2, B, Hkv, S - start, G) of keys and values from token ``start`` on, from the
        stored scales."""
        if self.alike:
            return self.histories[0].group_error_bound(dtype, start)
        return torch.stack([history.group_error_bound(dtype, start) for history in self.histories])

    def error_bound(self, pair: torch.Tensor) -> torch.Tensor:
        """Elementwise fp64 bounds (2, B, Hkv, S, d) of keys and values against ``pair``, the history decoded."""
        if self.alike:
            return self.histories[0].error_bound(pair)
        return torch.stack([history.error_bound(decoded) for history, decoded in zip(self.histories, pair)])

    def chunks(self, role: int) -> list:
        """The packed chunks of keys (0) or values (1), in write order."""
        if not self.alike:
            return self.histories[role].chunks
        chunk = self.histories[0].chunks[0]
        return [chunk[role] if isinstance(chunk, torch.Tensor) else
                tuple(p[role] if isinstance(p, torch.Tensor) else p for p in chunk)]

    def nbytes(self) -> int:
        return sum(history.nbytes() for history in self.histories)

    def reserved(self) -> int:
        return sum(history.reserved() for history in self.histories)

"""A growable buffer along a token axis: what a monitored cache appends to on every step instead of ``cat``.

``torch.cat`` of a layer's history with one new token copies the whole history on every decode
step (O(S) bytes per token and a fresh allocation). :class:`TokenBuffer` preallocates and grows
by a quarter (:data:`GROWTH`: amortised ``1 / (GROWTH - 1) = 4`` tokens copied per token written, against
the ``S`` tokens a decode-on-read store decodes per step; the room kept ahead is at most a quarter of the
tokens held, where doubling kept up to as many again); :meth:`TokenBuffer.append` writes the new tokens
in place and returns a view of every token written so far.

Why a view handed out earlier stays valid: tokens are only ever appended, never rewritten, so a
view covers tokens that keep their values; after a regrowth the old view keeps the old storage
alive. What a store reports as held are the views' bytes (the tokens); the spare room
(:meth:`TokenBuffer.reserved`) is reported apart.
"""
from __future__ import annotations

import math

import torch

MIN_CAPACITY = 16  # tokens: the first allocation (a prefill usually sets a larger one)
GROWTH = 1.25  # a full buffer grows to this many times its capacity


class TokenBuffer:
    """Tokens appended along ``axis`` (negative: counted from the last dimension), preallocated, grown by a quarter."""

    def __init__(self, axis: int):
        if axis >= 0:
            raise ValueError(f"axis must be negative (counted from the last dimension), got {axis}")
        self.axis = axis
        self.data: torch.Tensor | None = None
        self.length = 0

    def append(self, new: torch.Tensor) -> torch.Tensor:
        """Copy ``new`` in after the tokens held; return a view of all of them (no copy of the history)."""
        axis = new.dim() + self.axis
        if axis < 0:
            raise ValueError(f"a tensor of rank {new.dim()} has no axis {self.axis}")
        n = new.shape[axis]
        data = self.data
        if data is None:
            data = self.data = new.new_empty(*new.shape[:axis], max(n, MIN_CAPACITY), *new.shape[axis + 1:])
        else:
            if (new.shape[:axis] != data.shape[:axis] or new.shape[axis + 1:] != data.shape[axis + 1:]
                    or new.dtype != data.dtype or new.device != data.device):
                raise ValueError(f"a chunk {tuple(new.shape)} / {new.dtype} does not continue the buffer "
                                 f"{tuple(data.shape)} / {data.dtype} along axis {self.axis}")
            if self.length + n > data.shape[axis]:
                data = self._grow(axis, max(math.ceil(GROWTH * data.shape[axis]), self.length + n))
        data.narrow(axis, self.length, n).copy_(new)
        self.length += n
        return data.narrow(axis, 0, self.length)

    def view(self) -> torch.Tensor | None:
        """Every token written so far (``None`` before the first append)."""
        return None if self.data is None else self.data.narrow(self.data.dim() + self.axis, 0, self.length)

    def widen(self, dtype: torch.dtype) -> None:
        """Hold the tokens in ``dtype`` from now on (a caller's promise that it represents them exactly)."""
        if self.data is not None and self.data.dtype != dtype:
            self.data = self.data.to(dtype)

    def nbytes(self) -> int:
        """Bytes of the tokens held (the view), not of the spare capacity."""
        view = self.view()
        return 0 if view is None else view.numel() * view.element_size()

    def reserved(self) -> int:
        """Bytes allocated beyond the tokens held (the room growth keeps ahead)."""
        return 0 if self.data is None else self.data.numel() * self.data.element_size() - self.nbytes()

    def _grow(self, axis: int, capacity: int) -> torch.Tensor:
        grown = self.data.new_empty(*self.data.shape[:axis], capacity, *self.data.shape[axis + 1:])
        grown.narrow(axis, 0, self.length).copy_(self.data.narrow(axis, 0, self.length))
        self.data = grown
        return grown


def split_pair(buffer: TokenBuffer | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Keys and values (views) of a buffer of stacked pairs ``(2, ..., S, d)``; ``None`` when there is none yet."""
    if buffer is None or not buffer.length:
        return None
    pair = buffer.view()
    return pair[0], pair[1]

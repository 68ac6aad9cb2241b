"""Where the batched spot check's exact logits come from: one gather of exact keys per kv head and call.

:func:`witcert.spot.batched.check_cells` asks a source for the exact logits ``l`` of many (cell, token) pairs
at once: ``source.logits(cells (M,), tokens (M,)) -> (M,)`` fp64. Sources:

* :class:`TableLogits`: exact logits already in memory (tests, callers that hold them);
* :class:`KeyGather`: the checked cells' queries against exact keys, the exact cache ``(B, Hkv, S, d)``
  (validation) or the content-checked backing store (:class:`BackedKeys`, production: only the drawn tokens'
  keys, read by token index, each row checked against the checksum of the bytes written). Each call gathers
  the distinct (row, kv head, token) keys its pairs need once, so query heads sharing a kv head share
  their reads, then forms every logit ``(q . k_t) scale + bias_t`` in fp64 as the monitor's exact logits
  are formed (the bias: the additive mask term both logits carry).

``bytes_read`` (per cell, fp64) charges each key row of the exact cache to the first cell that asked for it in
the call, and each key row read from the backing store to the first cell of its (row, kv head), so its sum is
the traffic the checks caused.
"""
from __future__ import annotations

import torch

from witcert.spot.groups import group_logits, wanted_by_group


class TableLogits:
    """Exact logits ``(N, S)`` held in memory; reads cost nothing. ``groups`` (N,) int64, optional: the key groups
    of the cells (:mod:`witcert.spot.groups`; ``None``: each cell on its own, no group read whole)."""

    def __init__(self, exact: torch.Tensor, groups: torch.Tensor | None = None):
        self.exact = torch.as_tensor(exact).detach().to(torch.float64).cpu()
        self.bytes_read = torch.zeros(self.exact.shape[0], dtype=torch.float64)
        self.groups = None if groups is None else torch.as_tensor(groups, dtype=torch.int64).reshape(-1)

    def logits(self, cells: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.exact[cells, tokens]

    def dense_logits(self, cells: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        """``(M, S)`` exact logits of the rows ``cells`` (every token; ``wanted`` the ones used)."""
        return self.exact[cells]


class BackedKeys:
    """One layer's exact keys in the content-checked backing store, read by token index.

    ``length`` is the number of keys the call attends; the store must hold exactly those (a scheme
    that drops or reorders tokens would make the store's positions mean other keys). The keys read so far
    are kept in fp64 (one slot per (row, kv head, token) read, in one buffer), so a read of tokens already held
    is one indexing; a token is read from the store at most once per call, every (row, kv head) of a read at
    once (:meth:`witcert.gate.backing_store.BackingStore.read_key_rows_at`: each row checked against the checksum
    of the bytes written). The gate's re-checks of the call share the object, so they re-read nothing.
    """

    def __init__(self, backing, layer: int, length: int):
        if backing is None:
            raise RuntimeError("spot check in production: the monitor keeps no backing store for this request")
        held = backing.length(layer)
        if held != length:
            raise ValueError(f"backing store: layer {layer} holds {held} exact keys, the call attends {length}: "
                             "its positions would not be the call's tokens")
        self.backing, self.layer, self.length = backing, layer, length
        lead = backing.lead_shape(layer)
        self.kv_heads = lead[1]
        self._slot = torch.full((lead[0] * lead[1] * length,), -1, dtype=torch.int64)  # flat pair -> buffer row
        self._keys = torch.empty(0, 0, dtype=torch.float64)  # (read, d) fp64

    def rows(self, b: int, kv: int, index: torch.Tensor) -> torch.Tensor:
        """``(k, d)`` fp64 exact keys of tokens ``index`` of row ``b``, kv head ``kv`` (each read once)."""
        flat = (b * self.kv_heads + kv) * self.length + torch.as_tensor(index, dtype=torch.int64)
        self.fetch(flat)
        return self.gather(flat)

    def fetch(self, flat: torch.Tensor, distinct: bool = False) -> torch.Tensor:
        """Read (verified) every pair of ``flat`` (``(row * kv_heads + kv head) * length + token``) not held yet,
        in one store read; returns the flat pairs read now (``distinct``: ``flat`` has no repeats)."""
        wanted = flat if distinct else torch.unique(flat)
        new = wanted[self._slot[wanted] < 0]
        if not new.numel():
            return new
        keys = self.backing.read_key_rows_at(self.layer, new // self.length, new % self.length).to(torch.float64)
        self._slot[new] = torch.arange(self._keys.shape[0], self._keys.shape[0] + new.numel())
        self._keys = keys if not self._keys.numel() else torch.cat([self._keys, keys])
        return new

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """``(k, d)`` fp64 keys of the flat pairs ``flat`` already read (:meth:`fetch`), in one indexing."""
        return self._keys[self._slot[flat]]

    def latest(self, count: int) -> torch.Tensor:
        """``(count, d)`` fp64 keys of the last ``count`` pairs read (:meth:`fetch` keeps their order)."""
        return self._keys[self._keys.shape[0] - count:]

    @property
    def row_bytes(self) -> int:
        """Bytes of one key row in the store."""
        return self.backing.row_nbytes(self.layer)


class KeyGather:
    """Exact logits of ``N`` cells from exact keys, one gather per kv head and call (see the module docstring).

    ``queries`` (N, d) the cells' post-RoPE queries; ``rows`` (N,) int64 each cell's batch row and ``kv`` (N,)
    its kv head; ``keys`` the exact cache (B, Hkv, S, d) or a :class:`BackedKeys`; ``scale`` the softmax
    scale; ``bias`` (N, S) fp64 the additive mask term of each cell's logits, or ``None``.
    """

    def __init__(self, queries: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor, keys, scale: float,
                 bias: torch.Tensor | None = None):
        self.q = queries.detach().to(torch.float64).cpu()
        self.rows, self.kv, self.scale = rows.cpu(), kv.cpu(), scale
        self.bias = None if bias is None else bias.detach().to(torch.float64).cpu()
        self.backed = isinstance(keys, BackedKeys)
        if self.backed:
            self.keys, self.kv_heads, self.length = keys, keys.kv_heads, keys.backing.length(keys.layer)
        else:
            self.keys = keys.detach()
            self.kv_heads, self.length = keys.shape[1], keys.shape[2]
            self.row_bytes = keys.shape[-1] * keys.element_size()
        self._heads = self.rows * self.kv_heads + self.kv  # (N,) each cell's flat (row, kv head)
        self._bytes_read = torch.zeros(self.q.shape[0], dtype=torch.float64)
        self._read = None  # (rows * kv heads * length,) bool: key rows read in this call (allocated at a first read)
        self._first_cell = None  # (row, kv head) -> first cell asking for it (store reads' charges)
        self._store_bytes = torch.zeros(self.q.shape[0], dtype=torch.float64)  # verified key rows charged per cell

    @property
    def bytes_read(self) -> torch.Tensor:
        """(N,) fp64 bytes the checks' reads cost, each charged once (see the module docstring)."""
        return self._bytes_read + self._store_bytes

    def logits(self, cells: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``(q_cell . k_token) scale + bias`` fp64 for every pair, (M,)."""
        flat = self._heads[cells] * self.length + tokens  # (row, kv head, token) flat
        unique, inverse = torch.unique(flat, return_inverse=True)
        keys = self._backed(unique) if self.backed else self._cached(unique)  # (U, d) fp64, one gather
        if not self.backed:
            self._charge_rows(unique, inverse, cells)
        logits = (keys[inverse] * self.q[cells]).sum(-1) * self.scale
        return logits if self.bias is None else logits + self.bias[cells, tokens]

    @property
    def groups(self) -> torch.Tensor:
        """(N,) int64 each cell's (row, kv head): cells of one group attend the same exact keys
        (:mod:`witcert.spot.groups`)."""
        return self._heads

    def dense_logits(self, cells: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        """``(M, S)`` fp64 exact logits of the cells ``cells`` at the tokens ``wanted`` (M, S) bool (others 0): the
        union of each (row, kv head)'s wanted keys, every head's in one read (charged as :meth:`logits` charges:
        each row once), and every logit by one matmul per (row, kv head) of its cells' queries against its keys."""
        names, member, first, head, tokens = wanted_by_group(self.groups[cells], wanted)
        if not head.numel():
            return torch.zeros(cells.numel(), self.length, dtype=torch.float64)
        flat = names[head] * self.length + tokens
        if self.backed:
            keys = self._backed(flat)
        else:
            keys = self._cached(flat)
            self._charge_rows(flat, torch.arange(flat.numel()), cells[first[head]])
        out = group_logits(self.q[cells], member, head, tokens, keys, self.scale, self.length)
        if self.bias is not None:
            out = torch.where(wanted, out + self.bias[cells], 0.0)
        return out

    def _cached(self, unique: torch.Tensor) -> torch.Tensor:
        """Key rows ``unique`` of the exact cache, gathered where the cache lives (an accelerator too), to the host."""
        d = self.keys.shape[-1]
        return self.keys.reshape(-1, d)[unique.to(self.keys.device)].to(device="cpu", dtype=torch.float64)

    def _backed(self, unique: torch.Tensor) -> torch.Tensor:
        """Keys of ``unique`` flat indices (distinct) from the backing store: the pairs not held yet read and checked
        together, each new row charged to the first cell of its (row, kv head)."""
        new = self.keys.fetch(unique, distinct=True)
        if new.numel():
            self._store_bytes.index_add_(0, self._first_cells()[new // self.length],
                                         torch.full((new.numel(),), float(self.keys.row_bytes), dtype=torch.float64))
        if new.numel() == unique.numel():  # all read now: the rows just appended, in order (no gather)
            return self.keys.latest(new.numel())
        return self.keys.gather(unique)

    def _charge_rows(self, unique: torch.Tensor, inverse: torch.Tensor, cells: torch.Tensor) -> None:
        """Charge each key row ``unique`` read for the first time in this call to the first cell that asked for it
        (``inverse`` maps the call's pairs to ``unique``, ``cells`` their cells)."""
        if self._read is None:
            self._read = torch.zeros(int(self.rows.max()) + 1 if self.rows.numel() else 0, self.kv_heads,
                                     self.length, dtype=torch.bool).reshape(-1)
        new = ~self._read[unique]
        if not bool(new.any()):
            return
        first = torch.full((unique.numel(),), inverse.numel()).scatter_reduce(0, inverse, torch.arange(inverse.numel()),
                                                                               "amin")  # each row's first pair
        self._bytes_read.index_add_(0, cells[first[new]], torch.full((int(new.sum()),), float(self.row_bytes),
                                                                     dtype=torch.float64))
        self._read[unique[new]] = True

    def _first_cells(self) -> torch.Tensor:
        """(rows * kv heads,) the first cell of each (row, kv head) in this call (the store reads' charges)."""
        if self._first_cell is None:
            heads = self._heads
            size = int(heads.max()) + 1 if heads.numel() else 0
            self._first_cell = torch.full((size,), heads.numel(), dtype=torch.int64).scatter_reduce(
                0, heads, torch.arange(heads.numel()), "amin")
        return self._first_cell

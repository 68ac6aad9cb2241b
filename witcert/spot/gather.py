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


class TableLogits:
    """Exact logits ``(N, S)`` held in memory; reads cost nothing."""

    def __init__(self, exact: torch.Tensor):
        self.exact = torch.as_tensor(exact).detach().to(torch.float64).cpu()
        self.bytes_read = torch.zeros(self.exact.shape[0], dtype=torch.float64)

    def logits(self, cells: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.exact[cells, tokens]


class BackedKeys:
    """One layer's exact keys in the content-checked backing store, read by token index.

    ``length`` is the number of keys the call attends; the store must hold exactly those (a scheme
    that drops or reorders tokens would make the store's positions mean other keys). Each (row, kv head)
    keeps the keys read so far in one fp64 buffer, so a read of tokens already held is one indexing; a token
    is read from the store (:meth:`witcert.gate.backing_store.BackingStore.read_key_rows`: its row checked
    against the checksum of the bytes written) at most once per call.
    """

    def __init__(self, backing, layer: int, length: int):
        if backing is None:
            raise RuntimeError("spot check in production: the monitor keeps no backing store for this request")
        held = backing.length(layer)
        if held != length:
            raise ValueError(f"backing store: layer {layer} holds {held} exact keys, the call attends {length}: "
                             "its positions would not be the call's tokens")
        self.backing, self.layer, self.length = backing, layer, length
        self.kv_heads = backing.lead_shape(layer)[1]
        self._keys: dict[tuple[int, int], torch.Tensor] = {}  # (row, kv head) -> (length, d) fp64, rows read
        self._held: dict[tuple[int, int], torch.Tensor] = {}  # (row, kv head) -> (length,) bool

    def rows(self, b: int, kv: int, index: torch.Tensor) -> torch.Tensor:
        """``(k, d)`` fp64 exact keys of tokens ``index`` of row ``b``, kv head ``kv`` (each read once)."""
        self.fetch(b, kv, index)
        return self._keys[b, kv][index]

    def fetch(self, b: int, kv: int, index: torch.Tensor) -> int:
        """Read (verified) every token of ``index`` not held yet; the bytes read now."""
        if (b, kv) not in self._held:
            self._held[b, kv] = torch.zeros(self.length, dtype=torch.bool)
        held = self._held[b, kv]
        wanted = torch.unique(index)
        new = wanted[~held[wanted]]
        if not new.numel():
            return 0
        before = self.backing.bytes_paged
        keys = self.backing.read_key_rows(self.layer, (b, kv), new).to(torch.float64)
        if (b, kv) not in self._keys:
            self._keys[b, kv] = torch.empty(self.length, keys.shape[-1], dtype=torch.float64)
        self._keys[b, kv][new] = keys
        held[new] = True
        return self.backing.bytes_paged - before

    def gather(self, b: int, kv: int, index: torch.Tensor) -> torch.Tensor:
        """``(k, d)`` fp64 keys of ``index`` already read (:meth:`fetch`), in one indexing."""
        return self._keys[b, kv][index]


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
        self._bytes_read = torch.zeros(self.q.shape[0], dtype=torch.float64)
        self._read = None  # (rows * kv heads * length,) bool: key rows read in this call (allocated at a first read)
        self._first_cell = None  # (row, kv head) -> first cell asking for it (store reads' charges)
        self._store_bytes: dict[int, int] = {}  # cell -> bytes of the verified key rows charged to it

    @property
    def bytes_read(self) -> torch.Tensor:
        """(N,) fp64 bytes the checks' reads cost, each charged once (see the module docstring)."""
        out = self._bytes_read.clone()
        for cell, nbytes in self._store_bytes.items():
            out[cell] += nbytes
        return out

    def logits(self, cells: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``(q_cell . k_token) scale + bias`` fp64 for every pair, (M,)."""
        head = self.rows[cells] * self.kv_heads + self.kv[cells]  # (M,) flat (row, kv head)
        flat = head * self.length + tokens
        unique, inverse = torch.unique(flat, return_inverse=True)
        keys = self._backed(unique) if self.backed else self._cached(unique)  # (U, d) fp64, one gather
        if not self.backed:
            self._charge_rows(unique, inverse, cells)
        logits = (keys[inverse] * self.q[cells]).sum(-1) * self.scale
        return logits if self.bias is None else logits + self.bias[cells, tokens]

    def _cached(self, unique: torch.Tensor) -> torch.Tensor:
        """Key rows ``unique`` of the exact cache, gathered where the cache lives (an accelerator too), to the host."""
        d = self.keys.shape[-1]
        return self.keys.reshape(-1, d)[unique.to(self.keys.device)].to(device="cpu", dtype=torch.float64)

    def _backed(self, unique: torch.Tensor) -> torch.Tensor:
        """Keys of ``unique`` flat indices from the backing store: per (row, kv head), the rows not held yet read
        and checked."""
        heads, tokens = unique // self.length, unique % self.length
        out = torch.empty(unique.numel(), self.q.shape[-1], dtype=torch.float64)
        for head in torch.unique(heads).tolist():
            at = heads == head
            b, kv = divmod(head, self.kv_heads)
            self._charge_store(head, self.keys.fetch(b, kv, tokens[at]))
            out[at] = self.keys.gather(b, kv, tokens[at])
        return out

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

    def _charge_store(self, head: int, nbytes: int) -> None:
        """Charge the key rows read now from the store to the first cell of their (row, kv head) in this call."""
        if not nbytes:
            return
        if self._first_cell is None:
            heads = (self.rows * self.kv_heads + self.kv).tolist()
            self._first_cell = {}
            for cell, h in enumerate(heads):
                self._first_cell.setdefault(h, cell)
        self._store_bytes[self._first_cell[head]] = self._store_bytes.get(self._first_cell[head], 0) + nbytes

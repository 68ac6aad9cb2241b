"""The gate's exact store: a host copy of every exact key and value, indexed like vLLM's cache.

vLLM's cache is paged: a *slot* (``block * block_size + offset``) holds one token of one layer
for every kv head, blocks are freed and reused by other requests, and prefix-shared blocks are
read by several. The store is indexed the same way (one row per slot: ``(Hkv, d)`` keys and
values), so it always holds the exact tensors of what the slot's cache entry was written from,
and block reuse overwrites both together.

Content is checked, not bytes counted (the paper's system once paged in zeros from a store it
allocated and never wrote): every write folds the *source* bytes of each slot's key and value
rows into a CRC-32 (from the incoming tensors, before the copy), and every page-in recomputes
the CRC over the store's rows and raises :class:`~witcert.gate.backing_store.NeverWrittenError`
for a slot never written and :class:`~witcert.gate.backing_store.ChecksumMismatchError` for one
whose bytes differ. A spot check reads keys alone (:meth:`ExactStore.read_keys`): each slot's key bytes
have a CRC-32 of their own, so what it reads is checked and nothing it does not read is charged. Each slot also
records the number of the write that last wrote it (``last_write``): a verified copy of a row read before that
write no longer holds the slot (:class:`~.spot_check.KeyReads`).
"""
import zlib

import numpy as np
import torch

from witcert.gate.backing_store import ChecksumMismatchError, NeverWrittenError


class ExactStore:
    """Exact keys and values of one layer's cache, ``(slots, Hkv, d)``, on the host."""

    def __init__(self, num_slots: int, num_kv_heads: int, head_size: int, dtype: torch.dtype):
        self.k = torch.zeros(num_slots, num_kv_heads, head_size, dtype=dtype)
        self.v = torch.zeros(num_slots, num_kv_heads, head_size, dtype=dtype)
        self.crc = np.zeros(num_slots, dtype=np.uint32)
        self.key_crc = np.zeros(num_slots, dtype=np.uint32)  # of the key bytes alone (spot checks read keys only)
        self.written = np.zeros(num_slots, dtype=bool)
        self.bytes_paged = 0
        self.bytes_checked = 0  # key bytes read by spot checks (read_keys)
        self.writes = 0  # writes so far
        self.last_write = np.zeros(num_slots, dtype=np.int64)  # per slot, the number of the write that last wrote it

    @property
    def key_row_bytes(self) -> int:
        """Bytes of one slot's key row (every kv head)."""
        return self.k[0].numel() * self.k.element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot's key and value rows."""
        return 2 * self.k[0].numel() * self.k.element_size()

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store exact rows ``k``, ``v`` (N, Hkv, d) at ``slots`` (N,); the CRC is of the source bytes."""
        if k.shape != v.shape or k.shape[0] != slots.shape[0] or k.shape[1:] != self.k.shape[1:]:
            raise ValueError(f"exact store rows: k {tuple(k.shape)}, v {tuple(v.shape)} for {slots.shape[0]} slots "
                             f"of shape {tuple(self.k.shape[1:])}")
        k_src = k.detach().to(self.k.dtype).contiguous()
        v_src = v.detach().to(self.v.dtype).contiguous()
        index = slots.long()
        ids = index.tolist()
        key_crcs = _key_crcs(k_src)
        self.key_crc[ids] = key_crcs
        self.crc[ids] = _row_crcs(k_src, v_src, key_crcs)
        self.written[ids] = True
        self.k[index] = k_src
        self.v[index] = v_src
        self.writes += 1
        self.last_write[ids] = self.writes  # a verified copy read before this write no longer holds the slot

    def page_in(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Verified copies of the rows at ``slots`` (N,): ``(k, v)`` each (N, Hkv, d)."""
        ids = slots.long().tolist()
        missing = [s for s in ids if not self.written[s]]
        if missing:
            raise NeverWrittenError(f"exact store: slot(s) {missing[:8]} were never written; refusing to page in "
                                    "unwritten data")
        index = slots.long()
        k, v = self.k[index].clone(), self.v[index].clone()
        bad = [s for s, crc in zip(ids, _row_crcs(k, v)) if crc != self.crc[s]]
        if bad:
            raise ChecksumMismatchError(f"exact store: the bytes of slot(s) {bad[:8]} differ from the bytes written")
        self.bytes_paged += len(ids) * self.row_bytes
        return k, v

    def read_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """Verified copies of the key rows at ``slots`` (N,) (distinct), (N, Hkv, d): each checked against the CRC of
        the key bytes written (``NeverWrittenError``, ``ChecksumMismatchError`` as :meth:`page_in`)."""
        index = slots.long()
        ids = index.numpy()
        missing = ids[~self.written[ids]]
        if missing.size:
            raise NeverWrittenError(f"exact store: slot(s) {missing[:8].tolist()} were never written; refusing to read "
                                    "unwritten keys")
        k = self.k[index].clone()
        bad = ids[np.asarray(_key_crcs(k), dtype=np.uint32) != self.key_crc[ids]]
        if bad.size:
            raise ChecksumMismatchError(f"exact store: the key bytes of slot(s) {bad[:8].tolist()} differ from the "
                                        "bytes written")
        self.bytes_checked += ids.size * self.key_row_bytes
        return k


def _key_crcs(k: torch.Tensor) -> list[int]:
    """CRC-32 of each slot's key bytes."""
    kb = k.reshape(k.shape[0], -1).view(torch.uint8).numpy()
    return [zlib.crc32(row) for row in kb]  # each row a contiguous buffer: no copy


def _row_crcs(k: torch.Tensor, v: torch.Tensor, key_crcs: list[int] | None = None) -> list[int]:
    """CRC-32 of each slot's key bytes followed by its value bytes (continued from ``key_crcs`` when given)."""
    key_crcs = _key_crcs(k) if key_crcs is None else key_crcs
    vb = v.reshape(v.shape[0], -1).view(torch.uint8).numpy()
    return [zlib.crc32(row, crc) for row, crc in zip(vb, key_crcs)]

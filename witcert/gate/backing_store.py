"""Exact backing store for gated repair: a host copy of every exact key (and value) written.

The gate (docs/design.md "Gating and repair") repairs compressed cache slots by paging exact values in from here.
The paper's serving system once allocated this store and never wrote it: repair paged in
zeros and quality collapsed while a smoke test that counted bytes moved stayed green. So
this store checks *content*, not bytes:

- every write appends the source rows to a host buffer and folds the **source** bytes into a
  per-block CRC-32 (computed from the incoming tensor, never from the buffer, so a write path
  that forgets to copy is caught);
- every page-in recomputes the CRC of the buffer rows and compares; a block whose tokens were
  never (fully) written, or whose bytes differ, raises :class:`BackingStoreError`;
- every key row written also gets its own checksum (a weighted sum of its **source** bytes,
  :func:`row_checksums`), so a reader that needs a few keys, not whole blocks (the spot check), reads
  them by token index (:meth:`BackingStore.read_key_rows`) and each row read is checked the same way.

Layout
------
A *stream* is one key (any hashable, e.g. a layer index) holding a tensor ``(*lead, S, d)``:
``lead`` is fixed by the first write (e.g. ``(batch, kv_heads)``) and tokens are appended
along ``S``. Block ``j`` of lead index ``i`` is tokens ``[j * block_size, (j + 1) * block_size)``
of ``stream[i]`` (the last block may be partial). Bytes paged = tokens x d x itemsize (keys)
plus the same for values when values are stored.

Where the bytes live: host memory by default; with ``directory``, memory-mapped files there
(one file per stream and side, grown by doubling), so the exact copy occupies neither the
accelerator nor resident host memory. The content check is the same either way: a page-in
verifies the file's bytes against the CRC of the bytes written. The files hold a request's exact
keys and values, so they are created readable by their owner only (mode 0600, in a directory this
store creates with mode 0700), and :meth:`BackingStore.close` removes them (``witcert.monitor`` closes
a request's store when its cache is released and when the monitor closes).

CRC-32 detects every error burst up to 32 bits and any other corruption with probability
``1 - 2^-32``; it is an integrity check against bugs and bit rot, not an adversarial MAC. The row
checksum ``sum_i w_i b_i`` (16-bit words ``b_i``, fixed odd weights ``w_i < 2^31``, exact in int64) changes
under every single-word error (``w_i (b_i' - b_i) != 0``), so it catches a row never copied, a zeroed or
shifted row and bit rot within one word; like the CRC it is no MAC.
"""
import itertools
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable

import numpy as np
import torch


class BackingStoreError(RuntimeError):
    """A page-in found content that is not the exact data written (never raised silently)."""


class NeverWrittenError(BackingStoreError):
    """The requested block holds tokens that no write ever delivered."""


class ChecksumMismatchError(BackingStoreError):
    """The buffer bytes of a block differ from the bytes that were written."""


@dataclass(frozen=True)
class PagedBlock:
    """One verified page-in.

    Attributes
    ----------
    k : Tensor (n, d)
        Exact keys of the block's ``n`` tokens (a copy, store dtype).
    v : Tensor (n, d_v) or None
        Exact values, when the store keeps them.
    start : int
        Token index of the block's first token.
    nbytes : int
        Bytes moved: ``n * d * itemsize`` (+ values).
    """

    k: torch.Tensor
    v: torch.Tensor | None
    start: int
    nbytes: int

    @property
    def tokens(self) -> slice:
        """The token range of the block."""
        return slice(self.start, self.start + self.k.shape[0])


@dataclass
class _Stream:
    """Host buffers and per-block integrity records of one stream."""

    k: torch.Tensor  # (*lead, capacity, d)
    v: torch.Tensor | None  # (*lead, capacity, d_v)
    k_crc: np.ndarray  # (*lead, n_blocks_capacity) uint32, CRC of the source bytes written
    k_rows: np.ndarray  # (*lead, capacity) int64, checksum of each source key row written (row_checksums)
    v_crc: np.ndarray | None
    written: np.ndarray  # (*lead, n_blocks_capacity) int64, tokens delivered to each block
    length: int = 0
    files: dict = field(default_factory=dict)  # "k"/"v" -> Path of a file-backed buffer

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.k.shape[:-2])


@dataclass
class BackingStore:
    """Exact host copy of a KV cache, written on every cache write, verified on every page-in.

    Parameters
    ----------
    block_size : int
        Tokens per block (the page-in unit). Default 16.
    directory : str or Path, optional
        Keep the buffers in memory-mapped files in this directory (created if missing, mode 0700)
        instead of host memory; each file is created with mode 0600.

    Attributes
    ----------
    bytes_written : int
        Bytes delivered by :meth:`write` (source bytes; counts even if a broken subclass drops
        them, which is exactly why a smoke test on this number proves nothing).
    bytes_paged : int
        Bytes returned by verified :meth:`page_in` calls.
    """

    block_size: int = 16
    directory: str | Path | None = None
    bytes_written: int = field(default=0, init=False)
    bytes_paged: int = field(default=0, init=False)
    _streams: dict = field(default_factory=dict, init=False, repr=False)
    _file_ids: itertools.count = field(default_factory=itertools.count, init=False, repr=False)

    def __post_init__(self):
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.directory is not None:
            self.directory = Path(self.directory)
            if self.directory.exists() and not self.directory.is_dir():
                raise ValueError(f"directory {str(self.directory)!r} exists and is not a directory")
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # owner only (the umask may remove more)

    # -- write path ---------------------------------------------------------------------
    def write(self, key: Hashable, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Append exact keys (and values) ``(*lead, T, d)`` to stream ``key``.

        Call this on every cache write (prefill and each decode step), with the exact
        (uncompressed) tensors, before they are compressed.
        """
        _check_rows("k", k)
        if v is not None:
            _check_rows("v", v)
            if v.shape[:-1] != k.shape[:-1]:
                raise ValueError(f"v shape {tuple(v.shape)} does not match k shape {tuple(k.shape)} before the last dim")
        stream = self._stream_for(key, k, v)
        k_host = k.detach().to("cpu", copy=True).contiguous()  # (*lead, T, d)
        v_host = None if v is None else v.detach().to("cpu", copy=True).contiguous()
        start, stop = stream.length, stream.length + k_host.shape[-2]
        self._ensure_capacity(stream, stop)
        self._copy_in(stream.k, k_host, start, stop)
        _fold_crc(stream.k_crc, k_host, start, self.block_size)
        stream.k_rows[..., start:stop] = row_checksums(k_host)  # of the source rows, never of the buffer
        if v_host is not None:
            self._copy_in(stream.v, v_host, start, stop)
            _fold_crc(stream.v_crc, v_host, start, self.block_size)
        _count_written(stream.written, start, stop, self.block_size)
        stream.length = stop
        self.bytes_written += _nbytes(k_host) + (0 if v_host is None else _nbytes(v_host))

    def _copy_in(self, buffer: torch.Tensor, rows: torch.Tensor, start: int, stop: int) -> None:
        """The one line that puts the data in the store (the paper's missing line)."""
        buffer[..., start:stop, :] = rows

    # -- read path ----------------------------------------------------------------------
    def page_in(self, key: Hashable, index: tuple[int, ...], block: int, keys_only: bool = False) -> PagedBlock:
        """Verified copy of block ``block`` of ``stream[key][index]`` (``keys_only``: the keys alone, for a reader
        that needs no values, e.g. the spot check; only the keys' bytes are read and counted).

        Raises
        ------
        NeverWrittenError
            Some token of the block was never delivered by :meth:`write`.
        ChecksumMismatchError
            The buffer bytes differ from the bytes written (keys or values).
        ValueError, KeyError
            Unknown key, bad index or block out of range.
        """
        stream = self._get(key)
        index = _check_index(index, stream.lead)
        tokens = self._block_tokens(stream, block)
        delivered = int(stream.written[index + (block,)])
        if delivered != tokens.stop - tokens.start:
            raise NeverWrittenError(
                f"backing store {key!r}{list(index)} block {block}: {delivered} of "
                f"{tokens.stop - tokens.start} tokens were ever written; refusing to page in unwritten data"
            )
        k = stream.k[index][tokens].clone()  # (n, d)
        _verify(k, int(stream.k_crc[index + (block,)]), f"keys of {key!r}{list(index)} block {block}")
        v = None
        if stream.v is not None and not keys_only:
            v = stream.v[index][tokens].clone()
            _verify(v, int(stream.v_crc[index + (block,)]), f"values of {key!r}{list(index)} block {block}")
        nbytes = _nbytes(k) + (0 if v is None else _nbytes(v))
        self.bytes_paged += nbytes
        return PagedBlock(k=k, v=v, start=tokens.start, nbytes=nbytes)

    def read_key_rows(self, key: Hashable, index: tuple[int, ...], tokens: torch.Tensor) -> torch.Tensor:
        """Verified copies ``(n, d)`` of the keys of ``tokens`` (n,) of ``stream[key][index]``, read by token index:
        each row's bytes are checked against the checksum of the bytes written (:func:`row_checksums`) and only
        those rows are read and counted in ``bytes_paged``. :meth:`read_key_rows_at` with one lead index.

        Raises
        ------
        NeverWrittenError
            Some token was never delivered by :meth:`write`.
        ChecksumMismatchError
            A row's bytes differ from the bytes written.
        ValueError, KeyError
            Unknown key, bad index, or a token that is not an int in ``[0, length)``.
        """
        stream = self._get(key)
        flat = int(np.ravel_multi_index(_check_index(index, stream.lead), stream.lead)) if stream.lead else 0
        tokens = _checked_tokens(tokens)
        return self.read_key_rows_at(key, torch.full_like(tokens, flat), tokens)

    def read_key_rows_at(self, key: Hashable, heads: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """:meth:`read_key_rows` of many lead indices at once: the verified keys ``(n, d)`` of the pairs ``(heads[i],
        tokens[i])``, ``heads`` (n,) flat (row-major) indices into the stream's leading shape (for ``(batch, kv
        heads)``: ``row * kv_heads + kv head``). One indexing and one checksum pass for every row read (the spot
        check reads a layer's rows of every kv head together); the same checks and errors as :meth:`read_key_rows`.
        """
        stream = self._get(key)
        tokens, heads = _checked_tokens(tokens), _checked_tokens(heads, "heads")
        lead = int(np.prod(stream.lead))
        if heads.shape != tokens.shape:
            raise ValueError(f"heads: expected one lead index per token, got {tuple(heads.shape)} for "
                             f"{tuple(tokens.shape)} tokens")
        at, head = tokens.numpy(), heads.numpy()
        if at.size and not (0 <= at.min() and at.max() < stream.length):
            raise ValueError(f"tokens: expected token indices in [0, {stream.length}) of stream {key!r}, got "
                             f"{int(at.min())}..{int(at.max())}")
        if head.size and not (0 <= head.min() and head.max() < lead):
            raise ValueError(f"heads: expected flat lead indices in [0, {lead}) of stream {key!r} (lead "
                             f"{stream.lead}), got {int(head.min())}..{int(head.max())}")
        delivered = stream.written.reshape(lead, -1)[head, at // self.block_size]  # appends: a block's first tokens
        missing = at % self.block_size >= delivered
        if missing.any():
            raise NeverWrittenError(f"backing store {key!r}{self._lead_index(stream, head[missing][0])} token "
                                    f"{int(at[missing][0])} was never written; refusing to read unwritten data")
        k = stream.k.reshape(lead, stream.k.shape[-2], -1)[heads, tokens]  # (n, d), a copy
        bad = row_checksums(k) != stream.k_rows.reshape(lead, -1)[head, at]
        if bad.any():
            raise ChecksumMismatchError(f"backing store content check failed for the key of {key!r}"
                                        f"{self._lead_index(stream, head[bad][0])} token {int(at[bad][0])}: its bytes "
                                        "differ from the bytes written (store not populated or corrupted)")
        self.bytes_paged += _nbytes(k)
        return k

    @staticmethod
    def _lead_index(stream: _Stream, flat) -> list[int]:
        return [int(i) for i in np.unravel_index(int(flat), stream.lead)] if stream.lead else []

    def verify(self, key: Hashable) -> int:
        """Page in (without counting) and verify every block of stream ``key``; return the block count."""
        stream = self._get(key)
        before = self.bytes_paged
        count = 0
        for index in np.ndindex(*stream.lead):
            for block in range(self.n_blocks(key)):
                self.page_in(key, tuple(index), block)
                count += 1
        self.bytes_paged = before
        return count

    # -- accounting ---------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._streams

    def length(self, key: Hashable) -> int:
        """Tokens written to stream ``key``."""
        return self._get(key).length

    def lead_shape(self, key: Hashable) -> tuple[int, ...]:
        """Leading shape ``lead`` of stream ``key``."""
        return self._get(key).lead

    def row_nbytes(self, key: Hashable) -> int:
        """Bytes of one key row of stream ``key`` (what :meth:`read_key_rows` counts per row read)."""
        k = self._get(key).k
        return k.shape[-1] * k.element_size()

    def n_blocks(self, key: Hashable) -> int:
        """Blocks covering the tokens written to stream ``key``."""
        return -(-self._get(key).length // self.block_size)

    def has_values(self, key: Hashable) -> bool:
        """Whether stream ``key`` keeps values."""
        return self._get(key).v is not None

    def nbytes(self) -> int:
        """Bytes of the buffers allocated for every stream (host memory or files)."""
        return sum(self.stream_nbytes(key) for key in self._streams)

    def stream_nbytes(self, key: Hashable) -> int:
        """Bytes of the buffers allocated for stream ``key`` (host memory or files; grown by doubling)."""
        stream = self._get(key)
        return _nbytes(stream.k) + (0 if stream.v is None else _nbytes(stream.v))

    def clear(self, key: Hashable | None = None) -> None:
        """Drop one stream (end of its request) or all of them (their files are removed)."""
        for name in (list(self._streams) if key is None else [key]):
            stream = self._streams.pop(name, None)
            for path in (stream.files.values() if stream is not None else ()):
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Drop every stream and remove its files, then the directory when nothing else is left in it: the end
        of the request whose exact keys and values this store held."""
        self.clear()
        if self.directory is not None:
            try:
                self.directory.rmdir()
            except OSError:  # missing, or holding files this store did not make: left as it is
                pass

    # -- internals ----------------------------------------------------------------------
    def _get(self, key: Hashable) -> _Stream:
        if key not in self._streams:
            raise KeyError(f"backing store has no stream {key!r} (nothing was written under it)")
        return self._streams[key]

    def _block_tokens(self, stream: _Stream, block: int) -> slice:
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
            raise ValueError(f"block must be an int, got {block!r}")
        n_blocks = -(-stream.length // self.block_size)
        if not 0 <= block < n_blocks:
            raise ValueError(f"block {block} out of range: the stream has {n_blocks} blocks ({stream.length} tokens)")
        start = int(block) * self.block_size
        return slice(start, min(start + self.block_size, stream.length))

    def _allocate(self, stream: _Stream | None, part: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A zero buffer: host memory, or a fresh memory-mapped file (the old file of ``part`` removed)."""
        if self.directory is None:
            return torch.zeros(shape, dtype=dtype)
        path = self.directory / f"backing-{next(self._file_ids)}-{part}.bin"
        count = int(np.prod(shape))
        # a sparse file of zeros of the right size, readable by its owner only: it holds exact keys and values
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.truncate(count * torch.empty((), dtype=dtype).element_size())
        buffer = torch.from_file(str(path), shared=True, size=count, dtype=dtype).view(shape)
        if stream is not None:
            old = stream.files.get(part)
            stream.files[part] = path
            if old is not None:
                old.unlink(missing_ok=True)  # the old mapping stays valid until its tensor is freed
        return buffer

    def _new_stream(self, k: torch.Tensor, v: torch.Tensor | None) -> _Stream:
        lead = tuple(k.shape[:-2])
        records = lead + (1,)
        stream = _Stream(k=None, v=None, k_crc=np.zeros(records, dtype=np.uint32),
                         k_rows=np.zeros(lead + (self.block_size,), dtype=np.int64),
                         v_crc=None if v is None else np.zeros(records, dtype=np.uint32),
                         written=np.zeros(records, dtype=np.int64))
        stream.k = self._allocate(stream, "k", (*lead, self.block_size, k.shape[-1]), k.dtype)
        if v is not None:
            stream.v = self._allocate(stream, "v", (*lead, self.block_size, v.shape[-1]), v.dtype)
        return stream

    def _ensure_capacity(self, stream: _Stream, stop: int) -> None:
        """Grow the buffers (doubling, whole blocks) so that ``stop`` tokens fit."""
        capacity = stream.k.shape[-2]
        if stop <= capacity:
            return
        new_blocks = max(2 * capacity // self.block_size, -(-stop // self.block_size))

        def grow_buffer(part, x):
            out = self._allocate(stream, part, (*x.shape[:-2], new_blocks * self.block_size, x.shape[-1]), x.dtype)
            out[..., :capacity, :] = x
            return out

        def grow_record(a):
            out = np.zeros(a.shape[:-1] + (new_blocks,), dtype=a.dtype)
            out[..., : a.shape[-1]] = a
            return out

        stream.k = grow_buffer("k", stream.k)
        stream.k_crc = grow_record(stream.k_crc)
        stream.k_rows = np.concatenate([stream.k_rows, np.zeros(stream.k_rows.shape[:-1] + (
            new_blocks * self.block_size - stream.k_rows.shape[-1],), dtype=np.int64)], axis=-1)
        stream.written = grow_record(stream.written)
        if stream.v is not None:
            stream.v = grow_buffer("v", stream.v)
            stream.v_crc = grow_record(stream.v_crc)

    def _stream_for(self, key: Hashable, k: torch.Tensor, v: torch.Tensor | None) -> _Stream:
        if key not in self._streams:
            self._streams[key] = self._new_stream(k, v)
            return self._streams[key]
        stream = self._streams[key]
        if tuple(k.shape[:-2]) != stream.lead or k.shape[-1] != stream.k.shape[-1] or k.dtype != stream.k.dtype:
            raise ValueError(
                f"k of shape {tuple(k.shape)} / {k.dtype} does not continue stream {key!r} "
                f"(lead {stream.lead}, d {stream.k.shape[-1]}, {stream.k.dtype})"
            )
        if (v is None) != (stream.v is None):
            raise ValueError(f"stream {key!r} was started {'with' if stream.v is not None else 'without'} values")
        if v is not None and (v.shape[-1] != stream.v.shape[-1] or v.dtype != stream.v.dtype):
            raise ValueError(f"v of shape {tuple(v.shape)} / {v.dtype} does not continue stream {key!r}")
        return stream


def _check_rows(name: str, x) -> None:
    if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
        raise ValueError(f"{name} must be a floating tensor (*lead, T, d)")
    if x.dim() < 2:
        raise ValueError(f"{name} must have shape (*lead, T, d), got {tuple(x.shape)}")
    if x.shape[-1] == 0:
        raise ValueError(f"{name} has head dim 0")
    if not _all_finite(x):
        raise ValueError(f"{name} contains NaN or Inf: exact cache entries must be finite")


def _all_finite(x: torch.Tensor) -> bool:
    """Whether every entry of ``x`` is finite, from its smallest and largest entry: a NaN makes both NaN, an
    infinity is one of them (one reduction pass; ``isfinite(x).all()`` measured 5x slower, 4096 tokens)."""
    if not x.numel():
        return True
    low, high = torch.aminmax(x.detach())
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _check_index(index, lead: tuple[int, ...]) -> tuple[int, ...]:
    index = tuple(int(i) for i in (index if isinstance(index, (tuple, list)) else (index,)))
    if len(index) != len(lead) or any(not 0 <= i < n for i, n in zip(index, lead)):
        raise ValueError(f"index {index} does not address the stream's leading shape {lead}")
    return index


def _checked_tokens(tokens, name: str = "tokens") -> torch.Tensor:
    """``tokens`` as a 1-D int64 tensor, or a ValueError naming ``name``."""
    tokens = torch.as_tensor(tokens)
    if tokens.dim() != 1 or tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected a 1-D integer tensor, got {tuple(tokens.shape)} {tokens.dtype}")
    return tokens.to(torch.int64)


def _row_bytes(x: torch.Tensor) -> np.ndarray:
    """Raw bytes of ``x`` (..., T, d) as uint8 (..., T, d * itemsize); works for bf16 too."""
    return x.contiguous().view(torch.uint8).numpy()


def _fold_crc(crc: np.ndarray, rows: torch.Tensor, start: int, block_size: int) -> None:
    """Extend each touched block's CRC with the source rows ``[start, start + T)``.

    CRC-32 is incremental (``crc32(b, crc32(a)) == crc32(a + b)``) and a block's rows are
    contiguous per lead index, so appends extend the running CRC of the partial last block.
    """
    raw = _row_bytes(rows)  # (*lead, T, d * itemsize)
    stop = start + rows.shape[-2]
    for index in np.ndindex(*raw.shape[:-2]):
        for block in range(start // block_size, -(-stop // block_size)):
            lo, hi = max(start, block * block_size), min(stop, (block + 1) * block_size)
            chunk = np.ascontiguousarray(raw[index][lo - start : hi - start])
            crc[index + (block,)] = zlib.crc32(chunk, int(crc[index + (block,)]))


_ROW_WEIGHTS = np.random.default_rng(0x5EED).integers(0, 1 << 30, size=1 << 15, dtype=np.int64) * 2 + 1
"""Odd weights ``< 2^31`` of the row checksum, one per word position (fixed: the checksum is part of the store)."""


def row_checksums(rows: torch.Tensor) -> np.ndarray:
    """``sum_i w_i b_i`` over the raw 16-bit words ``b_i`` of each row of ``rows`` (..., T, d) -> (..., T) int64
    (bytes where a row has an odd number of them).

    Exact: ``2^16 * 2^31 * 2^15 < 2^63``, so no sum wraps (rows of up to ``2^15`` words), and a word changed by
    ``D != 0`` changes the sum by ``w_i D != 0``. Computed in int64 directly (integer sums are exact in any order):
    measured 1.5 ms against 24 ms for the former fp64 product of 16-bit weight halves (the same integers), 4096
    tokens of three kv heads.
    """
    raw = _row_bytes(rows)
    words = raw.view(np.uint16) if raw.shape[-1] % 2 == 0 else raw  # half the terms: the checksum runs at every write
    if words.shape[-1] > _ROW_WEIGHTS.size:
        raise ValueError(f"rows of {raw.shape[-1]} bytes: the row checksum covers at most {_ROW_WEIGHTS.size} words")
    rows_count = int(np.prod(words.shape[:-1]))  # not -1: rows of no bytes reshape too
    flat, weights = words.reshape(rows_count, words.shape[-1]), _ROW_WEIGHTS[:words.shape[-1]]
    sums = np.empty(flat.shape[0], dtype=np.int64)
    step = max(1, _CHUNK_WORDS // max(1, flat.shape[1]))
    for start in range(0, flat.shape[0], step):  # the int64 words a chunk at a time (see _CHUNK_WORDS)
        sums[start:start + step] = flat[start:start + step].astype(np.int64) @ weights
    return sums.reshape(words.shape[:-1])  # (..., T)


_CHUNK_WORDS = 1 << 16
"""Words widened to int64 at once by :func:`row_checksums` (512 KiB). Widening a spot check's whole read at once (12,309
key rows of 128 words: 12.6 MB, fresh pages each call) took 13-17 ms inside a 4,096-token generation, against 1.3 ms
in chunks (measured in one process on the same rows, AMD EPYC, 2026-12-07): the chunks reuse memory already mapped."""


def _count_written(written: np.ndarray, start: int, stop: int, block_size: int) -> None:
    for block in range(start // block_size, -(-stop // block_size)):
        lo, hi = max(start, block * block_size), min(stop, (block + 1) * block_size)
        written[..., block] += hi - lo


def _verify(rows: torch.Tensor, expected: int, what: str) -> None:
    actual = zlib.crc32(np.ascontiguousarray(_row_bytes(rows)))
    if actual != expected:
        raise ChecksumMismatchError(
            f"backing store content check failed for {what}: CRC-32 {actual:#010x} of the paged-in bytes "
            f"!= {expected:#010x} of the bytes written (store not populated or corrupted)"
        )


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()

"""The backing store's row checksum, computed in int64 (``witcert.gate.backing_store.row_checksums``).

Implementation under test: ``row_checksums`` (the content check of every key row the spot check reads from the
store). Oracle: the direct integer sum ``sum_i w_i b_i`` in Python integers. Domain: random fp32/fp16/bf16 rows,
rows of all-ones words (every word 0xFFFF: the largest sums), odd byte counts, rows of the most words covered
(2^15). Tolerance: equal integers.
"""
import numpy as np
import pytest
import torch

from witcert.gate.backing_store import _ROW_WEIGHTS, _row_bytes, row_checksums


def direct(rows: torch.Tensor) -> list[int]:
    raw = _row_bytes(rows).reshape(-1, _row_bytes(rows).shape[-1])
    words = raw.view(np.uint16) if raw.shape[-1] % 2 == 0 else raw
    return [sum(int(w) * int(b) for w, b in zip(_ROW_WEIGHTS, row)) for row in words]


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
def test_checksums_equal_the_direct_integer_sum(dtype):
    rows = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert row_checksums(rows).reshape(-1).tolist() == direct(rows)


def test_checksums_of_many_rows_are_summed_a_chunk_at_a_time_alike(monkeypatch):
    """Rows past one chunk of widened words (several chunks, a partial last one, a row wider than a chunk) give the
    checksums of the direct sum, in the rows' shape."""
    from witcert.gate import backing_store

    rows = torch.randn(2, 37, 24, generator=torch.Generator().manual_seed(2))  # 48 words a row
    for chunk in (48, 100, 5 * 48, 1 << 16):  # one row, two rows, five rows a chunk, all at once
        monkeypatch.setattr(backing_store, "_CHUNK_WORDS", chunk)
        got = row_checksums(rows)
        assert got.shape == (2, 37) and got.reshape(-1).tolist() == direct(rows), chunk
    monkeypatch.setattr(backing_store, "_CHUNK_WORDS", 8)  # narrower than a row: one row a chunk
    assert row_checksums(rows).reshape(-1).tolist() == direct(rows)


def test_rows_of_no_bytes_and_no_rows_give_checksums_of_their_shape():
    assert row_checksums(torch.zeros(3, 0)).tolist() == [0, 0, 0]  # empty rows: the empty sum
    assert row_checksums(torch.zeros(0, 4)).shape == (0,)
    assert row_checksums(torch.zeros(2, 0, 4)).shape == (2, 0)


def test_the_largest_sums_are_exact():
    words = 1 << 15  # the most a row may hold
    ones = torch.full((2, words), -1, dtype=torch.int16).view(torch.float16)  # every word 0xFFFF
    assert row_checksums(ones).tolist() == direct(ones)
    assert row_checksums(ones)[0] == 0xFFFF * int(_ROW_WEIGHTS.sum())


def test_odd_byte_rows_sum_bytes():
    rows = torch.arange(2 * 7, dtype=torch.uint8).reshape(2, 7)
    assert row_checksums(rows).tolist() == direct(rows)


def test_a_changed_word_changes_the_checksum():
    rows = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    before = row_checksums(rows)
    rows.view(torch.int32)[2, 5] ^= 1
    after = row_checksums(rows)
    assert after[2] != before[2] and np.array_equal(np.delete(after, 2), np.delete(before, 2))

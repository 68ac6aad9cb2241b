"""The gate's exact store: content checked on every page-in, indexed like vLLM's cache (no vLLM needed).

Implementation: ``witcert.integrations.vllm.exact_store.ExactStore``. Oracle: the rows written
(exact equality); corruption, unwritten slots and a write path that drops the copy must raise.
"""
import pytest
import torch

from witcert.gate.backing_store import ChecksumMismatchError, NeverWrittenError
from witcert.integrations.vllm.exact_store import ExactStore


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_in_returns_the_rows_written_and_counts_bytes(dtype):
    g = torch.Generator().manual_seed(0)
    store = ExactStore(64, 3, 8, dtype)
    slots = torch.tensor([5, 17, 40, 63])
    k, v = torch.randn(4, 3, 8, generator=g).to(dtype), torch.randn(4, 3, 8, generator=g).to(dtype)
    store.write(slots, k, v)
    k2 = torch.randn(1, 3, 8, generator=g).to(dtype)
    store.write(torch.tensor([17]), k2, v[1:2])  # block reuse: the slot is written again
    got_k, got_v = store.page_in(torch.tensor([40, 17, 5]))
    assert torch.equal(got_k, torch.stack([k[2], k2[0], k[0]])) and torch.equal(got_v, v[[2, 1, 0]])
    assert store.bytes_paged == 3 * 2 * 3 * 8 * torch.tensor([], dtype=dtype).element_size()
    got_k[0] += 1  # a copy: the store is not changed through it
    assert torch.equal(store.page_in(torch.tensor([40]))[0][0], k[2])


def test_never_written_and_corrupted_slots_raise():
    store = ExactStore(16, 2, 4, torch.float32)
    store.write(torch.tensor([0, 1]), torch.ones(2, 2, 4), torch.zeros(2, 2, 4))
    with pytest.raises(NeverWrittenError, match=r"slot\(s\) \[2\] were never written"):
        store.page_in(torch.tensor([1, 2]))
    store.v[1, 0, 3] = 1e-30  # one value entry flipped: caught, though the key rows are intact
    with pytest.raises(ChecksumMismatchError, match=r"slot\(s\) \[1\]"):
        store.page_in(torch.tensor([0, 1]))
    assert store.bytes_paged == 0  # nothing was delivered


def test_a_write_path_that_forgets_to_copy_is_caught():
    # the CRC is folded from the source rows, not from the buffer: a store whose copy is lost
    # (the paper's never-written backing store) pages in zeros and must raise, not deliver them
    class Forgetful(ExactStore):
        def write(self, slots, k, v):
            saved_k, saved_v = self.k.clone(), self.v.clone()
            super().write(slots, k, v)
            self.k.copy_(saved_k)
            self.v.copy_(saved_v)

    store = Forgetful(8, 1, 4, torch.float32)
    store.write(torch.tensor([3]), torch.full((1, 1, 4), 2.0), torch.full((1, 1, 4), 3.0))
    with pytest.raises(ChecksumMismatchError):
        store.page_in(torch.tensor([3]))


def test_rows_of_the_wrong_shape_are_refused():
    store = ExactStore(8, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="exact store rows"):
        store.write(torch.tensor([0]), torch.zeros(1, 3, 4), torch.zeros(1, 3, 4))

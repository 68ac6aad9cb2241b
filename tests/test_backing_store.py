"""The exact backing store holds real data: content is checked, not bytes moved (docs/design.md "Gating and repair").

Implementation: ``witcert.gate.backing_store.BackingStore`` (CRC-32 per block over the bytes written,
verified on every page-in). Oracle: the source tensors themselves, compared bitwise.
Domain: lead shapes up to (2, 3), 1-40 tokens appended in 1-4 writes, block sizes 1-16,
fp16 / bf16 / fp32, keys with and without values. Tolerance: none (bitwise).

The paper's bug -- a store allocated but never written, paging in zeros while a smoke test
that counted bytes stayed green -- is reproduced by two deliberately broken stores below: the
smoke check passes on them, the content check fails on them (shown as strict xfails), and
the gate's page-in raises.
"""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from witcert.gate.backing_store import (
    BackingStore,
    BackingStoreError,
    ChecksumMismatchError,
    NeverWrittenError,
)
from witcert.gate.policy import Gate
from witcert.gate.repair import LayerPager, Repairer

# ----------------------------------------------------------------------------- broken stores


class NoCopyStore(BackingStore):
    """Broken on purpose: records checksums and lengths but drops the copy (the paper's one-line bug)."""

    def _copy_in(self, buffer, rows, start, stop):
        pass


class NeverWrittenStore(BackingStore):
    """Broken on purpose: allocates and advances the length, never delivers a byte."""

    def write(self, key, k, v=None):
        stream = self._stream_for(key, k, v)
        stop = stream.length + k.shape[-2]
        self._ensure_capacity(stream, stop)
        stream.length = stop
        self.bytes_written += k.numel() * k.element_size()


BROKEN_STORES = (NoCopyStore, NeverWrittenStore)

# ----------------------------------------------------------------------------- oracle machinery

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@st.composite
def write_plans(draw):
    """A stream: lead shape, head dim, dtype, values or not, block size, and the write chunks."""
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    d = draw(st.sampled_from((2, 8, 64)))
    dtype = draw(st.sampled_from(DTYPES))
    with_values = draw(st.booleans())
    block_size = draw(st.sampled_from((1, 3, 16)))
    chunks = draw(st.lists(st.integers(1, 20), min_size=1, max_size=4))
    seed = draw(st.integers(0, 2**16))
    return lead, d, dtype, with_values, block_size, chunks, seed


def make_source(lead, d, dtype, n_tokens, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*lead, n_tokens, d, generator=g)).to(dtype)


def fill(store, key, k, v, chunks):
    """Write ``k`` (and ``v``) in the given chunk sizes, as a cache would (prefill + decode)."""
    start = 0
    for size in chunks:
        stop = min(start + size, k.shape[-2])
        if stop > start:
            store.write(key, k[..., start:stop, :], None if v is None else v[..., start:stop, :])
        start = stop


def smoke_check(store_cls) -> bool:
    """What the paper's smoke test checked: writes complete and the byte account adds up."""
    store = store_cls(block_size=4)
    k = make_source((2,), 8, torch.float16, 10, seed=1)
    fill(store, "layer0", k, None, [7, 1, 2])
    return store.length("layer0") == 10 and store.bytes_written == k.numel() * 2


def content_check(store_cls) -> bool:
    """What must be checked: every paged-in block is bitwise the data written."""
    store = store_cls(block_size=4)
    k = make_source((2,), 8, torch.float16, 10, seed=1)
    fill(store, "layer0", k, None, [7, 1, 2])
    for head in range(2):
        for block in range(store.n_blocks("layer0")):
            paged = store.page_in("layer0", (head,), block)
            if not torch.equal(paged.k, k[head, paged.tokens]):
                return False
    return True


# ----------------------------------------------------------------------------- round trip


@given(plan=write_plans())
def test_page_in_returns_exactly_what_was_written(plan):
    lead, d, dtype, with_values, block_size, chunks, seed = plan
    n_tokens = sum(chunks)
    k = make_source(lead, d, dtype, n_tokens, seed)
    v = make_source(lead, d, dtype, n_tokens, seed + 1) if with_values else None
    store = BackingStore(block_size=block_size)
    fill(store, ("req", 3), k, v, chunks)
    assert store.length(("req", 3)) == n_tokens
    assert store.n_blocks(("req", 3)) == -(-n_tokens // block_size)
    for index in np.ndindex(*lead):
        for block in range(store.n_blocks(("req", 3))):
            paged = store.page_in(("req", 3), index, block)
            assert torch.equal(paged.k, k[index][paged.tokens])
            if with_values:
                assert torch.equal(paged.v, v[index][paged.tokens])
            n = paged.tokens.stop - paged.tokens.start
            assert paged.nbytes == n * d * k.element_size() * (2 if with_values else 1)


# ----------------------------------------------------------------------------- the paper's bug


@pytest.mark.parametrize("store_cls", (BackingStore,) + BROKEN_STORES)
def test_smoke_check_passes_even_on_broken_stores(store_cls):
    """Why a bytes-moved smoke test proves nothing: it is green on every store, broken or not."""
    assert smoke_check(store_cls)


@pytest.mark.parametrize(
    "store_cls",
    [BackingStore]
    + [pytest.param(cls, marks=pytest.mark.xfail(strict=True, raises=BackingStoreError)) for cls in BROKEN_STORES],
)
def test_content_check(store_cls):
    """The content test: passes on the real store, FAILS (strict xfail) on both broken stores."""
    assert content_check(store_cls)


@pytest.mark.parametrize(("store_cls", "error"), [(NoCopyStore, ChecksumMismatchError), (NeverWrittenStore, NeverWrittenError)])
def test_broken_store_fails_loudly_in_the_gate(store_cls, error):
    """The gate's page-in raises on a store that holds no real data (it never pages in zeros)."""
    store = store_cls(block_size=4)
    k = make_source((2,), 8, torch.float32, 12, seed=5)
    fill(store, 0, k, None, [12])
    q = torch.full((2, 8), 2.0)
    scores = (k @ q[..., None]).squeeze(-1) * 8**-0.5 + 0.3  # (2, 12)
    c = torch.full((2, 12), 1.0)
    pager = LayerPager(Repairer(store), key=0, q=q, sm_scale=8**-0.5)
    with pytest.raises(error):
        Gate(tau=0.2, block_size=4)(scores, c, pager=pager)


def test_corrupted_byte_is_caught():
    store = BackingStore(block_size=4)
    k = make_source((3,), 8, torch.float16, 9, seed=2)
    fill(store, "L", k, None, [9])
    store._streams["L"].k.view(torch.uint8)[1, 5, 3] ^= 1  # one bit of head 1, token 5
    assert torch.equal(store.page_in("L", (1,), 0).k, k[1, 0:4])
    with pytest.raises(ChecksumMismatchError):
        store.page_in("L", (1,), 1)


def test_verify_checks_every_block_without_counting_traffic():
    store = BackingStore(block_size=4)
    fill(store, "L", make_source((2, 3), 8, torch.float16, 10, seed=3), None, [10])
    assert store.verify("L") == 2 * 3 * 3
    assert store.bytes_paged == 0


# ----------------------------------------------------------------------------- bad input


def test_bad_input_raises_value_error():
    store = BackingStore(block_size=4)
    k = make_source((2,), 8, torch.float16, 5, seed=4)
    with pytest.raises(ValueError, match="block_size"):
        BackingStore(block_size=0)
    with pytest.raises(ValueError, match="NaN or Inf"):
        store.write("L", torch.full((2, 1, 8), float("nan")))
    with pytest.raises(ValueError, match=r"\(\*lead, T, d\)"):
        store.write("L", torch.zeros(8))
    store.write("L", k)
    with pytest.raises(ValueError, match="does not continue"):
        store.write("L", k.float())
    with pytest.raises(ValueError, match="does not continue"):
        store.write("L", make_source((3,), 8, torch.float16, 1, seed=0))
    with pytest.raises(ValueError, match="values"):
        store.write("L", k, k)
    with pytest.raises(ValueError, match="v shape"):
        store.write("M", k, k[..., :2, :])
    with pytest.raises(KeyError, match="no stream"):
        store.page_in("nope", (0,), 0)
    with pytest.raises(ValueError, match="index"):
        store.page_in("L", (2,), 0)
    with pytest.raises(ValueError, match="out of range"):
        store.page_in("L", (0,), 2)


# ----------------------------------------------------------------------------- production files (issue 40)


def _files(root) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_production_backing_files_live_only_as_long_as_their_request(tmp_path):
    """witcert.monitor(keep_exact=False, certificate='spot', backing_dir=...): each request's exact keys and values
    live in a directory of mode 0700 with files of mode 0600 while its cache is alive; the files go when the cache
    is released (five generate calls leave nothing behind) and when the monitor closes (a cache still held)."""
    import witcert
    from tiny_models import prompts, tiny
    from transformers import DynamicCache

    model = tiny("llama")
    ids, mask = prompts(1, length=20)
    root = tmp_path / "backing"
    with torch.no_grad(), witcert.monitor(model, "rtn-int4", keep_exact=False, certificate="spot",
                                          backing_dir=root) as mon:
        for _ in range(5):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert _files(root) == []  # each request's directory went with its cache
        cache = DynamicCache()
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        (request,) = root.iterdir()
        files = list(request.iterdir())
        assert files and request.stat().st_mode & 0o777 == 0o700
        assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
        assert root.stat().st_mode & 0o077 == 0  # the root the monitor made: owner only
        held = cache
    assert _files(root) == []  # closed with the monitor, although the cache is still held
    assert held.layers[0].store.backing is None and mon.memory().total.backing_files > 0  # reported, then released


# ----------------------------------------------------------------------------- reads by token index


@given(plan=write_plans(), picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=12))
def test_read_key_rows_returns_exactly_what_was_written(plan, picks):
    """Keys read by token index are bitwise the source rows (any chunking, dtype, growth) and only they are counted."""
    lead, d, dtype, with_values, block_size, chunks, seed = plan
    n = sum(chunks)
    k = make_source(lead, d, dtype, n, seed)
    v = make_source(lead, d, dtype, n, seed + 1) if with_values else None
    store = BackingStore(block_size=block_size)
    fill(store, "s", k, v, chunks)
    tokens = torch.tensor([p % n for p in picks])
    for index in np.ndindex(*lead):
        before = store.bytes_paged
        rows = store.read_key_rows("s", tuple(index), tokens)
        assert torch.equal(rows, k[index][tokens])
        assert store.bytes_paged - before == tokens.numel() * d * k.element_size()


@pytest.mark.parametrize(("store_cls", "error"), [(NoCopyStore, ChecksumMismatchError), (NeverWrittenStore, NeverWrittenError)])
def test_read_key_rows_fails_loudly_on_broken_stores(store_cls, error):
    store = store_cls(block_size=4)
    fill(store, 0, make_source((2,), 8, torch.float32, 10, seed=4), None, [7, 3])
    with pytest.raises(error, match="token"):
        store.read_key_rows(0, (1,), torch.tensor([2, 9]))


def test_read_key_rows_catches_one_flipped_bit_in_the_row_read():
    store = BackingStore(block_size=4)
    k = make_source((3,), 8, torch.float16, 9, seed=2)
    fill(store, "L", k, None, [9])
    store._streams["L"].k.view(torch.uint8)[1, 5, 3] ^= 1  # one bit of head 1, token 5
    assert torch.equal(store.read_key_rows("L", (1,), torch.tensor([4, 6])), k[1, [4, 6]])  # its block-mates
    with pytest.raises(ChecksumMismatchError, match="token 5"):
        store.read_key_rows("L", (1,), torch.tensor([4, 5]))


def test_read_key_rows_bad_tokens_raise_value_error():
    store = BackingStore(block_size=4)
    fill(store, "L", make_source((2,), 8, torch.float16, 10, seed=3), None, [10])
    for tokens in (torch.tensor([10]), torch.tensor([-1]), torch.tensor([[1]]), torch.tensor([1.0])):
        with pytest.raises(ValueError, match="tokens"):
            store.read_key_rows("L", (0,), tokens)
    with pytest.raises(ValueError, match="index"):
        store.read_key_rows("L", (2,), torch.tensor([1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_non_finite_entry_anywhere_is_refused(dtype, bad):
    """The finiteness check reads the smallest and largest entry: one NaN or infinity at the first, a middle or the
    last entry of keys or values is refused, naming the tensor; finite extremes (the dtype's largest) pass."""
    for position in (0, 37, -1):
        for name in ("k", "v"):
            k, v = torch.zeros(2, 5, 8, dtype=dtype), torch.ones(2, 5, 8, dtype=dtype)
            (k if name == "k" else v).view(-1)[position] = bad
            with pytest.raises(ValueError, match=f"{name} contains NaN or Inf"):
                BackingStore(block_size=4).write("L", k, v)
    extreme = torch.full((1, 3, 8), torch.finfo(dtype).max, dtype=dtype)
    extreme[0, 1] = -torch.finfo(dtype).max
    BackingStore(block_size=4).write("L", extreme, extreme)

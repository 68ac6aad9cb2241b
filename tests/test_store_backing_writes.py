"""A production store's writes to the host backing store: one write per run of steps, never a read of a row unwritten.

Implementation: :meth:`witcert.integrations.hf.compressed_cache.CompressedLayer.write_backing` (called by every
settle and by every metered pass before it reads the backing store, :func:`witcert.integrations.hf.attention.attend`),
and the deferred flush that reads a layer's history only where a cell is metered. Oracle: the exact keys and values
the model wrote (bit for bit, read back through the checksummed row and block reads); the count of history reads.
Domain: rtn-int4, a prefill then single-token steps, keys only (the audit) and keys with values (the gate); a tiny
Llama under ``generate`` with an audit that picks nothing. Adversary: a read of a row appended but not yet written
must raise. Tolerance: none.
"""
import pytest
import torch

import witcert
from tiny_models import prompts, tiny
from witcert.gate.backing_store import BackingStore
from witcert.integrations.hf.codecs import IntCodes
from witcert.integrations.hf.compressed_cache import CompressedLayer
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness_code import WitnessCode


def _store(values: bool) -> tuple[CompressedLayer, BackingStore]:
    backing = BackingStore(block_size=4)
    store = CompressedLayer(IntCodes(4), BandLayout(64, 16), keep_exact=False, backing=backing, backing_key=3,
                            backing_values=values, witness_code=WitnessCode(0))
    return store, backing


@pytest.mark.parametrize("values", [False, True])
def test_rows_reach_the_backing_store_at_a_settle_or_write_and_not_before(values):
    gen = torch.Generator().manual_seed(0)
    keys, vals = torch.randn(1, 2, 9, 64, generator=gen), torch.randn(1, 2, 9, 64, generator=gen)
    store, backing = _store(values)
    store.append(keys[..., :6, :], vals[..., :6, :])
    store.memory()  # a settle: the prefill is written
    assert backing.length(3) == 6
    for t in range(6, 9):
        store.append(keys[..., t:t + 1, :], vals[..., t:t + 1, :])
    assert backing.length(3) == 6
    with pytest.raises(ValueError, match="token indices"):  # appended, not yet written: the read raises
        backing.read_key_rows(3, (0, 1), torch.tensor([7]))
    store.write_backing()
    assert backing.length(3) == 9
    for head in range(2):
        rows = backing.read_key_rows(3, (0, head), torch.arange(9))
        assert torch.equal(rows, keys[0, head])
        if values:
            for block in range(3):
                paged = backing.page_in(3, (0, head), block)
                assert torch.equal(paged.v, vals[0, head, 4 * block:4 * block + paged.v.shape[0]])
    store.write_backing()  # nothing waiting: no second write
    assert backing.length(3) == 9


def test_an_audit_that_picks_nothing_reads_no_history_at_its_flush(monkeypatch):
    model = tiny("llama")
    ids, mask = prompts(1, length=24)
    reads = []
    original = CompressedLayer.read
    monkeypatch.setattr(CompressedLayer, "read", lambda self: reads.append(self) or original(self))
    with torch.no_grad(), witcert.monitor(model, "rtn-int4", keep_exact=False,
                                          audit=witcert.Audit(rate=1e-9)) as mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    layers = model.config.num_hidden_layers
    assert len(reads) == 3 * layers  # each decode step's attention read, none at the flush
    (result,) = mon.audit()
    assert result.picked == 0 and result.N > 0

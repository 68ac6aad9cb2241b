"""The engine gate's planner and pager over the exact store (no vLLM needed).

Implementation: ``witcert.integrations.vllm.gate`` (``witcert.Gate`` on the decode cells, Theorem 1
``T1``, block order Lemma 4 ``L4``). Oracle: a cache modelled in memory, written back as the
plan says; the meter recomputed on it from scratch must be <= tau on every cell the gate fired
and >= the fp64 true TV on every cell; the pager's logits against exact dot products.
"""
import torch

import witcert
from witcert.integrations.vllm import gate
from witcert.integrations.vllm.exact_store import ExactStore
from witcert.integrations.vllm.metering import decode_terms, true_tv_of
from witcert.core.metering import meter
from witcert.schemes.builtin import rtn_int2

LAYOUT = witcert.BandLayout(64, 16)
SCALE = 64**-0.5
BLOCK, GATE_BLOCK, TAU = 8, 4, 0.2


def _setup(g):
    rows, hkv, s, d = 2, 3, 22, 64
    lengths = [22, 13]
    n_blocks = 8
    block_table = [torch.tensor([5, 2, 7]), torch.tensor([0, 3])]  # cache blocks of each row, out of order
    store = ExactStore(n_blocks * BLOCK, hkv, d, torch.float32)
    k = torch.randn(rows, hkv, s, d, generator=g) * 2
    k[..., 9] *= 15
    v = torch.randn(rows, hkv, s, d, generator=g)
    for r, n in enumerate(lengths):
        k[r, :, n:] = 0
        store.write(gate.slots_of(block_table[r], n, BLOCK), k[r, :, :n].transpose(0, 1), v[r, :, :n].transpose(0, 1))
    k_hat = rtn_int2(k)
    for r, n in enumerate(lengths):
        k_hat[r, :, n:] = 0
    q = torch.randn(rows, 9, d, generator=g) * 3
    return q, k, k_hat, v, store, block_table, lengths


def test_plan_repairs_every_fired_cell_below_tau_when_written_back():
    g = torch.Generator().manual_seed(0)
    q, k, k_hat, v, store, block_table, lengths = _setup(g)
    lens = torch.tensor(lengths)
    w = witcert.witness_of(k, k_hat, LAYOUT)
    scores, c = decode_terms(q, k_hat.double(), w, lens, LAYOUT, SCALE)
    before = meter(scores, c)
    assert (before > TAU).any()  # int2 keys: the gate has work to do
    pager = gate.Pager(store, q, block_table, lengths, BLOCK, GATE_BLOCK, SCALE)
    plan = gate.plan(scores, c, TAU, GATE_BLOCK, pager)
    assert plan.blocks > 0 and plan.slots.numel() == plan.k.shape[0] == plan.v.shape[0]
    assert len(set(plan.slots.tolist())) == plan.slots.numel()  # each slot written back once
    distinct = {s for page in pager.pages.values() for s in page[0].tolist()}
    assert pager.bytes == store.bytes_paged == len(distinct) * store.row_bytes
    # write the plan back into the modelled cache (what the backend does through vLLM's writer)
    repaired, w2 = k_hat.clone(), w.clone()
    where = {}
    for r in range(2):
        for t, slot in enumerate(gate.slots_of(block_table[r], lengths[r], BLOCK).tolist()):
            where[slot] = (r, t)
    for slot, kk in zip(plan.slots.tolist(), plan.k):
        r, t = where[slot]
        assert torch.equal(kk, k[r, :, t])  # the store paged in the exact key of that slot
        repaired[r, :, t] = kk
        w2[r, :, t] = 0
    scores2, c2 = decode_terms(q, repaired.double(), w2, lens, LAYOUT, SCALE)
    after = meter(scores2, c2)
    fired = before > TAU
    assert (after[fired] <= TAU).all()
    assert (after >= true_tv_of(q, k, scores2, lens, SCALE)).all()


def test_pager_serves_exact_logits_and_counts_each_block_once():
    g = torch.Generator().manual_seed(1)
    q, k, _, _, store, block_table, lengths = _setup(g)
    pager = gate.Pager(store, q, block_table, lengths, BLOCK, GATE_BLOCK, SCALE)
    pager.n_tokens = 22
    page = pager((1, 4), 3)  # row 1 (13 tokens): block 3 holds token 12 and three padded positions
    exact = SCALE * (k[1, 4 // 3, 12].double() @ q[1, 4].double())
    assert page.logits.shape == (4,) and torch.allclose(page.logits[0], exact, rtol=1e-14, atol=0)
    assert page.nbytes == store.row_bytes and (page.error[:1] > 0).all() and (page.error[1:] == 0).all()
    again = pager((1, 7), 3)  # another query head, the same block: served from this step's page-in
    assert again.nbytes == 0 and store.bytes_paged == store.row_bytes

"""The plugin's spot check and spot-certified gate planner over the exact store (no vLLM needed).

Implementation: ``witcert.integrations.vllm.spot`` (settings from ``extra_args``), ``.spot_check`` (the check of a
layer-step's cells, keys read by slot from ``.exact_store``), ``.spot_gate`` (the planner). Oracle: the fp64 true
TV between attention over the exact keys and over the stored ones (as the shadow computes it); the bound's
failures at a large ``delta`` within a binomial ceiling (registry SCO, SCR).
"""
import math

import pytest
import torch

import witcert
from tests.spot_cells import binomial_ceiling
from witcert.gate.backing_store import ChecksumMismatchError, NeverWrittenError
from witcert.integrations.vllm import config, gate, spot, spot_gate
from witcert.integrations.vllm.decode_pass import cell_terms
from witcert.integrations.vllm.exact_store import ExactStore
from witcert.integrations.vllm.sequence_state import SequenceState
from witcert.integrations.vllm.spot_check import SpotChecker
from witcert.integrations.vllm.written import written
from witcert.schemes.builtin import rtn_int4

LAYOUT = witcert.BandLayout(64, 16)
SCALE = 64**-0.5
BLOCK, TAU = 16, 0.2


def _cells(seed: int, rows: int = 4, hkv: int = 2, groups: int = 4, s: int = 160):
    """Rows of int4 keys with an outlier channel (the meter saturates) in a store and a metering state; the query rows (R, Hkv, G, d)."""
    g = torch.Generator().manual_seed(seed)
    d = 64
    lengths = torch.tensor([s - 7 * r for r in range(rows)])
    blocks = math.ceil(s / BLOCK)
    store = ExactStore(rows * blocks * BLOCK, hkv, d, torch.float32)
    table = torch.randperm(rows * blocks, generator=g).reshape(rows, blocks)  # each row's blocks, out of order
    k = torch.randn(rows, s, hkv, d, generator=g)
    k[..., 5] *= 12  # an outlier channel: attention with a few heavy tokens
    v = torch.randn(rows, s, hkv, d, generator=g)
    state = SequenceState(hkv, d, LAYOUT.bands)
    state.arrange(0, rows, s, None, None)
    slots = []
    for r in range(rows):
        n = int(lengths[r])
        at = gate.slots_of(table[r], n, BLOCK)
        store.write(at, k[r, :n], v[r, :n])
        kept = written(k[r, :n], rtn_int4(k[r, :n].transpose(0, 1)).transpose(0, 1).float(), LAYOUT, False)
        state.write(torch.full((n,), r), torch.arange(n), kept.keys, kept.witness, kept.key_norms)
        slots.append(at)
    q = torch.randn(rows, hkv, groups, d, generator=g) * 2.0
    return q, k, store, state, lengths, slots


def _true_tv(q, k, view, lengths):
    scores, _ = cell_terms(q, view["keys"], view["witness"], view["key_norms"], lengths, view["norm_max"], LAYOUT,
                           SCALE, reference=True)
    truth = (SCALE * (q.double() @ k.double().transpose(1, 2).transpose(-1, -2))).masked_fill(scores == -math.inf,
                                                                                             -math.inf)
    return 0.5 * (torch.softmax(truth, -1) - torch.softmax(scores, -1)).abs().sum(-1)


def _checker(seed, groups=4):
    """``(q, k, store, view, lens, table, checker, over)``: :func:`_cells` set up for :meth:`SpotChecker.check`, every
    cell over tau."""
    q, k, store, state, lengths, slots = _cells(seed, groups=groups)
    rows, hkv, groups = q.shape[:3]
    view = state.view(rows, lengths)
    lens = lengths[:, None, None].expand(rows, 1, groups)
    table = torch.full((rows, int(lengths.max())), -1, dtype=torch.int64)
    for r, at in enumerate(slots):
        table[r, : at.numel()] = at
    checker = SpotChecker(store, SCALE, TAU, witcert.spot.spot_randomness(seed).generator)
    return q, k, store, view, lens, table, checker, torch.ones(rows, hkv, groups, dtype=torch.bool)


def _checked(seed, keys, delta, groups=4):
    q, k, store, view, lens, table, checker, over = _checker(seed, groups)
    rows = q.shape[0]
    out = checker.check(q, view, lens, over, table, [keys] * rows, torch.full((rows,), delta, dtype=torch.float64),
                        LAYOUT)
    return out, _true_tv(q, k, view, lens), store


def test_spot_bounds_cover_the_true_tv_at_small_delta_and_read_only_drawn_key_rows():
    out, tv, store = _checked(0, keys=32, delta=1e-6)
    assert out.cells == tv.numel() and bool((out.bound >= tv).all()), (out.bound - tv).min()
    assert out.bound.max() <= 1 and bool((out.bound < 1).any())  # informative where the 2-bit meter saturates
    assert store.bytes_checked == out.bytes > 0 and store.bytes_paged == 0  # keys only, apart from the gate's pages
    assert out.bytes < int(store.written.sum()) * store.key_row_bytes  # the drawn rows, not every row


def test_spot_failures_at_large_delta_stay_within_the_binomial_ceiling():
    """delta = 0.2 per cell, 48 of ~150 keys (the checks sample: two query heads per kv head read at most 96 of a
    group's ~150 keys, so no group is read whole): bounds below the true TV at most as often as delta allows, over 8
    independent draws of 16 cells; not vacuous: many bounds within 1.3x of the true TV."""
    failures, trials, tight = 0, 0, 0
    for seed in range(8):
        out, tv, _ = _checked(100 + seed, keys=48, delta=0.2, groups=2)
        failures += int((out.bound < tv).sum())
        tight += int((out.bound < 1.3 * tv).sum())
        trials += tv.numel()
        assert out.keys < out.cells * 48 + 1 and out.keys > out.cells * 16  # sampled, not read whole
    assert failures <= binomial_ceiling(trials, 0.2), (failures, trials)
    assert tight > trials // 4, tight


def test_key_groups_within_the_budget_are_read_whole_to_their_true_tv():
    """Four query heads per kv head at 48 keys each may read a group's whole history (at most 160 keys): every cell
    gets its true TV rounded up, each key row read once per group (charged as shares of at most the budget)."""
    out, tv, store = _checked(7, keys=48, delta=1e-6)
    assert bool((out.bound >= tv).all()) and bool((out.bound <= tv + 1e-8).all()), (out.bound - tv)
    assert out.bytes == int(store.written.sum()) * store.key_row_bytes  # every written key row, once
    assert out.keys <= out.cells * 48


def test_checks_reuse_verified_key_rows_until_the_store_writes_their_slot():
    """The gate's re-checks of a layer-step and the layer's later checks read no key row again and give the same
    whole-read bounds; a slot the store writes again (a freed block reused) is read anew, verified, and its new key
    is the one checked; rows read earlier are private verified copies (the store's bytes changing later is not read)."""
    q, k, store, view, lens, table, checker, over = _checker(11)
    rows = q.shape[0]
    delta = torch.full((rows,), 1e-6, dtype=torch.float64)
    first = checker.check(q, view, lens, over, table, [48] * rows, delta, LAYOUT)
    again = checker.check(q, view, lens, over, table, [48] * rows, delta, LAYOUT)
    assert first.bytes > 0 and again.bytes == 0 and torch.equal(first.bound, again.bound)
    assert bool((again.bound >= _true_tv(q, k, view, lens)).all())
    slot = table[0, :1]
    moved = k[0, :1] + 1e-3  # the slot written again with another exact key (within its radius): checked as written
    store.write(slot, moved, moved)
    k2 = k.clone()
    k2[0, 0] = moved[0]
    after = checker.check(q, view, lens, over, table, [48] * rows, delta, LAYOUT)
    assert after.bytes == store.key_row_bytes  # that slot alone, read anew
    assert bool((after.bound >= _true_tv(q, k2, view, lens)).all())
    assert not torch.equal(after.bound, first.bound)  # the new key's logits, not the kept copy's
    store.k[table[0, 1], 0, 0] += 1.0  # a kept row's bytes change in the store: the verified copy is what is read
    assert torch.equal(checker.check(q, view, lens, over, table, [48] * rows, delta, LAYOUT).bound, after.bound)
    store.write(slot, moved, moved)
    store.k[slot, 0, 0] += 1.0  # a slot written again, then corrupted: its fresh read fails its content check
    with pytest.raises(ChecksumMismatchError):
        checker.check(q, view, lens, over, table, [48] * rows, delta, LAYOUT)


def test_a_check_of_some_rows_forms_the_terms_of_those_rows_alone():
    """A re-check after a repair checks the rewritten rows only: their terms are formed for them alone, and each cell's
    bound is the one a check of every row gives it (read whole here: its true TV rounded up), NaN elsewhere."""
    q, k, store, view, lens, table, checker, over = _checker(13)
    rows = q.shape[0]
    delta = torch.full((rows,), 1e-6, dtype=torch.float64)
    every = checker.check(q, view, lens, over, table, [48] * rows, delta, LAYOUT).bound
    some = torch.zeros_like(over)
    some[2] = True
    some[0, 1] = True  # a whole key group (four cells x 48 keys cover its history: read whole)
    part = checker.check(q, view, lens, some, table, [48] * rows, delta, LAYOUT).bound
    assert torch.isnan(part[~some]).all() and torch.allclose(part[some], every[some], rtol=1e-12, atol=0)
    assert bool((part[some] >= _true_tv(q, k, view, lens)[some]).all())


def test_store_reads_keys_checked_against_their_own_crc():
    store = ExactStore(8, 2, 4, torch.float32)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    store.write(torch.tensor([1, 4, 6]), k, v)
    assert torch.equal(store.read_keys(torch.tensor([4, 1])), k[[1, 0]]) and store.bytes_checked == 2 * 32
    with pytest.raises(NeverWrittenError, match="never written"):
        store.read_keys(torch.tensor([2]))
    store.k[6, 1, 3] += 1.0  # the key bytes changed after the write
    with pytest.raises(ChecksumMismatchError, match=r"key bytes of slot\(s\) \[6\]"):
        store.read_keys(torch.tensor([6]))
    store.k[6, 1, 3] -= 1.0
    store.v[4, 0, 0] += 1.0  # a value changed: the gate's page-in sees it, a key read has nothing to check there
    with pytest.raises(ChecksumMismatchError):
        store.page_in(torch.tensor([4]))


@pytest.mark.parametrize("extra,match", [
    ({"witcert_certificate": "probably"}, r"witcert_certificate must be one of deterministic, spot"),
    ({"witcert_certificate": "spot", "witcert_spot_keys": 0}, r"witcert_spot_keys must be a positive integer"),
    ({"witcert_certificate": "spot", "witcert_spot_keys": "many"}, r"witcert_spot_keys must be a positive integer"),
    ({"witcert_certificate": "spot", "witcert_spot_delta": 1.0}, r"witcert_spot_delta must be a probability"),
    ({"witcert_certificate": "spot", "witcert_spot_delta": "x"}, r"witcert_spot_delta must be a probability"),
    ({"witcert_spot_delta": 0.1}, r"witcert_spot_delta set without witcert_certificate='spot'"),
    ({"witcert_certificate": "spot", "witcert_audit_rate": 0.1}, r"witcert_certificate='spot' with witcert_audit_rate"),
])
def test_bad_spot_settings_name_the_key(extra, match):
    cfg = config.PluginConfig(gate=True)
    with pytest.raises(ValueError, match=match):
        config.request_settings(cfg, dict({"witcert_gate": False}, **extra))


def test_spot_settings_from_extra_args_need_the_exact_store():
    cfg = config.PluginConfig(gate=True)
    got = config.request_settings(cfg, {"witcert_certificate": "spot", "witcert_spot_keys": "64",
                                        "witcert_spot_delta": "1e-4"})
    assert got.spot == spot.SpotRequest(keys=64, delta=1e-4) and got.gate
    assert config.request_settings(cfg, {}).spot is None
    with pytest.raises(ValueError, match=r"needs an engine started with WITCERT_VLLM_GATE=1"):
        config.request_settings(config.PluginConfig(), {"witcert_certificate": "spot"})


def test_spot_planner_asks_open_spot_cells_for_their_largest_blocks_only():
    q, k, store, state, lengths, slots = _cells(3, rows=2, groups=2)
    rows, hkv, groups = q.shape[:3]
    view = state.view(rows, lengths)
    scores, c = cell_terms(q, view["keys"], view["witness"], view["key_norms"], lengths[:, None, None].expand(rows, 1, groups),
                           view["norm_max"], LAYOUT, SCALE)
    scores, c = scores.reshape(rows, hkv * groups, -1), c.reshape(rows, hkv * groups, -1)
    blocks_of = [torch.unique_consecutive(at // BLOCK) for at in slots]
    pager = gate.Pager(store, q.reshape(rows, hkv * groups, -1), blocks_of, lengths.tolist(), BLOCK, BLOCK, SCALE)
    open_ = torch.zeros(rows, hkv * groups, dtype=torch.bool)
    open_[0, 1] = True  # row 0: one open cell (a spot row); row 1: nothing open
    one = spot_gate.plan(scores, c, open_, torch.tensor([True, False]), 1, TAU, BLOCK, pager)
    assert one.blocks == 1 and set(one.slots.tolist()) <= set(slots[0].tolist())
    every = spot_gate.plan(scores, c, open_, torch.tensor([True, False]), None, TAU, BLOCK, pager)  # the last round
    assert every.blocks >= one.blocks and set(every.slots.tolist()) <= set(slots[0].tolist())
    delta = spot_gate.SpotRows(pick=torch.tensor([0]), slots=slots[0][None], keys=[8], delta=torch.tensor([1e-3]),
                               gated=torch.tensor([True]), valid=torch.ones(1, 1, 2, dtype=torch.bool))
    total = delta.first_delta() + sum(delta.recheck_delta(i) for i in range(1, 1000))
    assert float(total) <= 1e-3  # the check before repair and every re-check together spend at most delta

"""Key groups read whole (``witcert.spot.groups``; registry SCO) and whole rows' exact logits (``dense_logits``).

Implementation under test: ``whole_groups``, ``check_cells`` with a source that names its cells' key groups
(``TableLogits(groups=...)``, ``KeyGather``), ``KeyGather.dense_logits`` over the exact cache and the backing store.
Oracles: the true TV of each synthetic cell (30 digits, ``tests/spot_cells.py``) and of each monitored cell (the
validation monitor's ``true_tv``), fp64 dot products of the exact keys, counts by hand, production against
validation. Domain: the adversarial families of ``tests/spot_cells.py`` (masked tokens, blown radii), groups
of 1-3 cells, histories below and above ``keys`` per cell. Tolerances: a whole cell's bound in ``[TV, TV (1 + 1e-8) +
1e-11]`` (the check's rounding up), delta exactly 0; logits within 1e-12 relative of the fp64 dot.
"""
import numpy as np
import pytest
import torch

import witcert
from witcert.gate.backing_store import BackingStore
from witcert.spot import KeyGather, TableLogits, check_cells
from witcert.spot.gather import BackedKeys
from witcert.spot.cells import SpotSettings
from witcert.spot.groups import whole_groups

from tests.spot_cells import FAMILIES, binomial_ceiling, stacked_cells, true_tv
from tests.tiny_models import prompts, tiny


def test_whole_groups_counts_the_union_and_shares_it_rounded_up():
    fresh = torch.zeros(5, 10, dtype=torch.bool)
    fresh[0, :6] = fresh[1, 3:9] = True  # group 7: union of 9 tokens over 2 cells
    fresh[2, :10] = True  # group 1 alone: 10 tokens
    fresh[3, :4] = fresh[4, :2] = True  # group 2: 4 tokens over 2 cells
    whole, shared = whole_groups(fresh, torch.tensor([7, 7, 1, 2, 2]), keys=4)
    assert whole.tolist() == [False, False, False, True, True]  # 9 > 2 * 4, 10 > 4, 4 <= 8
    assert shared.tolist() == [0, 0, 0, 2, 2]
    whole, shared = whole_groups(fresh, torch.tensor([7, 7, 1, 2, 2]), keys=5)
    assert whole.tolist() == [True, True, False, True, True] and shared.tolist() == [5, 5, 0, 2, 2]  # ceil(9 / 2)
    with pytest.raises(ValueError, match="groups"):
        whole_groups(fresh, torch.tensor([0, 1]), keys=4)


@pytest.mark.parametrize("delta", (1e-6, 0.5))
def test_a_group_read_whole_gets_every_cell_its_true_tv_with_no_delta(delta):
    """Three cells over one key history of 100 tokens, 40 keys each: read whole, at any delta (none is spent)."""
    families = list(FAMILIES)
    scores, c, eps = stacked_cells(families * 3, 100, seed=8)
    groups = torch.arange(len(families)).repeat(3)  # family i's three cells share group i
    source = TableLogits(scores - eps, groups=groups)
    assert not bool(check_cells(scores, c, source, keys=40, delta=delta, tau=0.0).whole.any())  # opt-in
    result = check_cells(scores, c, source, keys=40, delta=delta, tau=0.0, read_groups=True)
    assert bool(result.whole.all()) and bool((result.delta == 0).all()) and bool((result.rounds == 1).all())
    for i in range(scores.shape[0]):
        tv = true_tv(scores[i], eps[i])
        assert tv <= float(result.bound[i]) <= tv * (1 + 1e-8) + 1e-11, families[i % len(families)]
    visible = torch.isfinite(scores)
    union = torch.stack([visible[groups == g].any(0).sum() for g in range(len(families))])
    assert result.keys_read.tolist() == (-(-union // 3)).repeat(3).tolist()  # each cell's share, rounded up
    assert bool((result.keys_read <= 40).all())


def test_a_group_with_too_long_a_history_is_sampled_within_each_cells_budget():
    """200 tokens over three cells of 40 keys: sampled per cell (delta spent, at most 40 keys each); at delta 0.2 the
    bounds fall below the true TV at most as often as the binomial ceiling allows."""
    trials = 60
    scores, c, eps = stacked_cells(["vertex"], 200, seed=3)
    scores, c, eps = scores.expand(trials, -1), c.expand(trials, -1), eps.expand(trials, -1)
    groups = torch.arange(trials) // 3
    result = check_cells(scores, c, TableLogits(scores - eps, groups=groups), keys=40, delta=0.2, tau=0.01,
                         read_groups=True)
    assert not bool(result.whole.any()) and bool((result.delta > 0).all()) and bool((result.keys_read <= 40).all())
    assert int((result.bound < true_tv(scores[0], eps[0])).sum()) <= binomial_ceiling(trials, 0.2)


@pytest.mark.parametrize("backed", (False, True))
def test_dense_logits_match_the_fp64_dot_and_charge_each_row_once(backed):
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(2, 2, 30, 8, generator=g).to(torch.float16)  # (B, Hkv, S, d)
    queries = torch.randn(4, 8, generator=g, dtype=torch.float64)
    rows, kv = torch.tensor([0, 0, 1, 0]), torch.tensor([1, 1, 0, 0])
    bias = torch.randn(4, 30, generator=g, dtype=torch.float64)
    store = BackingStore(block_size=4)
    store.write(0, keys)
    source = KeyGather(queries, rows, kv, BackedKeys(store, 0, 30) if backed else keys, 0.25, bias)
    cells = torch.tensor([0, 1, 2, 3])
    assert not bool(source.dense_logits(cells, torch.zeros(4, 30, dtype=torch.bool)).any())  # nothing wanted: no read
    assert float(source.bytes_read.sum()) == 0
    wanted = torch.ones(4, 30, dtype=torch.bool)
    wanted[0, 20:] = wanted[1, 25:] = False  # group (0, 1): the union of 25 tokens is read
    wanted[2, :] = False
    wanted[2, 3] = True
    wanted[3, :] = False  # group (0, 0) reads nothing, group (1, 0) one token
    got = source.dense_logits(cells, wanted)
    wanted[3, :] = True
    got = source.dense_logits(cells, wanted)
    for i in range(4):
        want = (keys[rows[i], kv[i]].double() @ queries[i]) * 0.25 + bias[i]
        assert torch.allclose(got[i][wanted[i]], want[wanted[i]], rtol=1e-12, atol=1e-12)
        assert bool((got[i][~wanted[i]] == 0).all())
    row = 8 * 2
    assert source.bytes_read.tolist() == [25 * row, 0, 1 * row, 30 * row]  # each row once, to its group's first cell
    if backed:
        assert store.bytes_paged == 56 * row


def test_monitor_sources_name_their_key_groups():
    keys = torch.zeros(2, 3, 5, 4)
    source = KeyGather(torch.zeros(4, 4), torch.tensor([0, 1, 1, 0]), torch.tensor([2, 0, 2, 2]), keys, 1.0)
    assert source.groups.tolist() == [2, 3, 5, 2]  # row * kv heads + kv head
    assert TableLogits(torch.zeros(2, 3)).groups is None


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("keep_exact", (True, False))
def test_the_monitor_reads_key_groups_whole_at_the_end_of_a_call(keep_exact):
    """Tiny Llama (2 query heads per kv head), 40-token prompts, 24 keys: a decode step whose two heads over a kv
    head are both checked reads its ~42 keys whole; those cells report their true TV (validation), delta 0, 21-22
    keys each. Production reads the same keys from the backing store and reports the same bounds."""
    def table(keep):
        ids, mask = prompts(2, length=40)
        mon = witcert.monitor(tiny("llama"), "kivi-2bit", certificate="spot", spot_keys=24, tau=0.04, keep_exact=keep)
        mon.spot = SpotSettings(keys=24, delta=1e-6, tau=0.04, seed=3)
        with torch.no_grad(), mon:
            tiny("llama").generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                   pad_token_id=0)
        return mon.table()

    got = table(keep_exact)
    checked = ~np.isnan(got["spot_bound"])
    whole = checked & (got["spot_delta"] == 0)
    assert whole.any() and np.all(got["spot_keys"][checked] <= 24)
    assert np.all(got["spot_keys"][whole] < 24)  # a share of a group's ~42 keys
    if keep_exact:
        tv = got["true_tv"]
        assert np.all(tv <= got["meter"])
        assert np.all(got["spot_bound"][whole] <= tv[whole] * (1 + 1e-6) + 1e-9)  # the true TV, up to fp64
        assert np.all(tv[whole] <= got["spot_bound"][whole])
    else:
        validation = table(True)
        assert np.array_equal(validation["spot_bound"], got["spot_bound"], equal_nan=True)
        assert got["spot_bytes"].sum() == validation["spot_bytes"].sum() > 0

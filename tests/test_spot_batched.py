"""The batched spot check (``witcert.spot.check_cells``; registry SCO, SCB, SCR) and its exact-key gather.

Implementation under test: ``check_cells`` over (N, S) cells, ``KeyGather`` (exact cache and backing store),
``TableLogits``. Oracles: the one-cell form ``witcert.spot.spot_check`` on the same draws (each cell's draws
recorded in the batched call and replayed in the one-cell call: ``tests/spot_cells.py``), the true TV of each
synthetic cell (30 digits), and fp64 dot products of the exact keys. Domain: the adversarial families of
``tests/spot_cells.py`` stacked, S = 300..1500, one round and adaptive rounds, masked tokens, GQA heads sharing
a kv head. Tolerances: bound equal to the one-cell form's within 1e-10 relative (fp64 sums in another order),
same keys read and rounds; logits within 1e-12 relative of the fp64 dot; 0 violations at delta = 1e-6.
"""
import numpy as np
import pytest
import torch

from witcert.gate.backing_store import BackingStore
from witcert.spot import KeyGather, TableLogits, check_cells, spot_check, spot_randomness
from witcert.spot.gather import BackedKeys

from tests.spot_cells import (FAMILIES, RecordingSampler, ReplaySampler, binomial_ceiling, reader_for, stacked_cells,
                              true_tv)


@pytest.mark.parametrize("tau", (None, 0.05, 0.3))
@pytest.mark.parametrize("keys", (40, 128))
def test_same_bound_for_the_same_draws_as_the_one_cell_form(tau, keys):
    """Each cell's draws in the batched call, replayed in the one-cell call: the same bound, keys and rounds."""
    families = list(FAMILIES) * 2
    scores, c, eps = stacked_cells(families, 600, seed=40)
    recorder = RecordingSampler(seed=3)
    batched = check_cells(scores, c, TableLogits(scores - eps), keys=keys, delta=1e-4, tau=tau, sampler=recorder)
    for i, family in enumerate(families):
        one = spot_check(scores[i], c[i], reader_for(scores[i], eps[i]), keys=keys, delta=1e-4, tau=tau,
                         sampler=ReplaySampler(recorder.rows.get(i, [])))
        assert float(batched.bound[i]) == pytest.approx(one.bound, rel=1e-10, abs=1e-15), (family, tau)
        assert int(batched.keys_read[i]) == one.keys_read <= keys
        assert int(batched.rounds[i]) == one.rounds and float(batched.delta[i]) == pytest.approx(one.delta, rel=1e-12)


@pytest.mark.parametrize("tau", (None, 0.1))
def test_batched_bound_covers_true_tv_at_small_delta(tau):
    families = list(FAMILIES)
    for size in (300, 1500):
        scores, c, eps = stacked_cells(families, size, seed=size)
        tvs = torch.tensor([true_tv(scores[i], eps[i]) for i in range(len(families))], dtype=torch.float64)
        result = check_cells(scores, c, TableLogits(scores - eps), keys=128, delta=1e-6, tau=tau,
                             generator=spot_randomness(size).generator)
        assert bool((result.bound >= tvs).all()), (size, result.bound, tvs)
        assert bool((result.keys_read <= 128).all()) and bool((result.delta <= 1e-6).all())


@pytest.mark.parametrize("family", ("vertex", "split", "heavy"))
def test_batched_failure_rate_at_large_delta(family):
    """delta = 0.2, adaptive rounds: the cells' bounds fall below the true TV at most as often as delta allows."""
    trials = 120
    scores, c, eps = stacked_cells([family] * trials, 400, seed=21)
    scores, c, eps = scores[:1].expand(trials, -1), c[:1].expand(trials, -1), eps[:1].expand(trials, -1)
    tv = true_tv(scores[0], eps[0])
    result = check_cells(scores, c, TableLogits(scores - eps), keys=48, delta=0.2, tau=0.01,
                         generator=spot_randomness(5).generator)
    assert int((result.bound < tv).sum()) <= binomial_ceiling(trials, 0.2), family


def test_small_cells_are_read_whole_with_no_delta():
    scores, c, eps = stacked_cells(["vertex", "masked"], 30, seed=2)
    result = check_cells(scores, c, TableLogits(scores - eps), keys=64, delta=1e-6, tau=0.0)
    for i in range(2):
        tv = true_tv(scores[i], eps[i])
        assert tv <= float(result.bound[i]) <= tv * (1 + 1e-8) + 1e-11
    assert bool(result.whole.all()) and bool((result.delta == 0).all())


def test_key_gather_shares_reads_across_query_heads_and_charges_them_once():
    """Two query heads over one kv head ask for the same tokens: one key row read each, charged to the first."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 50, 8, generator=g)  # (B, Hkv, S, d)
    queries = torch.randn(4, 8, generator=g, dtype=torch.float64)
    rows, kv = torch.tensor([0, 0, 1, 0]), torch.tensor([1, 1, 0, 0])
    bias = torch.randn(4, 50, generator=g, dtype=torch.float64)
    gather = KeyGather(queries, rows, kv, keys, 0.3, bias)
    cells, tokens = torch.tensor([0, 1, 1, 2, 3]), torch.tensor([5, 5, 7, 5, 5])
    got = gather.logits(cells, tokens)
    want = torch.stack([(keys[rows[i], kv[i], t].double() @ queries[i]) * 0.3 + bias[i, t]
                        for i, t in zip(cells.tolist(), tokens.tolist())])
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    row = 8 * 4
    assert gather.bytes_read.tolist() == [row, row, row, row]  # (0,1,5) cell 0, (0,1,7) cell 1, (1,0,5), (0,0,5)
    gather.logits(torch.tensor([1, 0]), torch.tensor([5, 7]))  # read already in this call: no new bytes
    assert float(gather.bytes_read.sum()) == 4 * row


def test_key_gather_from_the_backing_store_matches_the_exact_cache():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 2, 37, 8, generator=g)
    store = BackingStore(block_size=4)
    store.write(0, keys, keys.clone())
    queries = torch.randn(3, 8, generator=g, dtype=torch.float64)
    rows, kv = torch.zeros(3, dtype=torch.int64), torch.tensor([0, 1, 1])
    cells, tokens = torch.tensor([0, 1, 2, 2, 0]), torch.tensor([36, 3, 3, 20, 0])
    cached = KeyGather(queries, rows, kv, keys, 0.5).logits(cells, tokens)
    backed_gather = KeyGather(queries, rows, kv, BackedKeys(store, 0, 37), 0.5)
    assert torch.equal(backed_gather.logits(cells, tokens), cached)
    assert float(backed_gather.bytes_read.sum()) == store.bytes_paged > 0  # verified blocks, each paged once


@pytest.mark.parametrize("kwargs, match", [
    (dict(keys=0), "keys"), (dict(keys=2.5), "keys"), (dict(delta=0.0), "delta"), (dict(delta=1.5), "delta"),
    (dict(tau=1.0), "tau")])
def test_bad_arguments_name_themselves(kwargs, match):
    scores, c, eps = stacked_cells(["flat"], 20, seed=0)
    args = dict(keys=8, delta=1e-3) | kwargs
    with pytest.raises(ValueError, match=match):
        check_cells(scores, c, TableLogits(scores - eps), **args)


def test_bad_tensors_and_a_wrong_radius_name_themselves():
    scores, c, eps = stacked_cells(["vertex", "vertex"], 200, seed=6)
    source = TableLogits(scores - eps)
    with pytest.raises(ValueError, match="radii"):
        check_cells(scores, c * 0.5, source, keys=64, delta=1e-6)
    masked = scores.clone()
    masked[1] = -torch.inf
    with pytest.raises(ValueError, match="scores"):
        check_cells(masked, c, source, keys=8, delta=1e-3)
    with pytest.raises(ValueError, match="scores and radii"):
        check_cells(scores[0], c[0], source, keys=8, delta=1e-3)
    with pytest.raises(ValueError, match="radii"):
        check_cells(scores, -c, source, keys=8, delta=1e-3)


def test_per_cell_deltas_are_spent_per_cell():
    scores, c, eps = stacked_cells(["heavy", "split", "vertex"], 500, seed=9)
    delta = torch.tensor([1e-3, 1e-5, 1e-7], dtype=torch.float64)
    result = check_cells(scores, c, TableLogits(scores - eps), keys=64, delta=delta)
    assert np.allclose(result.delta.numpy(), delta.numpy(), rtol=1e-12)

"""The audit's two batched entry points: verdicts from counts equal :func:`requests_of` on the same cells, and every
request's picks in one Philox call equal its own :func:`picked` call and each cell's own Philox word, bit for bit."""
import math

import numpy as np
import pytest
import torch

from witcert.audit import Audit, requests_of
from witcert.audit.counts import requests_of_counts
from witcert.audit.picks import AUDIT_STREAM, picked
from witcert.audit.row_picks import picked_rows
from witcert.tier_b.philox import philox4x32_10


def _cells(rng, requests: int, per_request: int, rate: float) -> dict:
    rows = {name: [] for name in ("request", "layer", "head", "pos", "audited", "flagged")}
    for r in range(requests):
        for c in range(per_request):
            audited = bool(rng.random() < rate)
            for name, value in zip(rows, (3 * r + 1, c % 5, c % 7, 100 + c, audited, audited and rng.random() < 0.4)):
                rows[name].append(value)
    return {k: np.asarray(v) for k, v in rows.items()}


@pytest.mark.parametrize("rate", [0.02, 0.3])
def test_counts_give_the_verdicts_of_the_cell_rows(rate):
    rng = np.random.default_rng(5)
    settings = Audit(rate=rate, tau=0.2, delta=0.05, seed=11)
    columns = _cells(rng, 4, 400, rate)
    expected = requests_of(columns, settings, seed=11)
    ids, n, picks, flags, cells = [], [], [], [], []
    for r in np.unique(columns["request"]):
        mine = columns["request"] == r
        flagged = mine & columns["flagged"] & columns["audited"]
        ids.append(int(r))
        n.append(int(mine.sum()))
        picks.append(int((mine & columns["audited"]).sum()))
        flags.append(int(flagged.sum()))
        cells.append([tuple(int(columns[k][i]) for k in ("layer", "head", "pos")) for i in np.flatnonzero(flagged)])
    got = requests_of_counts(ids, n, picks, flags, cells, settings, seed=11)
    assert got == expected and sum(a.flagged for a in got) > 0


def test_counts_refuse_inconsistent_counts():
    settings = Audit(rate=0.1)
    with pytest.raises(ValueError, match="flagged <= picked <= cells"):
        requests_of_counts([0], [10], [2], [3], [[(0, 0, 0)] * 3], settings)
    with pytest.raises(ValueError, match="flagged_cells"):
        requests_of_counts([0], [10], [2], [1], [[]], settings)
    with pytest.raises(ValueError, match="one entry per request"):
        requests_of_counts([0, 1], [10], [2], [1], [[(0, 0, 0)]], settings)
    assert requests_of_counts([], [], [], [], [], settings) == ()


def test_row_picks_equal_each_requests_own_picks():
    seeds = [0, 2**64 - 1, 123456789012345, 7]
    rates = [0.02, 0.5, 1.0, 0.25]
    positions = torch.tensor([[40, 41], [0, 0], [2**32 - 1, 5], [699, 700]])
    together = picked_rows(seeds, rates, [0, 3, 0, 9], range(6), 9, positions)
    assert together.shape == (6, 4, 9, 2)
    for b, (seed, rate) in enumerate(zip(seeds, rates)):
        alone = picked(seed, [[0, 3, 0, 9][b]], range(6), 9, positions[b], rate)[:, 0]
        assert torch.equal(together[:, b], alone)
    assert bool(together[:, 2].all())  # rate 1 picks every cell
    # each cell against its own Philox word, counter and key as the module docstring lays them out
    requests = [0, 3, 0, 9]
    for layer, b, head, t in ((0, 0, 0, 0), (5, 1, 8, 1), (2, 3, 4, 1), (3, 0, 7, 1), (1, 3, 2, 0)):
        seed = seeds[b]
        counter = torch.tensor([int(positions[b, t]), head | layer << 16, requests[b], AUDIT_STREAM])
        word = philox4x32_10(counter, torch.tensor([seed & 0xFFFFFFFF, seed >> 32]))[0]
        assert bool(together[layer, b, head, t]) == (int(word) < math.ceil(rates[b] * 2**32))


def test_row_picks_refuse_bad_input():
    with pytest.raises(ValueError, match="seeds"):
        picked_rows([-1], [0.1], [0], [0], 2, torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="rate"):
        picked_rows([1], [0.0], [0], [0], 2, torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="positions must be"):
        picked_rows([1, 2], [0.1, 0.1], [0, 0], [0], 2, torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="positions"):
        picked_rows([1], [0.1], [0], [0], 2, torch.tensor([[-3]]))

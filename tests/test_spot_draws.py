"""The batched draws of the spot check (:func:`witcert.spot.randomness.draw_until_new`), row by row.

Each row's valid prefix is its own sequential process: it stops at the first draw that brings its count of new
tokens (outside ``known``, each counted once) to ``counts``, or at ``MAX_DRAWS_PER_KEY counts`` draws; rows with
``counts < 1`` draw nothing. Checked on one-chunk batches (every row stops in its first chunk: the prefix is
returned as drawn) and on batches where some rows need further chunks or draw nothing (the packed form).
"""
import pytest
import torch

from witcert.spot.randomness import MAX_DRAWS_PER_KEY, MultinomialSampler, draw_until_new


def _check_row(draws: torch.Tensor, valid: torch.Tensor, known: torch.Tensor, weights: torch.Tensor, count: int):
    used = draws[valid].tolist()
    assert bool(valid[:len(used)].all()) and not bool(valid[len(used):].any())  # a prefix
    if count < 1:
        assert not used
        return
    assert all(weights[t] > 0 for t in used)  # a token of weight 0 is never drawn
    new, seen = [], set(known.nonzero().reshape(-1).tolist())
    for i, t in enumerate(used):
        if t not in seen:
            seen.add(t)
            new.append(i)
    assert len(new) <= count and len(used) <= count * MAX_DRAWS_PER_KEY
    if len(new) == count:  # stopped at the draw that reached the count
        assert new[-1] == len(used) - 1
    else:  # or at the cap
        assert len(used) == count * MAX_DRAWS_PER_KEY


@pytest.mark.parametrize("case", ["one chunk", "later chunks", "some rows idle"])
def test_each_row_is_its_own_stopped_process(case):
    g = torch.Generator().manual_seed(7)
    rows, size = 6, 40
    weights = torch.rand(rows, size, generator=g, dtype=torch.float64)
    known = torch.zeros(rows, size, dtype=torch.bool)
    counts = torch.full((rows,), 3, dtype=torch.int64)
    if case == "later chunks":  # few new tokens of real weight: most rows need more than their first chunk
        weights[:, 5:] = 1e-3
        known[:, :3] = True
        counts = torch.tensor([2, 4, 6, 8, 3, 5])
    if case == "some rows idle":
        counts = torch.tensor([0, 3, 0, 5, 1, 0])
    for trial in range(20):
        draws, valid = draw_until_new(MultinomialSampler(torch.Generator().manual_seed(trial)), weights, counts, known)
        assert draws.shape == valid.shape and draws.shape[0] == rows
        for r in range(rows):
            _check_row(draws[r], valid[r], known[r], weights[r], int(counts[r]))


def test_known_is_not_changed_and_no_rows_draw_nothing():
    sampler = MultinomialSampler(torch.Generator().manual_seed(0))
    known = torch.zeros(2, 5, dtype=torch.bool)
    known[0, 1] = True
    before = known.clone()
    draw_until_new(sampler, torch.ones(2, 5, dtype=torch.float64), torch.tensor([4, 4]), known)
    assert torch.equal(known, before)
    draws, valid = draw_until_new(sampler, torch.ones(0, 5, dtype=torch.float64), torch.zeros(0, dtype=torch.int64),
                                  torch.zeros(0, 5, dtype=torch.bool))
    assert draws.shape == (0, 0) and valid.shape == (0, 0)

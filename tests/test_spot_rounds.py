"""Adaptive key budgets (``witcert.spot.rounds``; registry SCR) and the request budget (``RequestBudget``, SCD).

Implementations: ``witcert.spot.spot_check(..., tau=)`` (rounds of 32, 128, ... keys, each at ``delta share_r``),
``witcert.spot.rounds``, ``witcert.monitor(certificate="spot", spot_delta=RequestBudget(...))``. Oracles: exact
rationals for the delta split (sums at most 1), the true TV of each synthetic cell (30 digits) and the binomial
law of failures at large delta (scipy), including a threshold at the true TV itself, where the stopping rule
decides which rounds run; ``delta_at_step`` for the budget each step spends. Domain: the adversarial families
of ``tests/spot_cells.py`` at S = 400..1000, key budgets 48..256, both splits; the tiny Llama.
Tolerances: failures within a binomial ceiling at 1e-4; keys read never above the budget.
"""
from fractions import Fraction

import numpy as np
import pytest
import torch

import witcert
from witcert.spot import RequestBudget, delta_at_step, spot_check, spot_randomness
from witcert.spot.rounds import SPLITS, budgets, round_shares, schedule

from tests.spot_cells import binomial_ceiling, reader_for, synthetic_cell, true_tv
from tests.tiny_models import prompts, tiny


def run(scores, c, eps, **kwargs):
    return spot_check(scores, c, reader_for(scores, eps), **kwargs)


@pytest.mark.parametrize("split", SPLITS)
def test_round_shares_sum_to_at_most_one(split):
    for rounds in range(1, 12):
        shares = round_shares(rounds, split)
        assert len(shares) == rounds and sum(Fraction(s) for s in shares) <= 1 and min(shares) > 0
    assert round_shares(1, "uniform") == [1.0]


def test_budgets_grow_up_to_the_key_budget():
    assert budgets(512, True) == [32, 128, 512] and budgets(100, True) == [32, 100]
    assert budgets(512, True, growth=2) == [32, 64, 128, 256, 512]
    assert budgets(16, True) == [16] and budgets(256, False) == [256]
    assert schedule(256, None) == [(256, 1.0)]
    with pytest.raises(ValueError, match="split"):
        round_shares(3, "geometric")
    with pytest.raises(ValueError, match="growth"):
        budgets(512, True, growth=1)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("family", ("vertex", "split", "heavy"))
def test_rounds_fail_within_delta_at_large_delta(family, split):
    """delta = 0.2, every round run (tau 0): the least bound over the rounds below the true TV at most as often as
    delta allows."""
    trials = 120
    scores, c, eps = synthetic_cell(family, 400, seed=21)
    tv = true_tv(scores, eps)
    failures = sum(run(scores, c, eps, keys=96, delta=0.2, tau=0.0, split=split,
                       generator=spot_randomness(s).generator).bound < tv for s in range(trials))
    assert failures <= binomial_ceiling(trials, 0.2), (family, split, failures)


@pytest.mark.parametrize("family", ("vertex", "aligned"))
def test_stopping_at_the_true_tv_keeps_the_failure_rate(family):
    """tau at the true TV: a round stops the cell as soon as its bound reaches tau, the worst place for a stopping
    rule to bias the result; failures still within delta."""
    trials = 120
    scores, c, eps = synthetic_cell(family, 400, seed=22)
    tv = true_tv(scores, eps)
    results = [run(scores, c, eps, keys=128, delta=0.2, tau=min(0.99, tv * 1.02),
                   generator=spot_randomness(s).generator) for s in range(trials)]
    assert sum(r.bound < tv for r in results) <= binomial_ceiling(trials, 0.2)
    assert all(r.keys_read <= 128 and r.delta <= 0.2 for r in results)


def test_easy_cells_stop_early_and_hard_ones_read_the_budget():
    scores, c, eps = synthetic_cell("sparse_big", 1000, seed=4)
    easy = run(scores, c, eps, keys=256, delta=1e-6, tau=0.5, generator=spot_randomness(0).generator)
    assert easy.rounds == 1 and easy.keys_read <= 32 and easy.bound <= 0.5 and 0 < easy.delta < 1e-6
    hard = run(scores, c * 40, eps, keys=256, delta=1e-6, tau=1e-4, generator=spot_randomness(0).generator)
    assert hard.rounds == 3 and 128 < hard.keys_read <= 256 and hard.delta == pytest.approx(1e-6, rel=1e-9)


@pytest.mark.usefixtures("one_thread")
def test_monitor_spends_a_request_budget_per_step():
    """spot_delta=RequestBudget(delta_req): a checked cell of metered step k spends at most
    delta_at_step(delta_req, k, layers x heads x queries), so the request's cells, however many steps, stay within
    delta_req; a callable that returns no probability is refused."""
    model = tiny("llama")
    ids, mask = prompts(1, length=40)
    budget = RequestBudget(1e-3)
    with torch.no_grad(), witcert.monitor(model, "kivi-2bit", certificate="spot", spot_keys=16, spot_delta=budget,
                                          tau=0.04) as mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    table = mon.table()
    cells = model.config.num_hidden_layers * model.config.num_attention_heads
    checked = ~np.isnan(table["spot_bound"])
    assert checked.any()
    steps = np.unique(table["pos"][checked])
    for k, position in enumerate(sorted(steps), start=1):
        here = checked & (table["pos"] == position)
        assert np.all(table["spot_delta"][here] <= delta_at_step(1e-3, k, cells) * (1 + 1e-9))
    assert table["spot_delta"].sum() <= 1e-3
    with pytest.raises(ValueError, match="spot_delta"):
        witcert.monitor(model, "kivi-2bit", certificate="spot", spot_delta=2.0)
    with pytest.raises(ValueError, match="request budget returned"):
        with torch.no_grad(), witcert.monitor(model, "kivi-2bit", certificate="spot", spot_keys=16, tau=0.04,
                                              spot_delta=lambda step, cells: 1.5):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("split", SPLITS)
def test_shares_match_the_spec(split):
    from witcert.spec import spot_check as spec

    for rounds in (1, 3, 5):
        for got, want in zip(round_shares(rounds, split), spec.round_shares(rounds, split)):
            assert got <= want * (1 + 1e-15) and got == pytest.approx(float(want), rel=1e-15)

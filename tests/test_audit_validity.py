"""Validity of the request audit's statement (registry AU) at large delta, over hundreds of audited requests.

Implementation: ``witcert.monitor(..., audit=witcert.Audit(...))`` on a tiny model, ``mon.audit()``.
Oracle: the same requests metered on every cell with the exact cache kept (``keep_exact=True``): each cell's true
TV, hence each request's true count ``M`` of cells above ``tau`` (the audit never changes what the model computes,
so both runs hold the same cells). A request *fails* when ``M > M_upper``; over ``T`` audited requests a statement
at level ``delta`` fails at most ``T delta`` times on average, so the failures are checked against the binomial
ceiling of ``T`` trials at ``delta`` (``P(exceed) < 1e-4``), as the spot-check tests do.
Domain: constructed requests where a layer collapses (its keys scaled by -8, ``benchmarks/audit_requests.py``)
beside rtn-int4 and kivi-2bit layers, 3-layer GQA Llama, 48 left-padded rows per run (each its own request),
10 new tokens, picks at rate 0.2, four audit seeds per population (independent audits of the same requests).
Four regimes: the exact audit (``keys=None``: each picked cell's bound is its true TV, the whole ``delta`` at the
binomial limit); every checked cell read whole (``keys`` above the context: a flag is exactly ``TV > tau``, so the
binomial limit alone is at stake, at ``delta_s``); few keys (8: the spot checks' union is at stake too, at
``delta``); the default ``delta = 1e-3`` in validation and production: with 8 keys 0 failures and 0 missed flags,
exact 0 missed flags and failures within the binomial ceiling at ``delta`` (one seeded request fails on a 5e-4 event).
"""
import functools

import numpy as np
import pytest
import torch

import witcert
from benchmarks.audit_requests import collapse_layer
from tests.spot_cells import binomial_ceiling
from tests.tiny_models import prompts, tiny

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_hidden_layers=3)
POPULATIONS = {"rtn-int4, layer 1 collapsed": ("rtn-int4", (1,)), "kivi-2bit, layers 0 and 2 collapsed": ("kivi-2bit", (0, 2))}
ROWS, PROMPT, NEW_TOKENS, RATE, TAU, SEEDS = 48, 16, 10, 0.2, 0.2, range(4)


def run(population: str, audit=None, keep_exact=True):
    scheme, collapsed = POPULATIONS[population]
    ids, mask = prompts(ROWS, length=PROMPT)
    model = tiny("llama", **MODEL)
    mon = witcert.monitor(model, scheme, keep_exact=keep_exact, audit=audit)
    for layer in collapsed:
        collapse_layer(mon, layer)
    with torch.no_grad(), mon:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
    return mon, out


@functools.lru_cache(maxsize=None)
def truth(population: str):
    """``(true TV per cell key, M per request, generated ids)`` of the population, every cell metered."""
    mon, out = run(population)
    table = mon.table()
    keys = list(zip(table["request"], table["layer"], table["head"], table["pos"]))
    above = np.bincount(table["request"].astype(np.int64), weights=table["true_tv"] > TAU).astype(np.int64)
    return dict(zip(keys, table["true_tv"])), above, out


def audited(population: str, keys: int, delta: float, keep_exact=True):
    """``(failures, requests, missed flags, naive failures)`` over the audit seeds."""
    tv_of, above, out = truth(population)
    failures = requests = missed = naive = 0
    for seed in SEEDS:
        mon, generated = run(population, witcert.Audit(rate=RATE, tau=TAU, delta=delta, keys=keys, seed=seed),
                             keep_exact)
        assert torch.equal(generated, out)  # the same cells as the oracle's run
        table = mon.table()
        tv = np.array([tv_of[key] for key in zip(table["request"], table["layer"], table["head"], table["pos"])])
        missed += int(np.sum(table["audited"] & (tv > TAU) & ~table["flagged"]))
        for audit in mon.audit():
            requests += 1
            failures += int(above[audit.request] > audit.M_upper)
            naive += int(above[audit.request] > audit.flagged / RATE)  # the point estimate as a limit
    return failures, requests, missed, naive


@pytest.mark.parametrize("population", POPULATIONS)
def test_populations_have_cells_on_both_sides_of_tau(population):
    tv_of, above, _ = truth(population)
    cells = len(tv_of) // ROWS
    assert above.min() > 0.05 * cells and above.max() < 0.9 * cells, (above.min(), above.max(), cells)


@pytest.mark.parametrize("population", POPULATIONS)
def test_binomial_limit_fails_within_delta_s_when_flags_are_exact(population):
    """keys above the context: every checked cell is read whole, its bound is its TV (rounded up), no draw can
    fail, and the statement fails with probability at most delta_s = delta / 2."""
    delta = 0.3
    failures, requests, missed, naive = audited(population, keys=64, delta=delta)
    assert requests == ROWS * len(SEEDS) and missed == 0
    assert failures <= binomial_ceiling(requests, delta / 2), (failures, requests)
    assert naive > binomial_ceiling(requests, delta / 2), naive  # the check has power: X / r as a limit fails


@pytest.mark.parametrize("population", POPULATIONS)
def test_the_exact_audit_fails_within_the_whole_delta(population):
    """keys=None: every picked cell's bound is its true TV (rounded up), no check exists to fail, and the binomial
    limit is taken at the whole delta: the statement fails with probability at most delta."""
    delta = 0.3
    failures, requests, missed, naive = audited(population, keys=None, delta=delta)
    assert requests == ROWS * len(SEEDS) and missed == 0
    assert failures <= binomial_ceiling(requests, delta), (failures, requests)
    assert naive > binomial_ceiling(requests, delta), naive


@pytest.mark.parametrize("population", POPULATIONS)
def test_statement_fails_within_delta_with_few_keys(population):
    """8 keys per check at a large delta: the spot checks' union is part of the statement's delta."""
    delta = 0.3
    failures, requests, _, _ = audited(population, keys=8, delta=delta)
    assert failures <= binomial_ceiling(requests, delta), (failures, requests)


@pytest.mark.parametrize("keep_exact", [True, False], ids=["validation", "production"])
def test_the_exact_audit_at_the_default_delta_misses_no_flag_and_fails_within_its_level(keep_exact):
    """The whole delta = 1e-3 at the binomial limit: over 192 requests a failure is a rare event (the union allows
    0.19 expected), not a bug; seeded as they are, rtn-int4's request 27 at audit seed 1 flags 2 of 31 picks where
    its 55 cells above tau give P(Binomial(55, 0.2) <= 2) = 5.0e-4 < delta: one failure, on the event the level
    pays for (the bounded-read audit, whose limit sits at delta / 2, just covers it)."""
    delta = witcert.Audit().delta
    for population in POPULATIONS:
        failures, requests, missed, _ = audited(population, keys=None, delta=delta, keep_exact=keep_exact)
        assert missed == 0 and failures <= binomial_ceiling(requests, delta), (population, failures, requests)


@pytest.mark.parametrize("keep_exact", [True, False], ids=["validation", "production"])
def test_no_failure_at_the_default_delta(keep_exact):
    for population in POPULATIONS:
        failures, requests, missed, _ = audited(population, keys=8, delta=witcert.Audit().delta, keep_exact=keep_exact)
        assert (failures, missed) == (0, 0), (population, failures, missed, requests)

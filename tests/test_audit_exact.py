"""The exact request audit (registry AU, ``witcert.Audit(keys=None)``, the default): each picked cell bounded by its
true TV from every exact key it sees, nothing metered, no witness kept, the whole ``delta`` at the binomial limit.

Implementation: ``witcert.monitor(..., audit=witcert.Audit(...))`` through ``witcert.integrations.hf.attention`` and
:mod:`witcert.audit.exact`. Oracles: the same generation metered on every cell with the exact cache kept (each
cell's fp64 true TV: ``cells.measure``'s, formed independently of :func:`witcert.audit.exact.true_tv_bounds`),
validation against production (the exact cache against the host backing store), deferred against in-step, and a
backing store whose bytes are corrupted (its content check must refuse them). Domain: the tiny GQA Llama of
``tests/tiny_models.py`` (two left-padded rows, one layer collapsed so cells sit on both sides of ``tau``),
rtn-int4, kivi-2bit, the fp8 query format. Tolerances: bound within ``[TV, TV + 1e-8]`` of the oracle's TV (the
rounding up is ``1e-9`` relative plus ``1e-12``; the two fp64 evaluations differ by summation order only); picks,
flags and bounds bit-identical between validation and production; between deferred and in-step runs picks and flags
identical, bounds within 1e-12 relative (the fp64 logits of a fold of calls sum in another order).
"""
import numpy as np
import pytest
import torch

import witcert
from tests.test_audit_monitor import MODEL, TAU, generate, keyed
from tests.tiny_models import tiny
from witcert.audit import requests_of
from witcert.audit.limit import upper_limit
from witcert.audit.picks import pick_probability
from witcert.gate.backing_store import BackingStore, ChecksumMismatchError

pytestmark = pytest.mark.usefixtures("one_thread")
EXACT = witcert.Audit(rate=0.3, tau=TAU, delta=1e-3, seed=1)
COLUMNS = ("audited", "flagged", "audit_bound", "audit_check_delta", "audit_keys", "metered")


def oracle_tv(scheme="rtn-int4", **kwargs) -> dict:
    full, _ = generate(scheme, **kwargs)
    return keyed(full.table(), "true_tv")


def picked_rows(table):
    on = table["audited"].astype(bool)
    cells = list(zip(table["request"][on], table["layer"][on], table["head"][on], table["pos"][on]))
    return on, cells


@pytest.mark.parametrize("scheme", ["rtn-int4", "kivi-2bit"])
def test_each_picked_cell_is_bounded_by_its_true_tv_and_flagged_exactly_above_tau(scheme):
    tv_of = oracle_tv(scheme)
    mon, _ = generate(scheme, audit=EXACT)
    table = mon.table()
    on, cells = picked_rows(table)
    tv = np.array([tv_of[cell] for cell in cells])
    bound = table["audit_bound"][on]
    assert on.sum() > 20 and (tv > TAU).any() and (tv <= TAU).any()  # cells on both sides of tau
    assert np.all(tv <= bound) and np.all(bound <= tv + 1e-8)
    assert np.array_equal(table["flagged"][on], bound > TAU)  # flagged exactly when the TV is above tau
    assert np.all(table["audit_check_delta"][on] == 0)  # no check can fail
    assert np.all(table["audit_keys"][on] >= 1) and np.allclose(table["true_tv"][on], tv, rtol=0, atol=1e-12)
    assert not table["metered"].any() and np.isnan(table["meter"]).all()  # nothing metered
    assert not table["flagged"][~on].any() and np.isnan(table["audit_bound"][~on]).all()


def test_the_statement_takes_the_binomial_limit_at_the_whole_delta():
    assert (EXACT.exact, EXACT.delta_sampling, EXACT.delta_spot) == (True, EXACT.delta, 0.0)
    bounded = witcert.Audit(rate=0.3, tau=TAU, delta=1e-3, keys=16)
    assert (bounded.exact, bounded.delta_sampling, bounded.delta_spot) == (False, 5e-4, 5e-4)
    mon, _ = generate(audit=EXACT)
    for audit in mon.audit():
        n = np.array([audit.N])
        limit = upper_limit(np.array([audit.flagged]), n, pick_probability(EXACT.rate), EXACT.delta)
        assert audit.M_upper == int(limit[0]) and audit.flagged <= audit.picked <= audit.N


def test_production_reads_the_same_exact_keys_from_the_backing_store_and_keeps_no_witness():
    validation, out_v = generate(audit=EXACT)
    production, out_p = generate(audit=EXACT, keep_exact=False)
    assert torch.equal(out_v, out_p)
    v, p = validation.table(), production.table()
    for name in COLUMNS:
        assert np.array_equal(v[name], p[name], equal_nan=True), name
    assert np.isnan(p["true_tv"]).all()  # production keeps no exact cache: no true TV column, the bound only
    assert validation.audit() == production.audit()
    for mon in (validation, production):
        assert mon.memory().total.witness == 0  # the exact audit meters nothing: no store forms a witness
    bounded, _ = generate(audit=witcert.Audit(rate=0.3, tau=TAU, delta=1e-3, keys=16, seed=1), keep_exact=False)
    assert bounded.memory().total.witness > 0  # the meter-first audit keeps one


def test_deferred_and_in_step_exact_audits_give_the_same_bounds():
    deferred, _ = generate(audit=EXACT)
    in_step, _ = generate(audit=EXACT, defer=False)
    assert deferred.defer and not in_step.defer
    a, b = deferred.table(), in_step.table()
    for name in COLUMNS:
        of_a, of_b = keyed(a, name), keyed(b, name)
        assert of_a.keys() == of_b.keys()
        cells = sorted(of_a)
        x, y = np.array([of_a[c] for c in cells]), np.array([of_b[c] for c in cells])
        if name == "audit_bound":  # the fp64 logits of one query or of a fold of calls: the same sums, another order
            assert np.allclose(x, y, rtol=1e-12, atol=1e-15, equal_nan=True)
        else:
            assert np.array_equal(x, y, equal_nan=True), name
    statement = [[(x.N, x.picked, x.flagged, x.M_upper, sorted(x.flagged_cells)) for x in mon.audit()]
                 for mon in (deferred, in_step)]
    assert statement[0] == statement[1]  # the table's row order differs (a flush meters layer by layer)


def test_with_sampled_metering_the_sampled_cells_are_metered_and_the_picked_ones_bounded_exactly():
    tv_of = oracle_tv()
    mon, _ = generate(audit=EXACT, sample=witcert.MeterSampling(every=2, seed=0))
    table = mon.table()
    on, cells = picked_rows(table)
    tv = np.array([tv_of[cell] for cell in cells])
    assert np.all(tv <= table["audit_bound"][on]) and np.all(table["audit_bound"][on] <= tv + 1e-8)
    metered = table["metered"].astype(bool)
    assert metered.any() and np.all(table["meter"][metered] >= table["true_tv"][metered])
    assert mon.memory().total.witness > 0  # the sampled cells' meter reads the witness


def test_a_quantized_query_is_audited_as_the_kernel_read_it():
    tv_of = oracle_tv(query_format="fp8-e4m3")  # true TV: exact q and keys against the kernel's q' and keys
    mon, _ = generate(audit=EXACT, query_format="fp8-e4m3")
    table = mon.table()
    on, cells = picked_rows(table)
    tv = np.array([tv_of[cell] for cell in cells])
    assert on.any() and np.all(tv <= table["audit_bound"][on]) and np.all(table["audit_bound"][on] <= tv + 1e-8)


def test_a_corrupted_backing_store_is_refused_never_read_as_exact_keys(monkeypatch):
    def copy_corrupted(self, buffer, rows, start, stop):
        buffer[..., start:stop, :] = rows
        buffer[..., start, 0] += 1.0  # one word of the first row written differs from the bytes delivered

    monkeypatch.setattr(BackingStore, "_copy_in", copy_corrupted)
    with pytest.raises(ChecksumMismatchError, match="content check failed"):
        generate(audit=EXACT, keep_exact=False)


def test_the_jsonl_rebuilds_the_exact_statement(tmp_path):
    mon, _ = generate(audit=EXACT)
    path = tmp_path / "cells.jsonl"
    mon.write_jsonl(path)
    import json

    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["audit_keys_budget"] for r in rows} == {None}
    columns = {name: np.array([r[name] for r in rows]) for name in ("request", "layer", "head", "pos", "audited",
                                                                     "flagged")}
    settings = witcert.Audit(rate=rows[0]["audit_rate"], tau=rows[0]["audit_tau"], delta=rows[0]["audit_delta"],
                             keys=rows[0]["audit_keys_budget"])
    assert requests_of(columns, settings, rows[0]["audit_seed"]) == mon.audit()
    assert "true TV" in str(mon.summary())


@pytest.mark.parametrize("keys", [0, -1, 1.5, True, "all"])
def test_keys_must_be_none_or_a_positive_int(keys):
    with pytest.raises(ValueError, match="keys must be None"):
        witcert.Audit(keys=keys)


def test_a_store_that_forms_no_witness_refuses_to_be_metered():
    mon = witcert.monitor(tiny("llama", **MODEL), "rtn-int4", audit=EXACT)
    assert not mon.statistics
    store = mon._store(0, type("Record", (), {"seed": None, "ids": (0,)})(), None)
    store.append(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64))
    with pytest.raises(ValueError, match="stored: this store forms no witness"):
        store.stored()
    assert store.memory().witness == 0


def test_the_dithered_cache_is_audited_exactly_in_its_step():
    """Tier B's cache is metered in its step (not deferred); its exact audit reads what attention read then."""
    tv_of = oracle_tv("dithered-int8", collapse=False, seed=5)  # the same dither seed: the same cache
    mon, _ = generate("dithered-int8", audit=EXACT, collapse=False, seed=5)
    table = mon.table()
    on, cells = picked_rows(table)
    tv = np.array([tv_of[cell] for cell in cells])
    assert not mon.defer and on.sum() > 20 and set(table["tier"]) == {"B"}
    assert np.all(tv <= table["audit_bound"][on]) and np.all(table["audit_bound"][on] <= tv + 1e-8)

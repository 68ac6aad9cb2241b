"""The request audit inside ``witcert.monitor`` (registry AU): which cells are metered, replay, deferral, production,
sampling, refusals, per-request state, and what the summary, JSONL and plot carry.

Implementation: ``Monitor`` with ``audit=witcert.Audit(...)`` (``witcert.integrations.hf.attention`` with
``witcert.audit``). Oracles: the same generation metered on every cell (its meter and true TV per cell), the same
audit replayed from its seed, in its step (``mon.defer = False``) and deferred, validation against production
(``keep_exact=True`` against ``False``: the spot checks read the same exact keys from the exact cache and from the
backing store), and the JSONL written by the run. Domain: the tiny Llama of ``tests/tiny_models.py`` (GQA, two
left-padded rows; one layer collapsed so cells sit above ``tau``), rtn-int4, kivi-2bit, dithered-int8.
Tolerances: picks, flags and bounds exact between replays; meters rel 1e-4 against the full run (the fused
pass's fp32 budget depends on the row's columns).
"""
import json

import numpy as np
import pytest
import torch

import witcert
from benchmarks.audit_requests import collapse_layer
from tests.tiny_models import prompts, tiny
from witcert.audit import requests_of
from witcert.audit.picks import pick_probability
from witcert.tier_a.witness_code import DEFAULT_WITNESS_BITS

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
TAU = 0.2


AUDIT_WITNESS_BITS = DEFAULT_WITNESS_BITS  # an audit's spot checks keep rtn-int4's stored witness byte by default


def generate(scheme="rtn-int4", audit=None, collapse=True, defer=True, rows=2, new_tokens=9, **kwargs):
    ids, mask = prompts(rows, length=16)
    model = tiny("llama", **MODEL)
    mon = witcert.monitor(model, scheme, audit=audit, **kwargs)
    if collapse:
        collapse_layer(mon, 1)
    with torch.no_grad(), mon:
        mon.defer = mon.defer and defer
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return mon, out


def keyed(table, name):
    return dict(zip(zip(table["request"], table["layer"], table["head"], table["pos"]), table[name]))


def audit_columns(table):
    return {name: table[name] for name in ("audited", "flagged", "audit_bound", "audit_check_delta", "metered")}


def same_columns(a, b):
    return all(np.array_equal(a[name], b[name], equal_nan=True) for name in a)


def test_only_picked_cells_are_metered_and_unpicked_cells_are_never_certified():
    full, out_full = generate(witness_bits=AUDIT_WITNESS_BITS)
    # 2 keys a check: some key groups (a layer, row and kv head of the flush) have at most 2 tokens per checked cell
    # and are read whole, the others sample
    mon, out = generate(audit=witcert.Audit(rate=0.3, tau=TAU, delta=1e-3, keys=2, seed=1))
    assert torch.equal(out, out_full)  # the audit never changes what the model computes
    table, meter, truth = mon.table(), keyed(full.table(), "meter"), keyed(full.table(), "true_tv")
    audited, metered = table["audited"], table["metered"]
    assert len(table) == len(full.table()) and 0 < audited.sum() < len(table)
    assert np.array_equal(audited, metered)  # without sampling the audit meters its picks, nothing else
    for name in ("meter", "true_tv", "audit_bound", "audit_check_delta"):
        assert np.isnan(table[name][~audited]).all(), name
    assert not table["flagged"][~audited].any() and not table["joint"][~audited].any()
    summary = mon.summary()
    assert summary.total["cells"] == audited.sum() and summary.total["unmetered"] == (~audited).sum()
    for key, value, bound, tv, on in zip(zip(table["request"], table["layer"], table["head"], table["pos"]),
                                         table["meter"], table["audit_bound"], table["true_tv"], audited):
        if on:
            assert value == pytest.approx(meter[key], rel=1e-4, abs=1e-12), key
            assert tv == pytest.approx(truth[key], rel=1e-9, abs=1e-15) and tv <= bound <= value, key
    checked = audited & (table["meter"] > TAU)
    spent = table["audit_check_delta"]
    assert checked.any() and (spent[checked] > 0).any() and np.all(spent[audited & ~checked] == 0)
    whole = checked & (spent == 0)  # a check that read every key its cell sees: its bound is the true TV, rounded up
    assert whole.any() and np.allclose(table["audit_bound"][whole], table["true_tv"][whole], rtol=1e-6, atol=1e-9)
    assert np.array_equal(table["flagged"][audited], table["audit_bound"][audited] > TAU)
    assert np.all(table["audit_keys"][checked] > 0)


def test_each_request_gets_its_statement():
    mon, _ = generate(audit=witcert.Audit(rate=0.3, tau=TAU, delta=1e-3, keys=16, seed=1))
    table = mon.table()
    audits = mon.audit()
    assert [a.request for a in audits] == [0, 1]
    for a in audits:
        mine = table["request"] == a.request
        assert a.N == mine.sum() == 2 * 8 * 8  # layers x query heads x the 8 decode steps that read the cache
        assert a.picked == table["audited"][mine].sum() and a.flagged == table["flagged"][mine].sum()
        exact_rate = pick_probability(0.3)  # the law of the picks: ceil(0.3 2^32) / 2^32
        assert a.M_upper == witcert.audit.upper_limit(a.flagged, a.N, exact_rate, 5e-4) and a.fraction_upper == a.M_upper / a.N
        assert (a.tau, a.delta, a.rate, a.seed) == (TAU, 1e-3, 0.3, 1)
        assert a.interval[0] <= a.estimate <= a.interval[1] <= a.fraction_upper
        flagged = table["flagged"] & mine
        assert sorted(a.flagged_cells) == sorted(zip(table["layer"][flagged].astype(int), table["head"][flagged].astype(int),
                                                     table["pos"][flagged].astype(int)))
        assert all(layer == 1 for layer, _, _ in a.flagged_cells)  # the collapsed layer, nowhere else


def test_picks_replay_from_the_seed_and_are_secret_by_default():
    audit = witcert.Audit(rate=0.3, tau=TAU, delta=1e-3, keys=16, seed=7)
    first, _ = generate(audit=audit)
    again, _ = generate(audit=audit)
    assert same_columns(audit_columns(first.table()), audit_columns(again.table()))
    assert first.audit() == again.audit()
    other, _ = generate(audit=witcert.Audit(rate=0.3, tau=TAU, delta=1e-3, keys=16, seed=8))
    assert not np.array_equal(first.table()["audited"], other.table()["audited"])
    secret_a, _ = generate(audit=witcert.Audit(rate=0.3, keys=16))
    secret_b, _ = generate(audit=witcert.Audit(rate=0.3, keys=16))
    assert secret_a.audit_seed != secret_b.audit_seed and secret_a.audit()[0].seed == secret_a.audit_seed
    assert not np.array_equal(secret_a.table()["audited"], secret_b.table()["audited"])


def test_checked_cells_over_one_key_history_are_read_whole_together():
    """A flush's checked cells over one key history (a layer, row and kv head) read it whole where it has at most
    ``keys`` tokens per checked cell: each gets its true TV rounded up, spends no delta and reports its share of the
    group's reads (``witcert.spot.groups``)."""
    full, _ = generate(witness_bits=AUDIT_WITNESS_BITS)
    mon, _ = generate(audit=witcert.Audit(rate=0.3, tau=TAU, delta=1e-3, keys=16, seed=1))
    table, truth = mon.table(), keyed(full.table(), "true_tv")
    checked = table["audited"] & (table["meter"] > TAU)
    assert checked.sum() > 8
    assert np.all(table["audit_check_delta"][checked] == 0)
    for key, bound, on in zip(zip(table["request"], table["layer"], table["head"], table["pos"]), table["audit_bound"],
                              checked):
        if on:
            assert truth[key] <= bound <= truth[key] * (1 + 1e-6) + 1e-9, key
    keys = table["audit_keys"][checked]
    assert np.all((keys >= 1) & (keys <= 16))
    assert np.array_equal(table["flagged"][checked], table["audit_bound"][checked] > TAU)


def test_deferred_and_in_step_audits_pick_the_same_cells():
    # one key a check: every check samples (no key group is read whole), in its step and deferred alike
    audit = witcert.Audit(rate=0.3, tau=TAU, delta=1e-3, keys=1, seed=3)
    deferred, _ = generate(audit=audit)
    in_step, _ = generate(audit=audit, defer=False)
    assert deferred.defer and not in_step.defer
    a, b = deferred.table(), in_step.table()
    picked_a, picked_b = keyed(a, "audited"), keyed(b, "audited")
    assert picked_a == picked_b and any(picked_a.values())  # a pick is a function of the cell and the seed
    delta_a, delta_b = keyed(a, "audit_check_delta"), keyed(b, "audit_check_delta")
    for key, on in picked_a.items():  # the same cells checked (meters far from tau), at the same step's budget
        if on:
            assert delta_a[key] == delta_b[key], key
    for table in (a, b):
        on = table["audited"]
        assert np.all(table["true_tv"][on] <= table["audit_bound"][on])


def test_production_audit_reads_the_backing_store_for_the_checked_cells():
    audit = witcert.Audit(rate=0.3, tau=TAU, delta=1e-3, keys=16, seed=5)
    validation, out_v = generate(audit=audit)
    production, out_p = generate(audit=audit, keep_exact=False)
    assert torch.equal(out_v, out_p)
    v, p = validation.table(), production.table()
    assert same_columns(audit_columns(v), audit_columns(p))  # the same exact keys, from memory or the host store
    assert np.isnan(p["true_tv"]).all() and validation.audit() == production.audit()
    spot, out_s = generate(keep_exact=False, certificate="spot", spot_keys=16)  # its host store keeps values too
    assert torch.equal(out_s, out_p)
    keys_only, keys_and_values = production.memory().total.backing_host, spot.memory().total.backing_host
    assert keys_only > 0 and 2 * keys_only == keys_and_values  # the audit reads exact keys only


def test_the_audit_combines_with_sampled_metering():
    full, _ = generate(witness_bits=AUDIT_WITNESS_BITS)
    sampling = witcert.MeterSampling(every=3, seed=2)
    mon, _ = generate(audit=witcert.Audit(rate=0.2, tau=TAU, delta=1e-3, keys=16, seed=4), sample=sampling)
    table, meter = mon.table(), keyed(full.table(), "meter")
    sampled = table["pos"] % 3 == 0
    assert np.array_equal(table["metered"], sampled | table["audited"])  # the union is metered
    assert (table["audited"] & ~sampled).any() and (sampled & ~table["audited"]).any()
    on = table["metered"]
    for key, value in zip(zip(table["request"][on], table["layer"][on], table["head"][on], table["pos"][on]),
                          table["meter"][on]):
        assert value == pytest.approx(meter[key], rel=1e-4, abs=1e-12), key
    assert np.isnan(table["audit_bound"][~table["audited"]]).all()  # sampled-only cells are no audit picks
    assert sum(a.picked for a in mon.audit()) == table["audited"].sum()


def test_state_never_leaks_between_requests():
    ids, mask = prompts(2, length=16)
    model = tiny("llama", **MODEL)
    mon = collapse_layer(witcert.monitor(model, "rtn-int4", audit=witcert.Audit(rate=0.3, keys=1, seed=9)), 1)  # 1 key: the checks sample (spend delta)
    with torch.no_grad(), mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=0)
        alone = mon.audit()
        model.generate(input_ids=ids[:, 4:], attention_mask=mask[:, 4:], max_new_tokens=6, do_sample=False,
                       pad_token_id=0)
    audits, table = mon.audit(), mon.table()
    assert [a.request for a in audits] == [0, 1, 2, 3] and audits[:2] == alone  # later requests change nothing
    for a in audits:
        mine = table["request"] == a.request
        assert a.N == mine.sum() and all(cell in set(zip(table["layer"][mine], table["head"][mine], table["pos"][mine]))
                                         for cell in a.flagged_cells)
    first_step = {}  # each request counts its steps from its own first call: the same budget at its step 1
    for request in (0, 2):
        mine = (table["request"] == request) & (table["audit_check_delta"] > 0)
        first = table["pos"][table["request"] == request].min()
        first_step[request] = set(table["audit_check_delta"][mine & (table["pos"] == first)])
    assert first_step[0] and first_step[0] == first_step[2]


def test_summary_jsonl_and_plot_carry_the_audit(tmp_path):
    mon, _ = generate(audit=witcert.Audit(rate=0.3, tau=TAU, delta=1e-3, keys=16, seed=1))
    text = str(mon.summary())
    assert "request audit" in text and "1 - delta = 1 - 0.001" in text and mon.audit()[0].line() in text
    assert "the audit: " in text and "left unmetered" in text
    path = tmp_path / "cells.jsonl"
    mon.write_jsonl(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["audit_rate"] for r in rows} == {0.3} and {r["audit_seed"] for r in rows} == {1}
    columns = {name: np.array([r[name] for r in rows]) for name in ("request", "layer", "head", "pos", "audited",
                                                                     "flagged")}
    rebuilt = requests_of(columns, witcert.Audit(rate=rows[0]["audit_rate"], tau=rows[0]["audit_tau"],
                                                 delta=rows[0]["audit_delta"], keys=rows[0]["audit_keys_budget"]),
                           rows[0]["audit_seed"])
    assert rebuilt == mon.audit()  # the JSONL carries the whole audit
    unpicked = [r for r in rows if not r["audited"]]
    assert unpicked and all(r["meter"] is None and r["metered"] is False for r in unpicked)
    fig = mon.plot_audit(tmp_path / "audit.png")
    assert (tmp_path / "audit.png").stat().st_size > 0 and len(fig.axes) == 2
    assert "flagged" in fig.axes[0].get_title()


def test_dithered_cache_is_audited_in_its_step():
    tau = 2e-3  # the dithered cache's meters sit near 2e-3 on the tiny model: some certified, some checked
    mon, _ = generate("dithered-int8", audit=witcert.Audit(rate=0.3, tau=tau, delta=1e-3, keys=16, seed=2),
                      collapse=False, seed=5)
    table = mon.table()
    assert not mon.defer and table["audited"].any() and set(table["tier"]) == {"B"}
    on = table["audited"]
    assert np.all(table["true_tv"][on] <= table["audit_bound"][on])
    assert np.array_equal(table["flagged"][on], table["audit_bound"][on] > tau)
    assert (table["audit_check_delta"][on] > 0).any() and (table["audit_check_delta"][on] == 0).any()


def test_refusals_name_the_argument_and_say_what_to_do():
    model = tiny("llama", **MODEL)
    with pytest.raises(ValueError, match="audit: a gate would act on the audit's outcomes.*Acting after a request ends"):
        witcert.monitor(model, "rtn-int4", audit=witcert.Audit(), gate=witcert.Gate(tau=0.2))
    with pytest.raises(ValueError, match="audit: certificate='spot'"):
        witcert.monitor(model, "rtn-int4", audit=witcert.Audit(), certificate="spot")
    with pytest.raises(ValueError, match="audit must be a witcert.Audit or None"):
        witcert.monitor(model, "rtn-int4", audit=0.02)
    with pytest.raises(ValueError, match="audit: this monitor does not audit"):
        witcert.monitor(model, "rtn-int4").audit()

"""Deferred metering (``witcert.integrations.hf.pending``): cells metered at a request's flush are the cells
metered in their step, and results are never read with cells missing.

Implementation: ``Monitor`` with ``defer`` (the default where the meter feeds nothing back). Oracle: the same
run metered in its steps (``mon.defer = False``), cell by cell; the fp64 true TV against the exact keys.
Domain: the tiny Llama (GQA, two left-padded rows), schemes with packed codes, reconstructions and a user
callable, both ``keep_exact`` modes, ``generate`` and hand-written forward loops.
Tolerance: the fused pass's fp32 budget grows with the row's columns (a deferred row also holds the
tokens written after its step, hidden), so meters agree to rel 1e-4; true TVs (fp64) to rel 1e-9. The
radii are fp32 enclosures of one fp64 quantity, formed by BLAS in an order the CPU picks (the batched pass
and the per-step pass differ, and so do CPUs): each lies in ``[exact, exact (1 + RADIUS_SLACK)]``, so two
paths' ``c_max`` agree within ``2 RADIUS_SLACK`` relative, never bit for bit.
"""
import dataclasses

import numpy as np
import pytest
import torch

import witcert
from tests.tiny_models import prompts, tiny
from witcert.integrations.hf import monitoring

pytestmark = pytest.mark.usefixtures("one_thread")
BANDS = 16  # the tiny Llama's head dim 64: 32 RoPE pairs, 16 bands
RADIUS_SLACK = (BANDS + 4) * 2.0**-23 + 2 * 2.0**-21  # witcert.fastpath.radius: the band dot's lift and fp32_up twice
MODEL = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
LAYERS, HEADS, ROWS = 2, 8, 2


def int6(x):
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 31
    return (x / scale).round().clamp(-31, 31) * scale


def run(scheme, keep_exact, defer, new_tokens=9, **kwargs):
    ids, mask = prompts(ROWS)
    model = tiny("llama", **MODEL)
    with torch.no_grad(), witcert.monitor(model, scheme, keep_exact=keep_exact, **kwargs) as mon:
        mon.defer = mon.defer and defer
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return mon, out


def keyed(table):
    key = list(zip(table["request"], table["layer"], table["head"], table["pos"]))
    return {name: dict(zip(key, table[name])) for name in table.columns}


@pytest.mark.parametrize("scheme", ["rtn-int4", "fp8-e4m3", "kivi-2bit", int6], ids=str)
@pytest.mark.parametrize("keep_exact", [True, False])
def test_deferred_cells_are_the_in_step_cells(scheme, keep_exact):
    in_step, out_a = run(scheme, keep_exact, defer=False)
    deferred, out_b = run(scheme, keep_exact, defer=True)
    assert torch.equal(out_a, out_b)  # metering never changes what the model computes
    a, b = keyed(in_step.table()), keyed(deferred.table())
    assert a["meter"].keys() == b["meter"].keys() and len(a["meter"]) == ROWS * LAYERS * HEADS * 8
    for key, meter in a["meter"].items():
        assert b["meter"][key] == pytest.approx(meter, rel=1e-4, abs=1e-12), key
        assert b["c_max"][key] == pytest.approx(a["c_max"][key], rel=2 * RADIUS_SLACK, abs=1e-12), key
        if keep_exact:
            assert b["true_tv"][key] == pytest.approx(a["true_tv"][key], rel=1e-9, abs=1e-15), key
            assert b["true_tv"][key] <= b["meter"][key], key
    # the same bytes held; the room growable buffers keep ahead depends on when the witnesses were formed
    assert dataclasses.replace(in_step.memory().total, reserved=0) == dataclasses.replace(deferred.memory().total,
                                                                                            reserved=0)
    assert deferred.summary().total["cells"] == in_step.summary().total["cells"]


def forward_loop(mon, model, steps: int, check):
    """Prefill, then one forward call per token; ``check(step)`` after each decode call."""
    ids, mask = prompts(ROWS)
    out = model(input_ids=ids, attention_mask=mask)
    for step in range(steps):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
        out = model(input_ids=nxt, attention_mask=mask, past_key_values=out.past_key_values)
        check(step + 1)


def test_results_read_mid_request_hold_every_call_so_far():
    model = tiny("llama", **MODEL)
    with torch.no_grad(), witcert.monitor(model, "rtn-int4", keep_exact=True) as mon:
        assert mon.defer

        def check(steps):
            table = mon.table()  # a read of the results meters the recorded calls first
            assert len(table) == ROWS * LAYERS * HEADS * steps
            assert np.all(table["true_tv"] <= table["meter"])

        forward_loop(mon, model, 5, check)


def test_a_request_holds_at_most_flush_calls_recorded_calls(monkeypatch):
    monkeypatch.setattr(monitoring, "FLUSH_CALLS", 3)
    model = tiny("llama", **MODEL)
    with torch.no_grad(), witcert.monitor(model, "rtn-int4", keep_exact=False) as mon:
        metered = []
        forward_loop(mon, model, 7, lambda steps: metered.append(len(mon._batches)))  # no read: no flush by a read
    assert metered[:2] == [0, 0]  # recorded, not metered yet
    assert metered[2] == LAYERS and metered[5] == 2 * LAYERS  # every third call meters the request's calls
    assert len(mon.table()) == ROWS * LAYERS * HEADS * 7  # the block's end meters the rest


def test_two_requests_keep_their_own_cells():
    model = tiny("llama", **MODEL)
    ids, mask = prompts(ROWS)
    with torch.no_grad(), witcert.monitor(model, "rtn-int4") as mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        model.generate(input_ids=ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    table = mon.table()
    per_request = {int(r): int((table["request"] == r).sum()) for r in np.unique(table["request"])}
    assert per_request == {0: LAYERS * HEADS * 3, 1: LAYERS * HEADS * 3, 2: LAYERS * HEADS * 5}
    assert np.all(table["true_tv"] <= table["meter"])


@pytest.mark.parametrize("sample", [dict(every=3, heads=0.5), dict(every=2), dict(heads=0.25)], ids=str)
@pytest.mark.parametrize("keep_exact", [True, False])
def test_sampled_metering_deferred_meters_the_cells_it_meters_in_the_step(sample, keep_exact):
    sampling = witcert.MeterSampling(**sample, seed=23)
    in_step, out_a = run("rtn-int4", keep_exact, defer=False, sample=sampling)
    deferred, out_b = run("rtn-int4", keep_exact, defer=True, sample=sampling)
    assert deferred.defer and not in_step.defer and torch.equal(out_a, out_b)
    a, b = keyed(in_step.table()), keyed(deferred.table())
    assert a["metered"] == b["metered"] and len(a["metered"]) == ROWS * LAYERS * HEADS * 8
    assert 0 < sum(b["metered"].values()) < len(b["metered"])
    for key, on in a["metered"].items():
        if not on:  # left out: reported as unmetered, never as certified
            assert np.isnan(b["meter"][key]) and np.isnan(b["true_tv"][key]) and not b["joint"][key], key
            continue
        assert b["meter"][key] == pytest.approx(a["meter"][key], rel=1e-4, abs=1e-12), key
        if keep_exact:
            assert b["true_tv"][key] == pytest.approx(a["true_tv"][key], rel=1e-9, abs=1e-15), key
            assert b["true_tv"][key] <= b["meter"][key], key
    for count in ("cells", "unmetered"):
        assert deferred.summary().total[count] == in_step.summary().total[count], count


@pytest.mark.parametrize("kwargs", [dict(gate=witcert.Gate(tau=0.1)),
                                    dict(certificate="spot", spot_delta=witcert.spot.RequestBudget(1e-3)),
                                    dict(scheme="dithered-int8")], ids=["gate", "spot-request-budget", "tier-b"])
def test_a_meter_that_feeds_back_runs_in_the_step(kwargs):
    """A gate and Tier B feed back or depend on the step; a spot check's request budget gives each cell a share
    that depends on its metered step: all three meter each call in its step."""
    scheme = kwargs.pop("scheme", "rtn-int4")
    model = tiny("llama", **MODEL)
    with torch.no_grad(), witcert.monitor(model, scheme, seed=3, **kwargs) as mon:
        assert not mon.defer
        forward_loop(mon, model, 2, lambda steps: None)
        assert len(mon._batches) == 2 * LAYERS  # recorded as each call ran


def test_a_caller_reusing_its_query_or_mask_buffers_cannot_change_a_recorded_call():
    """A recorded call keeps its own copy of the query and the mask: a model or loop that writes its next step into
    the same buffers (a preallocated mask, an in-place query workspace) must not move the cells already served."""
    from witcert.integrations.hf.attention import CallScope, attend
    from witcert.integrations.hf.cache_layer import MonitoredLayer
    from witcert.integrations.hf.codecs import codec_for
    from witcert.integrations.hf.compressed_cache import CompressedLayer
    from witcert.integrations.hf.pending import PendingCells
    from witcert.schemes.plugins import resolve_scheme
    from witcert.tier_a.bands import BandLayout

    g = torch.Generator().manual_seed(9)
    layout = BandLayout(64, 16, "rotate_half")
    layer = MonitoredLayer(CompressedLayer(codec_for(resolve_scheme("rtn-int4"), packed=True), layout,
                                           keep_exact=True), 0)
    recorded = []
    scope = CallScope(layout=layout, tier="A", adaptive=True, truth=True, record=recorded.append, rows=(0,))
    keys, values = torch.randn(1, 2, 12, 64, generator=g) * 3, torch.randn(1, 2, 12, 64, generator=g)
    layer.update(keys, values)
    k, v = layer.store.read()  # the compressed keys a decode step attends (a prefill's update returns the exact ones)
    query = torch.randn(1, 8, 1, 64, generator=g) * 4
    mask = torch.ones(1, 1, 1, 12, dtype=torch.bool)
    mask[..., 5:9] = False
    _, served = attend(scope, layer, query, (k, v), mask, 0.125, None)  # the cells as metered in the step
    pending = PendingCells(scope, [layer])
    assert pending.defer(0, query, mask, 12, 0.125, adaptive=True)
    query.mul_(-7.0)  # the caller's buffers now hold its next step
    mask[..., 5:9] = True
    mask[..., :5] = False
    pending.flush()
    (deferred,) = recorded
    assert served.true_tv.max() > 1e-3  # the compression moves this attention: a check with something to show
    assert torch.equal(deferred.true_tv, served.true_tv)
    assert torch.allclose(deferred.meter, served.meter, rtol=1e-4, atol=0)
    assert torch.all(deferred.true_tv <= deferred.meter)


@pytest.mark.parametrize("keep_exact", [True, False])
def test_spot_checks_deferred_to_the_flush_hold_and_fill_every_checked_cell(keep_exact):
    """certificate="spot" at a fixed delta per cell defers: every layer's cells above tau of every recorded call are
    checked at the flush in one batch. The cells' meters before the check are the in-step ones; every checked cell
    has its spot columns (rounds >= 1, delta spent at most spot_delta) and its reported meter is the least of the
    two; with the exact cache kept, no reported meter is below the true TV."""
    spot = dict(certificate="spot", spot_keys=8, spot_delta=1e-6)
    in_step, out_a = run("rtn-int2", keep_exact, defer=False, **spot)
    deferred, out_b = run("rtn-int2", keep_exact, defer=True, **spot)
    assert deferred.defer and not in_step.defer and torch.equal(out_a, out_b)
    a, b = keyed(in_step.table()), keyed(deferred.table())
    assert a["meter"].keys() == b["meter"].keys()
    checked = [key for key, before in b["meter_before_spot"].items() if before > 0.2]
    assert checked  # rtn-int2 leaves cells above tau: the spot check runs
    for key, before in a["meter_before_spot"].items():
        assert b["meter_before_spot"][key] == pytest.approx(before, rel=1e-4, abs=1e-12), key
    for key in checked:
        assert b["spot_rounds"][key] >= 1 and 0 <= b["spot_delta"][key] <= 1e-6, key
        assert b["meter"][key] == min(b["meter_before_spot"][key], b["spot_bound"][key]), key
        if keep_exact:
            assert b["true_tv"][key] <= b["meter"][key], key


def test_a_deferred_request_is_released_with_its_cache_once_metered():
    """The monitor holds a request with recorded calls (and its cache: the flush reads its stores) only until they
    are metered; then the cache, its host store and its backing files go when the caller drops the cache."""
    import gc

    model = tiny("llama", **MODEL)
    ids, mask = prompts(ROWS)
    with torch.no_grad(), witcert.monitor(model, "rtn-int4", keep_exact=False, certificate="spot") as mon:
        assert mon.defer
        for _ in range(3):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
        gc.collect()
        assert len(mon._live) == 0 and not mon._unflushed
        assert len(mon.table()) == 3 * ROWS * LAYERS * HEADS * 2  # every decode cell of the three requests

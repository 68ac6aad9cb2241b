"""Sampled metering (``witcert.monitor(..., sample=witcert.MeterSampling(...))``): which cells are metered, that
the metered ones carry the same bound as an unsampled run, and that the rest are reported as unmetered."""
import json

import numpy as np
import pytest
import torch

import witcert
from tests.tiny_models import prompts, tiny

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64)  # G = 4 query heads per kv head


def generate(scheme="rtn-int4", new_tokens=7, **kwargs):
    ids, mask = prompts(2)
    model = tiny("llama", **MODEL)
    with torch.no_grad(), witcert.monitor(model, scheme, seed=5, **kwargs) as mon:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return mon, out


def keyed(table, name):
    """``name`` per (request, layer, head, pos) cell."""
    return {key: value for key, value in zip(zip(table["request"], table["layer"], table["head"], table["pos"]),
                                             table[name])}


@pytest.mark.parametrize("scheme", ["rtn-int4", "dithered-int8"])
def test_metered_cells_carry_the_unsampled_bound_and_the_rest_are_unmetered(scheme):
    full, out_full = generate(scheme)
    sampled, out_sampled = generate(scheme, sample=witcert.MeterSampling(every=3, heads=0.5, seed=11))
    assert torch.equal(out_full, out_sampled)  # metering never changes what the model computes
    table, reference = sampled.table(), keyed(full.table(), "meter")
    metered = table["metered"]
    assert metered.dtype == bool and 0 < metered.sum() < len(table)
    assert np.all(table["pos"][metered] % 3 == 0)  # decode steps at multiples of every
    for name in ("meter", "risk", "true_tv", "output_bound", "c_max"):
        assert np.isnan(table[name][~metered]).all(), name
    assert not table["repaired"][~metered].any() and not table["joint"][~metered].any()
    for key, value, on in zip(zip(table["request"], table["layer"], table["head"], table["pos"]), table["meter"],
                              metered):
        if on:
            assert value == pytest.approx(reference[key], rel=1e-9, abs=1e-15), key
    assert np.all(table["true_tv"][metered] <= table["meter"][metered])


def test_each_metered_call_watches_every_kv_head_with_its_share_of_query_heads():
    mon, _ = generate(sample=witcert.MeterSampling(heads=0.5, seed=3))
    table = mon.table()
    for layer in np.unique(table["layer"]):
        for pos in np.unique(table["pos"]):
            cell = (table["layer"] == layer) & (table["pos"] == pos) & (table["batch"] == 0)
            heads = table["head"][cell & table["metered"]]
            assert sorted(np.bincount(heads // 4, minlength=2).tolist()) == [2, 2], (layer, pos)  # ceil(0.5 * 4) each
    draws = {tuple(table["head"][(table["layer"] == 0) & (table["pos"] == p) & table["metered"] & (table["batch"] == 0)])
             for p in np.unique(table["pos"])}
    assert len(draws) > 1  # drawn anew per call


def test_the_selection_replays_from_its_seed():
    first, _ = generate(sample=witcert.MeterSampling(every=2, heads=0.25, seed=7))
    again, _ = generate(sample=witcert.MeterSampling(every=2, heads=0.25, seed=7))
    other, _ = generate(sample=witcert.MeterSampling(every=2, heads=0.25, seed=8))
    assert np.array_equal(first.table()["metered"], again.table()["metered"])
    assert not np.array_equal(first.table()["metered"], other.table()["metered"])


def test_summary_and_jsonl_report_the_unmetered_cells(tmp_path):
    mon, _ = generate(sample=witcert.MeterSampling(every=2))
    table = mon.table()
    summary = mon.summary()
    assert summary.total["unmetered"] == int((~table["metered"]).sum()) > 0
    assert summary.total["cells"] == int(table["metered"].sum())  # 'cells' counts the metered ones only
    assert "left unmetered" in str(summary)
    mon.write_jsonl(tmp_path / "cells.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    off = [r for r in rows if not r["metered"]]
    assert off and all(r["meter"] is None for r in off)


def test_every_cell_is_metered_by_default():
    mon, _ = generate()
    assert "metered" not in mon.table().columns and "unmetered" not in mon.summary().total


@pytest.mark.parametrize("kwargs, match", [
    (dict(every=0), "every must be an int >= 1"),
    (dict(every=1.5), "every must be an int >= 1"),
    (dict(heads=0.0), r"heads must be a fraction in \(0, 1\]"),
    (dict(heads=1.5), r"heads must be a fraction in \(0, 1\]"),
    (dict(seed=-1), "seed must be an int"),
])
def test_bad_sampling_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        witcert.MeterSampling(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(gate=witcert.Gate(tau=0.2)), dict(certificate="spot")])
def test_sampling_is_refused_with_a_gate_or_a_spot_check(kwargs):
    model = tiny("llama", **MODEL)
    with pytest.raises(ValueError, match="sample: sampled metering leaves cells unmetered"):
        witcert.monitor(model, "rtn-int4", sample=witcert.MeterSampling(every=2), **kwargs)
    with pytest.raises(ValueError, match="sample must be a witcert.MeterSampling"):
        witcert.monitor(model, "rtn-int4", sample=2)

"""Which bound each cell carries: proved, or holding with probability 1 - delta, in every output (issue 41 item 2).

Implementations: ``witcert.integrations.hf.bound_kind`` (``label_columns``, ``counts``, ``read_every_key``),
the columns ``bound_kind``/``bound_delta``/``tier_b_delta`` of ``telemetry.cell_table`` and ``write_jsonl``,
``Monitor.summary()``, ``witcert.observatory.run_plot.plot_run``, the observatory's printed table and report
lines. Oracles: the rules stated in ``bound_kind``'s docstring applied by hand to synthetic columns; on monitored
runs of the tiny Llama, the columns the monitor records (``spot_bound`` against ``meter_before_spot``,
``spot_delta``, the monitor's own ``delta_loc``), and the words each output must and must not print.
Domain: Tier A with and without the spot check (a 62-token prompt, 64 keys: checks read whole below position 64), the
dithered cache's Tier B inside and outside ``non_adaptive()``. Tolerance: exact.
"""
import json

import numpy as np
import pytest
import torch

import witcert
from witcert.integrations.hf import bound_kind, ranking
from witcert.integrations.hf.telemetry import CellTable
from tests.tiny_models import prompts, tiny

pytestmark = pytest.mark.usefixtures("one_thread")
NAN = np.nan


# ----------------------------------------------------------------------------- the rules, on synthetic columns


def test_each_rule_of_the_label_columns():
    columns = {
        "meter": np.array([0.1, 0.1, 0.3, 0.05, 0.05, NAN, 0.02, 0.01]),
        "meter_before_spot": np.array([0.1, 0.4, 0.3, 0.05, 0.9, NAN, 0.5, 0.5]),
        "spot_bound": np.array([NAN, 0.1, 0.35, NAN, 0.05, NAN, 0.02, 0.01]),
        "spot_delta": np.array([0.0, 1e-6, 1e-6, 0.0, 1e-6, 0.0, 3e-6, 0.0]),
        "tier_b_delta": np.array([0.0, 0.0, 0.0, 2e-7, 2e-7, 0.0, 2e-7, 0.0]),
        "adaptive": np.array([True, True, True, False, False, True, True, True]),
    }
    labels = bound_kind.label_columns(columns)
    assert labels["bound_kind"].tolist() == [
        "proved",  # nothing probabilistic entered
        "probabilistic",  # the spot check lowered the meter
        "proved",  # checked, but the check did not lower it: the minimum is the deterministic meter
        "probabilistic",  # Tier B's sub-Gaussian branch on a non-adaptive call
        "probabilistic",  # both: the failure probabilities add (a union bound)
        "none",  # no meter
        "probabilistic",  # an adaptive call's tier_b_delta does not count
        "proved",  # the check read every key: no delta spent, its bound is the cell's TV
    ]
    np.testing.assert_array_equal(labels["bound_delta"], [0.0, 1e-6, 0.0, 2e-7, 1e-6 + 2e-7, NAN, 3e-6, 0.0])


def test_a_table_without_the_label_columns_is_labelled_from_its_columns():
    table = CellTable({"meter": np.array([0.2, NAN]), "layer": np.zeros(2)})
    kind, delta = bound_kind.labels_of(table)
    assert kind.tolist() == ["proved", "none"] and delta[0] == 0.0
    counts = bound_kind.counts(table)
    assert (counts.proved, counts.probabilistic, counts.max_delta) == (1, 0, 0.0)
    assert counts.describe() == "1 proved"


# ----------------------------------------------------------------------------- monitored runs


def _model():
    return tiny("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def spot_run():
    """rtn-int2 under the spot check (64 keys) on a 62-token prompt, checked in each step, one query head per kv
    head (a key group of one cell, :mod:`witcert.spot.groups`): queries before position 64 are read whole (no delta
    spent), later ones sampled; tau = 0.01 makes every cell checked. (Deferred to the flush, a group would hold
    every step's cells and be read whole: all proved.)"""
    model = tiny("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64)
    ids, mask = prompts(1, length=62)
    with torch.no_grad(), witcert.monitor(model, "rtn-int2", certificate="spot", spot_keys=64, spot_delta=1e-6,
                                          tau=0.01) as mon:
        mon.defer = False
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return mon


def test_spot_checked_cells_are_labelled_probabilistic_with_their_delta(spot_run):
    table = spot_run.table()
    lowered = ~np.isnan(table["spot_bound"]) & (table["spot_bound"] < table["meter_before_spot"])
    sampled = lowered & (table["spot_delta"] > 0)  # a check that read every key spent no delta: its bound is proved
    assert sampled.any() and (lowered & ~sampled).any()
    assert np.array_equal(table["bound_kind"] == "probabilistic", sampled)
    np.testing.assert_array_equal(table["bound_delta"][sampled], table["spot_delta"][sampled])
    assert np.all(table["bound_delta"][~sampled] == 0)
    assert np.all(table["true_tv"] <= table["meter"])  # the labels change no bound


def test_the_summary_under_the_spot_check_never_calls_its_bound_proved(spot_run):
    text = str(spot_run.summary())
    counts = bound_kind.counts(spot_run.table())
    assert text.splitlines()[0].startswith("WitCert summary: tier A + spot check, tau = 0.01")
    assert "proved upper bound" not in text and "proved <= tau" not in text  # the labels of a deterministic run
    assert f"bounds: {counts.proved:,d} proved, {counts.probabilistic:,d} hold with probability >= 1 - 1e-06" in text
    assert "read every one: their bound" in text  # the 10-token prompt is shorter than spot_keys
    assert spot_run.summary().total["probabilistic"] == counts.probabilistic > 0
    assert max(len(line) for line in text.splitlines()) <= 100


def test_the_ranking_under_the_spot_check_is_the_measured_statistic_and_says_so(spot_run):
    summary = spot_run.summary()
    table = spot_run.table()
    top = summary.heads[0]
    cells = table.where((table["layer"] == top["layer"]) & (table["head"] == top["head"]))
    assert top["score"] == pytest.approx(ranking.STATISTICS[ranking.RANK_BY](cells))
    assert "the ranking does not change with the certificate" in str(summary)


def test_jsonl_lines_carry_the_labels(spot_run, tmp_path):
    path = tmp_path / "cells.jsonl"
    spot_run.write_jsonl(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = {row["bound_kind"] for row in rows}
    assert "probabilistic" in kinds and kinds <= {"proved", "probabilistic"}
    assert all(row["bound_delta"] == (row["spot_delta"] if row["bound_kind"] == "probabilistic" else 0.0)
               for row in rows)


def test_the_plot_names_both_kinds_and_the_checks_that_read_every_key(spot_run):
    pytest.importorskip("matplotlib")
    fig = spot_run.plot()
    meter_panel, _, scatter = fig.axes[:3]
    assert "proved bound" not in meter_panel.get_title() and "p >= 1 - 1e-06" in meter_panel.get_title()
    assert "with p >= 1 - 1e-06" in fig._suptitle.get_text()
    whole = int(bound_kind.read_every_key(spot_run.table()).sum())
    assert whole > 0 and any(f"{whole:,d} spot-checked cells read every key" in t.get_text() for t in scatter.texts)
    labels = [t.get_text() for t in scatter.get_legend().get_texts()]
    assert "spot check read every key: bound = exact TV" in labels


def test_a_deterministic_run_is_proved_everywhere_and_says_so():
    model = _model()
    ids, mask = prompts(1, length=12)
    with torch.no_grad(), witcert.monitor(model, "rtn-int4") as mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    table = mon.table()
    assert set(table["bound_kind"]) == {"proved"} and np.all(table["bound_delta"] == 0)
    text = str(mon.summary())
    assert "proved upper bound" in text and f"bounds: {len(table):,d} proved" in text
    assert "probability" not in text.split("Riskiest")[0]


def test_tier_b_cells_are_probabilistic_only_where_its_sub_gaussian_branch_ran():
    from transformers import DynamicCache

    model = tiny("llama")
    ids, _ = prompts(1, length=40)
    with torch.no_grad(), witcert.monitor(model, "dithered-int8", delta_loc=2e-7) as mon:
        cache = DynamicCache(config=model.config)
        with mon.non_adaptive():  # teacher-forced: the probabilistic branch is allowed
            model(ids[:, :30], past_key_values=cache)
            model(ids[:, 30:], past_key_values=cache)
        model(ids[:, -1:], past_key_values=cache)  # outside the block: adaptive, deterministic branch only
    table = mon.table()
    adaptive = table["adaptive"].astype(bool)
    assert adaptive.any() and (~adaptive).any()
    np.testing.assert_array_equal(table["tier_b_delta"], np.where(adaptive, 0.0, 2e-7))
    assert np.array_equal(table["bound_kind"] == "probabilistic", ~adaptive)
    assert "hold with probability >= 1 - 2e-07 (Tier B)" in str(mon.summary())

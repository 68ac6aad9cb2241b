"""``witcert study``: the quick variant on the embedded model, its report, and the intervals it uses.

Implementation: :mod:`witcert.observatory.study` (run), :mod:`witcert.observatory.study_report`
(files), :mod:`witcert.observatory.stats` (intervals, paired test), :mod:`witcert.cli.study`.
Oracles: the fp64 true TV of every metered cell against the exact shadow (per cell, never in
aggregate); scipy's binomial test; hand-counted 2x2 tables. Domain: SmolLM2-135M-Instruct
(skipped when it is not installed), the quick study (4 needle cases of 192 tokens, kivi-2bit raw
and gated at tau 0.2 and 5, its sweep of the first and last layer, the thirds and all layers).
Tolerance: none on the per-cell check; 1e-12 on interval arithmetic.
"""
import json

import numpy as np
import pytest
import torch

from witcert.observatory import stats, study, study_report


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The quick study's report, written to a directory, and every metered cell table."""
    from witcert.integrations.hf.default_model import ModelUnavailable, load_model

    try:
        loaded = load_model()
    except ModelUnavailable as err:
        pytest.skip(str(err))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tables = []
    try:
        report = study.run_study(loaded, study.QUICK, cells_sink=lambda name, table: tables.append((name, table)))
    finally:
        torch.set_num_threads(threads)
    out = tmp_path_factory.mktemp("study")
    study_report.write(report, out)
    return report, tables, out, loaded.model.config.num_hidden_layers


def test_every_metered_cell_has_true_tv_at_most_its_meter(quick):
    report, tables, _, _ = quick
    metered = {name for name, _ in tables}
    expected = {c.name for c in study.configurations(study.QUICK, quick[3]) if c.scheme is not None}
    assert metered == expected
    for name, table in tables:
        tv, meter = table["true_tv"], table["meter"]
        assert len(table) > 0 and not np.isnan(tv).any() and not np.isnan(meter).any(), name
        bad = np.flatnonzero(tv > meter)
        assert bad.size == 0, f"{name}: {bad.size} cells with true TV above the meter, e.g. {tv[bad[:3]]} > {meter[bad[:3]]}"
        if "meter_after" in table.columns:  # a gated run: the repaired cells' bound after repair, per cell
            assert np.all(table["true_tv_after"] <= table["meter_after"]), name
    assert report["soundness"]["violations"] == 0 and report["soundness"]["unchecked"] == 0
    assert report["soundness"]["cells"] == sum(len(t) for _, t in tables)


def test_the_report_has_both_studies_with_intervals(quick):
    report, _, out, n_layers = quick
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["soundness"] == report["soundness"]
    names = [row["name"] for row in report["repair"]]
    assert names == ["uncompressed", "kivi-2bit", "kivi-2bit gated tau=0.2", "kivi-2bit spot-gated tau=0.2",
                     "kivi-2bit gated tau=5"]
    for row in report["repair"]:
        assert row["cases"] == study.QUICK.cases
        assert row["low"] <= row["accuracy"] <= row["high"]
        assert row["paired"]["low"] <= row["paired"]["diff"] <= row["paired"]["high"]
    assert report["repair"][0]["paired"]["diff"] == 0 and report["repair"][0]["cells"] == 0
    for row in report["repair"][2:]:  # the gates fired on cells and paged tokens in
        assert 0 < row["fired"] <= 1 and 0 < row["paged_fraction"] <= 1 and row["paged_bytes_per_case"] > 0
    deterministic, spot = report["repair"][2], report["repair"][3]
    assert spot["gate"]["certificate"] == "spot" and spot["spot_keys_per_cell"] > 0
    assert spot["paged_fraction"] <= deterministic["paged_fraction"]
    sweep = report["sweep"]["kivi-2bit"]
    assert [row["layers"] for row in sweep["single_layers"]] == [[0], [n_layers - 1]]
    assert len(sweep["thirds"]) == 3 and sweep["all_layers"]["layers"] is None
    assert sorted(sum((r["layers"] for r in sweep["thirds"]), [])) == list(range(n_layers))
    assert 0 <= sweep["single_layer_losses"] <= 2
    for row in [*sweep["single_layers"], *sweep["thirds"]]:
        assert row["cells"] > 0 and row["violations"] == 0 and row["mean_meter"] >= 0
    markdown = (out / "report.md").read_text()
    assert "## Repair study" in markdown and "## Layer sweep: kivi-2bit" in markdown
    assert markdown.count("| kivi-2bit gated tau=0.2 |") == 1
    for plot in ("repair.png", "sweep-kivi-2bit.png"):  # written beside the markdown and linked from it
        assert (out / plot).stat().st_size > 0 and f"]({plot})" in markdown


def test_accuracy_interval_is_clopper_pearson():
    low, high = stats.accuracy_interval(0, 10)
    assert low == 0 and high == pytest.approx(1 - 0.025 ** (1 / 10), abs=1e-12)  # closed form at 0 successes
    low, high = stats.accuracy_interval(10, 10)
    assert high == 1 and low == pytest.approx(0.025 ** (1 / 10), abs=1e-12)


def test_paired_difference_counts_discordant_pairs_and_tests_them():
    x = np.array([1, 1, 1, 1, 1, 0, 0, 1, 0, 1], dtype=bool)
    y = np.array([1, 0, 0, 0, 1, 0, 0, 1, 0, 1], dtype=bool)
    result = stats.paired_difference(x, y)
    assert (result["x_only"], result["y_only"]) == (3, 0)
    assert result["diff"] == pytest.approx(0.3, abs=1e-12)
    assert result["p_mcnemar"] == pytest.approx(0.25, abs=1e-12)  # two-sided binomial, 3 of 3 at 1/2
    assert result["low"] < 0.3 < result["high"]


@pytest.mark.parametrize("right, n", [(30, 40), (16, 32), (1, 8)])
def test_no_discordant_pair_still_gives_an_interval_of_positive_width(right, n):
    same = np.arange(n) < right
    result = stats.paired_difference(same, same)
    assert result["diff"] == 0 and result["p_mcnemar"] == 1
    assert result["low"] < -0.01 and result["high"] > 0.01


def test_bad_outcomes_are_refused():
    with pytest.raises(ValueError, match="one length"):
        stats.paired_difference([True], [True, False])
    with pytest.raises(ValueError, match="successes"):
        stats.accuracy_interval(3, 2)


def test_cli_rejects_an_unknown_scheme_before_loading_a_model(capsys):
    from witcert.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["study", "--scheme", "no-such-scheme"])
    assert exit_info.value.code == 2 and "--scheme" in capsys.readouterr().err


def test_a_layer_subset_monitor_meters_only_the_compressed_layers():
    from transformers import DynamicCache

    from tests.tiny_models import VOCAB, tiny

    model = tiny("llama")
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        stock = model(ids).logits[:, -3:]
        exact = DynamicCache(config=model.config)
        model(ids[:, :6], past_key_values=exact)
        with study._LayerSubsetMonitor(model, "rtn-int4", layers=(1,)) as mon:
            cache = exact
            for t in range(6, 9):  # one query at a time, like the greedy answer
                model(ids[:, t:t + 1], past_key_values=cache)
        layer0_only = DynamicCache(config=model.config)
        model(ids[:, :6], past_key_values=layer0_only)
        with study._LayerSubsetMonitor(model, "rtn-int4", layers=()) as none:
            got = torch.cat([model(ids[:, t:t + 1], past_key_values=layer0_only).logits for t in range(6, 9)], dim=1)
    table = mon.table()
    assert set(table["layer"].tolist()) == {1} and len(table) == 2 * 4 * 3
    assert not np.any(table["true_tv"] > table["meter"]) and np.any(table["true_tv"] > 0)
    assert len(none.table()) == 0  # nothing compressed: every read exact, unmetered
    torch.testing.assert_close(got, stock, rtol=1e-5, atol=1e-5)  # sdpa over the same exact keys, chunked vs whole

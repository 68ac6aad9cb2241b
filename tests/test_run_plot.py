"""The picture of a run draws the table's own data.

Implementation: :func:`witcert.observatory.run_plot.run_grid` / ``plot_run`` and ``Monitor.plot``
over a gated and an ungated monitored ``generate`` on a tiny Llama; oracle: the cell table itself,
reduced per (layer, position) by a plain loop. Tolerance: exact.
"""
import numpy as np
import pytest
import torch

import witcert
from witcert.integrations.hf import ranking
from witcert.integrations.hf.telemetry import CellTable
from witcert.observatory.run_plot import plot_run, run_grid
from tests.tiny_models import prompts, tiny

pytest.importorskip("matplotlib")
pytestmark = pytest.mark.usefixtures("one_thread")


def monitored(keep_exact: bool, gate=None):
    # the stored byte witness (rtn-int4's default, derived, is looser): the gate at tau 0.05 then fires on some
    # cells and not all, the picture this file checks
    model = tiny("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    ids, mask = prompts(2, length=24)
    with torch.no_grad(), witcert.monitor(model, "rtn-int4", gate=gate, keep_exact=keep_exact,
                                                witness_bits=8) as mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    return mon


@pytest.fixture(scope="module")
def gated():
    return monitored(True, witcert.Gate(tau=0.05))


def by_loop(table, name, layer, pos, reduce):
    sel = (table["layer"] == layer) & (table["pos"] == pos)
    values = table[name][sel].astype(np.float64)
    values = values[~np.isnan(values)]
    return reduce(values) if values.size else np.nan


def test_the_grid_is_the_worst_cell_of_each_layer_and_position(gated):
    table = gated.table()
    grid = run_grid(table)
    assert list(grid.layers) == sorted(set(table["layer"].tolist()))
    assert list(grid.steps) == sorted(set(table["pos"].tolist()))
    for i, layer in enumerate(grid.layers):
        for j, pos in enumerate(grid.steps):
            np.testing.assert_equal(grid.meter[i, j], by_loop(table, "meter", layer, pos, np.max))
            np.testing.assert_equal(grid.true_tv[i, j], by_loop(table, "true_tv", layer, pos, np.max))
            sel = (table["layer"] == layer) & (table["pos"] == pos)
            assert grid.saturated[i, j] == bool(np.any(table["meter"][sel] >= ranking.SATURATED))
            assert grid.repaired[i, j] == bool(np.any(table["repaired"][sel]))
    assert grid.repaired.any() and not grid.repaired.all()  # the gate fired on some cells, not all


def test_monitor_plot_saves_a_three_panel_figure(gated, tmp_path):
    path = tmp_path / "plots" / "run.png"
    fig = gated.plot(path)
    assert path.stat().st_size > 10_000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meter_panel, tv_panel, scatter = fig.axes[:3]
    np.testing.assert_array_equal(meter_panel.images[0].get_array().filled(np.nan), run_grid(gated.table()).meter)
    labels = [t.get_text() for t in meter_panel.get_legend().get_texts()]
    assert "repaired by the gate" in labels
    assert scatter.get_xscale() == "log" and "violations 0" in fig._suptitle.get_text()


def test_without_the_exact_cache_each_request_gets_its_meter_panel_and_none_is_empty():
    """Production: no true TV to draw, so one meter heatmap per request (oracle: the request's own cells)."""
    mon = monitored(keep_exact=False)
    table = mon.table()
    grid = run_grid(table)
    assert np.isnan(grid.true_tv).all() and not np.isnan(grid.meter).all()
    fig = plot_run(table, tau=0.2)
    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title().split(":")[0] for ax in panels] == ["request 0", "request 1"]
    for request, ax in enumerate(panels):
        own = run_grid(table.where(table["request"] == request)).meter
        np.testing.assert_array_equal(ax.images[0].get_array().filled(np.nan), np.maximum(own, 1e-4))
    assert "keep_exact=False" in fig.axes[-1].get_ylabel()  # the colour bar says why there is no true TV


def test_an_empty_run_is_refused_by_name():
    with pytest.raises(ValueError, match="table: the run measured no cell"):
        run_grid(CellTable({"layer": np.array([]), "pos": np.array([]), "meter": np.array([]),
                            "true_tv": np.array([])}))

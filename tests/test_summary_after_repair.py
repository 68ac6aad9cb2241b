"""A gated monitor records every cell's meter and true TV after repair, and ``summary()`` reports them.

Implementation: :func:`witcert.integrations.hf.cells.gated_output` (the gate's recomputed meter,
the TV against the exact logits) through ``witcert.monitor(..., gate=...)``; oracle: each cell's
own meter and true TV where the gate did not fire, ``tau`` where it did and reached ``tau``, and
the soundness relation true TV <= meter after repair, cell by cell.
"""
import numpy as np
import pytest
import torch

import witcert
from witcert.integrations.hf import ranking
from tests.tiny_models import prompts, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

TAU = 0.2


def gated_run(scheme="rtn-int2", tau=TAU, keep_exact=True):
    model = tiny("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    ids, mask = prompts(2, length=40)
    with torch.no_grad(), witcert.monitor(model, scheme, gate=witcert.Gate(tau=tau), keep_exact=keep_exact,
                                          tau=tau) as mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return mon


@pytest.fixture(scope="module")
def mon():
    return gated_run()


def test_every_cell_records_its_meter_and_true_tv_after_repair(mon):
    table = mon.table()
    fired = table["repaired"]
    assert fired.any() and not fired.all()  # both kinds of cell are checked
    before, after = table["meter"], table["meter_after"]
    tv_after = table["true_tv_after"]
    assert np.all(after[fired] <= TAU)  # every fired cell reached tau (the exact shadow has every block)
    assert np.array_equal(after[~fired], before[~fired]) and np.array_equal(tv_after[~fired], table["true_tv"][~fired])
    assert np.all(tv_after >= 0) and np.all(tv_after <= after)  # sound after repair, no tolerance
    assert np.all(tv_after[fired] <= table["true_tv"][fired] + 1e-12)  # exact blocks moved attention back
    assert np.all((table["paged_fraction"][fired] > 0) & (table["paged_fraction"][fired] <= 1))
    assert np.all(table["paged_fraction"][~fired] == 0)


def test_the_summary_shows_the_after_repair_figures(mon):
    summary = mon.summary()
    table = mon.table()
    total = summary.total
    assert total["repaired"] == pytest.approx(np.mean(table["repaired"]))
    assert total["paged"] == pytest.approx(np.mean(table["paged_fraction"]))
    assert total["coverage_after"] == 1.0 and total["coverage"] < 1.0
    assert total["max_true_tv_after"] == pytest.approx(np.max(table["true_tv_after"]))
    assert total["violations"] == 0 and total["violations_after"] == 0
    text = str(summary)
    assert f"fired on {total['repaired']:.1%} of cells" in text and f"paged {total['paged']:.1%}" in text
    assert f"after repair:  100.0% certified at tau, max true TV {total['max_true_tv_after']:.4f}" in text
    for column in ("fired", "paged", "cert. after", "max TV after"):
        assert column in text.splitlines()[5]  # the table's header (after the title, meaning and a blank line)
    assert "proved upper bound" in text and "total variation" in text


def test_the_summary_ranks_layers_and_heads_with_true_tv_beside_the_meter(mon):
    summary = mon.summary()
    scores = [r["score"] for r in summary.heads]
    assert scores == sorted(scores, reverse=True) and len(summary.layers) == 2
    table = mon.table()
    top = summary.heads[0]
    cells = table.where((table["layer"] == top["layer"]) & (table["head"] == top["head"]))
    assert top["score"] == pytest.approx(ranking.STATISTICS[ranking.RANK_BY](cells))
    assert top["mean_true_tv"] == pytest.approx(np.mean(cells["true_tv"]))
    assert f"L{top['layer']} H{top['head']}" in str(summary) and "mean true TV" in str(summary)


def test_the_summary_fits_a_100_column_terminal(mon):
    assert max(len(line) for line in str(mon.summary()).splitlines()) <= 100
    ungated = witcert.monitor(tiny("llama"), "rtn-int4")
    with torch.no_grad(), ungated:
        ids, mask = prompts(1, length=12)
        tiny("llama").generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    text = str(ungated.summary())
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "fired" not in text and "saturated" in text and "violations" in text


def test_production_gate_has_a_meter_after_repair_but_no_true_tv():
    mon = gated_run(keep_exact=False)
    table = mon.table()
    assert table["repaired"].any() and np.all(table["meter_after"][table["repaired"]] <= TAU)
    assert np.isnan(table["true_tv_after"]).all()
    assert "max true TV n/a" in str(mon.summary())


@pytest.mark.parametrize("scheme, gate", [("rtn-int2", witcert.Gate(tau=0.05, repair="whole")),
                                          ("sign-1bit", witcert.Gate(tau=1.0)),
                                          ("rtn-int2", witcert.Gate(tau=0.2, granularity="request"))],
                         ids=["whole-blocks", "risk-ranked", "per-request"])
def test_after_repair_meter_is_sound_for_every_gate_policy(scheme, gate):
    """Oracle: per cell, true TV after repair <= meter after repair (no tolerance), for whole-head
    repair, a risk-ranked gate (tau >= 1: the meter after repair is recomputed by ``witcert.meter``,
    not the gated risk score) and request granularity. Larger weights (initializer_range 0.1) give
    logits large enough for raw risk scores above 1."""
    model = tiny("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 initializer_range=0.1)
    ids, mask = prompts(2, length=40)
    with torch.no_grad(), witcert.monitor(model, scheme, gate=gate) as mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    table = mon.table()
    fired = table["repaired"]
    assert fired.any()
    after, tv_after = table["meter_after"], table["true_tv_after"]
    assert np.all((after >= 0) & (after <= 1)) and np.all((tv_after >= 0) & (tv_after <= after))
    if gate.tau < 1 and gate.granularity == "head":
        assert np.all(after[fired] <= gate.tau)

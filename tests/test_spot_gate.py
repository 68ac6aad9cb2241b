"""The spot-certified gate (``witcert.spot.gate``; registry SCO, SCD, SCR), in validation and in production.

Implementation under test: ``witcert.monitor(..., gate=witcert.Gate(tau), certificate="spot")`` with
``keep_exact=True`` and ``keep_exact=False`` (the production gate: pages and checks read the verified
backing store). Oracles: the same call under the deterministic certified gate (it pages the
Lemma 4 prefix until the meter is <= tau; the spot-certified gate must never page more), the exact
logits (true TV after repair, per cell, against ``meter_after``; for production, validation's true TV
where both modes paged the same share of the cell) and the budget rule (the check before repair spends
half of a cell's ``delta``, the gate's checks ``delta / 2 * 6 / (pi^2 i^2)`` each: at most ``delta`` in all).
Domain: the tiny Llama, kivi-2bit, 2 rows x 256 prompt tokens then one teacher-forced decode step,
tau 0.03, blocks of 8, 64 spot keys (the checks sample: a key group, the two query heads over a kv head,
holds up to 256 tokens, more than 64 per cell; with 128 it is read whole, :mod:`witcert.spot.groups`).
"""
import numpy as np
import pytest
import torch

import witcert
from witcert.spot.cells import SpotSettings

from tests.tiny_models import prompts, tiny

pytestmark = pytest.mark.usefixtures("one_thread")
TAU = 0.03
SPOT_KEYS = 64


def decode_step_table(model, gate, certificate: str, keep_exact: bool = True, spot_keys: int = SPOT_KEYS,
                      tau: float = TAU):
    ids, mask = prompts(2, length=256)
    out = model(input_ids=ids[:, :255], attention_mask=mask[:, :255])  # exact prefill, not metered
    cache = out.past_key_values
    mon = witcert.monitor(model, "kivi-2bit", gate=gate, certificate=certificate, spot_keys=spot_keys, spot_delta=1e-6,
                          tau=tau, keep_exact=keep_exact)
    if certificate == "spot":  # replay opt-in: both modes draw alike
        mon.spot = SpotSettings(keys=spot_keys, delta=1e-6, tau=tau, seed=7, gated=True)
    with torch.no_grad(), mon:
        model(input_ids=ids[:, 255:], attention_mask=mask, past_key_values=cache)
    return mon.table()


@torch.no_grad()
def test_spot_gate_is_sound_and_never_pages_more_than_the_deterministic_gate():
    model = tiny("llama")
    gate = witcert.Gate(tau=TAU, block_size=8)
    deterministic = decode_step_table(model, gate, "deterministic")
    spot = decode_step_table(model, gate, "spot")
    assert len(deterministic) == len(spot)
    assert np.all(spot["true_tv_after"] <= spot["meter_after"])
    assert np.all(spot["true_tv"] <= spot["meter"])
    assert np.all(spot["paged_fraction"] <= deterministic["paged_fraction"] + 1e-12)
    fired_before = deterministic["repaired"].astype(bool)
    assert fired_before.any()
    assert spot["paged_fraction"].sum() < deterministic["paged_fraction"].sum()  # the point of it
    checked = ~np.isnan(spot["spot_bound"])
    delta = spot["spot_delta"][checked]  # the table may hold it in fp32
    assert np.all(delta > 0) and np.all(delta <= 1e-6 * (1 + 1e-6))  # the whole cell within delta
    ran = spot["spot_gate_checks"] > 0
    assert np.all(spot["spot_delta"][~ran & checked] <= 0.5e-6 * (1 + 1e-6))  # the check before repair: half
    assert np.all(spot["meter_after"][spot["repaired"].astype(bool)] <= TAU)
    assert np.all(spot["spot_gate_keys"] <= spot["spot_gate_checks"] * SPOT_KEYS) and spot["spot_gate_keys"].sum() > 0


@torch.no_grad()
def test_key_groups_that_fit_the_budget_are_read_whole_and_only_cells_above_tau_are_repaired():
    """With 128 keys a key group (two query heads over a kv head, at most 256 tokens) is read whole: every checked
    cell's bound is its true TV rounded up with no failure probability, so the gate repairs exactly the cells whose
    true TV exceeds tau, and each repaired cell ends with a bound at most tau. (tau 0.007: the true TVs of this
    step's 16 cells lie between 0.005 and 0.009.)"""
    model, tau = tiny("llama"), 0.007
    truth = decode_step_table(model, witcert.Gate(tau=tau, block_size=8), "spot", spot_keys=128, tau=tau)["true_tv"]
    for keep_exact in (True, False):
        spot = decode_step_table(model, witcert.Gate(tau=tau, block_size=8), "spot", keep_exact, 128, tau)
        checked, repaired = ~np.isnan(spot["spot_bound"]), spot["repaired"].astype(bool)
        bound = spot["spot_bound"][checked]
        assert checked.sum() > 4 and np.all(truth[checked] <= bound)
        assert np.allclose(bound, truth[checked], rtol=1e-6, atol=1e-9)
        assert 0 < repaired.sum() < checked.sum() and np.array_equal(repaired[checked], bound > tau)
        assert np.all(spot["spot_delta"][checked & ~repaired] == 0)  # read whole: nothing spent
        assert np.all(spot["spot_delta"][repaired] <= 0.5e-6 * (1 + 1e-6))  # only the gate's re-checks' half
        assert np.all(spot["meter_after"][repaired] <= tau)


@torch.no_grad()
def test_production_spot_gate_pages_from_the_backing_store_and_reports_both_traffics():
    """keep_exact=False: the gate decides on min(meter, spot bound) as in validation (it does not repair the cells
    the check certified), pages and checks read the verified backing store, and the table keeps the bytes paged
    (``bytes_paged``) apart from the bytes the checks read (``spot_bytes``, ``spot_gate_bytes``)."""
    model = tiny("llama")
    gate = witcert.Gate(tau=TAU, block_size=8)
    validation = decode_step_table(model, gate, "spot")
    production = decode_step_table(model, gate, "spot", keep_exact=False)
    deterministic = decode_step_table(model, gate, "deterministic", keep_exact=False)
    assert np.array_equal(validation["spot_bound"], production["spot_bound"], equal_nan=True)
    assert np.array_equal(validation["repaired"], production["repaired"])
    assert np.all(production["paged_fraction"] <= deterministic["paged_fraction"] + 1e-12)
    assert production["paged_fraction"].sum() < deterministic["paged_fraction"].sum()
    same = np.isclose(production["paged_fraction"], validation["paged_fraction"], rtol=0, atol=1e-12)
    assert same.mean() > 0.9
    assert np.all(validation["true_tv_after"][same] <= production["meter_after"][same])
    assert production["bytes_paged"].sum() > 0 and production["spot_bytes"].sum() > 0
    assert production["spot_gate_bytes"].sum() > 0 and validation["bytes_paged"].sum() == 0


def test_gate_rechecks_start_from_the_reads_of_the_check_before_repair():
    """A fired cell's first re-check carries the exact logits the check before repair read for that same cell
    (``reads = (at, known, exact)`` over the call's cells), matched by position, whatever the order of ``at``."""
    from witcert.spot.gate import _Open

    shape = torch.Size((2, 3, 2))  # (B, Hq, Tq): 12 cells
    at = torch.tensor([[1, 2, 1], [0, 1, 0], [1, 0, 0]])  # flat cells 11, 2, 6, in no particular order
    known = torch.rand(3, 5, generator=torch.Generator().manual_seed(0)) < 0.5
    exact = torch.where(known, torch.arange(15, dtype=torch.float64).reshape(3, 5), 0.0)
    rows = torch.tensor([2, 11])  # the fired cells: a subset of the checked ones
    scores = torch.zeros(2, 5, dtype=torch.float64)
    work = _Open(witcert.Gate(tau=0.2, block_size=2), scores, torch.ones_like(scores), torch.ones_like(scores), rows)
    work.carry_checked((at, known, exact), shape)
    carried_known, carried_exact = work.carried(torch.arange(2))
    assert torch.equal(carried_known, known[[1, 0]]) and torch.equal(carried_exact, exact[[1, 0]])

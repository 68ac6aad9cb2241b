"""The spot-certified gate (``witcert.spot.gate``; registry SCO, SCD).

Implementation under test: ``witcert.monitor(..., gate=witcert.Gate(tau), certificate="spot")`` in
validation mode. Oracles: the same call under the deterministic certified gate (it pages the
Lemma 4 prefix until the meter is <= tau; the spot-certified gate must never page more), the exact
logits (true TV after repair, per cell, against ``meter_after``) and the budget rule (each repaired
cell's ``spot_delta`` is ``delta`` plus ``delta 6 / (pi^2 i^2)`` per check, below ``2 delta``).
Domain: the tiny Llama, kivi-2bit, 2 rows x 256 prompt tokens then one teacher-forced decode step,
tau 0.03, blocks of 8, 128 spot keys.
"""
import numpy as np
import pytest
import torch

import witcert
from witcert.spot.gate import prefix_lengths

from tests.tiny_models import prompts, tiny

pytestmark = pytest.mark.usefixtures("one_thread")
TAU = 0.03


def decode_step_table(model, gate, certificate: str):
    ids, mask = prompts(2, length=256)
    out = model(input_ids=ids[:, :255], attention_mask=mask[:, :255])  # exact prefill, not metered
    cache = out.past_key_values
    with torch.no_grad(), witcert.monitor(model, "kivi-2bit", gate=gate, certificate=certificate, spot_keys=128,
                                          spot_delta=1e-6, tau=TAU) as mon:
        model(input_ids=ids[:, 255:], attention_mask=mask, past_key_values=cache)
    return mon.table()


def test_prefix_lengths_double_below_the_deterministic_stop():
    assert prefix_lengths(0) == [] and prefix_lengths(1) == [] and prefix_lengths(5) == [1, 2, 4]
    assert prefix_lengths(8) == [1, 2, 4]


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
    assert np.all(delta >= 1e-6 * (1 - 1e-6)) and np.all(delta < 2e-6)
    ran = spot["spot_gate_checks"] > 0
    assert np.allclose(spot["spot_delta"][~ran & checked], 1e-6)
    assert np.all(spot["meter_after"][spot["repaired"].astype(bool)] <= TAU)
    assert np.all(spot["spot_gate_keys"] <= spot["spot_gate_checks"] * 128) and spot["spot_gate_keys"].sum() > 0

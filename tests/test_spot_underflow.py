"""A token whose compressed weight underflows is still seen by the spot check (issue 40 item 1; registry SCO, SC).

Implementations: ``witcert.spot.spot_check`` and ``spot_check_two_sided`` (sampled and read-whole paths),
``witcert.monitor(certificate="spot")`` in validation and production (``keep_exact=False``), and the
spot-certified gate. Oracles: the true TV from the exact and compressed logits (fp64 softmax of each,
no rounded weight decides anything; at 30 digits for the synthetic cells), and for production the same
generation in validation mode (same scheme, greedy, same cells). Domain: one token whose compressed logit
lies 745-1000 below the row maximum while its exact logit is at or above it (a scheme that reconstructs
one token's key with a blown per-token scale: finite, right shape and dtype); 100-token synthetic cells
and the tiny Llama. Tolerance: none (bound >= true TV, per cell).
"""
import numpy as np
import pytest
import torch

import witcert
from witcert.spot import spot_check, spot_check_two_sided, spot_randomness
from witcert.verification.attacks import spot_underflow

from tests.spot_cells import reader_for, true_tv
from tests.tiny_models import prompts, tiny

FORMS = {"one-sided": spot_check, "two-sided": spot_check_two_sided}
BLOWN = 5  # the token of each prompt whose key the scheme blows
SCALE = -3e4  # its key reconstructed as SCALE times the exact one: finite, and the compressed logit far below


def blown_cell(size: int = 100, gap: float = 800.0, seed: int = 0):
    """(scores, c, eps): one token ``|gap|`` below the compressed maximum, its exact logit above every other
    (``gap < 0``: ``|gap|`` above it, its exact logit among the others)."""
    g = torch.Generator().manual_seed(seed)
    exact = torch.randn(size, generator=g, dtype=torch.float64)
    scores = exact + 0.05 * torch.randn(size, generator=g, dtype=torch.float64)
    if gap > 0:
        exact[7] = exact.max() + 1.0
    scores[7] = scores.max() - gap
    eps = scores - exact
    return scores, eps.abs() * 1.01 + 0.01, eps


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("keys", (16, 64, 128))  # sampled paths and the read-whole path (S = 100 <= 128)
def test_spot_check_sees_a_token_whose_compressed_weight_underflows(form, keys):
    """Before the fix: bound ~1e-2 (sampled) or 1e-12 (read whole) against a true TV of 0.19."""
    scores, c, eps = blown_cell()
    assert float(torch.softmax(scores, 0)[7]) == 0.0  # the weight underflows in fp64
    tv = true_tv(scores, eps)
    assert tv > 0.1
    for seed in range(3):
        result = FORMS[form](scores, c, reader_for(scores, eps), keys=keys, delta=1e-6,
                             generator=spot_randomness(seed).generator)
        assert result.bound >= tv, (form, keys, seed, result.bound, tv)
        assert 7 in result.exact.tolist()  # the heaviest witness contribution: read exactly


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("keys", (16, 128))
def test_spot_check_where_z_itself_underflows(form, keys):
    """A token 2,000 above the others in the compressed logits only: every ``p~ W`` underflows, so does ``Z``
    (the log-space forms without their ``Z`` floor reported 1e-12 here against a true TV of 0.99): trivial bound."""
    scores, c, eps = blown_cell(gap=-2000.0)
    tv = true_tv(scores, eps)
    assert tv > 0.9
    result = FORMS[form](scores, c, reader_for(scores, eps), keys=keys, delta=1e-6,
                         generator=spot_randomness(0).generator)
    assert result.bound >= tv


def test_the_attack_class_catches_the_old_visibility_rule_and_passes_the_library():
    """``witcert fuzz``'s ``spot-underflow`` class: the library is sound on it; the known-false control (tokens
    whose fp64 ``p~`` is 0 taken as masked, the rule before issue 40) is caught."""
    g = torch.Generator().manual_seed(0)
    tally = spot_underflow.run(24, g)
    assert tally.cells >= 24 and tally.violations == 0, tally.notes
    control = spot_underflow.run(24, torch.Generator().manual_seed(0), check=spot_underflow.probability_visibility)
    assert control.violations > 0


@witcert.register_scheme("test-blown-token", replace=True)
def blown_token(x, role="key"):
    """Exact, except one prompt token's key comes back as ``SCALE`` times itself (a blown per-token scale)."""
    if role == "key" and x.shape[-2] > BLOWN:
        x[..., BLOWN, :] *= SCALE
    return x


def generate_table(keep_exact: bool, spot_keys: int, gate=None, certificate: str = "spot", meter: str = "fused"):
    model = tiny("llama")
    ids, mask = prompts(2, length=40)
    with torch.no_grad(), witcert.monitor(model, "test-blown-token", certificate=certificate, spot_keys=spot_keys,
                                          spot_delta=1e-6, tau=0.04, keep_exact=keep_exact, gate=gate,
                                          meter=meter) as mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    return mon.table()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spot_keys", (16, 64))  # sampled; read whole (at most 43 tokens)
def test_monitor_spot_meter_covers_a_blown_token(spot_keys):
    """Validation mode: every cell's reported meter (``min(meter, spot bound)``) is at or above its true TV, and
    the cells the blown token dominates are among them; production reads the same keys, reports the same meters."""
    validation = generate_table(True, spot_keys)
    live = ~np.isnan(validation["meter"])
    assert np.all(validation["true_tv"][live] <= validation["meter"][live])
    assert np.nanmax(validation["true_tv"]) > 0.05  # the blown token carries real exact weight somewhere
    production = generate_table(False, spot_keys)
    assert np.array_equal(np.isnan(production["meter"]), ~live)
    assert np.all(validation["true_tv"][live] <= production["meter"][live])


@pytest.mark.usefixtures("one_thread")
def test_spot_certified_gate_repairs_a_blown_token():
    """The spot-certified gate (validation) neither certifies nor leaves above ``meter_after`` a cell the blown
    token dominates."""
    table = generate_table(True, 16, gate=witcert.Gate(tau=0.04, block_size=8))
    live = ~np.isnan(table["meter"])
    assert np.all(table["true_tv"][live] <= table["meter"][live])
    assert np.all(table["true_tv_after"][live] <= table["meter_after"][live])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("meter", ("fused", "full"))
def test_deterministic_meter_and_gate_cover_a_blown_token(meter):
    """The deterministic meter (fused pass and eager reference) and the certified gate's ``meter_after`` on the same
    cells: every bound at or above the true TV (before and after repair)."""
    table = generate_table(True, 16, gate=witcert.Gate(tau=0.04, block_size=8), certificate="deterministic", meter=meter)
    live = ~np.isnan(table["meter"])
    assert np.nanmax(table["true_tv"]) > 0.5
    assert np.all(table["true_tv"][live] <= table["meter"][live])
    assert np.all(table["true_tv_after"][live] <= table["meter_after"][live])

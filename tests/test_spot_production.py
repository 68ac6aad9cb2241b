"""The spot check in production (``keep_exact=False``): exact keys from the content-checked backing store.

Implementation under test: ``witcert.spot.cells.BackedKeys`` and the monitor's production spot path.
Oracle: the same generation under ``keep_exact=True`` with the same spot seed (the validation path
reads the exact cache): identical spot bounds and key counts per cell, since both read the same
exact keys; the backing store's content check (a corrupted block raises, a store that does not
hold the call's tokens is refused). Domain: the tiny Llama of ``tests/tiny_models.py``, kivi-2bit,
2 rows x 40 prompt tokens + 3 generated, blocks of 16 tokens.
"""
import numpy as np
import pytest
import torch

import witcert
from witcert.gate.backing_store import BackingStore, ChecksumMismatchError
from witcert.spot.cells import BackedKeys, SpotSettings

from tests.tiny_models import prompts, tiny


def spot_table(model, keep_exact: bool):
    ids, mask = prompts(2, length=40)
    mon = witcert.monitor(model, "kivi-2bit", certificate="spot", spot_keys=16, tau=0.04, keep_exact=keep_exact)
    mon.spot = SpotSettings(keys=16, delta=1e-6, tau=0.04, seed=3)  # replay opt-in: both runs draw alike
    with torch.no_grad(), mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    return mon.table()


@pytest.mark.usefixtures("one_thread")
def test_production_reads_the_same_keys_as_validation():
    model = tiny("llama")
    validation, production = spot_table(model, True), spot_table(model, False)
    checked = ~np.isnan(validation["spot_bound"])
    assert checked.any()
    assert np.array_equal(checked, ~np.isnan(production["spot_bound"]))
    assert np.array_equal(validation["spot_bound"][checked], production["spot_bound"][checked])
    assert np.array_equal(validation["spot_keys"][checked], production["spot_keys"][checked])
    assert np.array_equal(validation["meter"], production["meter"], equal_nan=True)
    # production reads the drawn keys by token index (no blocks, no values): each key row once per call, as the
    # validation reads rows of the exact cache
    assert production["spot_bytes"][checked].sum() == validation["spot_bytes"][checked].sum() > 0


def test_backed_keys_are_content_checked():
    store = BackingStore(block_size=4)
    keys = torch.randn(1, 2, 10, 8)
    store.write(0, keys, keys.clone())
    backed = BackedKeys(store, 0, length=10)
    index = torch.tensor([9, 1, 5])
    assert torch.equal(backed.rows(0, 1, index), keys[0, 1, index].double())
    store._get(0).k[0, 0, 2] += 1.0  # bit rot in a block no one paged yet
    with pytest.raises(ChecksumMismatchError):
        BackedKeys(store, 0, length=10).rows(0, 0, torch.tensor([2]))
    with pytest.raises(ValueError, match="holds 10 exact keys"):
        BackedKeys(store, 0, length=12)


@pytest.mark.usefixtures("one_thread")
def test_dithered_cache_non_adaptive_spot_check_relies_on_deterministic_radii(monkeypatch):
    """Under Tier B's probabilistic branch (a declared non-adaptive prefill) the spot check is handed Tier A's
    radii, which hold for every query, so its ``spot_delta`` is the cell's whole failure probability."""
    from witcert.spot.deferred import PendingChecks

    seen = []
    original = PendingChecks.add

    def spy(self, math, query, exact_keys, scale, radii, layers):
        seen.append((bool((radii >= math.c).all()), not torch.equal(radii, math.c)))
        return original(self, math, query, exact_keys, scale, radii, layers)

    monkeypatch.setattr(PendingChecks, "add", spy)
    model = tiny("llama")
    ids, mask = prompts(2, length=40)
    with torch.no_grad(), witcert.monitor(model, "dithered-int8", seed=5, certificate="spot", spot_keys=16,
                                          tau=1e-6) as mon:
        with mon.non_adaptive():  # a prefill, then teacher-forced steps: metered under the probabilistic branch
            out = model(input_ids=ids[:, :36], attention_mask=mask[:, :36])
            for i in range(36, 40):
                out = model(input_ids=ids[:, i:i + 1], attention_mask=mask[:, :i + 1], past_key_values=out.past_key_values)
    table = mon.table()
    checked = ~np.isnan(table["spot_bound"])
    assert seen and all(wider for wider, _ in seen) and any(differs for _, differs in seen) and checked.any()
    assert np.all(table["true_tv"][checked] <= table["spot_bound"][checked])

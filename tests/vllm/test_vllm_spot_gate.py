"""The spot-certified gate through vLLM: kivi-2bit, the exact shadow, the meter-only gate beside it.

Implementation: ``witcert.integrations.vllm.spot_gate`` and ``.spot_check`` through the backend (requests with
``witcert_certificate: "spot"``). Oracle: the exact shadow's true TV of every cell, before and after repair
(0 cells above their bound at delta 1e-6 per cell), and the meter-only gate's pages on the same prompt.
"""
import json

import pytest

from tests.vllm.engines import HAS_VLLM, NO_VLLM, run_engine

# ~115 tokens: kivi-2bit stores each complete 32-token group of the prompt at 2 bits
PROMPT = " ".join(["The old lighthouse keeper walked along the shore every morning, counting the boats and writing "
                   "their names in a little book."] * 5)


def _gated(xargs: dict) -> dict:
    out = run_engine("--plugin", "--shadow", "--gate", "--scheme", "kivi-2bit", "--max-tokens", "3",
                     "--prompts", PROMPT, "--xargs", json.dumps(xargs))
    return out["witcert"]


def test_spot_gate_pages_less_than_the_meter_only_gate_with_no_violation(smollm2, monkeypatch):
    if not HAS_VLLM:
        pytest.skip(NO_VLLM)
    monkeypatch.setenv("WITCERT_VLLM_COMPILE", "0")  # eager: the gate's logic, not the compiled pass, is tested
    meter_only = _gated({})
    spot = _gated({"witcert_certificate": "spot", "witcert_spot_keys": 64, "witcert_spot_delta": 1e-6})
    for snap in (meter_only, spot):
        assert snap["shadow_cells"] > 0 and snap["shadow_violations"] == 0  # served and before repair
        assert snap["gate_counts"]["shadow_repair_mismatches"] == 0
        assert snap["schemes"]["kivi-2bit"]["unreachable"] == 0
    assert meter_only["gate_counts"]["tokens_paged"] > 0 and meter_only["bounds"]["probabilistic"] == 0
    counts = spot["gate_counts"]
    assert 0 < counts["tokens_paged"] < meter_only["gate_counts"]["tokens_paged"]
    assert counts["spot_cells"] > 0 and counts["spot_bytes"] > 0 and counts["spot_keys"] > 0
    assert spot["bounds"]["probabilistic"] > 0 and spot["deltas"] == {"1e-06": spot["bounds"]["probabilistic"]}


def test_speed_table_gate_modes_run_in_an_engine_with_the_exact_store():
    from witcert.integrations.vllm import speed

    off, meter_only, spot = speed.modes(keys=("gate", "spot-gate"))
    assert not off.plugin and meter_only.gate and spot.gate and meter_only.engine == spot.engine != off.engine
    assert spot.xargs == {"witcert_scheme": "kivi-2bit", "witcert_certificate": "spot"}
    runs = [{"decode_tokens_per_s": 2.0, "gate": {"fraction_paged": f}} for f in (0.1, 0.3, 0.2)]
    result = {"modes": {spot.name: {"baseline": spot.baseline, **speed._paged(runs)}}, "ratios": {spot.name: 0.5}}
    assert speed.lines(result) == [f"{spot.name}: 0.50x of plugin off, 0.200 of tokens paged"]

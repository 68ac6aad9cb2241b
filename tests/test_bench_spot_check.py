"""``benchmarks.spot_check``'s sampling hook stands in for the monitor's spot settings (same ``apply`` signature).

Oracle: every sampled cell's spot bound at every budget is at least its true TV, and the hook leaves
the call's cells unchanged. Domain: the tiny Llama, rtn-int4, 2 rows x 40 tokens + 3 generated.
"""
import pytest
import torch

from benchmarks.spot_check import CONFIGS, SampledSpotChecks, summarize_monitor
from witcert.integrations.hf.monitoring import Monitor

from tests.tiny_models import prompts, tiny


@pytest.mark.usefixtures("one_thread")
def test_the_sampling_hook_records_sound_checks_through_the_monitor():
    model = tiny("llama")
    ids, mask = prompts(2, length=40)
    monitor = Monitor(model, "rtn-int4", tau=1e-4)
    monitor.spot = SampledSpotChecks(per_call=2, delta=1e-6, tau=1e-4, task="text",
                                     configs=("adaptive 512", "fixed 256"))
    with torch.no_grad(), monitor:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    rows = monitor.spot.rows
    checked = [r for r in rows if r["spot"]]
    assert rows and checked
    for row in checked:
        assert sorted(row["spot"]) == ["adaptive 512", "fixed 256"] and set(row["spot"]) <= set(CONFIGS)
        assert all(entry["bound"] >= row["true_tv"] for entry in row["spot"].values())
    assert "spot_bound" not in monitor.table().columns  # the hook records, it changes nothing


@pytest.mark.usefixtures("one_thread")
def test_the_monitor_section_summarizes_a_spot_certified_run():
    """The monitor section's summary of a spot-certified run (exact cache kept): sound bounds give coverage at most
    the ceiling, at least the deterministic meter's, no violation; every checked cell read exact keys."""
    model = tiny("llama")
    ids, mask = prompts(2, length=40)
    monitor = Monitor(model, "rtn-int4", tau=1e-3, certificate="spot", spot_keys=16, spot_delta=1e-6)
    with torch.no_grad(), monitor:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    summary = summarize_monitor([monitor.table()], tau=1e-3)
    assert summary["cells"] > 0 and summary["checked"] == summary["above_tau"] > 0
    assert summary["coverage_deterministic"] <= summary["coverage"] <= summary["ceiling"]
    assert summary["violations"] == 0 and summary["median_bound_over_true_tv"] >= 1.0
    assert summary["mean_keys_read"] > 0 and 0.0 <= summary["read_whole"] <= 1.0

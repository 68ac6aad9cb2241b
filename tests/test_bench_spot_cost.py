"""``benchmarks.spot_cost`` runs every line on a small layer-step (timings are not asserted: benchmarks measure them)."""
import math

from benchmarks import spot_cost


def test_every_line_is_timed_per_checked_cell():
    row = spot_cost.measure(256, "SmolLM2", 32, reps=1)
    lines = ("batched, adaptive (tau 0.2)", "batched, fixed", f"batched, key groups ({spot_cost.GROUP_STEPS} steps)",
             "one cell, fixed")
    assert set(row["ms_per_checked_cell"]) == set(lines)
    assert all(math.isfinite(v) and v > 0 for v in row["ms_per_checked_cell"].values())
    assert row["mean_keys_read"] <= 32 and row["rounds"] >= 1

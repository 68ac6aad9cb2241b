"""``benchmarks.spot_cost`` runs every line on a small layer-step (timings are not asserted: benchmarks measure them)."""
import math

from benchmarks import spot_cost
from benchmarks.timing import compiled_available


def test_every_line_is_timed_per_checked_cell():
    row = spot_cost.measure(256, "SmolLM2", 32, reps=1)
    lines = {"batched, adaptive (tau 0.2)", "batched, fixed", f"batched, key groups ({spot_cost.GROUP_STEPS} steps)",
             "one cell, fixed"}
    if compiled_available():  # the compiled lines where torch.compile works here
        lines |= {spot_cost.COMPILED, "batched, fixed, compiled"}
    assert set(row["ms_per_checked_cell"]) == lines
    assert all(math.isfinite(v) and v > 0 for v in row["ms_per_checked_cell"].values())
    assert row["mean_keys_read"] <= 32 and row["rounds"] >= 1


def test_the_results_page_names_the_compiled_line_as_the_benchmark_does():
    import runpy
    from pathlib import Path

    page = runpy.run_path(str(Path(__file__).resolve().parent.parent / "scripts" / "gen_results_page.py"))
    assert page["COMPILED_SPOT"] == spot_cost.COMPILED

"""Section 1c -- the fused meter pass (witcert.fastpath) against attention, eager and compiled, in one run.

Same problem as ``cost.py`` (one decode step, batch 1, GQA, fp32 attention). Per entry, interleaved
in one process (every ratio is a median over the same run's attention median):

* ``library meter``: ``witcert.meter`` on ``(scores, c)`` (the eager reference, per-operation
  directed rounding, every bound);
* ``fused eager`` / ``fused compiled``: the fp32 pass :func:`witcert.fastpath.budgeted_pass.lean_pass`
  on the same ``(scores, c)`` (``T1``, ``P1``, ``MN``, ``CS``), as the monitor calls it (inputs valid
  by construction);
* ``+ Tier A c``: the per-token bound included -- eager: ``witcert.logit_bound`` (fp64, directed);
  compiled: :func:`witcert.fastpath.fused.tier_a_cells` (the fp32 band dot over the band-major fp16
  witness inside the same compiled pass) -- i.e. the whole Tier A meter of a cell; ``+ Tier B c``: eager
  ``witcert.tier_b_logit_bound`` (fp64); compiled :func:`witcert.fastpath.fused.tier_b_cells` (the two fp32
  group dots of :mod:`witcert.fastpath.tier_b_radius`, one compiled graph, then the compiled pass).

Each entry is timed warm (repeated calls, inputs in cache: the median per call of samples of >= 20 ms)
and, compiled, also cold (``cold_ratio_to_attention``: one call right after the attention step,
whose 50 MB of keys and values have evicted the meter's inputs, as in a decode step where a layer's
witness was last read a step ago). The first compile (a fresh process: dynamo + inductor, before
the on-disk cache helps) is timed separately. A GPU is never needed; GPU-only checks live in ``kernel.py``.
"""
import time

import torch

import witcert
from benchmarks.cost import SHAPES, _attention, _problem
from benchmarks.timing import compile_choice, time_after, time_interleaved
from witcert.fastpath import budgeted_pass, radius, tier_b_radius
from witcert.fastpath import compiled as compiled_mod
from witcert.fastpath.fused import lean_cells, tier_a_cells, tier_b_cells

LENGTHS = {"SmolLM2-135M (9q/3kv, d=64)": (2048, 8192, 32768, 131072), "7B-class (28q/4kv, d=128)": (2048, 8192, 32768)}
QUICK = (2048, 8192)


def first_compile_seconds() -> float:
    """Seconds to compile the fused pass, the Tier B kernel and the Tier A pass in this process (the on-disk cache helps after the first run)."""
    started = time.perf_counter()
    fns = [compiled_mod.compiled_of(budgeted_pass.lean_pass, budgeted_pass.probe),
           compiled_mod.compiled_of(tier_b_radius.tier_b_kernel, tier_b_radius.probe),
           compiled_mod.compiled_of(radius.tier_a_pass, radius.tier_a_probe)]
    return float("nan") if None in fns else time.perf_counter() - started


def measure(name: str, s: int, reps: int, compiled: bool) -> dict:
    p = _problem(*SHAPES[name], s)
    scores = (p["q"] @ p["k"].transpose(-1, -2)) * p["sm"]
    c_a = witcert.logit_bound(p["q"], p["w"], p["layout"], p["sm"])
    fns = {"attention": lambda: _attention(p),
           "library meter (Tier A c)": lambda: witcert.meter(scores, c_a)}
    for label in ("eager",) + (("compiled",) if compiled else ()):
        def fused(c_fn=None, compiled=label == "compiled"):
            with compile_choice(compiled):
                return lean_cells(scores, c_a if c_fn is None else c_fn(), checked=True).meter

        def fused_tier_a(compiled=label == "compiled"):  # one pass, the radius formed inside it
            with compile_choice(compiled):
                return tier_a_cells(scores, p["q"], p["w"], p["layout"], p["sm"], checked=True).meter

        def fused_tier_b(compiled=label == "compiled"):  # the bound's kernel, then the pass
            with compile_choice(compiled):
                return tier_b_cells(scores, p["q"], p["store"], p["delta_loc"], p["sm"], checked=True).meter

        fns[f"fused {label}"] = fused
        fns[f"fused {label} + Tier A c"] = fused_tier_a if label == "compiled" else lambda fused=fused: fused(
            lambda: witcert.logit_bound(p["q"], p["w"], p["layout"], p["sm"]))
        fns[f"fused {label} + Tier B c"] = fused_tier_b if label == "compiled" else lambda fused=fused: fused(
            lambda: witcert.tier_b_logit_bound(p["q"], p["store"], p["delta_loc"], p["sm"]))
    if compiled:  # the same numbers to the budget (the compiled code follows the same analysis)
        assert torch.allclose(fns["fused compiled"](), fns["fused eager"](), rtol=1e-6)
    timings = time_interleaved(fns, reps=reps, warmup=1)
    att = timings["attention"].median
    row = {"shape": name, "S": s, "reps": reps, "median_s": {k: t.median for k, t in timings.items()},
           "ratio_to_attention": {k: t.median / att for k, t in timings.items() if k != "attention"}}
    if compiled:
        cold = time_after({k: f for k, f in fns.items() if k.startswith("fused compiled")}, fns["attention"], reps)
        row["cold_ratio_to_attention"] = {k: t.median / att for k, t in cold.items()}
    return row


def run(quick: bool, reps: int) -> dict:
    compile_s = first_compile_seconds() if compiled_mod.compile_requested() or not quick else float("nan")
    compiled = compile_s == compile_s
    rows = []
    for name, lengths in LENGTHS.items():
        for s in (QUICK if quick else lengths):
            rows.append(measure(name, s, reps, compiled))
            r = rows[-1]["ratio_to_attention"]
            print(f"  fast {name} S={s}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()), flush=True)
    return {"first_compile_s": compile_s, "rows": rows}

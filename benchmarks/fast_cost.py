"""Section 1c -- the fused meter pass (witcert.fastpath) against attention, eager and compiled, in one run.

Same problem as ``cost.py`` (one decode step, batch 1, GQA, fp32 attention). Per entry, interleaved
in one process (every ratio is a median over the same run's attention median):

* ``library meter``: ``witcert.meter`` on ``(scores, c)`` (the eager reference, per-operation
  directed rounding, every bound);
* ``fused eager`` / ``fused compiled``: the fp32 pass :func:`witcert.fastpath.budgeted_pass.lean_pass`
  on the same ``(scores, c)`` (``T1``, ``P1``, ``MN``, ``CS``), as the monitor calls it (inputs valid
  by construction);
* ``+ Tier A c``: the per-token bound included -- eager: ``witcert.logit_bound`` (fp64, directed);
  compiled: :func:`witcert.fastpath.radius.fast_logit_bound` (one fp32 band dot; a BLAS call, not
  itself compiled) -- i.e. the whole Tier A meter of a cell; ``+ Tier B c``: eager
  ``witcert.tier_b_logit_bound`` (fp64); compiled
  :func:`witcert.fastpath.tier_b_radius.fast_tier_b_logit_bound` (two fp32 group dots, one compiled pass).

The first compile (a fresh process: dynamo + inductor, before the on-disk cache helps) is timed
separately. A GPU is never needed; GPU-only checks live in ``kernel.py``.
"""
import time

import torch

import witcert
from benchmarks.cost import SHAPES, _attention, _problem
from benchmarks.timing import compile_choice, time_interleaved
from witcert.fastpath import budgeted_pass, radius, tier_b_radius
from witcert.fastpath import compiled as compiled_mod
from witcert.fastpath.fused import lean_cells

LENGTHS = {"SmolLM2-135M (9q/3kv, d=64)": (2048, 8192, 32768, 131072), "7B-class (28q/4kv, d=128)": (2048, 8192, 32768)}
QUICK = (2048, 8192)


def first_compile_seconds() -> float:
    """Seconds to compile the fused pass and the Tier B kernel in this process (the on-disk cache helps after the first run)."""
    started = time.perf_counter()
    fns = [compiled_mod.compiled_of(budgeted_pass.lean_pass, budgeted_pass.probe),
           compiled_mod.compiled_of(tier_b_radius.tier_b_kernel, tier_b_radius.probe)]
    return float("nan") if None in fns else time.perf_counter() - started


def measure(name: str, s: int, reps: int, compiled: bool) -> dict:
    p = _problem(*SHAPES[name], s)
    scores = (p["q"] @ p["k"].transpose(-1, -2)) * p["sm"]
    c_a = witcert.logit_bound(p["q"], p["w"], p["layout"], p["sm"])
    fns = {"attention": lambda: _attention(p),
           "library meter (Tier A c)": lambda: witcert.meter(scores, c_a)}
    for label in ("eager",) + (("compiled",) if compiled else ()):
        tier_a_c = (lambda *a: radius.fast_logit_bound(*a, checked=True)) if label == "compiled" else witcert.logit_bound
        tier_b_c = tier_b_radius.fast_tier_b_logit_bound if label == "compiled" else witcert.tier_b_logit_bound

        def fused(c_fn=None, compiled=label == "compiled"):
            with compile_choice(compiled):
                return lean_cells(scores, c_a if c_fn is None else c_fn(), checked=True).meter

        fns[f"fused {label}"] = fused
        fns[f"fused {label} + Tier A c"] = lambda fused=fused, f=tier_a_c: fused(
            lambda: f(p["q"], p["w"], p["layout"], p["sm"]))
        fns[f"fused {label} + Tier B c"] = lambda fused=fused, f=tier_b_c: fused(
            lambda: f(p["q"], p["store"], p["delta_loc"], p["sm"]))
    if compiled:  # the same numbers to the budget (the compiled code follows the same analysis)
        assert torch.allclose(fns["fused compiled"](), fns["fused eager"](), rtol=1e-6)
    timings = time_interleaved(fns, reps=reps, warmup=1)
    att = timings["attention"].median
    return {"shape": name, "S": s, "reps": reps, "median_s": {k: t.median for k, t in timings.items()},
            "ratio_to_attention": {k: t.median / att for k, t in timings.items() if k != "attention"}}


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

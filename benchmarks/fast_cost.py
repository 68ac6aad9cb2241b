"""Section 1c -- the fused meter pass (witcert.fastpath) against attention, eager and compiled, in one run.

Same problem as ``cost.py`` (one decode step, batch 1, GQA, fp32 attention). Per entry, interleaved
in one process (every ratio is a median over the same run's attention median):

* ``library``: ``witcert.meter`` (the eager reference, per-operation directed rounding);
* ``fused eager`` / ``fused compiled``: :func:`witcert.fastpath.fused.lean_cells` on the same
  ``(scores, c)`` with the checks the monitor skips (its inputs are valid by construction);
* ``+ c``: the per-token bound included (Tier A ``logit_bound`` from the witness, Tier B
  ``tier_b_logit_bound``), i.e. the whole meter of a cell.

The first compile (a fresh process: dynamo + inductor, before the on-disk cache helps) is timed
separately. A GPU is never needed; GPU-only checks live in ``kernel.py``.
"""
import time

import torch

import witcert
from benchmarks.cost import SHAPES, _attention, _problem
from benchmarks.timing import time_interleaved
from witcert.fastpath import compiled as compiled_mod
from witcert.fastpath.budgeted_pass import lean_cells_kernel
from witcert.fastpath.fused import lean_cells

LENGTHS = {"SmolLM2-135M (9q/3kv, d=64)": (2048, 8192, 32768, 131072), "7B-class (28q/4kv, d=128)": (2048, 8192, 32768)}
QUICK = (2048, 8192)


def _fused(scores, c, kernel) -> torch.Tensor:
    s = scores.shape[-1]
    return kernel(scores.double().reshape(-1, s), c.double().reshape(-1, s), scores.new_zeros((), dtype=torch.float64),
                  scores.new_zeros((), dtype=torch.float64))[0]


def first_compile_seconds() -> float:
    """Seconds to compile the fused pass in this process (warm on-disk cache helps after the first run)."""
    started = time.perf_counter()
    fn = compiled_mod.compiled_kernel()
    return float("nan") if fn is None else time.perf_counter() - started


def measure(name: str, s: int, reps: int, compiled) -> dict:
    p = _problem(*SHAPES[name], s)
    scores = (p["q"] @ p["k"].transpose(-1, -2)) * p["sm"]
    c_a = witcert.logit_bound(p["q"], p["w"], p["layout"], p["sm"])
    c_b = witcert.tier_b_logit_bound(p["q"], p["store"], p["delta_loc"], p["sm"])
    kernels = {"eager": lean_cells_kernel} | ({"compiled": compiled} if compiled is not None else {})
    fns = {"attention": lambda: _attention(p),
           "library meter (Tier A c)": lambda: witcert.meter(scores, c_a)}
    for label, kernel in kernels.items():
        fns[f"fused {label}"] = lambda kernel=kernel: _fused(scores, c_a, kernel)
        fns[f"fused {label} + Tier A c"] = lambda kernel=kernel: _fused(
            scores, witcert.logit_bound(p["q"], p["w"], p["layout"], p["sm"]), kernel)
        fns[f"fused {label} + Tier B c"] = lambda kernel=kernel: _fused(
            scores, witcert.tier_b_logit_bound(p["q"], p["store"], p["delta_loc"], p["sm"]), kernel)
    for kernel in kernels.values():  # the same numbers (the compiled code follows the same budget)
        assert torch.allclose(_fused(scores, c_b, kernel), lean_cells(scores, c_b).meter.reshape(-1), rtol=1e-9)
    timings = time_interleaved(fns, reps=reps, warmup=1)
    att = timings["attention"].median
    return {"shape": name, "S": s, "reps": reps, "median_s": {k: t.median for k, t in timings.items()},
            "ratio_to_attention": {k: t.median / att for k, t in timings.items() if k != "attention"}}


def run(quick: bool, reps: int) -> dict:
    compile_s = first_compile_seconds() if compiled_mod.compile_requested() or not quick else float("nan")
    compiled = compiled_mod.compiled_kernel() if compile_s == compile_s else None
    rows = []
    for name, lengths in LENGTHS.items():
        for s in (QUICK if quick else lengths):
            rows.append(measure(name, s, reps, compiled))
            r = rows[-1]["ratio_to_attention"]
            print(f"  fast {name} S={s}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()), flush=True)
    return {"first_compile_s": compile_s, "rows": rows}

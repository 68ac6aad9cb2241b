"""Section 1 -- meter cost as a ratio to the decode attention it certifies (torch fp32, CPU).

One decode step, batch 1, GQA: ``Hq`` query heads read ``Hkv`` kv heads of ``S`` cached tokens.

* attention: ``scores = sm q K^T``, ``softmax``, ``p V`` over all heads (fp32);
* Tier A (library): ``witcert.logit_bound`` from the witness stored at write time (a B-length
  dot per token) + ``witcert.meter`` on the attention's own scores;
* Tier B (library): ``witcert.tier_b_logit_bound`` on the packed dithered-INT8 store + ``witcert.meter``;
* the library path split into its parts (input checks, ``logit_bound``, ``bounds.moments``, the
  bounds from the moments), to show where the time goes;
* a lean fp32 estimate of the compute floor (benchmark-local, NOT the library and without the
  rounding enclosures): ``c = W q_bandnorms`` and one e-form pass ``sum p~ expm1(c)``.

Every ratio is meter median / attention median from the same interleaved run.
"""
import math

import torch

import witcert
from witcert.core import bounds
from witcert.tier_b.certificate import delta_local
from witcert.tier_b.counters import StandaloneCounter
from witcert.core.checks import check_scores_and_bounds

from benchmarks.timing import time_interleaved

SHAPES = {  # name -> (Hq, Hkv, d)
    "SmolLM2-135M (9q/3kv, d=64)": (9, 3, 64),
    "7B-class (28q/4kv, d=128)": (28, 4, 128),
}
LENGTHS = (2048, 8192, 32768)
QUICK_LENGTHS = (2048, 8192)


def _problem(hq: int, hkv: int, d: int, s: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, s, d, generator=g)
    v = torch.randn(hkv, s, d, generator=g)
    q = torch.randn(hkv, hq // hkv, d, generator=g)  # (Hkv, G, d): query head h reads kv head h // G
    layout = witcert.BandLayout(d, 16)
    k_hat = witcert.get_scheme("rtn-int8")(k)
    w = witcert.witness_of(k, k_hat, layout)  # (Hkv, S, B) fp16, written once at cache-write time
    store = witcert.DitheredInt8().quantize(k, StandaloneCounter(request=0, layer=0))
    return dict(q=q, k=k_hat, v=v, w=w, layout=layout, store=store, sm=d**-0.5,
                delta_loc=delta_local(1e-2, 30, hq, 1024))


def _attention(p: dict) -> torch.Tensor:
    scores = (p["q"] @ p["k"].transpose(-1, -2)) * p["sm"]  # (Hkv, G, S)
    return torch.softmax(scores, -1) @ p["v"]  # (Hkv, G, d)


def _tier_a(p: dict, scores: torch.Tensor) -> torch.Tensor:
    c = witcert.logit_bound(p["q"], p["w"], p["layout"], p["sm"])  # (Hkv, G, S): G queries per kv head
    return witcert.meter(scores, c)


def _tier_b(p: dict, scores: torch.Tensor) -> torch.Tensor:
    c = witcert.tier_b_logit_bound(p["q"], p["store"], p["delta_loc"], p["sm"])  # (Hkv, G, S)
    return witcert.meter(scores, c)


def _lean_floor(p: dict, w32: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """fp32 compute floor: a B-length dot and one expm1 pass per token, two sums. ``mass`` =
    ``exp(scores - max)`` is what attention's softmax already computed (a fused kernel shares it).
    Not sound-rounded: a cost estimate only."""
    qn = p["layout"].band_norms(p["q"])  # (Hkv, G, B)
    c = (qn @ w32.transpose(-1, -2)) * p["sm"]  # (Hkv, G, S)
    k = (mass * torch.expm1(c)).sum(-1) / mass.sum(-1)
    return torch.minimum(0.5 * k * (k + 2), torch.tanh(c.amax(-1) / 2)).clamp(max=1)


def measure_shape(name: str, s: int, reps: int) -> dict:
    hq, hkv, d = SHAPES[name]
    p = _problem(hq, hkv, d, s)
    scores = (p["q"] @ p["k"].transpose(-1, -2)) * p["sm"]
    c_a = witcert.logit_bound(p["q"], p["w"], p["layout"], p["sm"])
    w32 = p["w"].float()  # the fp16 witness widened once (a kernel widens it in registers)
    mass = torch.exp(scores - scores.amax(-1, keepdim=True))
    fns = {
        "attention": lambda: _attention(p),
        "tier_a": lambda: _tier_a(p, scores),
        "tier_b": lambda: _tier_b(p, scores),
        "part: input checks": lambda: check_scores_and_bounds(scores, c_a),
        "part: logit_bound (Tier A c)": lambda: witcert.logit_bound(p["q"], p["w"], p["layout"], p["sm"]),
        "part: tier_b_logit_bound (Tier B c)": lambda: witcert.tier_b_logit_bound(p["q"], p["store"], p["delta_loc"], p["sm"]),
        "part: bounds.moments": lambda: bounds.moments(scores, c_a),
        "part: meter(scores, c)": lambda: witcert.meter(scores, c_a),
        "lean fp32 floor, exp shared (estimate)": lambda: _lean_floor(p, w32, mass),
        "lean fp32 floor, exp recomputed (estimate)": lambda: _lean_floor(
            p, w32, torch.exp(scores - scores.amax(-1, keepdim=True))),
    }
    timings = time_interleaved(fns, reps=reps, warmup=1)
    att = timings["attention"].median
    return {
        "shape": name, "Hq": hq, "Hkv": hkv, "d": d, "S": s, "reps": reps,
        "median_s": {k: t.median for k, t in timings.items()},
        "range_s": {k: [t.low, t.high] for k, t in timings.items()},
        "ratio_to_attention": {k: t.median / att for k, t in timings.items() if k != "attention"},
    }


def run(quick: bool, reps: int) -> list[dict]:
    rows = []
    for name in SHAPES:
        for s in (QUICK_LENGTHS if quick else LENGTHS):
            rows.append(measure_shape(name, s, reps))
            r = rows[-1]["ratio_to_attention"]
            print(f"  cost {name} S={s}: Tier A {r['tier_a']:.2f}x, Tier B {r['tier_b']:.2f}x, "
                  f"lean floor {r['lean fp32 floor, exp shared (estimate)']:.2f}x", flush=True)
    return rows


def profile(name: str = "7B-class (28q/4kv, d=128)", s: int = 8192, top: int = 12) -> list[dict]:
    """torch.profiler's top ops (self CPU time) of one Tier A and one Tier B meter call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    hq, hkv, d = SHAPES[name]
    p = _problem(hq, hkv, d, s)
    scores = (p["q"] @ p["k"].transpose(-1, -2)) * p["sm"]
    out = []
    for label, fn in (("tier_a", _tier_a), ("tier_b", _tier_b)):
        fn(p, scores)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(p, scores)
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        total = sum(e.self_cpu_time_total for e in prof.key_averages())
        out += [dict(path=label, shape=name, S=s, op=e.key, calls=e.count, self_ms=e.self_cpu_time_total / 1e3,
                     share=e.self_cpu_time_total / total) for e in events]
    return out

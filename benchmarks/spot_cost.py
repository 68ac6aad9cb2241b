"""Cost of the spot check against the attention it certifies: ``python -m benchmarks.spot_cost``.

One layer-step of decode: every query head's cell checked at once (:func:`witcert.spot.check_cells`,
``keys`` exact keys, ``delta`` 1e-6, exact logits gathered from fp32 keys in memory, one gather per kv head),
per checked cell, against one cell's attention (``softmax(q K^T / sqrt d) V`` in fp32) and against the layer
step's attention (sdpa with GQA), at ``S`` = 2k and 32k, for SmolLM2's shape (9 query heads over 3 kv heads,
head size 64) and a 7B-class one (32 over 8, head size 128), and the key-group path of a deferred flush (:mod:`witcert.spot.groups`: the cells of
``GROUP_STEPS`` steps per (row, kv head), each group's history read whole when that costs at most ``keys`` per
cell: every cell's true TV, no draws). Beside it the one-cell form
(:func:`witcert.spot.spot_check`) on one cell. The cells' radii are ``c_t = 100 |eps_t|`` (the witness exceeds
the error about that much where it saturates), so every check samples and, with ``tau`` 0.2 out of reach,
runs every round up to ``keys``: the worst case of the adaptive check. The batched check both eager and, where
``torch.compile`` works here, with ``WITCERT_COMPILE=1`` (its dense row terms compiled: what a monitor run with it
pays). Median of interleaved runs (:func:`benchmarks.timing.time_interleaved`), one torch thread.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks import spot_records
from benchmarks.timing import compile_choice, compiled_available, time_interleaved
from witcert.spot import KeyGather, check_cells, spot_check, spot_randomness

CONTEXTS = (2048, 32768)
GROUP_STEPS = 16
"""Decode steps whose cells share a key group in the key-group line (a deferred flush holds up to 64 calls)."""
SHAPES = {"SmolLM2": (9, 3, 64), "7B-class": (32, 8, 128)}  # query heads, kv heads, head size
COMPILED = "batched, adaptive (tau 0.2), compiled"


def layer_step(context: int, heads: int, kv_heads: int, dim: int, seed: int = 0):
    """``(q (Hq, d), K, V (Hkv, S, d), scores, radii (Hq, S), scale)`` of one synthetic decode layer-step."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, dim, generator=g)
    k = torch.randn(kv_heads, context, dim, generator=g)
    v = torch.randn(kv_heads, context, dim, generator=g)
    k_hat = k + 0.01 * torch.randn(kv_heads, context, dim, generator=g)
    scale = dim ** -0.5
    kv = torch.arange(heads) // (heads // kv_heads)
    scores = torch.einsum("hd,hsd->hs", q.double(), k_hat[kv].double()) * scale
    exact = torch.einsum("hd,hsd->hs", q.double(), k[kv].double()) * scale
    return q, k, v, scores, 100 * (scores - exact).abs() + 1e-9, scale


def measure(context: int, shape: str, keys: int, reps: int) -> dict:
    heads, kv_heads, dim = SHAPES[shape]
    q, k, v, scores, radii, scale = layer_step(context, heads, kv_heads, dim)
    generator = spot_randomness(0).generator
    kv = torch.arange(heads) // (heads // kv_heads)
    rows = torch.zeros(heads, dtype=torch.int64)
    q64, k0 = q.double(), k[0].double()

    def batched(tau, compiled=False):
        def run():
            source = KeyGather(q, rows, kv, k[None], scale)
            with compile_choice(compiled):
                return check_cells(scores, radii, source, keys=keys, delta=1e-6, tau=tau, generator=generator)
        return run

    def grouped():  # a deferred flush's case: GROUP_STEPS steps' cells per key group, each group read whole
        source = KeyGather(q.repeat(GROUP_STEPS, 1), rows.repeat(GROUP_STEPS), kv.repeat(GROUP_STEPS), k[None], scale)
        return check_cells(scores.repeat(GROUP_STEPS, 1), radii.repeat(GROUP_STEPS, 1), source, keys=keys, delta=1e-6,
                           tau=0.2, generator=generator, read_groups=True)

    def one_cell():
        return spot_check(scores[0], radii[0], lambda index: (k0[index] @ q64[0]) * scale, keys=keys, delta=1e-6,
                          generator=generator)

    qs, ks, vs = q[None, :, None], k[None], v[None]

    def attention_cell():
        return torch.softmax((k[0] @ q[0]) * scale, dim=0) @ v[0]

    def attention_layer():
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)

    lines = {"batched, adaptive (tau 0.2)": batched(0.2), "batched, fixed": batched(None)}
    if compiled_available():
        lines |= {COMPILED: batched(0.2, compiled=True), "batched, fixed, compiled": batched(None, compiled=True)}
    timed = time_interleaved(lines | {f"batched, key groups ({GROUP_STEPS} steps)": grouped,
                                      "one cell, fixed": one_cell, "attention, one cell": attention_cell,
                                      "attention, one layer step": attention_layer}, reps=reps)
    cell = timed["attention, one cell"].median
    cells = {name: heads for name in lines} | {f"batched, key groups ({GROUP_STEPS} steps)": heads * GROUP_STEPS,
                                                "one cell, fixed": 1}
    per_cell = {name: timed[name].median / count for name, count in cells.items()}
    result = batched(0.2)()
    return {"context": context, "shape": shape, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "keys": keys,
            "mean_keys_read": float(result.keys_read.double().mean()), "rounds": int(result.rounds.max()),
            "ms": {name: 1e3 * t.median for name, t in timed.items()},
            "ms_per_checked_cell": {name: 1e3 * t for name, t in per_cell.items()},
            "per_checked_cell_over_cell_attention": {name: t / cell for name, t in per_cell.items()}}


def run(contexts=CONTEXTS, shapes=tuple(SHAPES), keys: int = 256, reps: int = 5) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [measure(context, shape, keys, reps) for shape in shapes for context in contexts]
    finally:
        torch.set_num_threads(threads)


OUT = Path(__file__).with_name("results") / "spot_cost.json"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    record = spot_records.provenance("benchmarks.spot_cost", argv) | {"runs": run(keys=args.keys, reps=args.reps)}
    print(json.dumps(record["runs"], indent=1))
    spot_records.write(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

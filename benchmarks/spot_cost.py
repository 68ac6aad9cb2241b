"""Cost of one spot check against the attention it certifies: ``python -m benchmarks.spot_cost``.

Per cell (one query head, one decode query, ``S`` keys of SmolLM2's head size 64): the one-sided
spot check (:func:`witcert.spot.spot_check`, ``keys`` exact keys, ``delta`` 1e-6) with its exact
logits read from fp32 keys in memory, against that cell's attention (``softmax(q K^T / sqrt d) V``
in fp32) and against one decode step's attention of a whole SmolLM2 layer (9 query heads over 3 kv
heads). The cell's radii are ``c_t = 100 |eps_t|`` (the witness exceeds the error about that much
where it saturates), so the check samples rather than reads the cell whole. Median of interleaved
runs (:func:`benchmarks.timing.time_interleaved`), one torch thread.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.timing import time_interleaved
from witcert.spot import spot_check, spot_randomness

CONTEXTS = (2048, 32768)
HEAD_DIM, Q_HEADS, KV_HEADS = 64, 9, 3


def cell(context: int, seed: int = 0):
    """``(q, K, V, scores, radii)`` of a synthetic decode cell: exact keys, a compressed copy, radii 100x its error."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(HEAD_DIM, generator=g)
    k = torch.randn(context, HEAD_DIM, generator=g)
    v = torch.randn(context, HEAD_DIM, generator=g)
    k_hat = k + 0.01 * torch.randn(context, HEAD_DIM, generator=g)
    scale = HEAD_DIM ** -0.5
    scores = (k_hat.double() @ q.double()) * scale
    eps = scores - (k.double() @ q.double()) * scale
    return q, k, v, scores, 100 * eps.abs() + 1e-9, scale


def measure(context: int, keys: int, reps: int) -> dict:
    q, k, v, scores, radii, scale = cell(context)
    k64, q64 = k.double(), q.double()
    generator = spot_randomness(0).generator
    qs = torch.randn(1, Q_HEADS, 1, HEAD_DIM)
    ks, vs = torch.randn(1, KV_HEADS, context, HEAD_DIM), torch.randn(1, KV_HEADS, context, HEAD_DIM)

    def check():
        return spot_check(scores, radii, lambda index: (k64[index] @ q64) * scale, keys=keys, delta=1e-6,
                          generator=generator)

    def attention_cell():
        return torch.softmax((k @ q) * scale, dim=0) @ v

    def attention_layer():
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)

    timed = time_interleaved({"spot check": check, "attention, one cell": attention_cell,
                              "attention, one layer step": attention_layer}, reps=reps)
    result = check()
    return {"context": context, "keys": keys, "keys_read": result.keys_read, "bound": result.bound,
            "ms": {name: 1e3 * t.median for name, t in timed.items()},
            "spot_over_cell": timed["spot check"].median / timed["attention, one cell"].median,
            "spot_over_layer_step": timed["spot check"].median / timed["attention, one layer step"].median}


def run(contexts=CONTEXTS, keys: int = 256, reps: int = 7) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [measure(context, keys, reps) for context in contexts]
    finally:
        torch.set_num_threads(threads)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=256)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    print(json.dumps(run(keys=args.keys, reps=args.reps), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measure meter-driven gating and repair on synthetic activations (docs/design.md "Gating and repair").

Synthetic keys with massive-activation RoPE pairs and an attention-sink token, queries aimed
at "needle" tokens with norms spread over a decade, keys quantized by a registered Tier A
scheme (default ``rtn-int4``), Tier A band witness -> per-token ``c`` (Theorem 2), the gate of
``witcert.gate.policy`` repairing from a verified ``BackingStore``. Every repaired cell is checked per
query: true TV (exact vs repaired logits, fp64) <= recomputed meter.

Tables printed (and written as JSON with ``--json``):

1. error on the cells the gate selects, before vs after block repair, vs the average cell;
2. blocks needed to fall below tau, traffic vs whole-head repair (per case, no persistence);
3. certified vs risk-ranked traffic at tau in {0.2, 1, 5};
4. decode: naive whole-request re-paging vs persistent (repaired slots filtered) vs block-level.

Synthetic activations only; numbers describe this generator, not a model.
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch

import witcert
from witcert.gate.backing_store import BackingStore
from witcert.gate.policy import Gate
from witcert.gate.repair import LayerPager, Repairer

TAUS = (0.2, 1.0, 5.0)


# ----------------------------------------------------------------------------- activations


def make_activations(heads: int, tokens: int, queries: int, d: int, seed: int):
    """Exact fp16 keys/values (H, S, d), fp32 queries (H, T, d) with massive activations.

    Massive activations (Sun et al. 2024) sit on a few tokens (the sink at 0 and ~1 in 256
    others) in a few RoPE pairs; queries mix a "needle" key and noise (norms spread
    log-uniformly over [0.05, 1] x) with a pull toward the massive tokens, so attention is
    peaked on the sink as in real models.
    """
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(heads, tokens, d, generator=g)
    half = d // 2
    massive = torch.cat([torch.zeros(1, dtype=torch.long), torch.randint(1, tokens, (max(1, tokens // 256),), generator=g)])
    for pair in (3, 17):  # rotate_half pairs (j, j + d/2)
        amp = 40.0 + 40.0 * torch.rand(heads, massive.numel(), generator=g)
        k[:, massive, pair] = amp
        k[:, massive, pair + half] = -0.5 * amp
    v = torch.randn(heads, tokens, d, generator=g)
    needles = torch.randint(1, tokens, (heads, queries), generator=g)
    aim = torch.stack([k[h, needles[h]] for h in range(heads)])  # (H, T, d)
    aim[..., (3, 17, 3 + half, 17 + half)] = 0.0  # the needle part ignores the outlier pairs
    q = 0.5 * aim + 0.3 * torch.randn(heads, queries, d, generator=g)
    q = q * torch.exp(torch.empty(heads, queries, 1).uniform_(math.log(0.05), math.log(1.0), generator=g))
    q[..., 3] = 0.3 + 0.9 * torch.rand(heads, queries, generator=g)  # the sink pull: most mass on few tokens
    return k.half(), v.half(), q


def tier_a_bounds(q, k, k_hat, sm_scale):
    """Tier A: c (H, T, S) from the fp16 round-up band witness (T2)."""
    layout = witcert.BandLayout(q.shape[-1], 16)
    w = witcert.witness_of(k, k_hat, layout)  # (H, S, B)
    return witcert.logit_bound(q, w, layout, sm_scale).double()  # (H, T, S)


def logits(q, k, sm_scale):
    return torch.einsum("htd,hsd->hts", q.double(), k.double()) * sm_scale


def true_tv(exact, used):
    return 0.5 * (torch.softmax(exact, -1) - torch.softmax(used, -1)).abs().sum(-1)


def output_error(exact, used, v):
    y = torch.einsum("hts,hsd->htd", torch.softmax(exact, -1), v.double())
    y_hat = torch.einsum("hts,hsd->htd", torch.softmax(used, -1), v.double())
    return (y - y_hat).norm(dim=-1) / y.norm(dim=-1)


# ----------------------------------------------------------------------------- per-case gating


def gate_cases(tau, data, repair="blocks", radius=False):
    """Gate every (head, query) cell independently (no persistence: per-case traffic)."""
    q, k, k_hat, v, c, sm_scale, block_size = (data[n] for n in ("q", "k", "k_hat", "v", "c", "sm_scale", "block_size"))
    store = BackingStore(block_size=block_size)
    store.write("layer", k)
    pager = LayerPager(Repairer(store, persistent=False), "layer", q, sm_scale)
    exact, scores = logits(q, k, sm_scale), logits(q, k_hat, sm_scale)
    gate = Gate(tau, repair=repair, block_size=block_size)
    if radius:  # a shared block radius (max of c over the block): the Tier B input path
        n_tokens = c.shape[-1]
        pad = -n_tokens % block_size
        padded = torch.nn.functional.pad(c, (0, pad))
        result = gate(scores, radius=padded.unflatten(-1, (-1, block_size)).amax(-1), pager=pager)
    else:
        result = gate(scores, c, pager=pager)
    tv_after = true_tv(exact, result.scores)
    sound = bool((tv_after <= result.after.double() * (1 + 1e-9) + 1e-15).all()) if result.certified else None
    return result, exact, scores, tv_after, sound


def error_table(tau, data):
    result, exact, scores, tv_after, sound = gate_cases(tau, data)
    fired = result.fired
    tv_before = true_tv(exact, scores)
    out_before = output_error(exact, scores, data["v"])
    out_after = output_error(exact, result.scores, data["v"])
    row = {
        "tau": tau,
        "regime": "certified" if result.certified else "risk-ranked",
        "cells": fired.numel(),
        "fired": int(fired.sum()),
        "tv_all_before": float(tv_before.mean()),
        "out_all_before": float(out_before.mean()),
        "meter_all_median": float(result.before.median()),
        "sound_per_cell": sound,
    }
    if fired.any():
        row.update(
            tv_fired_before=float(tv_before[fired].mean()),
            tv_fired_after=float(tv_after[fired].mean()),
            out_fired_before=float(out_before[fired].mean()),
            out_fired_after=float(out_after[fired].mean()),
            max_tv_fired_after=float(tv_after[fired].max()),
        )
        row["tv_reduction"] = row["tv_fired_before"] / max(row["tv_fired_after"], 1e-300)
        row["out_reduction"] = row["out_fired_before"] / max(row["out_fired_after"], 1e-300)
    return row


def traffic_table(tau, data, radius=False):
    result, *_ = gate_cases(tau, data, radius=radius)
    fired = result.fired
    blocks = result.blocks[fired].tolist()
    head_bytes = data["k"].shape[1] * data["k"].shape[2] * data["k"].element_size()
    whole = head_bytes * int(fired.sum())
    row = {
        "tau": tau,
        "input": "shared block radius" if radius else "per-token c",
        "regime": "certified" if result.certified else "risk-ranked",
        "fired": int(fired.sum()),
        "reached": int((result.reached & fired).sum()),
        "blocks_median": statistics.median(blocks) if blocks else 0,
        "blocks_mean": statistics.mean(blocks) if blocks else 0,
        "blocks_max": max(blocks) if blocks else 0,
        "bytes_blocks": result.bytes_paged,
        "bytes_whole_head": whole,
    }
    row["traffic_reduction"] = whole / result.bytes_paged if result.bytes_paged else None
    return row


# ----------------------------------------------------------------------------- decode simulation


def decode_traffic(tau, data, steps, policy):
    """Bytes paged over ``steps`` decode steps (each appends one token per head).

    naive: request-granular, whole repair, nothing remembered (the paper's re-paging);
    filtered: request-granular, whole repair, persistent (repaired slots written back, witness 0);
    blocks: head-granular block repair, persistent.
    """
    k, k_hat, q_all, sm_scale, block_size = (data[n] for n in ("k", "k_hat", "q", "sm_scale", "block_size"))
    heads, total, d = k.shape
    prefill = total - steps
    layout = witcert.BandLayout(d, 16)
    witness = witcert.witness_of(k, k_hat, layout)  # (H, S, B), written as tokens arrive
    cache = k_hat.clone()
    store = BackingStore(block_size=block_size)
    store.write("layer", k[:, :prefill])
    repairer = Repairer(store, persistent=policy != "naive")
    gate = Gate(
        tau,
        granularity="head" if policy == "blocks" else "request",
        repair="blocks" if policy == "blocks" else "whole",
        block_size=block_size,
    )
    for step in range(steps):
        n = prefill + step + 1
        store.write("layer", k[:, n - 1 : n])
        q = q_all[:, step % q_all.shape[1]]  # (H, d)
        if policy == "naive":
            pager = LayerPager(repairer, "layer", q, sm_scale)
            kc, wc = k_hat[:, :n], witness[:, :n]
        else:
            pager = LayerPager(repairer, "layer", q, sm_scale, k_cache=cache[:, :n], witness=witness[:, :n])
            kc, wc = cache[:, :n], witness[:, :n]
        scores = torch.einsum("hd,hsd->hs", q.double(), kc.double()) * sm_scale
        c = witcert.logit_bound(q[:, None], wc, layout, sm_scale)[:, 0].double()  # (H, S)
        gate(scores, c, pager=pager)
    return repairer.totals()


# ----------------------------------------------------------------------------- main


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--scheme", default="rtn-int4")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the tables here")
    args = parser.parse_args(argv)

    t0 = time.time()
    k, v, q = make_activations(args.heads, args.tokens, args.queries, args.dim, args.seed)
    k_hat = witcert.get_scheme(args.scheme)(k)
    sm_scale = args.dim**-0.5
    data = dict(q=q, k=k, k_hat=k_hat, v=v, sm_scale=sm_scale, block_size=args.block_size)
    data["c"] = tier_a_bounds(q, k, k_hat, sm_scale)

    errors = [error_table(tau, data) for tau in TAUS]
    traffic = [traffic_table(tau, data) for tau in TAUS] + [traffic_table(0.2, data, radius=True)]
    decode = []
    for policy in ("naive", "filtered", "blocks"):
        totals = decode_traffic(0.2, data, args.decode_steps, policy)
        decode.append({"policy": policy, "tau": 0.2, **totals.__dict__})

    print(
        f"# gate table: synthetic activations, {args.heads} heads x {args.queries} queries, S={args.tokens}, "
        f"d={args.dim}, scheme={args.scheme}, Tier A witness (B=16), block={args.block_size} tokens, seed={args.seed}"
    )
    print("\n## 1. Error on gated cells (block repair, per case)  [TV = true attention TV; out = ||y-y^||/||y||, exact V]")
    print("| tau | regime | fired/cells | TV fired before | TV fired after | reduction | out fired before | out fired after | reduction | TV avg cell | sound per cell |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in errors:
        print(
            f"| {r['tau']:g} | {r['regime']} | {r['fired']}/{r['cells']} | {r.get('tv_fired_before', 0):.3e} | "
            f"{r.get('tv_fired_after', 0):.3e} | {r.get('tv_reduction', 0):.1f}x | {r.get('out_fired_before', 0):.3e} | "
            f"{r.get('out_fired_after', 0):.3e} | {r.get('out_reduction', 0):.1f}x | {r['tv_all_before']:.3e} | {r['sound_per_cell']} |"
        )
    print("\n## 2-3. Blocks to fall below tau, traffic vs whole-head repair (per case, fp16 K only)")
    print("| tau | regime | input | fired | reached | blocks median | mean | max | bytes (blocks) | bytes (whole head) | reduction |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in traffic:
        red = f"{r['traffic_reduction']:.1f}x" if r["traffic_reduction"] else "-"
        print(
            f"| {r['tau']:g} | {r['regime']} | {r['input']} | {r['fired']} | {r['reached']} | {r['blocks_median']} | "
            f"{r['blocks_mean']:.2f} | {r['blocks_max']} | {r['bytes_blocks']} | {r['bytes_whole_head']} | {red} |"
        )
    print(f"\n## 4. Decode, {args.decode_steps} steps, tau=0.2 (certified): repair traffic by policy")
    print("| policy | page-ins | bytes | repaired slots | cache hits |")
    print("|---|---|---|---|---|")
    for r in decode:
        print(f"| {r['policy']} | {r['page_ins']} | {r['bytes']} | {r['repaired_slots']} | {r['cache_hits']} |")
    print(f"\n(wall time {time.time() - t0:.1f} s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "errors": errors, "traffic": traffic, "decode": decode}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

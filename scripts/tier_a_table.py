"""The Tier A closing table: per built-in scheme, measured on synthetic keys.

Columns (per scheme, all key families and query kinds of ``tests/tier_a_oracles.py`` pooled):

- ``cells``: (query head, query) cells observed; ``viol``: cells with true TV > meter
  (must be 0; output-error and per-token logit violations are added in);
- ``cov@tau``: fraction of cells with meter <= tau (certified); ``cov (random q)`` the same over
  the random queries only (the aligned adversary draws large radii on purpose);
- ``med bound/TV``: median of meter / true TV over cells with TV > 0 (looseness);
- ``recall``: fraction of cells with true TV > tau that the meter flags (meter > tau; must be 1.0);
- ``aligned max TV/bound``: over the residual-aligned adversary's cells, the largest
  true TV / meter (close to 1 = the bound is tight there), and ``aligned max |eps|/c`` at the
  target token (Theorem 2 is an equality there up to the fp16 round-up).

Usage: ``python scripts/tier_a_table.py [--tq 500] [--s 256] [--head-dim 128] [--tau 0.2]``.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import witcert  # noqa: E402
from tests.tier_a_oracles import KEY_FAMILIES, QUERY_KINDS, workload  # noqa: E402


def measure(scheme: str, args) -> dict:
    """Observe every (family, kind) workload for ``scheme`` and pool the per-cell results."""
    layout = witcert.BandLayout(args.head_dim, args.bands, args.rope)
    scale = args.head_dim**-0.5
    rows = {"meter": [], "tv": [], "random_meter": [], "aligned_ratio": [], "aligned_eps_ratio": []}
    violations = 0
    for i, family in enumerate(KEY_FAMILIES):
        for j, kind in enumerate(QUERY_KINDS):
            w = workload(scheme, family, kind, layout, args.hkv, args.groups, args.tq, args.s, 1000 * i + j, scale)
            obs = witcert.observe(w.q, w.k, w.v, scheme, layout, sm_scale=scale, k_hat=w.k_hat, v_hat=w.v_hat)
            eps = scale * w.q.double().unflatten(0, (args.hkv, args.groups)) @ (w.k_hat - w.k).double()[:, None].mT
            eps = eps.reshape(obs.c.shape).abs()
            violations += int((obs.true_tv > obs.meter).sum())
            violations += int((obs.true_output_error > obs.output_bound).sum())
            violations += int((eps > obs.c).any(-1).sum())
            rows["meter"].append(obs.meter.flatten())
            rows["tv"].append(obs.true_tv.flatten())
            if kind == "random":
                rows["random_meter"].append(obs.meter.flatten())
            if kind == "aligned":
                rows["aligned_ratio"].append((obs.true_tv / obs.meter).nan_to_num(0.0).flatten())
                c_t = torch.gather(obs.c, -1, w.target[..., None])[..., 0]
                e_t = torch.gather(eps, -1, w.target[..., None])[..., 0]
                rows["aligned_eps_ratio"].append((e_t / c_t).nan_to_num(0.0).flatten())
    meter, tv = torch.cat(rows["meter"]), torch.cat(rows["tv"])
    dangerous = tv > args.tau
    positive = tv > 0
    return {
        "cells": meter.numel(),
        "viol": violations,
        "cov": float((meter <= args.tau).double().mean()),
        "cov_random": float((torch.cat(rows["random_meter"]) <= args.tau).double().mean()),
        "tight": float((meter[positive] / tv[positive]).median()) if positive.any() else float("nan"),
        "recall": float((meter[dangerous] > args.tau).double().mean()) if dangerous.any() else float("nan"),
        "n_danger": int(dangerous.sum()),
        "aligned_tv": float(torch.cat(rows["aligned_ratio"]).max()),
        "aligned_eps": float(torch.cat(rows["aligned_eps_ratio"]).max()),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tq", type=int, default=500, help="queries per head per workload")
    parser.add_argument("--s", type=int, default=256, help="cached tokens")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--bands", type=int, default=16)
    parser.add_argument("--rope", default="rotate_half")
    parser.add_argument("--hkv", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--tau", type=float, default=0.2)
    parser.add_argument("--schemes", nargs="*", default=None)
    args = parser.parse_args(argv)
    names = args.schemes or witcert.list_schemes()
    print(
        f"Tier A on synthetic keys: d={args.head_dim}, B={args.bands} ({args.rope}), Hkv={args.hkv}, G={args.groups}, "
        f"S={args.s}, Tq={args.tq}; families {KEY_FAMILIES} x queries {QUERY_KINDS}; tau={args.tau}\n"
    )
    columns = [
        "scheme", "cells", "viol", f"cov@{args.tau:g}", "cov (random q)", "med bound/TV", f"recall (n TV>{args.tau:g})",
        "aligned max TV/bound", "aligned max abs(eps)/c", "time",
    ]
    widths = [max(len(c), 16 if i == 0 else 6) for i, c in enumerate(columns)]
    print(_row(columns, widths))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for name in names:
        start = time.time()
        r = measure(name, args)
        cells = [
            name, f"{r['cells']}", f"{r['viol']}", f"{r['cov']:.3f}", f"{r['cov_random']:.3f}", f"{r['tight']:.2f}",
            f"{r['recall']:.3f} ({r['n_danger']})", f"{r['aligned_tv']:.3f}", f"{r['aligned_eps']:.6f}",
            f"{time.time() - start:.0f}s",
        ]
        print(_row(cells, widths), flush=True)


def _row(cells: list[str], widths: list[int]) -> str:
    return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"

if __name__ == "__main__":
    main()

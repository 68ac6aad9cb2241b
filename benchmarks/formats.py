"""The KV formats serving engines ship, on SmolLM2: ``python -m benchmarks.formats``.

For each engine format (:mod:`witcert.schemes.engine_formats`) on the embedded SmolLM2-135M-Instruct, with the
exact cache kept so that every cell has its true TV:

- **coverage at tau**: the sampled cells of :mod:`benchmarks.spot_check` (one case per task, text, code and a
  needle, ``--per-call`` cells per attention call), the share whose deterministic meter is at most tau, and the
  share once the spot check (``--spot-keys`` exact keys, ``delta`` per checked cell) bounds the others; the median
  true TV of those cells; violations (true TV above the reported bound);
- **needle accuracy**: the study's needle family (:func:`witcert.observatory.study.run_study`: ``--needle-cases``
  cases at ``--needle-context`` tokens, the answer decoded over the compressed cache) raw and behind the
  certified gate at tau, with exact binomial intervals, against the uncompressed model;
- **bytes per token**: what the engine stores per token and kv head, keys and values, and the monitor's witness,
  against bf16 (``KVFormat.bytes_per_token``, the formula the tests check against the packed bytes).

Writes ``benchmarks/results/formats.json`` with the date, machine and command.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import spot_check
from witcert.observatory.study import run_study
from witcert.observatory.study_config import StudyConfig
from witcert.schemes.engine_formats import FORMATS

SCHEMES = ("int8-per-token-head", "fp8-per-token-head", "int4-per-token-head", "nvfp4", "mxfp4",
           "turboquant-4bit-nc")
OUT = Path(__file__).with_name("results") / "formats.json"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated engine formats")
    p.add_argument("--context", type=int, default=1024, help="context tokens per coverage case")
    p.add_argument("--per-call", type=int, default=3, help="cells sampled per attention call")
    p.add_argument("--delta", type=float, default=1e-6, help="spot-check failure probability per checked cell")
    p.add_argument("--spot-keys", default=spot_check.BUDGETS[2], type=int, help="the spot check's key budget")
    p.add_argument("--tau", type=float, default=0.2)
    p.add_argument("--needle-cases", type=int, default=32)
    p.add_argument("--needle-context", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


def coverage(loaded, scheme: str, args) -> dict:
    """Deterministic and spot-check coverage, median true TV and violations over the sampled cells."""
    rows, randomness = spot_check.scheme_rows(loaded, scheme, args)
    summary = spot_check.summarize(rows, args.tau, args.head_dim)
    spot = summary["by_keys"][str(args.spot_keys)]
    return dict(cells=summary["cells"], coverage_deterministic=summary["coverage_deterministic"],
                coverage_spot=spot["coverage"], median_true_tv=float(np.median([r["true_tv"] for r in rows])),
                median_bound_over_true_tv=spot["median_bound_over_true_tv"],
                violations=summary["violations_deterministic"] + spot["violations"], randomness=randomness)


def needle(loaded, schemes: tuple, args) -> dict:
    """Needle accuracy raw and gated per format, and the uncompressed reference (the study's repair rows)."""
    config = StudyConfig(cases=args.needle_cases, sweep_cases=0, context_tokens=args.needle_context,
                         schemes=schemes, gated_schemes=schemes, risk_schemes=(), sweep_schemes=(),
                         tau_certified=args.tau)
    report = run_study(loaded, config, progress=lambda done, total, name: print(f"  needle {done}/{total} {name}",
                                                                               flush=True))
    keep = ("name", "scheme", "cases", "correct", "accuracy", "low", "high", "cells", "violations",
            "violations_after_repair", "paged_fraction", "mean_meter")
    return dict(rows=[{k: r[k] for k in keep if k in r} for r in report["repair"]], soundness=report["soundness"],
                wall_s=report["wall_s"])


def run(args, argv=None) -> dict:
    from witcert.integrations.hf.default_model import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model()
    config = loaded.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bands = 16 if head_dim // 2 % 16 == 0 else None
    args.head_dim = head_dim
    schemes = tuple(s for s in args.schemes.split(",") if s)
    results = dict(setup=dict(model=loaded.source, head_dim=head_dim, bands=bands, tau=args.tau,
                              coverage=dict(context_tokens=args.context, tasks=list(spot_check.TASKS),
                                            cells_per_call=args.per_call, delta_per_cell=args.delta,
                                            spot_keys=args.spot_keys),
                              needle=dict(cases=args.needle_cases, context_tokens=args.needle_context),
                              threads=args.threads, date=datetime.datetime.now(datetime.timezone.utc).strftime(
                                  "%Y-%m-%d %H:%M UTC"),
                              machine=spot_check.machine(args.threads) + " (shared with other engineers' jobs)",
                              command=" ".join(["python -m benchmarks.formats",
                                                *(sys.argv[1:] if argv is None else argv)])),
                   schemes={})
    for scheme in schemes:
        started = time.perf_counter()
        entry = dict(source=FORMATS[scheme].source, bytes=FORMATS[scheme].bytes_per_token(head_dim, bands),
                     **coverage(loaded, scheme, args))
        entry["coverage_wall_s"] = time.perf_counter() - started
        results["schemes"][scheme] = entry
        print(f"{scheme}: cells {entry['cells']}, coverage {entry['coverage_deterministic']:.3f} / spot "
              f"{entry['coverage_spot']:.3f}, median TV {entry['median_true_tv']:.4f}, violations "
              f"{entry['violations']}, {entry['coverage_wall_s']:.0f} s", flush=True)
    results["needle"] = needle(loaded, schemes, args)
    return results


def main(argv=None) -> int:
    args = parse(argv)
    results = run(args, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

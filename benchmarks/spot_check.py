"""Spot-check coverage on SmolLM2: ``python -m benchmarks.spot_check`` (``make bench``: section spot).

For each scheme, SmolLM2 (the embedded model) runs one observatory workload case per task (text,
code, needle) under ``witcert.monitor`` with the exact cache kept. In every attention call a few
cells are sampled uniformly (``--per-call``); each sampled cell whose deterministic meter exceeds
tau is spot-checked (:func:`witcert.spot.spot_check`, the one-sided default, ``delta`` per cell) at every key budget, with
its true TV beside it. Reported per scheme, task and budget: coverage at tau (reported meter
``min(deterministic, spot) <= tau``) against the deterministic meter's, the median reported meter /
true TV over the cells the deterministic meter leaves above tau, exact keys and bytes read, the
time per check, and violations (cells with true TV above the reported meter); then the cost of one
check against attention at S = 2k and 32k (:mod:`benchmarks.spot_cost`). Writes
``benchmarks/results/spot_check.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import spot_cost
from witcert.integrations.hf.monitoring import Monitor
from witcert.observatory.runner import ObserveConfig, build_cases, run_case
from witcert.spot import spot_check, spot_randomness
from witcert.spot.cells import ExactReaders

SCHEMES = ("rtn-int8", "fp8-e4m3", "rtn-int4", "kivi-2bit", "hf-quanto-int4")
TASKS = ("text", "code", "needle")
BUDGETS = (64, 128, 256, 512)
OUT = Path(__file__).with_name("results") / "spot_check.json"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated scheme names")
    p.add_argument("--context", type=int, default=1024, help="context tokens per case")
    p.add_argument("--per-call", type=int, default=3, help="cells sampled per attention call")
    p.add_argument("--delta", type=float, default=1e-6, help="failure probability per checked cell")
    p.add_argument("--tau", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


class SampledSpotChecks:
    """Stands in for the monitor's spot settings (same ``apply`` hook): records sampled cells, changes nothing."""

    def __init__(self, per_call: int, delta: float, tau: float, task: str = ""):
        self.per_call, self.delta, self.tau, self.task = per_call, delta, tau, task
        self.randomness = spot_randomness()  # the checks' own draws: OS-seeded, recorded
        self.pick = np.random.default_rng(0)  # which cells to sample (benchmark design, not the certificate)
        self.rows: list[dict] = []

    def apply(self, math, query, exact_keys, scale, tau_k, tau_v, radii=None):
        live = (~math.blank).cpu().nonzero().tolist()
        chosen = self.pick.choice(len(live), size=min(self.per_call, len(live)), replace=False)
        readers = ExactReaders(query, exact_keys, scale, math.bias)
        scores = math.scores_hat.detach().cpu()
        radii = (math.c if radii is None else radii).detach().cpu()  # the monitor's choice (Tier A under Tier B's event)
        meter, true_tv = math.cells["meter"].cpu(), math.cells["true_tv"].cpu()
        for b, h, t in (live[i] for i in chosen):
            row = dict(task=self.task, meter=float(meter[b, h, t]), true_tv=float(true_tv[b, h, t]),
                       tokens=int(torch.isfinite(scores[b, h, t]).sum()), spot={})
            if row["meter"] > self.tau:
                for keys in BUDGETS:
                    started = time.perf_counter()
                    result = spot_check(scores[b, h, t], radii[b, h, t], readers.cell(b, h, t), keys=keys,
                                        delta=self.delta, generator=self.randomness.generator)
                    row["spot"][keys] = dict(bound=result.bound, keys_read=result.keys_read,
                                             seconds=time.perf_counter() - started)
            self.rows.append(row)
        return math, {}


def scheme_rows(loaded, scheme: str, args) -> tuple[list[dict], dict]:
    """Sampled cells of ``scheme`` over one case per task, and the checks' randomness record."""
    model, tokenizer = loaded.model, loaded.tokenizer
    monitor = Monitor(model, scheme, tau=args.tau)
    sampler = SampledSpotChecks(args.per_call, args.delta, args.tau)
    monitor.spot = sampler  # the monitor's spot hook, sampled (witcert.spot.cells.SpotSettings.apply)
    with monitor:
        for task in TASKS:
            sampler.task = task
            config = ObserveConfig(schemes=(scheme,), task=task, context_tokens=args.context, cases=1)
            for case in build_cases(tokenizer, config):
                run_case(model, tokenizer, case, config.new_tokens, monitor)
    return sampler.rows, dict(seed=sampler.randomness.seed, from_os=sampler.randomness.from_os)


def summarize(rows: list[dict], tau: float, head_dim: int) -> dict:
    """Coverage, median reported meter / true TV, keys, bytes, time and violations per budget."""
    meter = np.array([r["meter"] for r in rows])
    tv = np.array([r["true_tv"] for r in rows])
    above = meter > tau
    out = dict(cells=len(rows), above_tau=int(above.sum()), coverage_deterministic=float(np.mean(meter <= tau)),
               violations_deterministic=int(np.sum(tv > meter)), by_keys={})
    for keys in BUDGETS:
        bound = np.array([r["spot"][keys]["bound"] if keys in r["spot"] else np.inf for r in rows])
        reported = np.minimum(meter, bound)
        checked = [r["spot"][keys] for r in rows if keys in r["spot"]]
        ratio = reported[above] / np.maximum(tv[above], 1e-300)
        read = np.array([c["keys_read"] for c in checked]) if checked else np.zeros(0)
        out["by_keys"][str(keys)] = dict(
            coverage=float(np.mean(reported <= tau)),
            median_bound_over_true_tv=float(np.median(ratio)) if ratio.size else None,
            violations=int(np.sum(tv > reported)),
            mean_keys_read=float(read.mean()) if read.size else 0.0,
            mean_bytes_read=float(read.mean() * head_dim * 4) if read.size else 0.0,  # fp32 exact keys
            ms_per_check=float(1e3 * np.median([c["seconds"] for c in checked])) if checked else None,
        )
    return out


def machine(threads: int) -> str:
    """Where it ran: CPU model, logical CPUs, torch threads."""
    from benchmarks.machine import _cpu_model

    return f"{_cpu_model()}, {os.cpu_count()} logical CPUs, {threads} torch thread{'s' if threads != 1 else ''}"


def run(schemes=SCHEMES, args=None, argv=None) -> dict:
    from witcert.integrations.hf.default_model import load_model

    args = args or parse([])
    torch.set_num_threads(args.threads)
    loaded = load_model()
    head_dim = loaded.model.config.head_dim if getattr(loaded.model.config, "head_dim", None) else \
        loaded.model.config.hidden_size // loaded.model.config.num_attention_heads
    results = dict(setup=dict(model=loaded.source, context_tokens=args.context, tasks=list(TASKS),
                              cells_per_call=args.per_call, delta_per_cell=args.delta, tau=args.tau,
                              budgets=list(BUDGETS), threads=args.threads,
                              split="one-sided estimator (witcert.spot.spot_check, registry SCO): 3/8 exact, 0.85 of the rest for the upper bound on Z, the rest for the one-sided mean; delta 0.8 / 0.2",
                              date=datetime.date.today().isoformat(), machine=machine(args.threads),
                              command=" ".join(["python -m benchmarks.spot_check", *(sys.argv[1:] if argv is None else argv)])),
                   schemes={})
    for scheme in schemes:
        started = time.perf_counter()
        try:
            rows, randomness = scheme_rows(loaded, scheme, args)
        except ImportError as err:  # hf-quanto-int4 needs the quant extra
            results["schemes"][scheme] = dict(skipped=str(err))
            continue
        entry = dict(all=summarize(rows, args.tau, head_dim), randomness=randomness,
                     by_task={task: summarize([r for r in rows if r["task"] == task], args.tau, head_dim)
                              for task in TASKS},
                     wall_s=time.perf_counter() - started)
        results["schemes"][scheme] = entry
        at256 = entry["all"]["by_keys"]["256"]
        print(f"{scheme}: cells {entry['all']['cells']}, coverage det {entry['all']['coverage_deterministic']:.3f} "
              f"spot@256 {at256['coverage']:.3f}, median ratio {at256['median_bound_over_true_tv']}, "
              f"violations {at256['violations']}, {entry['wall_s']:.0f} s", flush=True)
    results["cost"] = spot_cost.run(keys=256)  # one check against the attention it certifies, S = 2k and 32k
    return results


def main(argv=None) -> int:
    args = parse(argv)
    results = run(tuple(s for s in args.schemes.split(",") if s), args, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

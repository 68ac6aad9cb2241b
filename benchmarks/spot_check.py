"""Spot-check coverage on SmolLM2: ``python -m benchmarks.spot_check`` (``make bench``: section spot).

For each scheme, SmolLM2 (the embedded model) runs one observatory workload case per task (text,
code, needle) under ``witcert.monitor`` with the exact cache kept. In every attention call a few
cells are sampled uniformly (``--per-call``); the sampled cells whose meter exceeds tau are
spot-checked together (:func:`witcert.spot.check_cells`, ``delta`` per cell) under each configuration of
:data:`CONFIGS` (adaptive rounds up to 512 keys with either delta split, fixed budgets, and the stage
shares tried for re-tuning), with their true TV beside them. Reported per scheme, task and configuration:
coverage at tau (reported meter ``min(meter, spot) <= tau``) beside the ceiling (the share of sampled cells
whose true TV is at most tau) and the deterministic meter's coverage, the median reported meter / true TV
over the cells above tau, mean exact keys read per checked cell, the time per checked cell, and violations
(cells with true TV above the reported meter); then the cost of a batched check against attention at
S = 2k and 32k (:mod:`benchmarks.spot_cost`).

Section ``monitor``: the spot check as a user runs it, ``witcert.monitor(model, scheme, certificate="spot",
spot_keys=512, spot_delta=delta)`` with the exact cache kept (true TV of every cell) over the same cases, every
cell of every call: the monitor checks every cell above tau together per layer (key groups sharing a history
read whole where that is the cheaper read, :mod:`witcert.spot.groups`), so the exact keys read per checked cell
are those the product pays. Reported per scheme: coverage beside the ceiling, median reported meter / true TV over
the cells above tau, mean exact keys per checked cell, the share of checked cells whose keys were read whole (no
``delta`` spent), violations.

Writes ``benchmarks/results/spot_check.json``; a section not run (``--sections``) keeps what the file holds, each
section with its own date, machine and command.
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
from witcert.spot import check_cells, spot_randomness
from witcert.spot.cells import SpotSettings

SCHEMES = ("rtn-int8", "fp8-e4m3", "rtn-int4", "kivi-2bit", "hf-quanto-int4")
TASKS = ("text", "code", "needle")
CONFIGS = {  # name -> check_cells keywords (keys, tau: rounds when set, split, growth, stage shares)
    "adaptive 512": dict(keys=512, adaptive=True),
    "adaptive 512 doubling": dict(keys=512, adaptive=True, growth=2),
    "adaptive 512 inverse-square split": dict(keys=512, adaptive=True, split="inverse-square"),
    "adaptive 512 exact 1/4": dict(keys=512, adaptive=True, exact_share=1 / 4),
    "adaptive 512 exact 1/2": dict(keys=512, adaptive=True, exact_share=1 / 2),
    "adaptive 512 Z keys 0.7": dict(keys=512, adaptive=True, z_keys_share=0.7),
    "adaptive 1024": dict(keys=1024, adaptive=True),
    "fixed 256": dict(keys=256, adaptive=False),
    "fixed 512": dict(keys=512, adaptive=False),
}
OUT = Path(__file__).with_name("results") / "spot_check.json"
SECTIONS = ("sampled", "monitor")
WITNESS = ("the monitor's default under certificate=\"spot\": one byte per band (rtn-int4, kivi-2bit, fp8-e4m3), a 4-bit "
           "fraction of the derived witness (rtn-int8)")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated scheme names")
    p.add_argument("--context", type=int, default=2048, help="context tokens per case")
    p.add_argument("--per-call", type=int, default=3, help="cells sampled per attention call")
    p.add_argument("--delta", type=float, default=1e-6, help="failure probability per checked cell")
    p.add_argument("--tau", type=float, default=0.2)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-cost", dest="cost", action="store_false", help="skip the cost section (benchmarks.spot_cost)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated of {SECTIONS}: the sampled configurations, the monitor as a user runs it")
    p.add_argument("--spot-keys", type=int, default=512, help="the monitor section's spot_keys")
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


class SampledSpotChecks:
    """Stands in for the monitor's spot settings (same ``apply`` hook): records sampled cells, changes nothing."""

    def __init__(self, per_call: int, delta: float, tau: float, task: str = "", configs=tuple(CONFIGS)):
        self.per_call, self.delta, self.tau, self.task, self.configs = per_call, delta, tau, task, configs
        self.randomness = spot_randomness()  # the checks' own draws: OS-seeded, recorded
        self.pick = np.random.default_rng(0)  # which cells to sample (benchmark design, not the certificate)
        self.rows: list[dict] = []

    def pending(self, tau_k, tau_v, step):
        """The monitor's per-call hook (:meth:`witcert.spot.cells.SpotSettings.pending`): this sampler itself."""
        return self

    def add(self, math, query, exact_keys, scale, radii, layers):
        return self.apply(math, query, exact_keys, scale, None, None, radii)

    def attach(self, extra, batch):
        pass

    def run(self):
        pass

    def apply(self, math, query, exact_keys, scale, tau_k, tau_v, radii=None, **step):
        live = (~math.blank).cpu().nonzero()
        chosen = torch.as_tensor(self.pick.choice(len(live), size=min(self.per_call, len(live)), replace=False))
        at = live[chosen]
        radii = (math.c if radii is None else radii).detach().cpu()  # the monitor's choice (Tier A under Tier B's event)
        meter, true_tv = math.cells["meter"].cpu(), math.cells["true_tv"].cpu()
        where = tuple(at.T)
        rows = [dict(task=self.task, meter=float(m), true_tv=float(t), tokens=int(n), spot={})
                for m, t, n in zip(meter[where].tolist(), true_tv[where].tolist(),
                                   torch.isfinite(math.scores_hat.cpu()[where]).sum(-1).tolist())]
        above = (meter[where] > self.tau).nonzero().reshape(-1)
        if above.numel():
            for name in self.configs:
                kwargs = dict(CONFIGS[name])
                tau = self.tau if kwargs.pop("adaptive") else None
                scores, source = SpotSettings.cells(math, query, exact_keys, scale, at[above])
                started = time.perf_counter()
                result = check_cells(scores, radii[tuple(at[above].T)], source, delta=self.delta, tau=tau,
                                     generator=self.randomness.generator, **kwargs)
                seconds = (time.perf_counter() - started) / above.numel()
                for i, row in enumerate(above.tolist()):
                    rows[row]["spot"][name] = dict(bound=float(result.bound[i]), keys_read=int(result.keys_read[i]),
                                                   seconds=seconds)
        self.rows.extend(rows)
        return math, {}


def scheme_rows(loaded, scheme: str, args) -> tuple[list[dict], dict]:
    """Sampled cells of ``scheme`` over one case per task, and the checks' randomness record."""
    model, tokenizer = loaded.model, loaded.tokenizer
    # built as a spot-check user builds it (certificate="spot": its default witness, the stored byte for rtn-int4,
    # whose radii the checks sample by), then its spot hook replaced by the sampler
    monitor = Monitor(model, scheme, tau=args.tau, certificate="spot")
    sampler = SampledSpotChecks(args.per_call, args.delta, args.tau, configs=tuple(args.configs.split(",")))
    monitor.spot = sampler  # the monitor's spot hook, sampled (witcert.spot.cells.SpotSettings.apply)
    with monitor:
        for task in TASKS:
            sampler.task = task
            config = ObserveConfig(schemes=(scheme,), task=task, context_tokens=args.context, cases=1)
            for case in build_cases(tokenizer, config):
                run_case(model, tokenizer, case, config.new_tokens, monitor)
    return sampler.rows, dict(seed=sampler.randomness.seed, from_os=sampler.randomness.from_os)


def monitor_tables(loaded, scheme: str, args) -> dict:
    """``task -> CellTable`` of ``scheme`` under the spot-certified monitor (exact cache kept: true TV per cell)."""
    model, tokenizer = loaded.model, loaded.tokenizer
    monitor = Monitor(model, scheme, tau=args.tau, certificate="spot", spot_keys=args.spot_keys, spot_delta=args.delta)
    tables = {}
    with monitor:
        for task in TASKS:
            config = ObserveConfig(schemes=(scheme,), task=task, context_tokens=args.context, cases=1)
            for case in build_cases(tokenizer, config):
                tables[task] = run_case(model, tokenizer, case, config.new_tokens, monitor).cells
    return tables


def summarize_monitor(tables: list, tau: float) -> dict:
    """Coverage beside its ceiling, median reported / true TV above tau, keys per checked cell, whole reads and
    violations over the live cells of ``tables`` (the monitor's cell tables)."""
    column = lambda name: np.concatenate([np.asarray(t[name], dtype=np.float64) for t in tables])  # noqa: E731
    meter, tv, before, spot = column("meter"), column("true_tv"), column("meter_before_spot"), column("spot_bound")
    live = ~np.isnan(meter)
    meter, tv, before, spot = meter[live], tv[live], before[live], spot[live]
    checked = ~np.isnan(spot)
    keys, spent = column("spot_keys")[live][checked], column("spot_delta")[live][checked]
    above = before > tau
    ratio = meter[above] / np.maximum(tv[above], 1e-300)
    return dict(cells=int(live.sum()), above_tau=int(above.sum()), ceiling=float(np.mean(tv <= tau)),
                coverage_deterministic=float(np.mean(before <= tau)), coverage=float(np.mean(meter <= tau)),
                median_bound_over_true_tv=float(np.median(ratio)) if ratio.size else None,
                checked=int(checked.sum()), mean_keys_read=float(keys.mean()) if keys.size else 0.0,
                read_whole=float(np.mean(spent == 0)) if spent.size else 0.0, violations=int(np.sum(tv > meter)))


def monitor_section(loaded, schemes, args, argv) -> dict:
    """The ``monitor`` section: per scheme, every cell of one case per task under the spot-certified monitor."""
    out = dict(**provenance(args, argv), context_tokens=args.context, tasks=list(TASKS), spot_keys=args.spot_keys,
               delta_per_cell=args.delta, tau=args.tau, schemes={})
    for scheme in schemes:
        started = time.perf_counter()
        try:
            tables = monitor_tables(loaded, scheme, args)
        except ImportError as err:  # hf-quanto-int4 needs the quant extra
            out["schemes"][scheme] = dict(skipped=str(err))
            continue
        entry = dict(all=summarize_monitor(list(tables.values()), args.tau),
                     by_task={task: summarize_monitor([table], args.tau) for task, table in tables.items()},
                     wall_s=time.perf_counter() - started)
        out["schemes"][scheme] = entry
        every = entry["all"]
        print(f"{scheme} (monitor): cells {every['cells']}, ceiling {every['ceiling']:.3f}, coverage "
              f"{every['coverage']:.3f} ({every['mean_keys_read']:.0f} keys per checked cell, read whole "
              f"{every['read_whole']:.2f}), median bound / true TV {every['median_bound_over_true_tv']}, violations "
              f"{every['violations']}, {entry['wall_s']:.0f} s", flush=True)
    return out


def summarize(rows: list[dict], tau: float, head_dim: int, configs=tuple(CONFIGS)) -> dict:
    """Coverage beside its ceiling, median reported meter / true TV, keys, bytes, time and violations per configuration."""
    meter = np.array([r["meter"] for r in rows])
    tv = np.array([r["true_tv"] for r in rows])
    above = meter > tau
    out = dict(cells=len(rows), above_tau=int(above.sum()), coverage_deterministic=float(np.mean(meter <= tau)),
               ceiling=float(np.mean(tv <= tau)), violations_deterministic=int(np.sum(tv > meter)), by_config={})
    for name in configs:
        bound = np.array([r["spot"][name]["bound"] if name in r["spot"] else np.inf for r in rows])
        reported = np.minimum(meter, bound)
        checked = [r["spot"][name] for r in rows if name in r["spot"]]
        ratio = reported[above] / np.maximum(tv[above], 1e-300)
        read = np.array([c["keys_read"] for c in checked]) if checked else np.zeros(0)
        out["by_config"][name] = dict(
            coverage=float(np.mean(reported <= tau)),
            median_bound_over_true_tv=float(np.median(ratio)) if ratio.size else None,
            violations=int(np.sum(tv > reported)),
            mean_keys_read=float(read.mean()) if read.size else 0.0,
            mean_bytes_read=float(read.mean() * head_dim * 4) if read.size else 0.0,  # fp32 exact keys
            ms_per_checked_cell=float(1e3 * np.median([c["seconds"] for c in checked])) if checked else None,
        )
    return out


def provenance(args, argv) -> dict:
    """A section's date, machine and command."""
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=machine(args.threads) + " (shared with other engineers' jobs)",
                command=" ".join(["python -m benchmarks.spot_check", *(sys.argv[1:] if argv is None else argv)]))


def machine(threads: int) -> str:
    """Where it ran: CPU model, logical CPUs, torch threads."""
    from benchmarks.machine import _cpu_model

    return f"{_cpu_model()}, {os.cpu_count()} logical CPUs, {threads} torch thread{'s' if threads != 1 else ''}"


def run(schemes=SCHEMES, args=None, argv=None, previous: dict | None = None) -> dict:
    """The sections asked for (``args.sections``); those not asked for are kept from ``previous``."""
    from witcert.integrations.hf.default_model import load_model

    args = args or parse([])
    torch.set_num_threads(args.threads)
    loaded = load_model()
    sections = set(args.sections.split(","))
    unknown = sections - set(SECTIONS)
    if unknown:
        raise ValueError(f"--sections: unknown {sorted(unknown)}, expected some of {SECTIONS}")
    results = dict(previous or {})
    if "monitor" in sections:
        results["monitor"] = monitor_section(loaded, schemes, args, argv)
    if "sampled" in sections:
        results |= sampled_section(loaded, schemes, args, argv)
    return results


def sampled_section(loaded, schemes, args, argv) -> dict:
    """The sampled configurations (``setup``, ``schemes``) and the cost section."""
    head_dim = loaded.model.config.head_dim if getattr(loaded.model.config, "head_dim", None) else \
        loaded.model.config.hidden_size // loaded.model.config.num_attention_heads
    results = dict(setup=dict(model=loaded.source, context_tokens=args.context, tasks=list(TASKS),
                              cells_per_call=args.per_call, delta_per_cell=args.delta, tau=args.tau,
                              configs={name: CONFIGS[name] for name in args.configs.split(",")}, threads=args.threads,
                              witness=WITNESS,
                              estimator="one-sided, batched (witcert.spot.check_cells, registry SCO, SCR): per round 3/8 of its keys exact, 0.85 of the rest for the upper bound on Z, the rest for the one-sided mean, delta 0.8 / 0.2 (unless a configuration sets other shares); adaptive: rounds of 32, 128, 512 keys (growth 4) unless a configuration sets another growth, stopping at a bound <= tau",
                              **provenance(args, argv)),
                   schemes={})
    for scheme in schemes:
        started = time.perf_counter()
        try:
            rows, randomness = scheme_rows(loaded, scheme, args)
        except ImportError as err:  # hf-quanto-int4 needs the quant extra
            results["schemes"][scheme] = dict(skipped=str(err))
            continue
        configs = tuple(args.configs.split(","))
        entry = dict(all=summarize(rows, args.tau, head_dim, configs), randomness=randomness,
                     by_task={task: summarize([r for r in rows if r["task"] == task], args.tau, head_dim, configs)
                              for task in TASKS},
                     wall_s=time.perf_counter() - started)
        results["schemes"][scheme] = entry
        line = ", ".join(f"{name} {v['coverage']:.3f} ({v['mean_keys_read']:.0f} keys)"
                         for name, v in entry["all"]["by_config"].items())
        print(f"{scheme}: cells {entry['all']['cells']}, ceiling {entry['all']['ceiling']:.3f}, coverage det "
              f"{entry['all']['coverage_deterministic']:.3f}; {line}; violations "
              f"{max(v['violations'] for v in entry['all']['by_config'].values())}, {entry['wall_s']:.0f} s", flush=True)
    if args.cost:
        results["cost"] = spot_cost.run()  # a batched check against the attention it certifies, S = 2k and 32k
    return results


def main(argv=None) -> int:
    args = parse(argv)
    previous = json.loads(args.out.read_text(encoding="utf-8")) if args.out.exists() else None
    results = run(tuple(s for s in args.schemes.split(",") if s), args, argv, previous)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The request audit on SmolLM2 (issue 43): ``python -m benchmarks.audit`` writes ``benchmarks/results/audit.json``.

Three sections, each recorded with its date, machine and command:

* ``cost``: tokens/s of ``generate`` (prefill included, 16 new tokens, greedy, batch 1) at each context,
  interleaved round by round, the median of ``--reps``, in wall time and in the process's CPU time (one torch
  thread: the work done, which other jobs on a shared machine stretch far less than the wall time): stock; the
  production monitor (``keep_exact=False``, rtn-int4, ``WITCERT_COMPILE=1``) metering every cell; the same with
  ``audit=witcert.Audit(rate=0.02)`` (the exact audit: each picked cell's true TV from its exact keys in the host
  backing store, nothing metered, no witness kept); with ``keys=512`` (bounded reads: the picked cells metered, each
  above tau spot-checked with at most 512 exact keys); the exact audit at rate 1e-9 (*audit, none picked*: the
  production monitor with its host store of exact keys, nothing metered: the floor any audit rate pays); and, where
  the ``quanto`` extra is installed, transformers' own int4 cache unmonitored (``QuantizedCache``, quanto, 4 bits,
  128 recent tokens kept exact), for scale;
* ``usefulness``: per workload case (needle, text, code; fp8-e4m3 and rtn-int4 under the exact audit, and with
  bounded reads of ``--keys`` exact keys), the request metered on every cell
  with the exact cache kept gives its true fraction of cells above tau; audited runs of the same request at rate
  0.05 (``--seeds`` audit seeds) give ``fraction_upper``; recorded: the median of ``fraction_upper`` minus the true
  fraction, and the requests where the true count exceeded ``M_upper`` (the statement's failures); each
  configuration's entry carries its own date, so a run of some ``--keys`` keeps the others' entries;
* ``collapse``: requests (text and code windows) with one layer's keys destroyed
  (:func:`benchmarks.audit_requests.collapse_layer`, rtn-int4 elsewhere), audited at rate 0.02: the share of
  requests with at least one flagged cell, and the true TV of the collapsed layer's picked cells.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import witcert
from benchmarks import machine
from benchmarks.audit_requests import collapse_layer
from benchmarks.generation import timed_generate
from benchmarks.timing import compiled_available
from witcert.audit.settings import DEFAULT_KEYS
from witcert.observatory.runner import ObserveConfig, build_cases, run_case

OUT = Path(__file__).with_name("results") / "audit.json"
COST_SCHEME, COST_RATE = "rtn-int4", 0.02
USEFUL_SCHEMES = {"fp8-e4m3": (None, DEFAULT_KEYS), "rtn-int4": (None, 256, DEFAULT_KEYS)}  # most keys (None: exact)
USEFUL_TASKS, USEFUL_RATE = ("needle", "text", "code"), 0.05
COLLAPSED_LAYER = 14
TAU = 0.2
FIXED_COST_RATE = 1e-9  # picks no cell of a 16-token request (expected 4e-6 picks): the audit's cost without checks
FIXED_COST = "audit, none picked"
HF_QUANTIZED = "transformers int4 cache"  # transformers' QuantizedCache (quanto, 4 bits), unmonitored: for scale


def _timed(model, ids, new_tokens: int, config: dict) -> tuple[float, float]:
    """``(wall, CPU)`` seconds of one :func:`benchmarks.generation.timed_generate` (or of transformers' own quantized
    cache): the process's CPU time (one torch thread) is the work done, which a machine shared with other jobs
    stretches far less than the wall time."""
    started = time.process_time()
    if config.get("hf_quantized"):
        wall = _quantized_generate(model, ids, new_tokens)
    else:
        wall = timed_generate(model, ids, new_tokens, **config)
    return wall, time.process_time() - started


def _quantized_generate(model, ids, new_tokens: int) -> float:
    """Seconds of one greedy ``generate`` with transformers' own int4 cache (optimum-quanto, its default of 128 recent
    tokens kept exact), nothing monitored: what a compressed cache costs here without WitCert, for scale."""
    started = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, cache_implementation="quantized",
                   cache_config={"backend": "quanto", "nbits": 4})
    return time.perf_counter() - started


def _ratios(samples: dict, new_tokens: int) -> tuple[dict, dict, dict]:
    """``(median seconds, tokens/s, tokens/s against stock)`` of each configuration's samples."""
    seconds = {name: statistics.median(v) for name, v in samples.items()}
    rate = {name: new_tokens / s for name, s in seconds.items()}
    return seconds, rate, {name: rate[name] / rate["stock"] for name in samples if name != "stock"}


def cost(model, context: int, reps: int, new_tokens: int = 16) -> dict:
    """Median seconds and tokens/s against stock of each configuration at ``context`` tokens, in wall time and in
    the process's CPU time."""
    ids = torch.randint(100, 20000, (1, context), generator=torch.Generator().manual_seed(0))
    compiled = compiled_available()
    configs = {"stock": dict(keep_exact=None, compiled=False),
               "every cell": dict(keep_exact=False, compiled=compiled, scheme=COST_SCHEME),
               f"audit {COST_RATE:g}": dict(keep_exact=False, compiled=compiled, scheme=COST_SCHEME,
                                            audit=witcert.Audit(rate=COST_RATE)),
               f"audit {COST_RATE:g}, {DEFAULT_KEYS} keys": dict(
                   keep_exact=False, compiled=compiled, scheme=COST_SCHEME,
                   audit=witcert.Audit(rate=COST_RATE, keys=DEFAULT_KEYS)),
               FIXED_COST: dict(keep_exact=False, compiled=compiled, scheme=COST_SCHEME,
                                audit=witcert.Audit(rate=FIXED_COST_RATE))}
    if importlib.util.find_spec("optimum") and importlib.util.find_spec("optimum.quanto"):  # the extra, for scale
        configs[HF_QUANTIZED] = dict(hf_quantized=True)
    for config in configs.values():  # warm-up at the timed token count: the audit's checks (picked at this length)
        _timed(model, ids, new_tokens, config)  # and their compiles run here, never in a timed rep
    wall, cpu = {name: [] for name in configs}, {name: [] for name in configs}
    for _ in range(reps):
        for name, config in configs.items():
            seconds, used = _timed(model, ids, new_tokens, config)
            wall[name].append(seconds)
            cpu[name].append(used)
    seconds, rate, ratio = _ratios(wall, new_tokens)
    cpu_seconds, cpu_rate, cpu_ratio = _ratios(cpu, new_tokens)
    out = {"context": context, "new_tokens": new_tokens, "reps": reps, "compiled": compiled, "median_s": seconds,
           "samples_s": wall, "tokens_per_s": rate, "ratio_to_stock": ratio, "median_cpu_s": cpu_seconds,
           "samples_cpu_s": cpu, "cpu_tokens_per_s": cpu_rate, "cpu_ratio_to_stock": cpu_ratio}
    print(f"  cost at {context}: " + ", ".join(f"{k} {v:.3f}x (CPU time {cpu_ratio[k]:.3f}x)" for k, v in ratio.items()),
          flush=True)
    return out


def _request(loaded, scheme: str, case, audit=None, collapsed: int | None = None, new_tokens: int = 6):
    """The cell table and audits of one workload case as one request (keep_exact=True: true TV per metered cell)."""
    mon = witcert.monitor(loaded.model, scheme, audit=audit)
    if collapsed is not None:
        collapse_layer(mon, collapsed)
    with mon:
        run_case(loaded.model, loaded.tokenizer, case, new_tokens, mon)
    return mon.table(), (mon.audit() if audit is not None else ())


def usefulness(loaded, cases_per_task: int, seeds: int, context: int, budgets: tuple, stamp: dict) -> dict:
    """fraction_upper against the true fraction above tau, per scheme and task, for the key ``budgets`` (``None``:
    the exact audit; see the module docstring); each entry stamped with ``stamp`` and its date."""
    out, truths = {}, {}
    configs = [(scheme, keys) for scheme, allowed in USEFUL_SCHEMES.items() for keys in allowed if keys in budgets]
    for scheme, keys in configs:
        for task in USEFUL_TASKS:
            config = ObserveConfig(schemes=(scheme,), task=task, context_tokens=context, cases=cases_per_task)
            rows = []
            for index, case in enumerate(build_cases(loaded.tokenizer, config)):
                if (scheme, task, index) not in truths:  # one every-cell run per request, whatever the key budget
                    table, _ = _request(loaded, scheme, case)
                    truths[scheme, task, index] = int(np.sum(table["true_tv"] > TAU)), len(table)
                above, n = truths[scheme, task, index]
                for seed in range(seeds):
                    audit = witcert.Audit(rate=USEFUL_RATE, tau=TAU, keys=keys, seed=1000 * index + seed)
                    _, (result,) = _request(loaded, scheme, case, audit)
                    assert result.N == n, (result.N, n)  # the same cells as the every-cell run
                    rows.append({"case": index, "seed": audit.seed, "N": n, "true_fraction": above / n,
                                 "fraction_upper": result.fraction_upper, "picked": result.picked,
                                 "flagged": result.flagged, "estimate": result.estimate,
                                 "failed": above > result.M_upper})
            gaps = [r["fraction_upper"] - r["true_fraction"] for r in rows]
            name = f"{scheme}, {'exact' if keys is None else f'{keys} keys'}, {task}"
            date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            out[name] = {"scheme": scheme, "keys": keys, "task": task, "date": date, **stamp,
                         "median_gap": statistics.median(gaps),
                                        "median_true_fraction": statistics.median(r["true_fraction"] for r in rows),
                                        "median_fraction_upper": statistics.median(r["fraction_upper"] for r in rows),
                                        "failures": sum(r["failed"] for r in rows), "requests": len(rows),
                                        "rows": rows}
            print(f"  usefulness {name}: median gap {out[name]['median_gap']:.3f}", flush=True)
    return out


def collapse(loaded, requests: int, context: int, probe: int) -> dict:
    """The share of requests with one collapsed layer that the audit flags at rate 0.02."""
    cases = []
    for task in ("text", "code"):
        config = ObserveConfig(schemes=(COST_SCHEME,), task=task, context_tokens=context, probe_tokens=probe,
                               cases=requests // 2)
        cases += build_cases(loaded.tokenizer, config)
    flagged, picked_tv, n = [], [], 0
    for case in cases:
        table, (result,) = _request(loaded, COST_SCHEME, case, witcert.Audit(rate=COST_RATE, tau=TAU),
                                    collapsed=COLLAPSED_LAYER)
        flagged.append(result.flagged > 0)
        here = table["audited"] & (table["layer"] == COLLAPSED_LAYER)
        picked_tv += table["true_tv"][here].tolist()
        n = result.N
    out = {"requests": len(cases), "flagged_requests": int(sum(flagged)), "share_flagged": float(np.mean(flagged)),
           "cells_per_request": n, "collapsed_layer": COLLAPSED_LAYER, "context": context, "probe_tokens": probe,
           "picked_cells_of_collapsed_layer": len(picked_tv),
           "their_share_above_tau": float(np.mean(np.asarray(picked_tv) > TAU)) if picked_tv else float("nan")}
    print(f"  collapse: {out['flagged_requests']} of {out['requests']} requests flagged", flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default="cost,usefulness,collapse")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cases", type=int, default=6, help="usefulness: cases per task")
    p.add_argument("--seeds", type=int, default=3, help="usefulness: audits per case")
    p.add_argument("--keys", nargs="+", default=["exact", str(DEFAULT_KEYS), "256"],
                   help="usefulness: the key budgets measured ('exact': keys=None, the default audit)")
    p.add_argument("--requests", type=int, default=200, help="collapse: requests")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from witcert.integrations.hf.default_model import load_model

    loaded = load_model()
    info = machine.describe(args.threads)
    record = json.loads(args.out.read_text()) if args.out.exists() else {}
    command = "python -m benchmarks.audit " + " ".join(sys.argv[1:] if argv is None else argv)
    stamp = {"machine": f"{info['cpu']} ({info['logical_cpus']} logical CPUs, shared with other engineers' jobs), "
                        f"{args.threads} torch thread(s)", "command": command, "commit": info.get("commit")}
    for section in args.sections.split(","):
        started = time.perf_counter()
        if section == "cost":
            body = {"runs": [cost(loaded.model, context, args.reps) for context in args.contexts],
                    "scheme": COST_SCHEME, "rate": COST_RATE, "keys": None, "bounded_keys": DEFAULT_KEYS}
        elif section == "usefulness":
            budgets = tuple(None if k == "exact" else int(k) for k in args.keys)
            before = record.get("usefulness", {})  # the other budgets' entries, each with its date
            since = {k: before[k] for k in ("date", "machine", "command", "commit") if k in before}
            kept = {name: since | row for name, row in before.get("by", {}).items() if row["keys"] not in budgets}
            body = {"rate": USEFUL_RATE, "tau": TAU, "context": 512, "cases_per_task": args.cases,
                    "seeds": args.seeds, "default_keys": None,
                    "by": kept | usefulness(loaded, args.cases, args.seeds, 512, budgets, stamp)}
        elif section == "collapse":
            body = collapse(loaded, args.requests, 256, 32) | {"bound": "exact"}
        else:
            raise ValueError(f"--sections: unknown section {section!r} (cost, usefulness, collapse)")
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        record[section] = {"date": date, **stamp, "wall_s": time.perf_counter() - started, **body}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()

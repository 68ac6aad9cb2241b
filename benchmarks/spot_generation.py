"""Generation with the spot check in production: ``python -m benchmarks.spot_generation``.

SmolLM2 ``generate`` (greedy, batch 1, a prompt of ``context`` fixed random ids, ``new_tokens`` new tokens)
stock against ``witcert.monitor(model, "rtn-int4", keep_exact=False, ...)``:

* ``meter``: the deterministic meter alone;
* ``spot``: ``certificate="spot"`` (every cell above tau 0.2 checked, up to ``spot_keys`` exact keys read in
  rounds from the verified host backing store; without a gate checked together at the request's flush);
* ``spot gate``: the same with ``gate=witcert.Gate(tau=0.2)``: the production spot-certified gate (in-step
  checks, repairs from the backing store);
* ``meter gate``: ``gate=witcert.Gate(tau=0.2)`` without the spot check, for reference: the deterministic gate,
  which on these 4-bit keys pages most of each cell's tokens from the backing store;
* with ``--witness-bits N``, both spot lines again with ``witness_bits=N`` (the monitor's default for rtn-int4
  derives its witness from the codec, whose radii the spot check samples by);

each eager and, when ``torch.compile`` works, with ``WITCERT_COMPILE=1`` (compiled before timing). Runs are
interleaved round by round; the figure is the median wall time of ``generate`` (prefill included, as a user
feels it) and the median of the process's CPU time (one torch thread: the work done, which other jobs on a shared
machine stretch far less than the wall time), with the cells checked, their mean exact keys and the share
certified. One torch thread.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import witcert
from benchmarks import spot_records
from benchmarks.timing import compile_choice, compiled_available

SCHEME = "rtn-int4"
TAU = 0.2
OUT = Path(__file__).with_name("results") / "spot_generation.json"


def configs(compiled: bool, spot_keys: int, gate: bool = True, witness_bits: int | None = None) -> dict:
    """name -> (monitor keywords or None for stock, compiled); ``gate``: with the production gates (spot-certified,
    and the deterministic one for reference);
    ``witness_bits``: the spot lines again with that witness code beside the monitor's default."""
    base = {"stock": (None, False), "meter": (dict(), False),
            "spot": (dict(certificate="spot", spot_keys=spot_keys), False)}
    if gate:
        base["spot gate"] = (dict(certificate="spot", spot_keys=spot_keys, gate=witcert.Gate(tau=TAU)), False)
        base["meter gate"] = (dict(gate=witcert.Gate(tau=TAU)), False)
    if witness_bits is not None:
        base |= {f"{name}, witness_bits={witness_bits}": (kwargs | dict(witness_bits=witness_bits), False)
                 for name, (kwargs, _) in list(base.items()) if name.startswith("spot")}
    if compiled:
        base |= {f"{name}, compiled": (kwargs, True) for name, (kwargs, _) in base.items() if kwargs is not None}
    return base


def timed_generate(model, ids, new_tokens: int, kwargs: dict | None, compiled: bool) -> tuple[float, dict]:
    """Seconds of one greedy ``generate`` of exactly ``new_tokens``, and what the spot check did."""
    args = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False)
    with compile_choice(compiled):
        started = time.perf_counter()
        if kwargs is None:
            model.generate(**args)
            return time.perf_counter() - started, {}
        with witcert.monitor(model, SCHEME, keep_exact=False, tau=TAU, **kwargs) as mon:
            model.generate(**args)
        seconds = time.perf_counter() - started
    table = mon.table()
    live = ~np.isnan(table["meter"])
    info = {"cells": int(live.sum()), "certified": float(np.mean(table["meter"][live] <= TAU))}
    if "spot_bound" in table.columns:
        checked = ~np.isnan(table["spot_bound"])
        info |= {"checked": int(checked.sum()), "mean_keys": float(table["spot_keys"][checked].mean()),
                 "spot_bytes": float(np.nansum(table["spot_bytes"]))}
    if "paged_fraction" in table.columns:
        info |= {"paged_fraction": float(np.mean(table["paged_fraction"][live])),
                 "bytes_paged": float(np.nansum(table["bytes_paged"]))}
    if "spot_gate_bytes" in table.columns:
        info["spot_gate_bytes"] = float(np.nansum(table["spot_gate_bytes"]))
    return seconds, info


def run(context: int, new_tokens: int, reps: int, compiled: bool, spot_keys: int, gate: bool = True,
        witness_bits: int | None = None) -> dict:
    from witcert.integrations.hf.default_model import load_model

    model = load_model().model
    ids = torch.randint(100, 20000, (1, context), generator=torch.Generator().manual_seed(0))
    chosen = configs(compiled and compiled_available(), spot_keys, gate, witness_bits)
    for kwargs, comp in chosen.values():  # warm-up: first-call costs (and compilation) out of the timing
        timed_generate(model, ids, 2, kwargs, comp)
    samples, cpu, infos = {name: [] for name in chosen}, {name: [] for name in chosen}, {}
    for _ in range(reps):
        for name, (kwargs, comp) in chosen.items():
            started = time.process_time()
            seconds, infos[name] = timed_generate(model, ids, new_tokens, kwargs, comp)
            cpu[name].append(time.process_time() - started)
            samples[name].append(seconds)
    seconds = {name: statistics.median(v) for name, v in samples.items()}
    cpu_seconds = {name: statistics.median(v) for name, v in cpu.items()}
    rate = {name: new_tokens / s for name, s in seconds.items()}
    out = {"context": context, "new_tokens": new_tokens, "reps": reps, "median_s": seconds, "tokens_per_s": rate,
           "ratio_to_stock": {name: rate[name] / rate["stock"] for name in chosen if name != "stock"},
           "median_cpu_s": cpu_seconds,
           "cpu_ratio_to_stock": {name: cpu_seconds["stock"] / cpu_seconds[name] for name in chosen if name != "stock"},
           "checks": infos}
    print(f"  {context}: " + ", ".join(f"{k} {v:.2f}x (CPU time {out['cpu_ratio_to_stock'][k]:.2f}x)"
                                       for k, v in out["ratio_to_stock"].items()), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--spot-keys", type=int, default=256)
    p.add_argument("--no-compile", dest="compiled", action="store_false")
    p.add_argument("--gate-up-to", type=int, default=1 << 30,
                   help="time the gates only at contexts up to this (they are the slowest configurations)")
    p.add_argument("--witness-bits", type=int, default=None,
                   help="also time the spot lines with this witness code (beside the monitor's default)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    record = spot_records.provenance("benchmarks.spot_generation", argv) | {
        "scheme": SCHEME, "tau": TAU, "spot_keys": args.spot_keys, "witness_bits": args.witness_bits, "runs": []}
    for context in args.contexts:  # written after each context: a long run keeps what it measured
        record["runs"].append(run(context, args.new_tokens, args.reps, args.compiled, args.spot_keys,
                                  gate=context <= args.gate_up_to, witness_bits=args.witness_bits))
        spot_records.write(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

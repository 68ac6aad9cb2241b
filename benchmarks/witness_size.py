"""What a smaller witness costs in tightness on SmolLM2: ``python -m benchmarks.witness_size``.

For each scheme (rtn-int8, rtn-int4, fp8-e4m3) and witness option (16, 8 or 4 bands; each band norm in
fp16 or in one e5m3 byte, :mod:`witcert.tier_a.witness_code`; or none stored, ``--bits 0``: the witness derived
from the codec's elementwise error bound, :mod:`witcert.tier_a.derived_witness`), SmolLM2 reads one held-out-style case per
task (text, code, needle: the observatory's workloads at ``--context`` tokens) under ``witcert.monitor``
with the exact cache kept: the context is prefilled once, exactly, outside the monitor, and each option's
monitor adopts a copy of that cache (compressed once, as a monitored prefill writes it), then meters every
cell of the teacher-forced probe chunk (the text's continuation, the needle's question). Reported per option:
coverage at tau (meter <= tau), the ceiling (true TV <= tau), the median and 90th percentile of meter /
true TV over cells with a true TV above 1e-9, violations (true TV above the meter), and the witness bytes per
token and kv head (with the value statistics). Writes ``benchmarks/results/witness_size.json``.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.record import write_json

SCHEMES = ("rtn-int8", "rtn-int4", "fp8-e4m3")  # and kivi-2bit with --schemes
BANDS = (16, 8, 4)
BITS = (16, 8)
TASKS = ("text", "code", "needle")
OUT = Path(__file__).with_name("results") / "witness_size.json"
RATIO_FLOOR = 1e-9  # looseness over cells whose true TV is above this (a ratio to 0 says nothing)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--context", type=int, default=1024, help="context tokens per case")
    p.add_argument("--tau", type=float, default=0.2)
    p.add_argument("--bands", default=",".join(map(str, BANDS)), help="band counts, comma-separated")
    p.add_argument("--bits", default=",".join(map(str, BITS)), help="witness bits, comma-separated (0: derived)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


def prefilled_cases(loaded, context: int) -> list[tuple]:
    """``(task, exact prefilled cache, probe ids)`` per task: one observatory case each."""
    from transformers import DynamicCache

    from witcert.observatory.runner import ObserveConfig, build_cases

    model, tokenizer = loaded.model, loaded.tokenizer
    out = []
    for task in TASKS:
        case = build_cases(tokenizer, ObserveConfig(schemes=("none",), task=task, context_tokens=context, cases=1))[0]
        probe = case.question if hasattr(case, "question") else case.continuation
        ctx_ids = tokenizer(case.context, return_tensors="pt").input_ids
        probe_ids = tokenizer(probe, return_tensors="pt", add_special_tokens=False).input_ids
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ctx_ids, past_key_values=cache, use_cache=True)
        out.append((task, cache, probe_ids))
    return out


def option_cells(model, cases, scheme: str, bands: int, bits: int, tau: float) -> dict:
    """Meter and true TV of every probe cell of every case under one witness option."""
    import witcert

    meter, tv = [], []
    with torch.no_grad(), witcert.monitor(model, scheme, bands=bands, witness_bits=bits, tau=tau) as mon:
        for _, cache, probe_ids in cases:
            with mon.non_adaptive():
                model(probe_ids, past_key_values=copy.deepcopy(cache), use_cache=True)
        table = mon.table()
        meter.append(table["meter"])
        tv.append(table["true_tv"])
    return dict(meter=np.concatenate(meter), true_tv=np.concatenate(tv))


def summarize(cells: dict, tau: float, bands: int, bits: int) -> dict:
    from witcert.tier_a.witness_code import WitnessCode

    meter, tv = cells["meter"], cells["true_tv"]
    live = ~np.isnan(meter)
    meter, tv = meter[live], tv[live]
    moved = tv > RATIO_FLOOR
    ratio = meter[moved] / tv[moved]
    return dict(bands=bands, bits=bits, witness_bytes=WitnessCode(bits).bytes_per_token(bands), cells=int(live.sum()),
                coverage=float(np.mean(meter <= tau)), ceiling=float(np.mean(tv <= tau)),
                median_meter_over_true_tv=float(np.median(ratio)) if ratio.size else None,
                p90_meter_over_true_tv=float(np.quantile(ratio, 0.9)) if ratio.size else None,
                violations=int(np.sum(tv > meter)))


def run(args) -> dict:
    from benchmarks.spot_check import machine
    from witcert.integrations.hf.default_model import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model()
    started = time.perf_counter()
    cases = prefilled_cases(loaded, args.context)
    results = dict(setup=dict(model=loaded.source, context_tokens=args.context, tasks=list(TASKS), tau=args.tau,
                              cells="every probe cell (the text continuation, the needle question), exact cache kept",
                              date=datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
                              machine=machine(args.threads) + " (shared with other jobs)",
                              command=" ".join(["python -m benchmarks.witness_size", *sys.argv[1:]])),
                   schemes={})
    for scheme in args.schemes.split(","):
        rows = []
        for bands in map(int, args.bands.split(",")):
            for bits in map(int, args.bits.split(",")):
                row = summarize(option_cells(loaded.model, cases, scheme, bands, bits, args.tau), args.tau, bands, bits)
                rows.append(row)
                print(f"{scheme} bands {bands:>2} bits {bits:>2}: coverage {row['coverage']:.3f} (ceiling "
                      f"{row['ceiling']:.3f}), median meter/TV {row['median_meter_over_true_tv']:.2f}, "
                      f"violations {row['violations']}, {row['cells']} cells", flush=True)
        results["schemes"][scheme] = rows
    results["setup"]["wall_s"] = round(time.perf_counter() - started, 1)
    return results


def main(argv=None) -> int:
    args = parse(argv)
    write_json(args.out, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

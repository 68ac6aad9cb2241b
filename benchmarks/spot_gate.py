"""The production spot-certified gate on the needle task: ``python -m benchmarks.spot_gate``.

SmolLM2 answers ``--cases`` needle-retrieval prompts of ``--context`` tokens (the observatory's needle
workload, :mod:`witcert.observatory.workloads`; greedy, 6 new tokens) uncompressed, and for each scheme under
``witcert.monitor(model, scheme, keep_exact=False, certificate="spot", gate=witcert.Gate(tau))``: the production
gate that decides on ``min(meter, spot bound)`` and pages from the verified host backing store
(:mod:`witcert.spot.gate`), and, for reference, the same cache without a gate. Reported per configuration:
exact-match accuracy with its exact binomial interval (Clopper-Pearson, 95%), the share of the tokens paged
(mean over cells of the fraction of visible tokens paged in), bytes paged and bytes read by the checks, the
cells the gate fired on, and the share of cells certified after repair (``meter_after <= tau``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

import witcert
from benchmarks import spot_records
from witcert.observatory import stats
from witcert.observatory.runner import ObserveConfig, build_cases, run_case

SCHEMES = ("kivi-2bit", "rtn-int4")
OUT = Path(__file__).with_name("results") / "spot_gate.json"


def accuracy(outcomes: list[bool]) -> dict:
    correct, n = int(sum(outcomes)), len(outcomes)
    low, high = stats.accuracy_interval(correct, n)
    return {"cases": n, "correct": correct, "accuracy": correct / n, "low": low, "high": high}


def run_configuration(model, tokenizer, cases, new_tokens: int, scheme: str | None, gate, spot_keys: int,
                      tau: float, witness_bits: int | None = None, progress=None) -> dict:
    """The configuration's row over ``cases``; ``progress(row)`` (optional) receives the row so far after each
    case, so a run stopped early keeps the cases it finished."""
    outcomes, paged, fired, certified, bytes_paged, check_bytes = [], [], [], [], 0.0, 0.0
    started = time.perf_counter()

    def row() -> dict:
        out = accuracy(outcomes) | {"wall_s": time.perf_counter() - started}
        if scheme is not None:
            out |= {"certified": float(np.mean(np.concatenate(certified))),
                    "check_bytes_per_case": check_bytes / len(outcomes)}
        if gate is not None:
            out |= {"paged_fraction": float(np.mean(np.concatenate(paged))),
                    "fired": float(np.mean(np.concatenate(fired))), "bytes_paged_per_case": bytes_paged / len(outcomes)}
        return out

    for case in cases:
        if scheme is None:
            out = run_case(model, tokenizer, case, new_tokens)
            outcomes.append(case.score(out.answer))
            continue
        mon = witcert.monitor(model, scheme, keep_exact=False, certificate="spot", spot_keys=spot_keys, tau=tau,
                              gate=gate, witness_bits=witness_bits)
        with mon:
            out = run_case(model, tokenizer, case, new_tokens, mon)
        outcomes.append(case.score(out.answer))
        print(f"  case {len(outcomes)}/{len(cases)}: {time.perf_counter() - started:.0f} s", flush=True)
        table = out.cells
        live = ~np.isnan(table["meter"])
        if gate is not None:
            paged.append(table["paged_fraction"][live])
            fired.append(table["repaired"][live])
            certified.append(table["meter_after"][live] <= gate.tau)
            bytes_paged += float(np.nansum(table["bytes_paged"]))
            check_bytes += float(np.nansum(table["spot_gate_bytes"]))
        else:
            certified.append(table["meter"][live] <= tau)
        check_bytes += float(np.nansum(table["spot_bytes"]))
        if progress is not None:
            progress(row())
    return row()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--cases", type=int, default=64)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--spot-keys", type=int, default=128)
    p.add_argument("--tau", type=float, default=0.2)
    p.add_argument("--witness-bits", type=int, default=None,
                   help="the monitor's witness_bits (default: the monitor's default for each scheme)")
    p.add_argument("--gate-only", action="store_true", help="skip the spot check without a gate (halves the time)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    from witcert.integrations.hf.default_model import load_model

    torch.set_num_threads(1)
    loaded = load_model()
    model, tokenizer = loaded.model, loaded.tokenizer
    config = ObserveConfig(schemes=SCHEMES, task="needle", context_tokens=args.context, cases=args.cases)
    cases = build_cases(tokenizer, config)
    record = spot_records.provenance("benchmarks.spot_gate", argv) | {
              "model": loaded.source, "cases": len(cases), "context_tokens": args.context, "tau": args.tau,
              "spot_keys": args.spot_keys, "witness_bits": args.witness_bits, "configurations": {}}
    with torch.no_grad():
        record["configurations"]["uncompressed"] = run_configuration(model, tokenizer, cases, config.new_tokens,
                                                                     None, None, args.spot_keys, args.tau)
        print("uncompressed", record["configurations"]["uncompressed"], flush=True)
        for scheme in (s for s in args.schemes.split(",") if s):
            configurations = [(f"{scheme}, production spot gate", witcert.Gate(tau=args.tau))]
            if not args.gate_only:
                configurations.append((f"{scheme}, spot check, no gate", None))
            for name, gate in configurations:
                def progress(partial, name=name):  # the cases finished so far, marked partial until the end
                    record["configurations"][name] = partial | {"partial": True}
                    spot_records.write(record, args.out)

                row = run_configuration(model, tokenizer, cases, config.new_tokens, scheme, gate, args.spot_keys,
                                        args.tau, args.witness_bits, progress)
                record["configurations"][name] = row
                print(name, row, flush=True)
                spot_records.write(record, args.out)  # after each configuration: a long run keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())

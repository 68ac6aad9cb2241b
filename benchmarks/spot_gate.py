"""The production spot-certified gate on the needle task: ``python -m benchmarks.spot_gate``.

SmolLM2 answers ``--cases`` needle-retrieval prompts of ``--context`` tokens (the observatory's needle
workload, :mod:`witcert.observatory.workloads`; greedy, 6 new tokens) uncompressed, and for each scheme under
``witcert.monitor(model, scheme, keep_exact=False, certificate="spot", gate=witcert.Gate(tau))``: the production
gate that decides on ``min(meter, spot bound)`` and pages from the verified host backing store
(:mod:`witcert.spot.gate`), and, for reference, the same cache without a gate. Reported per configuration:
exact-match accuracy with its exact binomial interval (Clopper-Pearson, 95%), the share of the tokens paged
(mean over cells of the fraction of visible tokens paged in), bytes paged and bytes read by the checks, the
cells the gate fired on, and the share of cells certified after repair (``meter_after <= tau``). The
configurations run interleaved, case by case, and the record is written after every case (each row marked
``partial`` until the last case), so a run stopped early holds the same cases for every configuration.
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


class Tally:
    """One configuration's outcomes over the cases run so far (``scheme`` ``None``: uncompressed)."""

    def __init__(self, scheme: str | None, gate, tau: float):
        self.scheme, self.gate, self.tau = scheme, gate, tau
        self.outcomes, self.paged, self.fired, self.certified = [], [], [], []
        self.bytes_paged = self.check_bytes = self.seconds = 0.0

    def run(self, model, tokenizer, case, new_tokens: int, spot_keys: int, witness_bits: int | None) -> None:
        """Run ``case`` under this configuration and keep its outcome, pages and traffic."""
        started = time.perf_counter()
        if self.scheme is None:
            out = run_case(model, tokenizer, case, new_tokens)
        else:
            mon = witcert.monitor(model, self.scheme, keep_exact=False, certificate="spot", spot_keys=spot_keys,
                                  tau=self.tau, gate=self.gate, witness_bits=witness_bits)
            with mon:
                out = run_case(model, tokenizer, case, new_tokens, mon)
        self.seconds += time.perf_counter() - started
        self.outcomes.append(case.score(out.answer))
        if self.scheme is None:
            return
        table = out.cells
        live = ~np.isnan(table["meter"])
        if self.gate is not None:
            self.paged.append(table["paged_fraction"][live])
            self.fired.append(table["repaired"][live])
            self.certified.append(table["meter_after"][live] <= self.gate.tau)
            self.bytes_paged += float(np.nansum(table["bytes_paged"]))
            self.check_bytes += float(np.nansum(table["spot_gate_bytes"]))
        else:
            self.certified.append(table["meter"][live] <= self.tau)
        self.check_bytes += float(np.nansum(table["spot_bytes"]))

    def row(self) -> dict:
        n = len(self.outcomes)
        out = accuracy(self.outcomes) | {"wall_s": self.seconds}
        if self.scheme is not None:
            out |= {"certified": float(np.mean(np.concatenate(self.certified))),
                    "check_bytes_per_case": self.check_bytes / n}
        if self.gate is not None:
            out |= {"paged_fraction": float(np.mean(np.concatenate(self.paged))),
                    "fired": float(np.mean(np.concatenate(self.fired))), "bytes_paged_per_case": self.bytes_paged / n}
        return out


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
              "model": loaded.source, "cases": 0, "cases_planned": len(cases), "context_tokens": args.context,
              "tau": args.tau,
              "spot_keys": args.spot_keys, "witness_bits": args.witness_bits, "configurations": {}}
    tallies = {"uncompressed": Tally(None, None, args.tau)}
    for scheme in (s for s in args.schemes.split(",") if s):
        tallies[f"{scheme}, production spot gate"] = Tally(scheme, witcert.Gate(tau=args.tau), args.tau)
        if not args.gate_only:
            tallies[f"{scheme}, spot check, no gate"] = Tally(scheme, None, args.tau)
    started = time.perf_counter()
    with torch.no_grad():
        for done, case in enumerate(cases, start=1):  # configurations interleaved case by case: a run stopped
            for name, tally in tallies.items():          # early holds the same cases for every configuration
                tally.run(model, tokenizer, case, config.new_tokens, args.spot_keys, args.witness_bits)
                record["configurations"][name] = tally.row() | ({"partial": True} if done < len(cases) else {})
            record["cases"] = done  # the cases every configuration has run (``cases_planned`` asked for)
            print(f"case {done}/{len(cases)}: {time.perf_counter() - started:.0f} s", flush=True)
            spot_records.write(record, args.out)
    for name, row in record["configurations"].items():
        print(name, row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

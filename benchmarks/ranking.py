"""Which statistic ranks layers and heads like their true TV: ``python -m benchmarks.ranking`` (``make bench``).

For each scheme, SmolLM2 (the embedded model) runs a few observatory workload cases under
``witcert.monitor`` (the default fused meter, the exact cache kept so that every cell has its
true TV). Cells are grouped per layer and per (layer, head); each group is scored by every
statistic of :data:`witcert.integrations.hf.ranking.STATISTICS` (mean / max meter, fraction
saturated, mean raw and log risk score, ..., and the spot bound with ``--certificate spot``)
and by its mean true TV. Per statistic: the Spearman correlation of the two rankings and the
overlap of their top-6 groups (of 6). The statistic with the highest mean Spearman over schemes
and levels is the one the summary and the report rank by (``ranking.RANK_BY``; the run says
whether it still is). Writes ``benchmarks/results/ranking.json``.
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
from scipy.stats import spearmanr

from witcert.integrations.hf import ranking
from witcert.integrations.hf.monitoring import Monitor
from witcert.integrations.hf.telemetry import concat
from witcert.observatory.runner import ObserveConfig, build_cases, run_case

SCHEMES = ("rtn-int4", "kvquant-4bit", "kivi-2bit", "fp8-e4m3")  # kvquant-4bit: the per-channel int4 key scheme
TASKS = ("text", "code", "needle")
LEVELS = {"layer": ("layer",), "head": ("layer", "head")}
TOP = 6
OUT = Path(__file__).with_name("results") / "ranking.json"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated scheme names")
    p.add_argument("--cases", type=int, default=2, help="cases per task (text, code, needle)")
    p.add_argument("--context", type=int, default=512, help="context tokens per case")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--certificate", choices=("deterministic", "spot"), default="deterministic",
                   help="spot: the monitor spot-checks cells above tau, and their spot bound joins the candidates")
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


def scheme_cells(loaded, scheme: str, cases_per_task: int, context: int, certificate: str = "deterministic"):
    """Every cell of ``scheme`` over the workload cases (one request per case), as one cell table."""
    model, tokenizer = loaded.model, loaded.tokenizer
    monitor = Monitor(model, scheme, tau=0.2, certificate=certificate)
    with monitor:
        for task in TASKS:
            config = ObserveConfig(schemes=(scheme,), task=task, context_tokens=context, cases=cases_per_task)
            for case in build_cases(tokenizer, config):
                run_case(model, tokenizer, case, config.new_tokens, monitor)
    return monitor.table()


def top_overlap(score: np.ndarray, truth: np.ndarray, top: int = TOP) -> int:
    """How many of the ``top`` groups by ``score`` are among the ``top`` groups by ``truth``."""
    return len(set(np.argsort(-score)[:top]) & set(np.argsort(-truth)[:top]))


def compare(table, by: tuple[str, ...]) -> dict:
    """Spearman and top-6 overlap against the mean true TV, per statistic, over the groups ``by``."""
    table = table.where(~np.isnan(table["meter"]) & ~np.isnan(table["true_tv"]))
    groups, members = ranking.groups(table, by)
    truth = np.array([m["true_tv"].mean() for m in members])
    result = {"groups": len(groups), "truth_top": [list(map(int, groups[i])) for i in np.argsort(-truth)[:TOP]]}
    for name in ranking.available(table):
        score = np.array([ranking.STATISTICS[name](m) for m in members], dtype=np.float64)
        if np.ptp(score) == 0:  # the same value for every group: no ranking at all
            result[name] = {"spearman": float("nan"), f"top{TOP}": None, "top": []}
            continue
        result[name] = {"spearman": float(spearmanr(score, truth).statistic), f"top{TOP}": top_overlap(score, truth),
                        "top": [list(map(int, groups[i])) for i in np.argsort(-score)[:TOP]]}
    return result


def best_statistic(per_scheme: dict) -> tuple[str, dict]:
    """The statistic with the highest mean Spearman over schemes and levels, and every statistic's mean."""
    names = {n for s in per_scheme.values() for lvl in s["levels"].values() for n in lvl if isinstance(lvl[n], dict)}
    means = {}
    for name in sorted(names):
        rhos = [lvl[name]["spearman"] for s in per_scheme.values() for lvl in s["levels"].values() if name in lvl]
        means[name] = float(np.nanmean(rhos)) if not all(np.isnan(rhos)) else float("nan")
    best = max((n for n in means if not np.isnan(means[n])), key=means.get)
    return best, means


def run(schemes=SCHEMES, cases_per_task: int = 2, context: int = 512, certificate: str = "deterministic") -> dict:
    """Measure every scheme; the dict written to ``ranking.json``."""
    from witcert.integrations.hf.default_model import load_model

    loaded = load_model()
    per_scheme = {}
    for scheme in schemes:
        started = time.perf_counter()
        table = scheme_cells(loaded, scheme, cases_per_task, context, certificate)
        per_scheme[scheme] = {"cells": len(table), "seconds": time.perf_counter() - started,
                              "levels": {level: compare(table, by) for level, by in LEVELS.items()}}
        print(f"  {scheme}: {len(table)} cells, {per_scheme[scheme]['seconds']:.0f} s", flush=True)
    best, means = best_statistic(per_scheme)
    return {"setup": {"model": loaded.source, "tasks": list(TASKS), "cases_per_task": cases_per_task,
                      "context_tokens": context, "meter": "fused",
                      "certificate": certificate, "truth": "mean true TV per group", "top": TOP},
            "schemes": per_scheme, "mean_spearman": means, "best": best, "rank_by": ranking.RANK_BY}


def markdown(result: dict) -> str:
    """The results page table: per scheme and level, Spearman / top-6 overlap of the meter, the raw risk and the choice."""
    shown = list(dict.fromkeys(["mean meter", "max meter", "fraction saturated", "mean raw risk", ranking.RANK_BY,
                                *(["mean spot bound"] if "mean spot bound" in result["mean_spearman"] else [])]))
    header = "| scheme | level | " + " | ".join(shown) + " |\n|---|---|" + "---|" * len(shown)
    lines = [header]
    for scheme, s in result["schemes"].items():
        for level, lvl in s["levels"].items():
            cells = [_entry(lvl[n]) for n in shown]
            lines.append(f"| {scheme} | {level} ({lvl['groups']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _entry(measured: dict) -> str:
    """``Spearman / top-6 overlap``, or ``constant`` for a statistic equal on every group."""
    if measured[f"top{TOP}"] is None:
        return "constant"
    return f"{measured['spearman']:.2f} / {measured[f'top{TOP}']}"


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = run(tuple(s.strip() for s in args.schemes.split(",") if s.strip()), args.cases, args.context,
                 args.certificate)
    result["command"] = "python -m benchmarks.ranking " + " ".join(sys.argv[1:] if argv is None else argv)
    result["seconds"] = time.perf_counter() - started
    result["finished"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    print(f"best: {result['best']} (ranking.RANK_BY = {result['rank_by']}); wrote {args.out} "
          f"in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()

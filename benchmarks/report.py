"""Write ``results.md`` (tables) and a few small PNGs from the results dictionary."""
import math
from pathlib import Path

from benchmarks.targets import evaluate


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        return f"{x:.3g}" if abs(x) < 1e-3 or abs(x) >= 1e4 else f"{x:.3f}"
    return str(x)


def _table(rows: list[dict], columns: list[str], headers: list[str] | None = None) -> str:
    headers = headers or columns
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _cost_md(results: dict) -> str:
    rows = []
    for r in results["cost"]:
        a = r["ratio_to_attention"]
        rows.append({"shape": r["shape"], "S": r["S"], "attention ms": 1e3 * r["median_s"]["attention"],
                     "Tier A": a["tier_a"], "Tier B": a["tier_b"], "checks": a["part: input checks"],
                     "logit_bound": a["part: logit_bound (Tier A c)"],
                     "tier_b c": a["part: tier_b_logit_bound (Tier B c)"], "moments": a["part: bounds.moments"],
                     "meter(scores,c)": a["part: meter(scores, c)"],
                     "lean floor (exp shared)": a["lean fp32 floor, exp shared (estimate)"],
                     "lean floor (exp recomputed)": a["lean fp32 floor, exp recomputed (estimate)"]})
    text = _table(rows, list(rows[0]))
    if results.get("cost_profile"):
        prof = [dict(r, share=f"{100 * r['share']:.1f}%") for r in results["cost_profile"]]
        first = results["cost_profile"][0]
        text += (f"\nWhere the time goes (torch.profiler, self CPU time, {first['shape']}, S = {first['S']}, "
                 "one call of each path):\n\n")
        text += _table(prof, ["path", "op", "calls", "self_ms", "share"])
    return text


def _fastpath_md(results: dict) -> str:
    fast = results["fastpath"]
    rows = [{"shape": r["shape"], "S": r["S"], "attention ms": 1e3 * r["median_s"]["attention"], **r["ratio_to_attention"]}
            for r in fast["rows"]]
    text = (f"First compile of the fused pass, the Tier B kernel and the Tier A pass: {_fmt(fast['first_compile_s'])} s "
            "(fresh process).\n\n" + _table(rows, list(rows[0])))
    cold = [{"shape": r["shape"], "S": r["S"], **r["cold_ratio_to_attention"]} for r in fast["rows"]
            if "cold_ratio_to_attention" in r]
    if cold:
        text += ("\n\nCold (compiled; one call right after the attention step, whose keys and values evicted the "
                 "meter's inputs from the caches, as in a decode step):\n\n" + _table(cold, list(cold[0])))
    return text


def _generation_md(results: dict) -> str:
    parts = []
    generation = results["generation"]
    for g in generation.get("runs", [generation]):  # a record of runs (one run: results written before 2026-12-06)
        rows = [{"config": name, "median s": g["median_s"][name], "tokens/s": g["tokens_per_s"][name],
                 "x stock": g["ratio_to_stock"].get(name, 1.0)} for name in g["median_s"]]
        parts.append(f"SmolLM2-135M, {g['context']}-token prompt, {g['new_tokens']} new tokens (prefill included), "
                     f"rtn-int8, {g['threads']} torch threads, median of {g['reps']} interleaved runs.\n\n"
                     + _table(rows, list(rows[0])))
    return "\n\n".join(parts)


def _proposals_md(results: dict) -> str:
    rows = []
    for r in results["proposals"]:
        row = {"shape": r["shape"], "S": r["S"], **r["ratio_to_attention"]}
        row["max rel diff vs library (c_A, c_B, meter 3, meter 4)"] = ", ".join(f"{v:.1e}" for v in r["max_rel_diff"].values())
        rows.append(row)
    return _table(rows, list(rows[0]))


def _quality_md(results: dict) -> str:
    main = ["domain", "config", "cells", "coverage_K", "joint_coverage", "competitor_coverage",
            "coverage_over_competitor", "page_in_reduction", "violations", "median_meter", "median_true_tv"]
    text = _table(results["quality"], main, ["domain", "config", "cells", "cov K", "joint cov", "competitor cov",
                                             "ours / competitor", "page-in reduction", "viol", "med meter",
                                             "med true TV"])
    tier_a = [r for r in results["quality"] if not r["config"].startswith("dithered")]
    text += "\nEach bound alone (Tier A schemes, same per-token c; coverage at tau = 0.2):\n\n"
    text += _table(tier_a, ["domain", "config", "coverage_K", "cov eform", "cov two_sided", "cov maxnorm",
                            "cov retention", "cov meter on competitor Delta", "P1 tighter (share of cells)",
                            "P1 coverage gain"],
                   ["domain", "config", "meter", "e-form T1", "two-sided P1", "tanh(D/2)", "retention",
                    "our meter on competitor's Delta", "P1 tighter (cells)", "P1 coverage gain"])
    dith = [r for r in results["quality"] if r["config"].startswith("dithered")]
    if dith:
        text += "\nDithered INT8 (Tier B, non-adaptive queries): per-token bound choices and delta_req:\n\n"
        cols = ["domain", "config", "cov meter[min] d=0.0001", "cov meter[min] d=0.01", "cov meter[min] d=0.05",
                "cov meter[u] d=0.01", "cov meter[delta]", "cov meter[A]", "cov meter[min&A] d=0.01",
                "joint d=0.0001", "joint d=0.01", "joint d=0.05", "cov [min] eform", "cov [min] two_sided",
                "cov [min] maxnorm", "P1 coverage gain"]
        text += _table(dith, cols, ["domain", "config", "min d=1e-4", "min d=1e-2", "min d=5e-2", "u only",
                                    "Delta only", "Tier A witness", "min & witness", "joint 1e-4", "joint 1e-2",
                                    "joint 5e-2", "e-form", "two-sided", "tanh(D/2)", "P1 gain"])
    return text


def _looseness_md(results: dict) -> str:
    rows = []
    for r in results["looseness"]:
        s, p = r["shape_meter_over_sup"], r["per_token_sup_over_tv"]
        rows.append({"config": r["config"], "cells": r["cells"], "saturated": r["saturated"],
                     "sup > meter (must be 0)": r["sup_above_meter"], "shape n": s["n"],
                     "meter/sup median": s["median"], "p90": s["p90"], "p99": s["p99"], "max": s["max"],
                     "sup/TV median": p["median"], "sup/TV p90": p["p90"], "sup/TV max": p["max"],
                     "e-form/sup median": r.get("median_eform_over_sup"),
                     "tanh(D/2)/sup median": r.get("median_maxnorm_over_sup"),
                     "tanh(D/2) binding": r.get("share_maxnorm_binding"),
                     "cells meter/sup > 10": r.get("tail_cells"),
                     "their median 1 - p_max": r.get("tail_median_one_minus_pmax"),
                     "others' median 1 - p_max": r.get("body_median_one_minus_pmax")})
    return _table(rows, list(rows[0]))


def markdown(results: dict) -> str:
    args = results["args"]
    parts = [
        "# WitCert benchmarks", "",
        f"`{results['command']}` on {results['machine']['cpu']} ({results['machine']['torch_threads']} torch "
        f"threads; GPU: {results['machine']['gpu']}), commit {results['machine']['commit']}, "
        f"{results['finished']}. Machine: [machine.md](machine.md); raw numbers: [results.json](results.json).", "",
        "## Targets", "",
        _table(evaluate(results), ["target", "measured", "met", "note"]),
    ]
    if results.get("cost"):
        parts += ["## 1. Meter cost / decode attention (torch fp32, CPU, batch 1, one decode step)", "",
                  f"Median of {args['reps']} interleaved repetitions after a warm-up; every entry is a ratio to "
                  "the attention time of the same run. `lean floor` is a benchmark-local fp32 estimate of the "
                  "compute floor (no rounding enclosure, no input checks), not the library.", "",
                  _cost_md(results), "![cost](cost.png)", ""]
    if results.get("fastpath"):
        parts += ["### 1c. The fused meter pass (witcert.fastpath), eager and compiled, as ratios to attention", "",
                  "`library meter`: `witcert.meter` (eager reference); `fused`: one fp32 pass with an a-priori "
                  "rounding budget (T1, P1, MN, CS, MS on four sets of its own); `+ Tier A/B c`: the per-token bound "
                  "included (eager: the fp64 library bounds; compiled: `tier_a_cells` and `tier_b_cells`, the fp32 "
                  "band dot of `witcert.fastpath.radius` inside the compiled pass, or the fp32 group dots of "
                  "`witcert.fastpath.tier_b_radius` in a compiled graph of their own before the pass).", "",
                  _fastpath_md(results), ""]
    if results.get("generation"):
        parts += ["### 1d. Generation overhead", "", _generation_md(results), ""]
    if results.get("proposals"):
        parts += ["### Proposed optimisations, measured (benchmarks/proposals.py; the library is unchanged)", "",
                  _proposals_md(results), ""]
    kernel = results.get("kernel")
    if kernel:
        parts += ["## 1b. Triton decode kernel, certificate on vs off", "",
                  "```", kernel.get("stdout", kernel.get("note", "")), "```", ""]
    if results.get("memory"):
        parts += ["## 2. Memory (allocated tensors)", "",
                  _table(results["memory"], ["head_dim", "config", "bytes_per_token_per_head", "capacity_vs_fp16",
                                             "paper_capacity"]), ""]
    if results.get("quality"):
        q = results["quality_setup"]
        parts += ["## 3. Certificate quality on SmolLM2 (teacher forcing)", "",
                  f"{q['model']}; {q['tokens']} prompt tokens per domain, last {q['queries']} positions as queries, "
                  f"layers {q['layers']}; cells = (layer, query head, query). tau_K = 0.2, tau_V = 0.05, "
                  "delta_req = 1e-2 unless noted; Tier B numbers hold for non-adaptive queries only. "
                  "Competitor: Runtime-Certified tanh(max_t Delta_t) (see benchmarks/quality.py for Delta on "
                  "black-box schemes, favourable to the competitor). Page-in reduction = relative drop of the "
                  "fraction of cells above tau.", "",
                  _quality_md(results), "![coverage](coverage.png)", ""]
    if results.get("looseness"):
        parts += ["## 4. Looseness split (sampled real-model cells)", "",
                  'shape = meter / sup-box TV (adversary of docs/design.md "How loose, and where"; unsaturated cells); per-token = '
                  "sup-box TV / true TV.", "", _looseness_md(results), ""]
    if results.get("throughput"):
        t = results["throughput"]
        parts += ["## 5. Regression throughput", "",
                  f"`witcert fuzz`: {t['trials']} adversarial per-query trials in {t['seconds']:.1f} s = "
                  f"**{t['trials_per_second']:.0f} trials/s** ({t['sound_violations']} violations of the sound "
                  f"bounds; the known-false dispersion form violated {t['dispersion_violations']} times; "
                  f"{t['golden_rechecks']} 50-digit re-checks).", ""]
    return "\n".join(parts)


def plots(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if results.get("cost"):
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=80)
        for shape in dict.fromkeys(r["shape"] for r in results["cost"]):
            rs = [r for r in results["cost"] if r["shape"] == shape]
            xs = [r["S"] for r in rs]
            for key, style in (("tier_a", "-o"), ("tier_b", "--s"), ("lean fp32 floor, exp shared (estimate)", ":^")):
                ax.plot(xs, [r["ratio_to_attention"][key] for r in rs], style,
                        label=f"{shape.split(' (')[0]}: {key.split(',')[0]}")
        ax.axhline(0.30, color="k", lw=0.8, label="target 0.30x")
        ax.set(xscale="log", yscale="log", xlabel="cached tokens S", ylabel="meter time / attention time")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "cost.png")
        plt.close(fig)
        written.append("cost.png")
    if results.get("quality"):
        rows = results["quality"]
        domains = list(dict.fromkeys(r["domain"] for r in rows))
        configs = list(dict.fromkeys(r["config"] for r in rows))
        fig, axes = plt.subplots(1, len(domains), figsize=(3.2 * len(domains), 3.4), dpi=80, sharey=True)
        for ax, domain in zip(axes if len(domains) > 1 else [axes], domains):
            rs = {r["config"]: r for r in rows if r["domain"] == domain}
            xs = range(len(configs))
            ax.bar([x - 0.2 for x in xs], [rs[c]["coverage_K"] for c in configs], 0.4, label="WitCert meter")
            ax.bar([x + 0.2 for x in xs], [rs[c]["competitor_coverage"] for c in configs], 0.4, label="competitor")
            ax.set_xticks(list(xs), [c.replace("dithered-int8 ", "dith ") for c in configs], rotation=70, fontsize=6)
            ax.set_title(domain, fontsize=8)
        (axes[0] if len(domains) > 1 else axes).set_ylabel("coverage (meter <= 0.2)")
        (axes[0] if len(domains) > 1 else axes).legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "coverage.png")
        plt.close(fig)
        written.append("coverage.png")
    return written

"""Generate the documentation's results page (and the README's results table) from ``benchmarks/results/``.

Every measurement the project publishes is a record under ``benchmarks/results/`` (JSON written by the
command that measured it, or a Markdown record with its date, machine and command); this script renders
them into ``docs/results.md``, one section per record, each headed by when, where and how it was
measured. The README's small table between the ``results-table`` markers is rendered from the same
spot-check record. Generated, never edited by hand: ``tests/test_docs_site.py`` checks both are in step.

Usage::

    python scripts/gen_results_page.py --write   # regenerate docs/results.md and the README table
    python scripts/gen_results_page.py --check   # exit status 1 when a committed page differs
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
README_MARKERS = ("<!-- results-table:begin (scripts/gen_results_page.py) -->", "<!-- results-table:end -->")
SPOT_KEYS = "256"  # the spot check's default budget (witcert.monitor's spot_keys)


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _committed_date(path: Path) -> str:
    """The date a record was last committed (for records that carry none of their own)."""
    done = subprocess.run(["git", "log", "-1", "--format=%cs", "--", str(path)], cwd=ROOT,
                          capture_output=True, text=True)
    return done.stdout.strip() or "not committed"


def _provenance(date: str, machine: str, command: str) -> str:
    return f"*Measured {date} on {machine}. Command: `{command}`.*"


def _fraction(x: float) -> str:
    return f"{x:.3f}"


# -- the README's table ---------------------------------------------------------------------------

def results_table() -> str:
    """Per scheme: the deterministic meter's coverage, the spot check's, and the violations (spot-check record)."""
    spot = _load("spot_check.json")
    setup = spot["setup"]
    lines = [f"| scheme | cells | certified at tau = {setup['tau']}: meter | with the spot check ({SPOT_KEYS} keys) "
             "| true TV above the reported bound |", "|---|---|---|---|---|"]
    for scheme, s in spot["schemes"].items():
        every = s["all"]
        spot_row = every["by_keys"][SPOT_KEYS]
        violations = every["violations_deterministic"] + spot_row["violations"]
        lines.append(f"| {scheme} | {every['cells']} | {_fraction(every['coverage_deterministic'])} "
                     f"| {_fraction(spot_row['coverage'])} | {violations} |")
    where = (f"SmolLM2-135M-Instruct, {setup['context_tokens']}-token contexts of text, code and a needle task, "
             f"spot-check failure probability {setup['delta_per_cell']:g} per cell; measured {setup['date']} "
             f"(`python -m benchmarks.spot_check`).")
    return "\n".join(lines) + "\n\n" + where


# -- the page's sections --------------------------------------------------------------------------

def fuzz_section() -> str:
    fuzz = _load("fuzz-500k.json")
    date = fuzz.get("date", _committed_date(RESULTS / "fuzz-500k.json"))
    lines = ["## The fuzz", "",
             _provenance(date, fuzz.get("machine", "a 2-core x86-64 VM (AVX2), 1 torch thread"),
                         fuzz.get("command", "witcert fuzz --trials 500000 --seed 28 --json benchmarks/results/fuzz-500k.json")),
             "", f"{fuzz['trials']:,} trials in {fuzz['seconds']:.0f} s for the bound table; every bound per query "
             "against the sup-box adversary (exhaustive for S <= 12), near-misses re-decided at 50 digits "
             f"({fuzz['golden_rechecks']:,} re-checks); NaN or out-of-range outputs: {fuzz['nonfinite_outputs']}. "
             "The dispersion form is known to be false and is a control: the adversary must break it.", "",
             "| bound | cells | true TV above the bound | worst TV / bound | median TV / bound |", "|---|---|---|---|---|"]
    for name, b in fuzz["bounds"].items():
        lines.append(f"| {name} | {b['cells']:,} | {b['violations']:,} | {b['worst_tv_over_bound']:.4g} "
                     f"| {b['median_tv_over_bound']:.3f} |")
    lines += ["", "Attack classes (public entry points, each cell against an exact oracle; *refused*: inputs outside "
              "the contract, rejected with a clear error):", "",
              "| class | cells | violations | refused | worst exact / bound | seconds |", "|---|---|---|---|---|---|"]
    for name, a in fuzz["attacks"].items():
        lines.append(f"| {name} | {a['cells']:,} | {a['violations']} | {a['rejected']} "
                     f"| {a['worst_exact_over_bound']:.4g} | {a['seconds']:.0f} |")
    return "\n".join(lines)


def ranking_section() -> str:
    sys.path.insert(0, str(ROOT))
    from benchmarks.ranking import markdown

    ranking = _load("ranking.json")
    setup = ranking["setup"]
    lines = ["## Which layers are risky", "",
             _provenance(ranking.get("finished", _committed_date(RESULTS / "ranking.json")),
                         "a 2-core AMD EPYC VM (AVX2, loaded), 1 torch thread", ranking["command"]), "",
             f"SmolLM2 runs {setup['cases_per_task']} cases each of {', '.join(setup['tasks'])} "
             f"({setup['context_tokens']}-token context, the {setup['meter']} meter, the exact cache kept); layers and "
             "heads are ranked by each statistic and by their mean true TV. Each entry: the Spearman correlation of "
             f"the two rankings / how many of the top {setup['top']} by the statistic are in the top {setup['top']} "
             "by true TV (*constant*: the statistic is equal on every group).", "", markdown(ranking), "",
             "Mean Spearman over the rows: " + ", ".join(
                 f"{name} {value:.2f}" for name, value in sorted(ranking["mean_spearman"].items(), key=lambda kv: -kv[1])),
             "", f"The summary and the observatory's report rank by **{ranking['rank_by']}**."]
    return "\n".join(lines)


def spot_section() -> str:
    spot = _load("spot_check.json")
    setup = spot["setup"]
    budgets = [str(b) for b in setup["budgets"]]
    lines = ["## The spot check", "",
             _provenance(setup["date"], setup.get("machine", "a 2-core AMD EPYC VM (AVX2, loaded), "
                                                  f"{setup['threads']} torch thread"),
                         setup.get("command", "python -m benchmarks.spot_check")), "",
             f"{setup['model']}: one {setup['context_tokens']}-token case per task ({', '.join(setup['tasks'])}), "
             f"{setup['cells_per_call']} cells sampled per attention call, tau = {setup['tau']}, failure probability "
             f"{setup['delta_per_cell']:g} per checked cell, every cell against its true TV. Key budget split: "
             f"{setup['split']}.", "",
             "| scheme | cells | meter coverage | " + " | ".join(f"spot: {b} keys" for b in budgets)
             + f" | median reported / true TV ({SPOT_KEYS}) | ms per check ({SPOT_KEYS}) | violations |",
             "|---|---|---|" + "---|" * len(budgets) + "---|---|---|"]
    for scheme, s in spot["schemes"].items():
        every = s["all"]
        by_keys = every["by_keys"]
        violations = every["violations_deterministic"] + sum(by_keys[b]["violations"] for b in budgets)
        lines.append(f"| {scheme} | {every['cells']} | {_fraction(every['coverage_deterministic'])} | "
                     + " | ".join(_fraction(by_keys[b]["coverage"]) for b in budgets)
                     + f" | {by_keys[SPOT_KEYS]['median_bound_over_true_tv']:.2f} "
                       f"| {by_keys[SPOT_KEYS]['ms_per_check']:.1f} | {violations} |")
    lines += ["", f"Coverage per task at {SPOT_KEYS} keys:", "", "| scheme | " + " | ".join(setup["tasks"]) + " |",
              "|---|" + "---|" * len(setup["tasks"])]
    for scheme, s in spot["schemes"].items():
        lines.append(f"| {scheme} | " + " | ".join(
            _fraction(s["by_task"][t]["by_keys"][SPOT_KEYS]["coverage"]) for t in setup["tasks"]) + " |")
    return "\n".join(lines + spot_cost_lines(spot.get("cost")))


def spot_cost_lines(cost: list | None) -> list[str]:
    """One check against the attention it certifies (``benchmarks.spot_cost``, recorded with the coverage)."""
    if not cost:
        return []
    lines = ["", f"Cost of one check ({cost[0]['keys']} keys, one torch thread, the same run; "
             "`benchmarks/spot_cost.py`): against one cell's attention (one query head, fp32) and one decode step's "
             "attention of a whole SmolLM2 layer (9 query heads over 3 kv heads).", "",
             "| context | spot check | attention, one cell | attention, one layer step | check / cell | "
             "check / layer step |", "|---|---|---|---|---|---|"]
    for row in cost:
        ms = row["ms"]
        lines.append(f"| {row['context']:,} | {ms['spot check']:.2f} ms | {ms['attention, one cell']:.3f} ms | "
                     f"{ms['attention, one layer step']:.2f} ms | {row['spot_over_cell']:.1f}x | "
                     f"{row['spot_over_layer_step']:.2f}x |")
    return lines


def spot_gate_section() -> str | None:
    """The study's spot-certified gate rows (``witcert study --spot-gate-scheme``), if recorded."""
    from witcert.observatory.study_report import repair_table

    path = RESULTS / "study-spot-gate" / "report.json"
    if not path.exists():
        return None
    report = json.loads(path.read_text(encoding="utf-8"))
    config, sound = report["config"], report["soundness"]
    rows, tau = {row["name"]: row for row in report["repair"]}, config["tau_certified"]
    lines = ["## The spot-certified gate", "",
             _provenance(report["date"], "a 2-core AMD EPYC VM, 1 torch thread", report["command"]), "",
             f"The study's needle family ({config['cases']} cases, {config['context_tokens']}-token context): each "
             f"scheme raw, behind the certified gate and behind the spot-certified gate ({config['spot_keys']} exact "
             f"keys per check, tau = {tau:g}). {sound['cells']:,} metered cells, {sound['violations']} with true TV "
             f"above the meter, {sound['violations_after_repair']} above their meter after repair.", ""]
    for scheme in config["spot_gated_schemes"]:
        det, spot = rows[f"{scheme} gated tau={tau:g}"], rows[f"{scheme} spot-gated tau={tau:g}"]
        lines.append(f"- {scheme}: the spot-certified gate pages {spot['paged_fraction']:.3f} of the tokens against "
                     f"{det['paged_fraction']:.3f} ({spot['paged_fraction'] / det['paged_fraction']:.2f}x), accuracy "
                     f"{spot['accuracy']:.3f} [{spot['low']:.3f}, {spot['high']:.3f}] against {det['accuracy']:.3f} "
                     f"[{det['low']:.3f}, {det['high']:.3f}]; its checks read {spot['spot_keys_per_cell']:.0f} exact "
                     "keys per cell (keys only, read to decide, not written into the cache).")
    table = repair_table(report)
    table[0] = "#" + table[0]  # a subsection of this one
    return "\n".join([*lines, "", *table])


def study_section() -> str:
    from witcert.observatory.study_report import repair_table

    path = ROOT / "docs" / "study" / "report.json"
    study = json.loads(path.read_text(encoding="utf-8"))
    sound = study["soundness"]
    lines = ["## The study", "",
             _provenance(_committed_date(path), "a 2-core x86-64 VM (AVX2, loaded), 1 torch thread",
                         "make study"), "",
             f"{study['config']['cases']} needle cases per configuration ({study['config']['context_tokens']}-token "
             f"context); {sound['cells']:,} metered cells, {sound['violations']} with true TV above the meter. "
             "The layer sweep, the plots and the protocol are in [the study's report](study/report.md).", "",
             *repair_table(study)]
    return "\n".join(lines)


def generation_section() -> str | None:
    """Monitored ``generate`` against stock, per context length (``generation.json``, written by ``make bench``)."""
    record = _load("generation.json")
    if record is None:
        return None
    lines = ["## Monitored generation", "", _provenance(record["date"], record["machine"], record["command"]), "",
             "SmolLM2-135M-Instruct `generate` (prefill included), rtn-int8; *monitored*: production mode "
             "(`keep_exact=False`, the meter only); *observed*: the default (`keep_exact=True`, every cell's true TV "
             "too); *compiled*: `WITCERT_COMPILE=1`; *every 4th step*: sampled metering "
             "(`sample=witcert.MeterSampling(every=4)`, off by default: the other steps' cells are reported unmetered). "
             "Ratios are tokens/s against stock in the same run, interleaved, the median of the runs.",
             "", *_ratio_table(record["runs"], GENERATION_CONFIGS)]
    return "\n".join(lines)


def _ratio_table(runs: list[dict], configs: tuple) -> list[str]:
    """Rows of tokens/s against stock per context: one run per row, one config per column."""
    lines = ["| context | new tokens | runs | stock tokens/s | " + " | ".join(configs) + " |",
             "|---|---|---|---|" + "---|" * len(configs)]
    for run in runs:
        ratios = run["ratio_to_stock"]
        lines.append(f"| {run['context']} | {run['new_tokens']} | {run['reps']} | {run['tokens_per_s']['stock']:.2f} | "
                     + " | ".join(f"{ratios[c]:.2f}x" if c in ratios else "-" for c in configs) + " |")
    return lines


def long_context_section() -> str | None:
    """Decode-only tokens/s at long context and one 7B-class attention layer (``long_context.json``)."""
    record = _load("long_context.json")
    if record is None:
        return None
    m = record["machine"]
    where = f"{m['cpu']} ({m['logical_cpus']} logical CPUs, shared), {m['torch_threads']} torch thread, commit {m['commit']}"
    configs = ("monitored", "monitored, compiled", "observed", "observed, compiled")
    lines = ["## Long context", "", "Re-measured by `make bench-long`.", "", _provenance(record["date"][:16].replace("T", " ") + " UTC", where,
                                                record["command"]), "",
             "Decode only (the prefill is done once, outside the timing; a request's adoption of the prefix too): "
             "SmolLM2-135M-Instruct over a prompt of offline text, rtn-int8, tokens/s against stock in the same run.",
             "", *_ratio_table(record["decode"], configs)]
    lines += ["", "One attention layer at a 7B-class shape (32 query / 8 kv heads, head dim 128, fp32, one decode "
              "query), ms per layer-step: stock (append the token, sdpa) against what the production monitor adds "
              "(compress the token and decode the store for the read, then record the call, its request metered "
              "every 16 steps with that share counted in; *in step*: metered in the step, as a gate, a spot check "
              "or Tier B meters).", "",
              "| cached tokens | sdpa | stock step | meter | meter, compiled | meter, in step | in step, compiled | "
              "(sdpa + meter, compiled) / stock step |", "|---|---|---|---|---|---|---|---|"]
    for layer in record["layer"]:
        t = layer["ms_per_layer_step"]
        nan = float("nan")
        ratio = (t["sdpa"] + t.get("meter, compiled", t["meter"])) / t["stock step"]
        lines.append(f"| {layer['context']} | {t['sdpa']:.1f} | {t['stock step']:.1f} | {t['meter']:.1f} | "
                     f"{t.get('meter, compiled', nan):.1f} | {t.get('meter, in step', nan):.1f} | "
                     f"{t.get('meter, in step, compiled', nan):.1f} | {ratio:.2f}x |")
    return "\n".join(lines)


def _vllm_machine(m: dict | str) -> str:
    if isinstance(m, str):
        return m
    simd = "AVX-512" if m.get("avx512") else "no AVX-512"
    return (f"{m['cpu']} ({m['logical_cpus']} logical CPUs, {simd}, {m.get('shared', 'shared')}), "
            f"vLLM {m['vllm']} (CPU build), torch {m['torch']}, Python {m['python']}")


def vllm_glance(link: str) -> str | None:
    """One sentence of the vLLM record for the README and the page's head (``None`` without ``vllm.json``)."""
    record = _load("vllm.json")
    if record is None:
        return None
    results = record["results"]
    lossy = list(dict.fromkeys(r["scheme"] for r in results if r["scheme"] != "none"))
    cells = sum(r["cells"] for r in results)
    violations = sum(r["violations"] for r in results)
    by = {(r["workload"], r["scheme"], r["gate"]): r for r in results}
    text = (f"In vLLM ({record['model']}, lossy schemes {', '.join(lossy)} stored in vLLM's own cache, "
            f"measured {record['date'][:10]}, `python -m witcert.integrations.vllm.bench table`): "
            f"{cells:,} decode cells audited against the exact keys, {violations} with true TV above the meter")
    base, check = by.get(("needle", "none", False)), record.get("needle_check") or {}
    if base is not None and check:
        lo, hi = check["interval"]  # the bench's Wilson interval and verdicts (witcert.integrations.vllm.bench)
        within = [s for s in lossy if check.get(s, {}).get("within")]
        text += (f"; gated needle accuracy within the uncompressed accuracy's 95% interval "
                 f"({base['needle_hits']}/{base['needle_cases']}, [{lo:.2f}, {hi:.2f}]) for {len(within)} of "
                 f"{len(lossy)} schemes")
        if ("needle", "kivi-2bit", True) in by:
            k = by["needle", "kivi-2bit", True]
            text += f" (kivi-2bit: {k['needle_hits']}/{k['needle_cases']})"
    return text + _vllm_speed_glance() + f" ([the vLLM table]({link}))."


def vllm_section() -> str | None:
    """The vLLM plugin with lossy schemes in vLLM's cache (``vllm.json``, ``witcert.integrations.vllm.bench table``)."""
    record = _load("vllm.json")
    if record is None:
        return None
    tau = record["tau"]
    by = {(r["workload"], r["scheme"], r["gate"]): r for r in record["results"]}
    workloads = list(dict.fromkeys(r["workload"] for r in record["results"]))
    schemes = list(dict.fromkeys(r["scheme"] for r in record["results"]))
    cells = sum(r["cells"] for r in record["results"])
    violations = sum(r["violations"] for r in record["results"])
    counts = record.get("gate_counts", {})
    lines = ["## Serving with vLLM", "",
             _provenance(f"{record['date']} (finished {record['finished']})", _vllm_machine(record["machine"]),
                         record["command"]), "",
             f"{record['model']} ({record['dtype']}) in one vLLM engine with the WitCert plugin on: every scheme "
             "stored in vLLM's own cache through vLLM's writer, vLLM's unchanged CPU attention kernel attending "
             "over it, the exact shadow checking every decode cell's true TV against its meter, the gate's exact "
             "store kept, prefix caching off. Each scheme runs the observatory's workloads "
             f"({', '.join(workloads)}) without the gate (*raw*) and with it (*gated*, per request); the "
             "uncompressed baseline is `witcert_scheme: none`. Greedy decoding; prefill tokens are not metered. "
             f"tau = {tau:g}. {cells:,} metered cells in all, {violations} with true TV above the meter "
             f"(the plugin's shadow counter: {record.get('shadow_violations', '-')}); repaired slots read back "
             f"and compared with the exact keys: {counts.get('shadow_repair_checked', '-'):,}, mismatches "
             f"{counts.get('shadow_repair_mismatches', '-')}.", "",
             "*cells*, *violations* (cells whose true TV exceeds their meter, served or before the gate's "
             "repair) and the medians are over every decode cell (request, layer, query head, step) of the batch.",
             "", f"| scheme | workload | cells raw / gated | violations | coverage at tau = {tau:g} raw -> gated "
             "| median meter raw / gated | median true TV raw / gated | max true TV raw / gated |",
             "|---|---|---|---|---|---|---|---|"]
    for scheme in schemes:
        for workload in workloads:
            raw, gated = by.get((workload, scheme, False)), by.get((workload, scheme, True))
            if raw is None:
                continue

            def pair(key: str, fmt: str) -> str:
                return format(raw[key], fmt) + (f" / {format(gated[key], fmt)}" if gated else "")

            coverage = f"{raw['coverage']:.3f}" + (f" -> {gated['coverage']:.3f}" if gated else "")
            lines.append(f"| {scheme} | {workload} | {pair('cells', ',')} "
                         f"| {raw['violations'] + (gated['violations'] if gated else 0)} | {coverage} "
                         f"| {pair('median_meter', '.3g')} | {pair('median_true_tv', '.3g')} "
                         f"| {pair('max_true_tv', '.3g')} |")
    lines += _request_tokens(record["results"], workloads)
    base, check = by.get(("needle", "none", False)), record.get("needle_check") or {}
    if base is not None and check:
        lo, hi = check["interval"]
        lines += ["", f"Needle accuracy (the observatory's scoring of the generated answer). Uncompressed: "
                  f"{base['needle_hits']}/{base['needle_cases']}, 95% Wilson interval [{lo:.2f}, {hi:.2f}]; "
                  "*within*: the gated accuracy lies in that interval.", "",
                  "| scheme | raw | gated | gated within the uncompressed interval |", "|---|---|---|---|"]
        for scheme in schemes:
            raw, gated = by.get(("needle", scheme, False)), by.get(("needle", scheme, True))
            if raw is None or gated is None:
                continue
            lines.append(f"| {scheme} | {raw['needle_hits']}/{raw['needle_cases']} "
                         f"| {gated['needle_hits']}/{gated['needle_cases']} "
                         f"| {'yes' if check.get(scheme, {}).get('within') else 'no'} |")
    if counts:
        lines += ["", "Gate work over the run: " + ", ".join(
            f"{name.replace('_', ' ')} {value:,}" for name, value in counts.items()
            if not name.startswith("shadow_")) + "."]
    lines += _vllm_caches(record)
    speed = vllm_speed_section()
    if speed:
        lines += ["", speed]
    return "\n".join(lines)


def _request_tokens(results: list, workloads: list) -> list:
    """Each workload's requests as prompt + generated tokens (recorded per row; older records have none)."""
    parts = []
    for workload in workloads:
        requests = next((r.get("requests") for r in results if r["workload"] == workload and r.get("requests")), None)
        if requests:
            counts = sorted({(q["prompt_tokens"], q["generated_tokens"]) for q in requests})
            parts.append(f"{workload}: {len(requests)} requests of " + ", ".join(f"{p} + {g}" for p, g in counts))
    return ["", "Tokens per request (prompt + generated): " + "; ".join(parts) + "."] if parts else []


def _vllm_caches(record: dict) -> list:
    """vLLM's own fp8 caches (``vllm_caches`` of ``vllm.json``): one engine each, raw and gated, or why not."""
    caches, skipped = record.get("vllm_caches") or {}, record.get("vllm_caches_skipped") or {}
    if not caches and not skipped:
        return []
    tau = record["tau"]
    lines = ["", "### vLLM's own fp8 caches", "",
             "The same workloads in an engine per `--kv-cache-dtype`, no WitCert scheme: vLLM's writer stores the "
             "exact keys cast to fp8, its kernel attends them, the plugin meters what it reads back; gated: the "
             "gate writes exact keys back, which the fp8 cache casts again (a repaired token keeps its fp8 "
             "rounding, so some cells stay above tau: *unreachable*).", "",
             f"| cache | workload | cells raw / gated | violations | coverage at tau = {tau:g} raw -> gated "
             "| median meter raw / gated | max true TV raw / gated | tokens per request (prompt + generated) |",
             "|---|---|---|---|---|---|---|---|"]
    for dtype, measured in caches.items():
        by = {(r["workload"], r["gate"]): r for r in measured["results"]}
        for workload in dict.fromkeys(r["workload"] for r in measured["results"]):
            raw, gated = by.get((workload, False)), by.get((workload, True))
            if raw is None:
                continue
            both = [x for x in (raw, gated) if x]
            requests = raw.get("requests") or []
            counts = sorted({(q["prompt_tokens"], q["generated_tokens"]) for q in requests})
            tokens = ", ".join(f"{p} + {g}" for p, g in counts) or "-"
            cells = " / ".join(format(x["cells"], ",") for x in both)
            lines.append(f"| `{dtype}` | {workload} | {cells} | {sum(x['violations'] for x in both)} | "
                         f"{' -> '.join(format(x['coverage'], '.3f') for x in both)} | "
                         f"{' / '.join(format(x['median_meter'], '.3g') for x in both)} | "
                         f"{' / '.join(format(x['max_true_tv'], '.3g') for x in both)} | {tokens} |")
    for dtype, reason in skipped.items():
        lines.append(f"| `{dtype}` | - | not measured: {reason} | | | | | |")
    return lines


def vllm_speed_section() -> str | None:
    """Decode speed against the plugin off (``vllm_speed.json``, ``witcert.integrations.vllm.bench speed``)."""
    record = _load("vllm_speed.json")
    if record is None:
        return None
    from statistics import median

    modes = record["modes"]
    rates = {name: [r["decode_tokens_per_s"] for r in mode["runs"]] for name, mode in modes.items()}
    requests = next(iter(modes.values()))["runs"][0]["requests"]
    counts = sorted({(q["prompt_tokens"], q["generated_tokens"]) for q in requests})
    lines = ["### Decode speed", "",
             _provenance(record["date"], _vllm_machine(record["machine"]), record["command"]), "",
             f"{record['model']} ({record['dtype']}), {record['workload']} prompts: {len(requests)} requests of "
             + ", ".join(f"{p} prompt + {g} generated tokens" for p, g in counts)
             + ". One engine process per configuration, one OpenMP thread each; every request is prefilled "
             "before the decode steps are timed (decode tokens over the time of those steps); the modes "
             f"interleaved over {record['repeats']} rounds after one untimed round; the plugin without the shadow, "
             "with its defaults (deferred metering over 8 steps). Ratios: the median against the median of the "
             "plugin off with the same cache, same run. The machine is shared with other work.", "",
             "| mode | decode tokens/s (median) | vs plugin off | runs |", "|---|---|---|---|"]
    for name, values in rates.items():
        m = median(values)
        base = median(rates[modes[name]["baseline"]]) if modes[name]["plugin"] else m
        lines.append(f"| {name} | {m:.2f} | {m / base:.2f}x | {', '.join(f'{v:.2f}' for v in values)} |")
    if record.get("fp8_skipped"):
        lines += ["", f"vLLM's fp8 cache: not measured ({record['fp8_skipped']})."]
    return "\n".join(lines)


def _vllm_speed_glance() -> str:
    """The speed ratios of ``vllm_speed.json`` as a clause of the glance sentence ('' without it)."""
    record = _load("vllm_speed.json")
    if record is None:
        return ""
    ratios = record["ratios"]
    return (f"; decode tokens/s against the plugin off ({record['date'][:10]}, `python -m "
            f"witcert.integrations.vllm.bench speed`): " + ", ".join(f"`{m}` {r:.2f}x" for m, r in ratios.items()))


GENERATION_CONFIGS = ("monitored", "monitored, compiled", "observed", "observed, compiled",
                      "monitored, compiled, every 4th step")


def bench_section() -> str:
    """``make bench``'s report, its headings one level down and its file links as paths."""
    text = (RESULTS / "results.md").read_text(encoding="utf-8")
    body = text.split("\n", 1)[1]
    body = re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", body, flags=re.M)
    body = re.sub(r"!\[([^\]]*)\]\(([^)]+)\)", r"(plot: `benchmarks/results/\2`)", body)
    body = re.sub(r"\[([^\]]+)\]\(((?!https?:)[^)]+)\)", r"`benchmarks/results/\2`", body)
    return "## Cost, memory and certificate quality: `make bench`\n" + body.rstrip()


def records_section(name: str) -> str:
    """A Markdown record as written (its own headings carry date, machine and command), comments dropped."""
    text = (RESULTS / name).read_text(encoding="utf-8")
    return re.sub(r"<!--.*?-->\n*", "", text, flags=re.S).strip()


def page() -> str:
    head = ["# Benchmarks and results", "",
            "<!-- generated by scripts/gen_results_page.py from benchmarks/results/; do not edit -->", "",
            "Every figure on this page is a record under `benchmarks/results/`, shown with the date, the machine "
            "and the command that measured it; rerun the command to reproduce it. The machines are shared "
            "2-core VMs without a GPU: read a timing as the ratio measured in the same run, not as an absolute.",
            "", "## At a glance", "", results_table()]
    for glance in (spot_gate_glance("#the-spot-certified-gate"), generation_glance("#monitored-generation"),
                   vllm_glance("#serving-with-vllm")):
        if glance:
            head += ["", glance]
    sections = [fuzz_section(), records_section("observatory.md"), ranking_section(), spot_section(),
                study_section(), spot_gate_section(), generation_section(), long_context_section(), vllm_section(),
                bench_section()]
    return "\n".join(head) + "\n\n" + "\n\n".join(s for s in sections if s is not None) + "\n"


def spot_gate_glance(link: str) -> str | None:
    """One sentence on the spot-certified gate against the certified one, if the study recorded it."""
    path = RESULTS / "study-spot-gate" / "report.json"
    if not path.exists():
        return None
    report = json.loads(path.read_text(encoding="utf-8"))
    tau = report["config"]["tau_certified"]
    rows = {row["name"]: row for row in report["repair"]}
    parts = []
    for scheme in report["config"]["spot_gated_schemes"]:
        det, spot = rows[f"{scheme} gated tau={tau:g}"], rows[f"{scheme} spot-gated tau={tau:g}"]
        parts.append(f"{scheme} {spot['paged_fraction']:.3f} against {det['paged_fraction']:.3f} (accuracy "
                     f"{spot['accuracy']:.3f} against {det['accuracy']:.3f})")
    return (f"The spot-certified gate (`gate=` with `certificate=\"spot\"`) pages fewer tokens than the certified "
            f"gate at tau = {tau:g}: {'; '.join(parts)}, {report['config']['cases']} needle cases, measured "
            f"{report['date']} ([the study's rows]({link})).")


def generation_glance(link: str) -> str | None:
    """One sentence of the generation record for the README and the page's head (``None`` without ``generation.json``)."""
    record = _load("generation.json")
    if record is None:
        return None
    parts = []
    for run in record["runs"]:
        r = run["ratio_to_stock"]
        parts.append(f"{r['monitored, compiled']:.2f}x at {run['context']} tokens of context (eager "
                     f"{r['monitored']:.2f}x, every 4th step metered {r.get(GENERATION_CONFIGS[-1], float('nan')):.2f}x)")
    sentence = (f"Production monitoring (`keep_exact=False`, rtn-int8, compiled meter) generates at {'; '.join(parts)} "
                f"of stock SmolLM2-135M tokens/s, 16 new tokens with the prefill included, measured "
                f"{record['date'][:10]} ([the generation table]({link})).")
    decode = _load("long_context.json")
    if decode is None or not decode["decode"]:
        return sentence
    alone = ", ".join(f"{run['ratio_to_stock'].get('monitored, compiled', float('nan')):.2f}x at {run['context']}"
                      for run in decode["decode"])
    return (f"{sentence[:-1]}; decode alone, the prefill left out: {alone} tokens of context, compiled, measured "
            f"{decode['date'][:10]} ([long context]({link.split('#')[0]}#long-context)).")


def readme_with_table(readme: str) -> str:
    begin, end = README_MARKERS
    start, stop = readme.index(begin) + len(begin), readme.index(end)
    glances = [g for g in (spot_gate_glance("docs/results.md#the-spot-certified-gate"),
                           generation_glance("docs/results.md#monitored-generation"),
                           vllm_glance("docs/results.md#serving-with-vllm")) if g]
    return readme[:start] + "\n" + results_table() + "".join("\n\n" + g for g in glances) + "\n" + readme[stop:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate docs/results.md and the README table")
    mode.add_argument("--check", action="store_true", help="exit status 1 when a committed page differs")
    args = parser.parse_args(argv)
    wanted = {PAGE: page(), README: readme_with_table(README.read_text(encoding="utf-8"))}
    if args.write:
        for path, text in wanted.items():
            path.write_text(text, encoding="utf-8")
        return 0
    stale = [str(p.relative_to(ROOT)) for p, text in wanted.items() if p.read_text(encoding="utf-8") != text]
    for name in stale:
        print(f"{name} is out of date: run python scripts/gen_results_page.py --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

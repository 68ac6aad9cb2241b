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
SPOT_CONFIG = "adaptive 512"  # the spot-check record's headline configuration (benchmarks.spot_check.CONFIGS)
COMPILED_SPOT = "batched, adaptive (tau 0.2), compiled"  # benchmarks.spot_cost.COMPILED (the script imports no package)


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

def results_table(setup_link: str) -> str:
    """Per scheme: the deterministic meter's coverage, the spot check's beside its ceiling, and the violations."""
    spot = _load("spot_check.json")
    setup = spot["setup"]
    lines = [f"| scheme | cells | certified at tau = {setup['tau']}: meter | with the spot check ({SPOT_CONFIG} keys, "
             "mean read) | ceiling (true TV <= tau) | true TV above the reported bound |", "|---|---|---|---|---|---|"]
    for scheme, s in spot["schemes"].items():
        if "all" not in s:
            continue
        every = s["all"]
        spot_row = every["by_config"][SPOT_CONFIG]
        violations = every["violations_deterministic"] + max(v["violations"] for v in every["by_config"].values())
        lines.append(f"| {scheme} | {every['cells']} | {_fraction(every['coverage_deterministic'])} "
                     f"| {_fraction(spot_row['coverage'])} ({spot_row['mean_keys_read']:.0f}) "
                     f"| {_fraction(every['ceiling'])} | {violations} |")
    where = (f"SmolLM2-135M-Instruct, {setup['context_tokens']}-token contexts (text, code, needle), failure probability "
             f"{setup['delta_per_cell']:g} per checked cell, keys read in rounds of 32, 128, 512; {setup['date'][:10]} "
             f"(`{setup['command'].split(' --')[0]}`; [setup]({setup_link})).")
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
    return "\n".join(lines + ranking_spot_lines())


def ranking_spot_lines() -> list[str]:
    """The same comparison on spot-checked runs (``ranking-spot.json``): why the ranking keeps its statistic."""
    record = _load("ranking-spot.json")
    if record is None:
        return []
    setup, spearman = record["setup"], record["mean_spearman"]
    best = max(spearman, key=spearman.get)
    return ["", f"With the spot check on ({', '.join(record['schemes'])}, {setup['cases_per_task']} case per task, "
            f"{setup['context_tokens']}-token context; measured {record['finished'][:10]}, machine not recorded, "
            f"`{record['command']}`): "
            f"mean Spearman {best} {spearman[best]:.2f}, mean spot bound {spearman['mean spot bound']:.2f}, "
            f"mean meter {spearman['mean meter']:.2f}. The ranking keeps the same statistic whichever the "
            "certificate; the spot bound stays the per-cell statement."]


def spot_section() -> str:
    spot = _load("spot_check.json")
    setup = spot["setup"]
    configs = list(setup["configs"])
    schemes = {scheme: s["all"] for scheme, s in spot["schemes"].items() if "all" in s}
    lines = ["## The spot check", "",
             _provenance(setup["date"], setup["machine"], setup["command"]), "",
             f"{setup['model']}: one {setup['context_tokens']}-token case per task ({', '.join(setup['tasks'])}), "
             f"{setup['cells_per_call']} cells sampled per attention call, tau = {setup['tau']}, failure probability "
             f"{setup['delta_per_cell']:g} per checked cell, every cell against its true TV. Estimator: "
             f"{setup['estimator']}." + (f" Witness: {setup['witness']}." if "witness" in setup else "")
             + " *Ceiling*: the share of sampled cells whose true TV is at most tau, which no sound bound exceeds.", "",
             f"| scheme | cells | ceiling | meter coverage | {SPOT_CONFIG}: coverage | mean keys read | "
             "fixed 256 keys | fixed 512 keys | median reported / true TV | ms per checked cell | violations |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for scheme, every in schemes.items():
        by = every["by_config"]
        head = by[SPOT_CONFIG]
        violations = every["violations_deterministic"] + max(v["violations"] for v in by.values())
        ratio = head["median_bound_over_true_tv"]
        lines.append(f"| {scheme} | {every['cells']} | {_fraction(every['ceiling'])} | "
                     f"{_fraction(every['coverage_deterministic'])} | {_fraction(head['coverage'])} | "
                     f"{head['mean_keys_read']:.0f} | {_fraction(by['fixed 256']['coverage'])} | "
                     f"{_fraction(by['fixed 512']['coverage'])} | {'-' if ratio is None else f'{ratio:.2f}'} | "
                     f"{head['ms_per_checked_cell']:.1f} | {violations} |")
    variants = [c for c in configs if c.startswith("adaptive") and c != SPOT_CONFIG]
    lines += ["", "The adaptive check's split of `delta` over its rounds and its stage shares, coverage (mean keys "
              "read) per configuration (the default first):", "",
              "| scheme | " + " | ".join([SPOT_CONFIG, *variants]) + " |", "|---|" + "---|" * (1 + len(variants))]
    for scheme, every in schemes.items():
        by = every["by_config"]
        lines.append(f"| {scheme} | " + " | ".join(
            f"{_fraction(by[c]['coverage'])} ({by[c]['mean_keys_read']:.0f})" for c in [SPOT_CONFIG, *variants]) + " |")
    lines += ["", f"Coverage per task, {SPOT_CONFIG}:", "", "| scheme | " + " | ".join(setup["tasks"]) + " |",
              "|---|" + "---|" * len(setup["tasks"])]
    for scheme, s in spot["schemes"].items():
        if "all" in s:
            lines.append(f"| {scheme} | " + " | ".join(
                _fraction(s["by_task"][t]["by_config"][SPOT_CONFIG]["coverage"]) for t in setup["tasks"]) + " |")
    lines += ["", "![Coverage against exact keys read, per scheme](assets/spot-coverage.png)", "",
              "Drawn from this record by `python scripts/docs_pictures.py --records` (dotted: the deterministic "
              "meter's coverage)."]
    lines += spot_monitor_lines(spot.get("monitor"))
    # the needle task's production spot gate (spot_gate.json) is shown once, in the spot-certified gate's section
    return "\n".join(lines + spot_cost_lines(_load("spot_cost.json")) + spot_generation_lines(_load("spot_generation.json"))
                     + spot_generation_lines(_load("spot_generation_gate.json"), "Generation with the production spot gate"))


def spot_monitor_lines(record: dict | None) -> list[str]:
    """The spot check as a user runs it (``benchmarks.spot_check --sections monitor``): every cell of every call."""
    if not record:
        return []
    lines = ["", "### As the monitor runs it", "", _provenance(record["date"], record["machine"], record["command"]), "",
             f"`witcert.monitor(model, scheme, certificate=\"spot\", spot_keys={record['spot_keys']}, "
             f"spot_delta={record['delta_per_cell']:g})` with the exact cache kept (true TV of every cell), one "
             f"{record['context_tokens']}-token case per task ({', '.join(record['tasks'])}), every cell of every "
             f"call, tau = {record['tau']}. The monitor checks the cells above tau together, one layer at a time; "
             "cells of one layer, sequence and kv head share a key history, read once and whole where that costs "
             "fewer keys per cell than sampling (their bound is then the exact TV rounded up, no failure "
             "probability spent). *Keys per checked cell*: exact keys read, shared reads divided among their cells.",
             "", "| scheme | cells | ceiling | meter coverage | coverage | keys per checked cell | read whole | "
             "median reported / true TV | violations |", "|---|---|---|---|---|---|---|---|---|"]
    for scheme, entry in record["schemes"].items():
        if "all" not in entry:
            continue
        every = entry["all"]
        ratio = every["median_bound_over_true_tv"]
        lines.append(f"| {scheme} | {every['cells']} | {_fraction(every['ceiling'])} | "
                     f"{_fraction(every['coverage_deterministic'])} | {_fraction(every['coverage'])} | "
                     f"{every['mean_keys_read']:.0f} | {every['read_whole']:.2f} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} | {every['violations']} |")
    return lines


def _needle_rows(record: dict) -> dict:
    """The formats record's needle rows by configuration name."""
    return {row["name"]: row for row in record["needle"]["rows"]}


def _hits(row: dict) -> str:
    return f"{row['correct']}/{row['cases']}"


def _format_bytes(scheme: str, setup: dict) -> dict:
    """An engine format's bytes per token and kv head at the record's shape, from the format's own formula and the
    production monitor's default witness code (analytic: the current default, whatever the record's run used)."""
    from witcert.schemes.engine_formats import FORMATS

    return FORMATS[scheme].bytes_per_token(setup["head_dim"], setup["bands"])


def formats_section() -> str | None:
    """The engine KV formats on SmolLM2 (``benchmarks/results/formats.json``, ``python -m benchmarks.formats``)."""
    record = _load("formats.json")
    if record is None:
        return None
    setup, rows = record["setup"], _needle_rows(record)
    cov, tau, keys = setup["coverage"], setup["tau"], setup["coverage"]["spot_keys"]
    base, sound = rows["uncompressed"], record["needle"]["soundness"]
    lines = ["## Engine KV formats", "", _provenance(setup["date"], setup["machine"], setup["command"]), "",
             f"The KV formats serving engines ship ([the formats guide](guides/formats.md)) on "
             f"{setup['model'].split(';')[0]}. "
             f"Coverage: one {cov['context_tokens']}-token case per task ({', '.join(cov['tasks'])}), "
             f"{cov['cells_per_call']} cells sampled per attention call, each against its true TV; the spot check "
             f"reads {keys} exact keys at failure probability {cov['delta_per_cell']:g} per checked cell. Needle: "
             f"{setup['needle']['cases']} cases of the study's family at {setup['needle']['context_tokens']} tokens, "
             f"raw and behind the certified gate at tau = {tau:g} (exact binomial 95% intervals; uncompressed "
             f"{_hits(base)} = {base['accuracy']:.3f} [{base['low']:.3f}, {base['high']:.3f}]). Bytes: what the engine "
             f"stores per token and kv head (keys and values) and the monitor's witness, against bf16, at head "
             f"dimension {setup['head_dim']} and {setup['bands']} bands.", "",
             f"| format | cells | certified at tau = {tau:g}: meter | with the spot check | median true TV "
             "| needle raw | needle gated (tokens paged) | bytes per token: codes + witness (bf16) | violations |",
             "|---|---|---|---|---|---|---|---|---|"]
    for scheme, s in record["schemes"].items():
        raw, gated = rows[scheme], rows[f"{scheme} gated tau={tau:g}"]
        b = _format_bytes(scheme, setup)
        violations = s["violations"] + raw["violations"] + gated["violations"] + gated.get("violations_after_repair", 0)
        lines.append(f"| {scheme} | {s['cells']} | {_fraction(s['coverage_deterministic'])} | "
                     f"{_fraction(s['coverage_spot'])} | {s['median_true_tv']:.4f} | {_hits(raw)} [{raw['low']:.2f}, "
                     f"{raw['high']:.2f}] | {_hits(gated)} [{gated['low']:.2f}, {gated['high']:.2f}] "
                     f"({gated['paged_fraction']:.2f}) | {b['codes']} + {b['witness']} ({b['bf16']}) | {violations} |")
    lines += ["", f"Needle runs: {sound['cells']:,} metered cells, {sound['violations']} with true TV above the meter, "
              f"{sound['violations_after_repair']} above their meter after repair. Each format's engine source "
              "(file and revision) is recorded with it in `benchmarks/results/formats.json`."]
    return "\n".join(lines)


def formats_glance(link: str) -> str | None:
    """The README's table of the engine formats (``None`` without ``formats.json``)."""
    record = _load("formats.json")
    if record is None:
        return None
    setup, rows = record["setup"], _needle_rows(record)
    tau = setup["tau"]
    cases = setup["needle"]["cases"]
    lines = ["| format | meter | spot | median TV | needle raw / gated | bytes / bf16 |",
             "|---|---|---|---|---|---|"]
    violations = record["needle"]["soundness"]["violations"] + record["needle"]["soundness"]["violations_after_repair"]
    for scheme, s in record["schemes"].items():
        violations += s["violations"]
        b = _format_bytes(scheme, setup)
        lines.append(f"| {scheme} | {s['coverage_deterministic']:.2f} | {s['coverage_spot']:.2f} | "
                     f"{s['median_true_tv']:.3f} | {rows[scheme]['correct']} / {rows[f'{scheme} gated tau={tau:g}']['correct']} "
                     f"| {(b['codes'] + b['witness']) / b['bf16']:.2f} |")
    base = rows["uncompressed"]
    return ("\n".join(lines) + f"\n\nEngine KV formats (vLLM, SGLang), same model and tau; needle answers of {cases} "
            f"(uncompressed {base['correct']}); bytes with witness over bf16; {violations} violations; "
            f"{setup['date'][:10]} ([table]({link})).")


def spot_cost_lines(record: dict | None) -> list[str]:
    """A batched check against the attention it certifies (``benchmarks.spot_cost``)."""
    if not record:
        return []
    rows = record["runs"]
    lines = ["", "### Cost per checked cell", "", _provenance(record["date"], record["machine"], record["command"]), "",
             f"One decode layer-step, every query head's cell checked at once ({rows[0]['keys']} keys at most, radii 100x "
             "the logit error so that every round runs: the worst case), per checked cell, against one cell's "
             "attention (fp32) and the layer step's (sdpa); the one-cell form beside it; steps' cells by key group: a deferred "
             "flush's cells of several steps per (row, kv head) in one check, each group's history read whole where it "
             "is at most the key budget per cell of the group (true TV, no draws; at 2k here), sampled otherwise; "
             "*compiled*: the batched adaptive check with `WITCERT_COMPILE=1`.", "",
             "| shape | context | batched, adaptive | batched, adaptive, compiled | batched, fixed | steps' cells by key "
             "group | one cell | attention, one cell | batched adaptive / cell attention | compiled / cell attention |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ms = row["ms_per_checked_cell"]
        grouped = next((f"{v:.3f} ms ({k.split('(')[1].rstrip(')')})" for k, v in ms.items()
                        if k.startswith("batched, key groups")), "not run")
        ratio = row["per_checked_cell_over_cell_attention"]
        compiled = COMPILED_SPOT in ms
        lines.append(f"| {row['shape']} ({row['heads']} heads over {row['kv_heads']}, d {row['head_dim']}) | "
                     f"{row['context']:,} | {ms['batched, adaptive (tau 0.2)']:.2f} ms | "
                     f"{f'{ms[COMPILED_SPOT]:.2f} ms' if compiled else 'not run'} | {ms['batched, fixed']:.2f} ms | "
                     f"{grouped} | {ms['one cell, fixed']:.2f} ms | {row['ms']['attention, one cell']:.3f} ms | "
                     f"{ratio['batched, adaptive (tau 0.2)']:.1f}x | "
                     f"{f'{ratio[COMPILED_SPOT]:.1f}x' if compiled else 'not run'} |")
    return lines


def spot_generation_lines(record: dict | None, title: str = "Generation with the spot check") -> list[str]:
    """Generation with the spot check in production (``benchmarks.spot_generation``), one record's table."""
    if not record:
        return []
    names = list(dict.fromkeys(n for run in record["runs"] for n in run["ratio_to_stock"]))
    lines = ["", f"### {title}", "", _provenance(record["date"], record["machine"],
                                                                        record["command"]), "",
             f"SmolLM2 `generate`, {record['scheme']}, production (`keep_exact=False`), tau = {record['tau']}, at most "
             f"{record['spot_keys']} exact keys per checked cell; tokens/s against stock, prefill included, interleaved, "
             "median of the runs.", "", "| context | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for run in record["runs"]:
        lines.append(f"| {run['context']:,} | " + " | ".join(
            f"{run['ratio_to_stock'][n]:.2f}x" if n in run["ratio_to_stock"] else "not run" for n in names) + " |")
    if all("cpu_ratio_to_stock" in run for run in record["runs"]):  # older records carry wall time only
        lines += ["", "The same runs in the process's CPU time (one torch thread: the work done, which the other jobs "
                  "of a shared machine stretch far less than the wall time):", "",
                  "| context | " + " | ".join(f"{n}, CPU time" for n in names) + " |", "|---|" + "---|" * len(names)]
        for run in record["runs"]:
            lines.append(f"| {run['context']:,} | " + " | ".join(
                f"{run['cpu_ratio_to_stock'][n]:.2f}x" if n in run["cpu_ratio_to_stock"] else "not run"
                for n in names) + " |")
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
    lines += ["", "![Tokens paged by gate kind](assets/gate-paged.png)"]
    table = repair_table(report)
    table[0] = "#" + table[0]  # a subsection of this one
    return "\n".join([*lines, "", *table, *production_spot_gate_lines(_load("spot_gate.json"))])


def _planned(record: dict) -> str:
    """`` (the first n of the N asked for)`` when a run stopped before its planned cases, else empty."""
    planned = record.get("cases_planned", record["cases"])
    return f" (the first {record['cases']} of the {planned} asked for)" if planned > record["cases"] else ""


def production_spot_gate_lines(record: dict | None) -> list[str]:
    """The production spot-certified gate on the needle task (``benchmarks.spot_gate``)."""
    if not record:
        return []
    rows = record["configurations"]
    lines = ["", "### The production spot gate", "", _provenance(record["date"], record["machine"], record["command"]),
             "", f"{record['cases']} needle cases{_planned(record)} of {record['context_tokens']} tokens, "
             "`keep_exact=False`: pages and "
             f"checks read the verified host backing store; tau = {record['tau']}, at most {record['spot_keys']} exact "
             "keys per check, witness "
             + ("the monitor's default for each scheme" if record.get("witness_bits") is None
                else f"`witness_bits={record['witness_bits']}`")
             + ". Accuracy with its exact binomial 95% interval; *paged*: the mean share of a cell's "
             "tokens paged in; *certified*: cells whose reported meter (after repair) is at most tau.", "",
             "| configuration | accuracy | paged | fired | certified | MB paged per case | MB read by checks per case |",
             "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        acc = f"{row['accuracy']:.3f} [{row['low']:.3f}, {row['high']:.3f}]"
        paged = f"{row['paged_fraction']:.3f}" if "paged_fraction" in row else "-"
        fired = f"{row['fired']:.3f}" if "fired" in row else "-"
        certified = f"{row['certified']:.3f}" if "certified" in row else "-"
        mb_paged = f"{row['bytes_paged_per_case'] / 1e6:.1f}" if "bytes_paged_per_case" in row else "-"
        mb_read = f"{row['check_bytes_per_case'] / 1e6:.1f}" if "check_bytes_per_case" in row else "-"
        lines.append(f"| {name} | {acc} | {paged} | {fired} | {certified} | {mb_paged} | {mb_read} |")
    return lines


def study_section() -> str:
    from witcert.observatory.study_report import repair_table

    path = ROOT / "docs" / "study" / "report.json"
    study = json.loads(path.read_text(encoding="utf-8"))
    sound = study["soundness"]
    lines = ["## The study", "",
             _provenance(study.get("date") or _committed_date(path), "a 2-core x86-64 VM (AVX2, loaded), 1 torch thread",
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
             "", *_ratio_table(record["runs"], GENERATION_CONFIGS), "",
             "![Monitored generation against stock](assets/production-overhead.png)"]
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


def audit_section() -> str | None:
    """The request audit on SmolLM2 (``audit.json``, ``python -m benchmarks.audit``): cost, usefulness, a collapse."""
    record = _load("audit.json")
    if record is None:
        return None
    lines = ["## The request audit", "",
             "`witcert.monitor(..., audit=witcert.Audit(rate, tau=0.2, delta=1e-3))`: each cell picked with probability "
             "`rate` and bounded by its true TV from its exact keys (with `keys=k`, bounded reads: by its meter, "
             "else a spot check of at most `k` exact keys); per request, with probability at least 1 - 1e-3 (a "
             "probabilistic "
             "statement, not a proof), at most `fraction_upper` of its cells have TV above tau "
             "([design](design.md#the-request-audit))."]
    cost = record.get("cost")
    if cost:
        configs = tuple(name for name in cost["runs"][0]["ratio_to_stock"])
        lines += ["", "### Cost", "", _provenance(cost["date"], cost["machine"], cost["command"]), "",
                  f"SmolLM2-135M-Instruct `generate` (prefill included), {cost['scheme']}, production mode "
                  "(`keep_exact=False`), the meter's passes compiled (`WITCERT_COMPILE=1`); *every cell*: every cell "
                  "metered; " + _audited_cost(cost) +
                  "at a rate that picks nothing (1e-9), the floor any rate pays "
                  "(the compressed cache and the host store of exact keys)"
                  + ("; *transformers int4 cache*: transformers' own `QuantizedCache` (quanto, 4 bits, 128 recent "
                     "tokens kept exact), unmonitored, for scale" if "transformers int4 cache" in configs else "")
                  + ". Tokens/s against stock in the same run, "
                  "interleaved, the median of the runs; in wall time, then in the process's CPU time (one torch "
                  "thread: the work done, which the other jobs of a shared machine stretch far less than the wall "
                  "time: the fairer figure here).", "",
                  *_ratio_table(cost["runs"], configs)]
        if all("cpu_ratio_to_stock" in run for run in cost["runs"]):
            lines += ["", "| context | CPU s per stock generate | " + " | ".join(f"{c}, CPU time" for c in configs) + " |",
                      "|---|---|" + "---|" * len(configs)]
            for run in cost["runs"]:
                lines.append(f"| {run['context']} | {run['median_cpu_s']['stock']:.2f} | "
                             + " | ".join(f"{run['cpu_ratio_to_stock'][c]:.2f}x" for c in configs) + " |")
    useful = record.get("usefulness")
    if useful:
        lines += ["", "### How close the statement is", "",
                  _provenance(useful["date"], useful["machine"], useful["command"]), "",
                  f"Observatory workloads ({useful['context']}-token context; needle: the question and a 6-token "
                  f"answer, text and code: 32 teacher-forced tokens), {useful['cases_per_task']} cases per task, "
                  f"{useful['seeds']} audits per case at rate {useful['rate']:g}. True fraction: cells with true TV "
                  f"above tau = {useful['tau']:g} in the same request metered on every cell; *failures*: audits whose "
                  "true count exceeded `M_upper`.", "",
                  "| scheme | bound of a picked cell | task | audits | median true fraction | median fraction_upper | "
                  "median fraction_upper - true | failures | measured |", "|---|---|---|---|---|---|---|---|---|"]
        for row in sorted(useful["by"].values(), key=lambda r: (r["scheme"], r["keys"] is not None, r["keys"] or 0)):
            bound = "true TV (exact)" if row["keys"] is None else f"meter, else <= {row['keys']} exact keys"
            lines.append(f"| {row['scheme']} | {bound} | {row['task']} | {row['requests']} | "
                         f"{row['median_true_fraction']:.3f} | {row['median_fraction_upper']:.3f} | "
                         f"{row['median_gap']:.3f} | {row['failures']} | {row.get('date', useful['date'])[:16]} |")
    collapse = record.get("collapse")
    if collapse:
        lines += ["", "### A collapsed layer", "", _provenance(collapse["date"], collapse["machine"],
                                                                collapse["command"]), "",
                  f"{collapse['requests']} requests (text and code, {collapse['context']}-token context, "
                  f"{collapse['probe_tokens']} teacher-forced tokens, {collapse['cells_per_request']:,} cells each), "
                  f"layer {collapse['collapsed_layer']}'s keys destroyed (scaled by -8), rtn-int4 elsewhere, audited at "
                  f"rate 0.02 ({_collapse_bound(collapse)}): **{collapse['flagged_requests']} of "
                  f"{collapse['requests']} requests flagged** "
                  f"({collapse['share_flagged']:.3f}); {collapse['their_share_above_tau']:.3f} of the collapsed layer's "
                  f"{collapse['picked_cells_of_collapsed_layer']:,} picked cells have true TV above tau."]
    return "\n".join(lines)


def _collapse_bound(collapse: dict) -> str:
    """How the collapse record's picked cells were bounded (records before the exact audit carry no ``bound``)."""
    if collapse.get("bound") == "exact":
        return "the exact audit: each picked cell's true TV"
    return "the audit's default of that date: the meter, else a spot check"


def _audited_cost(cost: dict) -> str:
    """What the cost table's audited configurations did (the exact audit since the record says ``keys: null``)."""
    rate = f"{cost['rate']:g}"
    if cost.get("keys", 256) is not None:  # a record from before the exact audit
        return (f"*audit {rate}*: the picked cells only metered, each above tau spot-checked with up to "
                f"{cost.get('keys', 256)} exact keys paged from the host backing store; "
                "*audit, none picked*: the same ")
    return (f"*audit {rate}*: the exact audit, each picked cell's true TV from its exact keys in the host backing "
            f"store (which the audited monitor fills with exact keys only), nothing metered, no witness kept; "
            f"*audit {rate}, {cost['bounded_keys']} keys*: bounded reads, the picked cells metered and each above tau "
            f"spot-checked with up to {cost['bounded_keys']} exact keys; *audit, none picked*: the exact audit ")


def audit_glance(link: str) -> str | None:
    """One sentence of the audit record for the README and the page's head (``None`` without its sections)."""
    record = _load("audit.json")
    if record is None or not {"cost", "usefulness", "collapse"} <= set(record):
        return None
    cost, useful, collapse = record["cost"], record["usefulness"], record["collapse"]
    audited = f"audit {cost['rate']:g}"
    ratios = ", ".join(f"{run.get('cpu_ratio_to_stock', run['ratio_to_stock'])[audited]:.2f}x at {run['context']}"
                       for run in cost["runs"])
    clock = "in CPU time" if all("cpu_ratio_to_stock" in run for run in cost["runs"]) else "in wall time"
    every = ", ".join(f"{run.get('cpu_ratio_to_stock', run['ratio_to_stock'])['every cell']:.2f}x"
                      for run in cost["runs"])
    gaps = {}
    for row in useful["by"].values():
        if row["keys"] == useful.get("default_keys", 256):  # the audit's default bound when recorded
            gaps.setdefault(row["scheme"], []).append(row["median_gap"])
    gap = "; ".join(f"{scheme} {max(values):.2f}" for scheme, values in gaps.items())
    return (f"The request audit (`audit=witcert.Audit(rate=0.02)`, a per-request statement at probability 1 - 1e-3) "
            f"generates at {ratios} tokens of context of stock tokens/s {clock} ({cost['scheme']}, production, "
            f"compiled; metering every cell: {every}); at "
            f"rate {useful['rate']:g} its bound exceeds the true fraction of cells above tau by at most (median per "
            f"task) {gap}; a collapsed layer is flagged in {collapse['flagged_requests']} of {collapse['requests']} "
            f"requests, measured {cost['date'][:10]} (cost on {cost['machine'].split(' (')[0]}: the share of a request "
            f"it adds depends on the CPU) ([the audit's tables]({link})).")


def capacity_section() -> str | None:
    """Tokens in a 1 GiB KV budget per scheme, raw and with the production monitor (``capacity.json``)."""
    record = _load("capacity.json")
    if record is None:
        return None
    setup = record["setup"]
    lines = ["## Capacity", "", _provenance(setup["date"], setup["machine"], setup["command"]), "",
             f"Tokens that fit in {setup['budget_bytes'] / 2**30:g} GiB of KV cache for a {setup['dtype']} model: the "
             "uncompressed cache, each scheme alone (its codes and their group statistics, as the production store "
             "holds them), and with the production monitor (`keep_exact=False`: the witness added at the monitor's "
             "default for the scheme, the *witness* column: 8 the one-byte band norms, 4 a 4-bit fraction of the "
             "witness derived from the codec's error bound, 0 that derived witness alone with only the value norms "
             "stored; and in fp16 and derived for comparison, *n/a* where the codec declares no bound). Accounted "
             "from the tensors the production store holds after a long prefill (`witcert.integrations.hf.footprint`). "
             "A gate or spot check in production also keeps the exact keys and values on the host (the uncompressed "
             "size, never on the device): the *host backing* column.", ""]
    for shape, rows in record["accounting"].items():
        bands = setup["bands"][shape]
        lines += [f"**{shape}**, {bands} bands:", "",
                  "| scheme | witness | bytes per token: bf16 | raw | monitored | tokens: bf16 | raw | monitored | "
                  "capacity: raw | monitored | with an fp16 witness | derived | host backing per token |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            t = r["tokens_in_budget"]
            derived = r.get("capacity_monitored_derived_witness")
            lines.append(f"| {r['scheme']} | {r.get('witness_bits', setup['witness_bits'])} | "
                         f"{r['bytes_per_token_bf16']:,.0f} | {r['bytes_per_token_raw']:,.0f} | "
                         f"{r['bytes_per_token_monitored']:,.0f} | {int(t['bf16']):,d} | {int(t['raw']):,d} | {int(t['monitored']):,d} | "
                         f"{r['capacity_raw']:.2f}x | {r['capacity_monitored']:.2f}x | "
                         f"{r['capacity_monitored_fp16_witness']:.2f}x | {'n/a' if derived is None else f'{derived:.2f}x'} | "
                         f"{r['host_backing_per_token']:,.0f} B |")
        lines.append("")
    generation = record.get("generation")
    if generation:
        g = setup["generation"]
        lines += [f"**Generation**: {g['model']}, a {g['context_tokens']}-token text prompt and {g['new_tokens']} new "
                  "tokens under `witcert.monitor(scheme, keep_exact=False)`; `mon.memory()` against the bf16 cache of "
                  "the same tokens (decode tokens included: KIVI keeps the keys of a chunk's last tokens exact, a "
                  "quantized cache an exact window of up to 128).", "",
                  "| scheme | tokens | held | of which witness | exact bf16 cache | capacity |", "|---|---|---|---|---|---|"]
        for r in generation:
            lines.append(f"| {r['scheme']} | {r['tokens']} | {r['held']:,d} B | {r['witness']:,d} B | "
                         f"{r['exact_cache_bf16']:,d} B | {r['capacity']:.2f}x |")
        lines.append("")
    lines += quantized_cache_reads_lines()
    shapes = list(record["accounting"])
    lines += ["Against the targets (production monitor, witness included, against bf16):", "",
              "| scheme | target | " + " | ".join(shapes) + " | generation |", "|---|---|" + "---|" * (len(shapes) + 1)]
    for r in record["targets"]:
        cells = [r[shape] for shape in shapes] + [r["generation"]]
        lines.append(f"| {r['scheme']} | {r['target']:g}x | " + " | ".join(
            "-" if c is None else f"{c:.2f}x {'(met)' if c >= r['target'] else '(below)'}" for c in cells) + " |")
    return "\n".join(lines)


def quantized_cache_reads_lines() -> list[str]:
    """transformers' quantized cache with and without a decoded copy between reads (``hf_cache_reads.json``)."""
    record = _load("hf_cache_reads.json")
    if record is None:
        return []
    lines = [f"**transformers' quantized cache between reads** ({record['scheme']}, SmolLM2-135M-Instruct in fp32, "
             f"{record['context']}-token prompt, {record['new_tokens']} new tokens, production mode). "
             + _provenance(record["date"], record["machine"], record["command"]), "",
             "| store | runs | held | of which decoded | exact cache | tokens/s against stock |", "|---|---|---|---|---|---|"]
    for label, m in record["medians"].items():
        lines.append(f"| {label} | {m['runs']} | {m['held']:,.0f} B | {m['decoded']:,.0f} B | {m['exact_cache']:,.0f} B | "
                     f"{m['ratio_to_stock']:.2f}x |")
    return lines + ["", "Medians of interleaved runs; every read decodes the history in both (transformers' own "
                    "update does), so holding a decoded copy saved no decoding.", ""]


def witness_size_section() -> str | None:
    """Coverage and looseness by witness bands and bits (``witness_size.json``)."""
    record = _load("witness_size.json")
    if record is None:
        return None
    setup = record["setup"]
    lines = ["## A smaller witness", "", _provenance(setup["date"], setup["machine"], setup["command"]), "",
             f"SmolLM2-135M-Instruct (head dim 64), {setup['context_tokens']}-token contexts of "
             f"{', '.join(setup['tasks'])}, {setup['cells']}: the deterministic meter's coverage at tau = {setup['tau']} "
             "(meter at most tau), the ceiling (true TV at most tau), meter / true TV over the cells whose attention "
             "moved, and the witness bytes per token and kv head (the value statistics included) for each option: "
             "bands, and each band norm in fp16 or in one byte (e5m3), both rounded up. The default is 16 bands in one "
             "byte.", "",
             "| scheme | bands | bits | witness bytes | cells | coverage | ceiling | median meter / true TV | "
             "90th percentile | violations |", "|---|---|---|---|---|---|---|---|---|---|"]
    for scheme, rows in record["schemes"].items():
        for r in rows:
            lines.append(f"| {scheme} | {r['bands']} | {_witness_cells(r)}")
    return "\n".join(lines + derived_witness_lines(record["schemes"].get("rtn-int8", [])))


def derived_witness_lines(fp16_rows: list) -> list[str]:
    """The witness derived from the codec's error bound against the stored byte (``witness_derived.json``)."""
    record = _load("witness_derived.json")
    if record is None:
        return []
    setup = record["setup"]
    fp16 = next((r for r in fp16_rows if r["bands"] == 16 and r["bits"] == 16), None)
    lines = ["", "### A witness derived from the codec's error bound", "",
             _provenance(setup["date"], setup["machine"], setup["command"]), "",
             "The same cases at 16 bands: the stored byte (bits 8); bits 0, no band norm stored, the witness derived "
             "at every read from the codec's elementwise error bound (registry `DW`, checked against the exact tokens "
             "on write), only the value norm kept; bits 4, each band norm stored as a 4-bit fraction of that derived "
             "witness. The monitor's defaults come from this table: derived for rtn-int4 and rtn-int2 (their meters "
             "saturate with any witness), the 4-bit fraction for rtn-int8"
             + (f" (fp16 norms: {_fraction(fp16['coverage'])})" if fp16 else "") + ", the stored byte otherwise.", "",
             "| scheme | bits | witness bytes | cells | coverage | ceiling | median meter / true TV | 90th percentile | "
             "violations |", "|---|---|---|---|---|---|---|---|---|"]
    for scheme, rows in record["schemes"].items():
        for r in rows:
            lines.append(f"| {scheme} | {_witness_cells(r)}")
    return lines


def _witness_cells(r: dict) -> str:
    """The cells a witness-option row shares in both witness tables: bits to violations."""
    return (f"{r['bits']} | {r['witness_bytes']} | {r['cells']:,d} | {_fraction(r['coverage'])} | "
            f"{_fraction(r['ceiling'])} | {r['median_meter_over_true_tv']:.2f} | {r['p90_meter_over_true_tv']:.2f} | "
            f"{r['violations']} |")


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
    text = (f"In vLLM ({record['model']}, {len(lossy)} lossy schemes in vLLM's own cache, {record['date'][:10]}, "
            f"`python -m witcert.integrations.vllm.bench table`): {cells:,} decode cells audited against the exact keys, {violations} with true TV "
            "above the meter")
    base, check = by.get(("needle", "none", False)), record.get("needle_check") or {}
    if base is not None and check:
        within = [s for s in lossy if check.get(s, {}).get("within")]  # the bench's Wilson-interval verdicts
        text += (f"; gated needle accuracy within the uncompressed one's 95% interval for {len(within)} of "
                 f"{len(lossy)} schemes")
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
    for name, heading in (("vllm_speed.json", "Decode speed"), ("vllm_speed_fp8.json", "Decode speed, vLLM's fp8 caches")):
        speed = vllm_speed_section(name, heading)
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


def vllm_speed_section(name: str = "vllm_speed.json", heading: str = "Decode speed") -> str | None:
    """Decode speed against the plugin off (a ``vllm_speed*.json`` record, ``witcert.integrations.vllm.bench speed``)."""
    record = _load(name)
    if record is None:
        return None
    from statistics import median

    modes = record["modes"]
    rates = {name: [r["decode_tokens_per_s"] for r in mode["runs"]] for name, mode in modes.items()}
    requests = next(iter(modes.values()))["runs"][0]["requests"]
    counts = sorted({(q["prompt_tokens"], q["generated_tokens"]) for q in requests})
    ran = record.get("modes_run")
    lines = [f"### {heading}", "",
             _provenance(record["date"], _vllm_machine(record["machine"]), record["command"]), "",
             f"{record['model']} ({record['dtype']}), {record['workload']} prompts: {len(requests)} requests of "
             + ", ".join(f"{p} prompt + {g} generated tokens" for p, g in counts)
             + ". One engine process per configuration, one OpenMP thread each; every request is prefilled "
             "before the decode steps are timed (decode tokens over the time of those steps"
             + ("; what the prefill journaled is entered before the clock starts, and each mode's deferred work, "
                "its deferred rows metered and its audits closed, is paid inside its own window"
                if record.get("floor_ratios") is not None else "")
             + f"); the modes interleaved over {record['repeats']} rounds after one untimed round"
             + (", their order shuffled each round after the first" if record.get("floor_ratios") is not None else "")
             + "; the plugin without the shadow, with its defaults (deferred metering over 8 steps). Ratios: the "
             "median against the median of the plugin off with the same cache, same run. The machine is shared "
             "with other work"
             + (f"; the whole run took {record['wall_s'] / 60:.1f} minutes." if record.get("wall_s") else ".")
             + (f" This run measured the modes `{','.join(ran)}` of the bench's `--modes`." if ran else ""), "",
             ]
    cpu = {name: [r.get("decode_tokens_per_cpu_s") for r in mode["runs"]] for name, mode in modes.items()}
    if all(all(values) for values in cpu.values()):  # the CPU-time rate beside the wall clock's
        lines += ["Beside the wall clock, the same decode steps per second of the engine process's CPU time (all its "
                  "threads), which other work on the shared cores does not inflate.", "", "| mode | decode tokens/s (median) | vs plugin off | per CPU second (median) | vs plugin off, "
                  "CPU time | runs (wall clock) |", "|---|---|---|---|---|---|"]
        for name, values in rates.items():
            m, c = median(values), median(cpu[name])
            base, cbase = ((median(rates[modes[name]["baseline"]]), median(cpu[modes[name]["baseline"]]))
                           if modes[name]["plugin"] else (m, c))
            lines.append(f"| {name} | {m:.2f} | {m / base:.2f}x | {c:.2f} | {c / cbase:.2f}x | "
                         f"{', '.join(f'{v:.2f}' for v in values)} |")
    else:
        lines += ["| mode | decode tokens/s (median) | vs plugin off | runs |", "|---|---|---|---|"]
        for name, values in rates.items():
            m = median(values)
            base = median(rates[modes[name]["baseline"]]) if modes[name]["plugin"] else m
            lines.append(f"| {name} | {m:.2f} | {m / base:.2f}x | {', '.join(f'{v:.2f}' for v in values)} |")
    floor, cpu_floor = record.get("floor_ratios") or {}, record.get("cpu_floor_ratios") or {}
    if floor:  # the metered modes of the plugin-on engine over its floor (nothing metered): their metering alone
        lines += ["", "Against the floor (plugin on, the request metering no layer, in the same engine process; by "
                  "the wall clock" + (" and per CPU second" if cpu_floor else "") + "): "
                  + ", ".join(f"{name} {ratio:.2f}x" + (f" ({cpu_floor[name]:.2f}x)" if name in cpu_floor else "")
                              for name, ratio in floor.items()) + "."]
    if record.get("fp8_skipped"):
        lines += ["", f"vLLM's fp8 cache: not measured ({record['fp8_skipped']})."]
    return "\n".join(lines)


def _vllm_speed_glance() -> str:
    """The speed ratios of ``vllm_speed.json`` as a clause of the glance sentence ('' without it)."""
    record = _load("vllm_speed.json")
    if record is None:
        return ""
    ratios, cpu = record["ratios"], record.get("cpu_ratios") or {}
    cpu_name = record["machine"].get("cpu") if isinstance(record.get("machine"), dict) else None
    return (f"; decode tokens/s against the plugin off ({record['date'][:10]}"
            + (f" on {cpu_name}" if cpu_name else "") + ", its `speed` mode"
            + (", by the wall clock and per CPU second" if cpu else "") + "): "
            + ", ".join(f"{m.removeprefix('metering').strip(' ,()')} {r:.2f}x"
                        + (f" ({cpu[m]:.2f}x)" if m in cpu else "") for m, r in ratios.items()))


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
            "", "## At a glance", "", results_table("#the-spot-check")]
    for glance in (spot_gate_glance("#the-spot-certified-gate"), generation_glance("#monitored-generation"),
                   audit_glance("#the-request-audit"), vllm_glance("#serving-with-vllm")):
        if glance:
            head += ["", glance]
    sections = [fuzz_section(), records_section("observatory.md"), ranking_section(), spot_section(),
                formats_section(), study_section(), spot_gate_section(), generation_section(), long_context_section(),
                capacity_section(), witness_size_section(), audit_section(), vllm_section(), bench_section()]
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
    glances = [g for g in (formats_glance("docs/results.md#engine-kv-formats"),
                           spot_gate_glance("docs/results.md#the-spot-certified-gate"),
                           generation_glance("docs/results.md#monitored-generation"),
                           audit_glance("docs/results.md#the-request-audit"),
                           vllm_glance("docs/results.md#serving-with-vllm")) if g]
    return readme[:start] + "\n" + results_table("docs/results.md#the-spot-check") + "".join("\n\n" + g for g in glances) + "\n" + readme[stop:]


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

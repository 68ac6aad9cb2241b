"""The study's report: ``report.json`` (every number), ``report.md`` (the two tables with their intervals) and the plots
(:mod:`witcert.observatory.study_plots`)."""
from __future__ import annotations

import json
from pathlib import Path

from witcert.observatory import study_plots
from witcert.observatory.study_plots import layer_span


def write(report: dict, out: Path) -> Path:
    """Write ``report.json``, ``report.md`` and the plots under ``out`` (created); returns the markdown path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    plots = study_plots.write(report, out)
    md = out / "report.md"
    md.write_text(markdown(report) + "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n", encoding="utf-8")
    return md


def markdown(report: dict) -> str:
    """Both tables, their protocol and the soundness totals, as markdown."""
    c, iv, sound = report["config"], report["intervals"], report["soundness"]
    lines = [
        "# WitCert study: gated repair and cross-layer accumulation",
        "",
        f"Model: {report['model']}. Needle family: {c['cases']} cases (depths 0.05-0.95, 1-4 keyed passkeys, one "
        f"asked), context {c['context_tokens']} tokens, greedy answer of {c['new_tokens']} tokens, exact match. "
        f"Wall time {report['wall_s'] / 60:.1f} min.",
        f"Intervals at {iv['level']:.0%}: accuracy {iv['accuracy']}; paired difference {iv['paired_difference']}; "
        f"test {iv['paired_test']}.",
        f"Soundness: {sound['cells']} metered cells, **{sound['violations']} with true TV above the meter** "
        f"(checked per cell; {sound['unchecked']} without a true TV; max true TV - meter "
        f"{sound['max_true_tv_minus_meter']:.3g})"
        + (f"; after repair, {sound['violations_after_repair']} gated cells with true TV above their meter after "
           "repair." if "violations_after_repair" in sound else "."),
        "",
        *repair_table(report),
        "",
    ]
    for scheme, sweep in report["sweep"].items():
        lines += [*sweep_table(scheme, sweep), ""]
    return "\n".join(lines)


def repair_table(report: dict) -> list[str]:
    """The repair study: accuracy, paired difference against uncompressed, gate activity."""
    lines = [f"## Repair study ({report['repair'][0]['cases']} cases per configuration)", "",
             "| configuration | accuracy [95% CI] | vs uncompressed [95% CI] | McNemar p | cells fired | "
             "tokens paged | paged K+V per case | cells / violations |",
             "|---|---|---|---|---|---|---|---|"]
    spot = any("spot_keys_per_cell" in row for row in report["repair"])
    if spot:  # the spot-certified gate also reads exact keys to decide
        lines[2] = lines[2].replace("| cells / violations |", "| spot keys read per cell | cells / violations |")
        lines[3] += "---|"
    for row in report["repair"]:
        cells = [row["name"], _acc(row), _diff(row), _p(row), _fraction(row.get("fired")),
                 _fraction(row.get("paged_fraction")), _bytes(row.get("paged_bytes_per_case"))]
        if spot:
            cells.append("-" if row.get("spot_keys_per_cell") is None else f"{row['spot_keys_per_cell']:.0f}")
        lines.append("| " + " | ".join([*cells, _cells(row)]) + " |")
    return lines


def sweep_table(scheme: str, sweep: dict) -> list[str]:
    """The layer sweep of one scheme: single layers, thirds, all layers."""
    n = sweep["cases"]
    lines = [f"## Layer sweep: {scheme} ({n} cases per configuration)", "",
             f"Single layers whose compression alone loses accuracy (McNemar p < 0.05): "
             f"**{sweep['single_layer_losses']} of {len(sweep['single_layers'])}** "
             f"({sweep['single_layer_losses_bonferroni']} after Bonferroni); all layers: "
             f"{_diff(sweep['all_layers'])} (p = {_p(sweep['all_layers'])}). Uncompressed accuracy on these cases: "
             f"{_acc(sweep['uncompressed'])}.", "",
             "| compressed layers | accuracy [95% CI] | vs uncompressed [95% CI] | McNemar p | mean meter | "
             "cells / violations |",
             "|---|---|---|---|---|---|"]
    for row in [*sweep["single_layers"], *sweep["thirds"], sweep["all_layers"]]:
        layers = "all" if row["layers"] is None else layer_span(row["layers"])
        lines.append("| " + " | ".join([layers, _acc(row), _diff(row), _p(row), _number(row.get("mean_meter")),
                                         _cells(row)]) + " |")
    return lines


def _acc(row: dict) -> str:
    return f"{row['accuracy']:.3f} [{row['low']:.3f}, {row['high']:.3f}] ({row['correct']}/{row['cases']})"


def _diff(row: dict) -> str:
    p = row["paired"]
    return f"{p['diff']:+.3f} [{p['low']:+.3f}, {p['high']:+.3f}]"


def _p(row: dict) -> str:
    return f"{row['paired']['p_mcnemar']:.3g}"


def _cells(row: dict) -> str:
    return "-" if not row["cells"] else f"{row['cells']} / {row['violations']}"


def _fraction(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _number(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _bytes(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f} MiB"


"""The study's plots (matplotlib Agg): accuracy with its 95% interval per repair configuration, and per layer-sweep configuration.

Both read only ``report.json``'s numbers (:mod:`witcert.observatory.study`), so a committed report can be re-plotted
without rerunning the study: ``study_report.write(json.load(open("report.json")), out)``.
"""
from __future__ import annotations

from pathlib import Path

from witcert.observatory.report import _plt


def write(report: dict, out: Path) -> list[Path]:
    """``repair.png`` and one ``sweep-<scheme>.png`` per swept scheme under ``out``; returns their paths."""
    paths = [_repair(report, Path(out))]
    for scheme, sweep in report["sweep"].items():
        paths.append(_sweep(scheme, sweep, Path(out)))
    return paths


def layer_span(layers: list) -> str:
    """``"7"`` for one layer, ``"0-9"`` for a contiguous run."""
    return str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"


def _repair(report: dict, out: Path) -> Path:
    """One horizontal interval per configuration; the dashed line is uncompressed accuracy."""
    plt = _plt()
    rows = report["repair"]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    for y, row in enumerate(rows):
        ax.errorbar(row["accuracy"], y, xerr=[[row["accuracy"] - row["low"]], [row["high"] - row["accuracy"]]],
                    fmt="o", color="C1" if row["gate"] else "C0", capsize=3)
    ax.axvline(rows[0]["accuracy"], color="k", ls="--", lw=1, label="uncompressed")
    ax.set_yticks(range(len(rows)), [row["name"] for row in rows])
    ax.invert_yaxis()
    ax.set(xlim=(0, 1), xlabel=f"needle accuracy, 95% CI ({rows[0]['cases']} cases each)",
           title="Repair study: raw schemes (blue) and behind a gate (orange)")
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, plt, out / "repair.png")


def _sweep(scheme: str, sweep: dict, out: Path) -> Path:
    """Accuracy with its interval for each single compressed layer, each third and all layers."""
    plt = _plt()
    rows = [*sweep["single_layers"], *sweep["thirds"], sweep["all_layers"]]
    labels = ["all" if r["layers"] is None else layer_span(r["layers"]) for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * len(rows) + 1.5), 4))
    for x, row in enumerate(rows):
        lost = row["paired"]["p_mcnemar"] < 0.05 and row["paired"]["diff"] < 0
        ax.errorbar(x, row["accuracy"], yerr=[[row["accuracy"] - row["low"]], [row["high"] - row["accuracy"]]],
                    fmt="o", color="C3" if lost else "C0", capsize=2, ms=4)
    ax.axhline(sweep["uncompressed"]["accuracy"], color="k", ls="--", lw=1, label="uncompressed")
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
    ax.set(ylim=(0, 1), xlabel="compressed layers (the others exact)",
           ylabel=f"needle accuracy, 95% CI ({sweep['cases']} cases)",
           title=f"Layer sweep, {scheme}: red = loses accuracy (McNemar p < 0.05)")
    ax.legend(fontsize=8)
    return _save(fig, plt, out / f"sweep-{scheme}.png")


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


"""Summaries and the report directory (markdown + PNG plots, matplotlib Agg) of an observatory run.

Definitions, per cell (layer, query head, query position), at threshold ``tau``:

- *violation*: true TV > meter (must never happen: the meter is a proved upper bound);
- *coverage*: fraction of cells with meter <= tau (certified safe at tau);
- *danger*: true TV > tau; *danger recall*: fraction of dangerous cells with meter > tau
  (1 whenever there is no violation; reported to show it measured, not assumed);
- *joint coverage*: fraction with pass_K and pass_V (:mod:`witcert.core.values`), measured;
- *output-bound violations*: true ||y - y^|| > output bound.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

_TAUS = np.logspace(-4, 0, 41)


@dataclass(frozen=True)
class Summary:
    """Headline numbers of one cell table at threshold ``tau``."""

    cells: int
    violations: int
    output_violations: int
    coverage: float
    joint_coverage: float
    danger: int
    danger_recall: float  # NaN when no cell is dangerous
    median_meter: float
    median_true_tv: float
    max_true_tv: float
    repaired: float  # fraction of cells the gate fired on

    def __post_init__(self):
        if self.cells < 0 or self.violations < 0:
            raise ValueError("cells and violations must be >= 0")


def summarize(table, tau: float) -> Summary:
    """The :class:`Summary` of a :class:`witcert.observatory.telemetry.CellTable` at ``tau``."""
    if len(table) == 0:
        return Summary(0, 0, 0, float("nan"), float("nan"), 0, float("nan"), *(float("nan"),) * 3, 0.0)
    meter, tv = table["meter"], table["true_tv"]
    known = ~np.isnan(tv)
    danger = known & (tv > tau)
    err, bound = table["true_output_error"], table["output_bound"]
    return Summary(
        cells=len(table),
        violations=int(np.sum(known & (tv > meter))),
        output_violations=int(np.sum(~np.isnan(err) & (err > bound))),
        coverage=float(np.mean(meter <= tau)),
        joint_coverage=float(np.mean(table["joint"])),
        danger=int(danger.sum()),
        danger_recall=float(np.mean(meter[danger] > tau)) if danger.any() else float("nan"),
        median_meter=float(np.median(meter)),
        median_true_tv=float(np.nanmedian(tv)) if known.any() else float("nan"),
        max_true_tv=float(np.nanmax(tv)) if known.any() else float("nan"),
        repaired=float(np.mean(table["repaired"])),
    )


def worst_cells(table, top: int = 3) -> list[tuple[int, int, float, float]]:
    """The ``top`` (layer, head) pairs by mean meter: (layer, head, mean meter, mean true TV)."""
    if len(table) == 0:
        return []
    keys = table["layer"].astype(np.int64) * 10_000 + table["head"].astype(np.int64)
    rows = []
    for key in np.unique(keys):
        sel = keys == key
        rows.append((int(key // 10_000), int(key % 10_000), float(table["meter"][sel].mean()),
                     float(np.nanmean(table["true_tv"][sel])) if (~np.isnan(table["true_tv"][sel])).any() else float("nan")))
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


def fmt(x: float, digits: int = 3) -> str:
    if x != x:  # NaN
        return "n/a"
    return f"{x:.{digits}f}"


def table_rows(results, tau: float, baseline: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the comparison table (one row per scheme)."""
    header = ["scheme [tier]", "task", "cells", "violations", f"coverage@{tau:g}", "joint cov", "danger recall",
              "median meter", "median TV", "worst (layer,head)", "KL", "top-1"]
    needle = any("needle_acc" in r.quality for r in results)
    gated = any(r.gated is not None for r in results)
    if needle:
        header += ["needle raw"] + (["needle gated"] if gated else [])
    if gated:
        header += ["gated KL", "fired / paged"]
    rows = []
    for r in results:
        s = summarize(r.raw, tau)
        worst = worst_cells(r.raw, 1)
        row = [f"{r.scheme} [{r.tier}]", r.task, str(s.cells), str(s.violations), fmt(s.coverage), fmt(s.joint_coverage),
               fmt(s.danger_recall) + f" ({s.danger})", fmt(s.median_meter, 4), fmt(s.median_true_tv, 4),
               f"L{worst[0][0]} H{worst[0][1]}" if worst else "-", fmt(r.quality["kl"], 4), fmt(r.quality["top1"])]
        if needle:
            row.append(fmt(r.quality.get("needle_acc", float("nan")), 2))
            if gated:
                row.append(fmt(r.extra.get("gated_quality", {}).get("needle_acc", float("nan")), 2))
        if gated:
            gq = r.extra.get("gated_quality", {})
            row += [fmt(gq.get("kl", float("nan")), 4), _fired_paged(r.gated, tau) if r.gated is not None else "-"]
        rows.append(row)
    return header, rows


def _fired_paged(gated, tau: float) -> str:
    """Fraction of cells the gate fired on / mean fraction of visible tokens paged in per cell."""
    paged = float(np.mean(gated["paged_fraction"])) if "paged_fraction" in gated.columns else float("nan")
    return f"{fmt(summarize(gated, tau).repaired, 2)} / {fmt(paged, 2)}"


def markdown_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(directory: Path, results, config, baseline: dict, model_source: str, wall_s: float) -> Path:
    """Write ``report.md`` and the PNG plots into ``directory``; returns the markdown path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    header, rows = table_rows(results, config.tau, baseline)
    plots = [_scatter(directory, results), _heatmaps(directory, results), _risk_coverage(directory, results, config.tau)]
    lines = [
        f"# WitCert observatory: {config.task}",
        "",
        f"- model: {model_source}",
        f"- schemes: {', '.join(config.schemes)}; tau = {config.tau:g}; "
        f"gate: {'certified block repair, tau = %g < 1' % config.tau if config.gate else 'off'}",
        f"- certificates: [A] Tier A band-norm witness (B = {config.bands}; adaptive-safe); [B] dithered-int8: "
        f"per-token min of Tier A and Tier B (delta_req = {config.delta_req:g} per request; sub-Gaussian branch "
        "only for the teacher-forced probe, deterministic Delta_t during greedy decoding)",
        f"- context {config.context_tokens} tokens, {config.cases} cases; cells = (layer, query head, query) "
        "over the probe chunk and the decode steps, after an exact prefill that is compressed on write",
        f"- wall time {wall_s:.1f} s",
    ]
    if "needle_acc" in baseline:
        lines.append(f"- needle accuracy without compression: {baseline['needle_acc']:.2f}")
    lines += ["", markdown_table(header, rows), "",
              "Violations count cells with true TV > meter (must be 0). Danger recall: fraction of cells with "
              "true TV > tau whose meter exceeds tau (count of such cells in brackets). KL is teacher-forced "
              "KL(p_exact || p_compressed) per probe token, top-1 the agreement of argmax tokens. "
              "Gated: fired = fraction of cells over tau, repaired by paging exact 16-token blocks in until the "
              "recomputed meter is <= tau; paged = mean fraction of a cell's visible tokens paged in.", ""]
    for r in results:
        worst = worst_cells(r.raw, 3)
        lines.append(f"- {r.scheme}: worst (layer, head) by mean meter: "
                     + ", ".join(f"L{l} H{h} (meter {m:.3f}, TV {t:.3f})" for l, h, m, t in worst))
    lines.append("")
    lines += [f"![{p.stem}]({p.name})" for p in plots if p is not None]
    path = directory / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _scatter(directory: Path, results, max_points: int = 20_000) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 5))
    rng = np.random.default_rng(0)
    for r in results:
        tv, meter = r.raw["true_tv"], r.raw["meter"]
        keep = ~np.isnan(tv)
        idx = np.flatnonzero(keep)
        if idx.size > max_points:
            idx = rng.choice(idx, max_points, replace=False)
        ax.scatter(np.maximum(tv[idx], 1e-8), np.maximum(meter[idx], 1e-8), s=2, alpha=0.3, label=r.scheme)
    ax.plot([1e-8, 1], [1e-8, 1], "k--", lw=1, label="meter = true TV")
    ax.set(xscale="log", yscale="log", xlabel="true TV (exact shadow)", ylabel="meter (proved bound)",
           title="meter vs true TV per cell (all points must lie above the line)")
    ax.legend(markerscale=4, fontsize=7)
    path = directory / "scatter_meter_vs_tv.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _heatmaps(directory: Path, results) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 5), squeeze=False)
    for ax, r in zip(axes[0], results):
        layers = int(r.raw["layer"].max()) + 1 if len(r.raw) else 1
        heads = int(r.raw["head"].max()) + 1 if len(r.raw) else 1
        grid = np.full((layers, heads), np.nan)
        for layer in range(layers):
            for head in range(heads):
                sel = (r.raw["layer"] == layer) & (r.raw["head"] == head)
                if sel.any():
                    grid[layer, head] = r.raw["meter"][sel].mean()
        im = ax.imshow(grid, aspect="auto", vmin=0, vmax=1, cmap="magma", origin="lower")
        ax.set(title=f"{r.scheme} [{r.tier}]", xlabel="query head")
    axes[0][0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[0].tolist(), label="mean meter")
    path = directory / "heatmap_layer_head.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _risk_coverage(directory: Path, results, tau: float) -> Path:
    """Left: certified coverage (meter <= t) and oracle coverage (true TV <= t) across thresholds t.
    Right: risk-coverage across the Tier B budget delta: coverage at tau against the measured
    violation rate (true TV > meter); Tier A schemes are deterministic (one point, delta = 0)."""
    plt = _plt()
    fig, (ax, ax_d) = plt.subplots(1, 2, figsize=(11, 4.5))
    for r in results:
        meter, tv = r.raw["meter"], r.raw["true_tv"]
        line = ax.plot(_TAUS, [np.mean(meter <= t) for t in _TAUS], label=f"{r.scheme}: meter <= t")
        color = line[0].get_color()
        known = ~np.isnan(tv)
        if known.any():
            ax.plot(_TAUS, [np.mean(tv[known] <= t) for t in _TAUS], ls=":", color=color,
                    label=f"{r.scheme}: true TV <= t (oracle)")
        points = _delta_points(r, config_delta=r.extra.get("delta_req", 1e-2))
        xs, ys, labels = zip(*[(np.mean(m <= tau), np.mean(known & (tv > m)), lab) for lab, m in points])
        ax_d.plot(xs, ys, marker="o", color=color, label=f"{r.scheme} [{r.tier}]")
        for x, y, lab in zip(xs, ys, labels):
            ax_d.annotate(lab, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.axvline(tau, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="threshold t", ylabel="fraction of cells",
           title="certified vs oracle coverage (no cell below its meter)")
    ax.legend(fontsize=6)
    ax_d.set(xlabel=f"coverage at tau = {tau:g}", ylabel="measured risk: fraction of cells with true TV > meter",
             title="risk-coverage across delta (Tier B; Tier A: delta = 0)")
    ax_d.set_ylim(bottom=-0.01)
    ax_d.legend(fontsize=6)
    path = directory / "risk_coverage.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _delta_points(result, config_delta: float) -> list[tuple[str, np.ndarray]]:
    """(label, meter column) per budget: the run's delta_req plus any swept Tier B budgets."""
    if result.tier != "B":
        return [("delta=0", result.raw["meter"])]
    points = [(f"delta={config_delta:g}", result.raw["meter"])]
    for name in result.raw.columns:
        if name.startswith("meter_delta="):
            points.append((name.removeprefix("meter_"), result.raw[name]))
    return sorted(points, key=lambda p: float(p[0].split("=")[1]))

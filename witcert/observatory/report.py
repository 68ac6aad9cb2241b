"""Summaries and the report directory (markdown + PNG plots, matplotlib Agg) of an observatory run.

The meter of a cell (layer, query head, query position) is an upper bound on how much attention
moved: the total variation (TV) between attention over the exact keys and over the compressed
keys; proved, or holding with probability at least ``1 - delta`` where the spot check or Tier B's
probabilistic branch gave it (each cell's ``bound_kind``, :mod:`witcert.integrations.hf.bound_kind`;
:func:`bound_lines` counts each kind). Definitions, per cell, at threshold ``tau``:

- *violation*: true TV > meter (must never happen: the meter is a proved upper bound);
- *coverage*: fraction of cells with meter <= tau (certified safe at tau); *deterministic
  coverage*: the same for the meter before the spot check (``meter_before_spot``; the meter
  itself without one);
- *danger*: true TV > tau; *danger recall*: fraction of dangerous cells with meter > tau
  (1 whenever there is no violation; reported to show it measured, not assumed);
- *joint coverage*: fraction with pass_K and pass_V (:mod:`witcert.core.values`), measured;
- *output-bound violations*: true ||y - y^|| > output bound;
- with a gate: *fired* (cells repaired), *paged* (fraction of a cell's visible tokens paged in),
  and the meter and true TV of every cell after repair.

Two tables: :func:`terminal_rows` (what ``witcert observe`` prints: eleven columns, fits a 100-column
terminal, :func:`terminal_legend` under it) and :func:`table_rows` (every column, in ``report.md``
with :data:`COLUMN_DOCS`). With one case per scheme, the columns whose unit is the case (KL, top-1,
needle accuracy) are marked ``*``: one case is an example, not a rate. Rankings of layers and heads use
:func:`witcert.integrations.hf.ranking.riskiest` (the statistic measured to follow the true TV).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from witcert.integrations.hf import bound_kind, ranking
from witcert.observatory.run_plot import plot_run

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
    paged: float = float("nan")  # mean fraction of a cell's visible tokens paged in (gated tables)
    coverage_after: float = float("nan")  # meter after repair <= tau (gated tables)
    max_true_tv_after: float = float("nan")
    violations_after: int = 0  # true TV after repair > meter after repair (must be 0)
    coverage_deterministic: float = float("nan")  # meter before the spot check <= tau (= coverage without one)
    spot: bool = False  # the spot check ran

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
        **_after_repair(table, tau),
        coverage_deterministic=float(np.mean(table[DETERMINISTIC] <= tau)) if DETERMINISTIC in table.columns
        else float(np.mean(meter <= tau)),
        spot=DETERMINISTIC in table.columns,
    )


DETERMINISTIC = "meter_before_spot"  # the meter before the spot check (witcert.spot.cells)
ONE_CASE = "*"  # marks a column whose unit is the case when a run has one case per scheme


def bound_lines(results) -> list[str]:
    """One line per scheme: how many cells carry a proved bound and how many one holding with probability 1 - delta."""
    return [f"bounds, {r.scheme}: {bound_kind.counts(r.raw).describe()}" for r in results if len(r.raw)]


def _after_repair(table, tau: float) -> dict:
    """The :class:`Summary` fields of a gated table's after-repair columns (none for an ungated one)."""
    if "meter_after" not in table.columns:
        return {}
    after, tv = table["meter_after"], table["true_tv_after"]
    known = ~np.isnan(tv)
    return dict(paged=float(np.mean(table["paged_fraction"])), coverage_after=float(np.mean(after <= tau)),
                max_true_tv_after=float(np.max(tv[known])) if known.any() else float("nan"),
                violations_after=int(np.sum(known & (tv > after))))


def riskiest(table, by=("layer", "head"), top: int = 3) -> list[dict]:
    """The ``top`` riskiest groups ``by`` (layer, head) by the ranking statistic, with meter and true TV
    (:func:`witcert.integrations.hf.ranking.riskiest`)."""
    return ranking.riskiest(table, tuple(by), top)


def _named(row: dict) -> str:
    return f"L{row['layer']}" + (f" H{row['head']}" if "head" in row else "")


def fmt(x: float, digits: int = 3) -> str:
    if x != x:  # NaN
        return "n/a"
    return f"{x:.{digits}f}"


def table_rows(results, tau: float, baseline: dict, cases: int | None = None) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the full comparison table of ``report.md`` (one row per scheme; :data:`COLUMN_DOCS`).

    ``cases``: cases per scheme; with 1 the columns whose unit is the case are marked :data:`ONE_CASE`.
    """
    spot = any(DETERMINISTIC in r.raw.columns for r in results)
    header = ["scheme [tier]", "task", "cells", "bounds", "violations", f"certified@{tau:g}"]
    header += [f"spot certified@{tau:g}"] if spot else []
    header += ["joint cov", "danger recall", "median meter", "median TV", "riskiest layer (mean TV)",
               "riskiest head (mean TV)", _per_case("KL", cases), _per_case("top-1", cases)]
    needle = any("needle_acc" in r.quality for r in results)
    gated = any(r.gated is not None for r in results)
    if needle:
        header += [_per_case("needle raw", cases)] + ([_per_case("needle gated", cases)] if gated else [])
    if gated:
        header += ["gated KL", "fired", "paged", f"certified@{tau:g} after", "max TV after", "violations after"]
    rows = []
    for r in results:
        s = summarize(r.raw, tau)
        row = [f"{r.scheme} [{r.tier}]", r.task, str(s.cells), _bounds_cell(r.raw), str(s.violations),
               fmt(s.coverage_deterministic)]
        row += [fmt(s.coverage) if s.spot else "-"] if spot else []
        row += [fmt(s.joint_coverage), fmt(s.danger_recall) + f" ({s.danger})", fmt(s.median_meter, 4),
                fmt(s.median_true_tv, 4), _top(r.raw, ("layer",)), _top(r.raw, ("layer", "head")),
                fmt(r.quality["kl"], 4), fmt(r.quality["top1"])]
        if needle:
            row.append(fmt(r.quality.get("needle_acc", float("nan")), 2))
            if gated:
                row.append(fmt(r.extra.get("gated_quality", {}).get("needle_acc", float("nan")), 2))
        if gated:
            g = summarize(r.gated, tau) if r.gated is not None else None
            row += [fmt(r.extra.get("gated_quality", {}).get("kl", float("nan")), 4)]
            row += ["-"] * 5 if g is None else [fmt(g.repaired), fmt(g.paged), fmt(g.coverage_after),
                                                fmt(g.max_true_tv_after, 4), str(g.violations_after)]
        rows.append(row)
    return header, rows


def _bounds_cell(table) -> str:
    """``"370 proved, 3,950 p >= 1 - 1e-06"``: the cells of each bound kind."""
    counts = bound_kind.counts(table)
    if not counts.probabilistic:
        return f"{counts.proved:,d} proved"
    return f"{counts.proved:,d} proved, {counts.probabilistic:,d} p >= 1 - {counts.max_delta:.2g}"


def _top(table, by) -> str:
    best = ranking.riskiest(table, by, 1)
    return f"{_named(best[0])} ({fmt(best[0]['mean_true_tv'], 4)})" if best else "-"


TERMINAL_LEGEND = (
    "meter: a proved upper bound on how much attention moved (the total variation between attention\n"
    "over exact and over compressed keys), per (layer, head, query). cert.: fraction of cells with\n"
    "meter <= tau (certified) before any spot check. spot: the same with the spot check, whose bound\n"
    "holds with probability >= 1 - delta per cell ('bounds' below counts each kind). viol.: cells\n"
    "whose measured TV exceeds the meter (must be 0). meter/TV: medians of the meter and of the\n"
    "true TV. risky: the layer ranked riskiest. KL: teacher-forced KL(exact || compressed) per\n"
    "probe token. needle: accuracy raw > gated. fired/paged: fraction of cells the gate repaired /\n"
    "of their visible tokens paged in. after: certified fraction / max true TV after repair.\n"
    "Every column: report.md."
)


def terminal_legend(cases: int | None = None) -> str:
    """:data:`TERMINAL_LEGEND`, and what the ``*`` marks mean when the run has one case per scheme."""
    if cases != 1:
        return TERMINAL_LEGEND
    return (TERMINAL_LEGEND + f"\n{ONE_CASE}: rests on one case per scheme, an example rather than a rate "
            "(--cases 4: the full sweep).")


def _per_case(name: str, cases: int | None) -> str:
    return name + ONE_CASE if cases == 1 else name


def terminal_rows(results, tau: float, cases: int | None = None) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the printed table: eleven columns at most (fits 100 columns; :func:`terminal_legend`).

    ``cases``: cases per scheme; with 1 the columns whose unit is the case are marked :data:`ONE_CASE`.
    """
    needle = any("needle_acc" in r.quality for r in results)
    gated = any(r.gated is not None for r in results)
    spot = any(DETERMINISTIC in r.raw.columns for r in results)
    header = ["scheme [tier]", "cells", "viol.", "cert."] + (["spot"] if spot else [])
    header += ["meter/TV", "risky", _per_case("KL", cases)]
    header += [_per_case("needle", cases)] if needle else []
    header += ["fired/paged", "after"] if gated else []
    rows = []
    for r in results:
        s = summarize(r.raw, tau)
        risky = ranking.riskiest(r.raw, ("layer",), 1)
        row = [f"{r.scheme} [{r.tier}]", str(s.cells), str(s.violations), fmt(s.coverage_deterministic)]
        row += [fmt(s.coverage) if s.spot else "-"] if spot else []
        row += [f"{fmt(s.median_meter, 2)}/{fmt(s.median_true_tv, 3)}", _named(risky[0]) if risky else "-",
                fmt(r.quality["kl"], 4)]
        if needle:
            raw = fmt(r.quality.get("needle_acc", float("nan")), 2)
            after = r.extra.get("gated_quality", {}).get("needle_acc")
            row.append(raw if after is None else f"{raw}>{fmt(after, 2)}")
        if gated:
            g = summarize(r.gated, tau) if r.gated is not None else None
            row += ["-", "-"] if g is None else [f"{fmt(g.repaired, 2)}/{fmt(g.paged, 2)}",
                                                 f"{fmt(g.coverage_after, 2)}/{fmt(g.max_true_tv_after, 3)}"]
        rows.append(row)
    return header, rows


COLUMN_DOCS = [
    "The meter of a cell (layer, query head, query) is a proved upper bound on how much attention moved: the "
    "total variation (TV) between attention over the exact keys and over the compressed keys (0: unchanged; "
    f"1: the bound says nothing; *saturated*: meter >= {ranking.SATURATED:g}). Where the spot check lowered it "
    "(or Tier B's probabilistic branch entered it) it holds with probability at least 1 - delta instead: the "
    "column *bounds* and the lines under the table count each kind. The true TV is measured against the exact "
    "cache the run keeps. Attention moving is not the answer changing: KL, top-1 and the needle accuracy "
    "measure that.",
    "",
    "- **scheme [tier]**: the compressed cache and its certificate: [A] the Tier A band-norm witness (any "
    "scheme, every query), [B] the dithered-int8 cache's Tier B bound (its minimum with Tier A). **task**: the "
    "workload (needle, text, code or a file).",
    "- **cells**: measured (layer, query head, query) cells over the probe chunk and the decode steps.",
    "- **bounds**: how many cells carry a proved meter and how many a meter that holds with probability at "
    "least 1 - delta (the largest delta shown): the spot check lowered it, or Tier B's sub-Gaussian branch "
    "entered it (the teacher-forced probe of the dithered cache). Each cell's `bound_kind` and `bound_delta` "
    "in `telemetry.jsonl`.",
    "- **violations**: cells whose true TV exceeds the meter. Must be 0; `witcert observe` exits 1 otherwise.",
    "- **certified@tau**: fraction of cells whose deterministic meter (before any spot check) is <= tau: their "
    "TV is proved to be at most tau (Tier B's probe cells: with probability 1 - delta).",
    "- **spot certified@tau**: fraction of cells whose reported meter, min(deterministic meter, spot bound), "
    "is <= tau: their TV is at most tau, with probability at least 1 - delta per spot-checked cell.",
    "- **joint cov**: fraction of cells that pass both the key test (meter <= tau) and the value test "
    "(`witcert.core.values`).",
    "- **danger recall**: of the cells with true TV > tau (count in brackets), the fraction whose meter "
    "exceeds tau. 1 whenever there is no violation; n/a when no cell is dangerous.",
    "- **median meter / median TV**: medians over the cells.",
    "- **riskiest layer / riskiest head (mean TV)**: the group ranked first by the risk ranking "
    f"(`{ranking.RANK_BY}` score: the raw e-form behind the meter, not clamped at 1, measured to rank layers "
    "and heads like their true TV; results page, \"Which layers are risky\"), with its mean true TV.",
    "- **KL**: teacher-forced KL(p_exact || p_compressed) per probe token; **top-1**: agreement of the argmax "
    "tokens with the uncompressed model.",
    f"- A column marked `{ONE_CASE}` rests on one case per scheme (the demo's default): an example, not a rate; "
    "`--cases 4` runs the full sweep.",
    "- **needle raw / needle gated**: needle exact-match accuracy without and with the gate.",
    "- **gated KL**: KL with the gate.",
    "- **fired**: fraction of cells over tau that the gate repaired, by paging exact 16-token blocks in "
    "(largest contribution first) until the meter, recomputed on the repaired cache, is <= tau.",
    "- **paged**: mean fraction of a cell's visible tokens paged in (over every cell).",
    "- **certified@tau after / max TV after / violations after**: the same figures after repair "
    "(meter and true TV of the repaired attention).",
]


def markdown_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(directory: Path, results, config, baseline: dict, model_source: str, wall_s: float) -> Path:
    """Write ``report.md`` and the PNG plots into ``directory``; returns the markdown path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cases = config.cases if config.task != "prompt" else None
    header, rows = table_rows(results, config.tau, baseline, cases)
    plots = [_scatter(directory, results), _heatmaps(directory, results), _risk_coverage(directory, results, config.tau),
             *_run_pictures(directory, results, config.tau)]
    lines = [
        f"# WitCert observatory: {config.task}",
        "",
        f"- model: {model_source}",
        f"- schemes: {', '.join(config.schemes)}; tau = {config.tau:g}; "
        f"gate: {'certified block repair, tau = %g < 1' % config.tau if config.gate else 'off'}",
        f"- certificates: [A] Tier A band-norm witness (B = {config.bands}; adaptive-safe); [B] dithered-int8: "
        f"per-token min of Tier A and Tier B (delta_req = {config.delta_req:g} per request; sub-Gaussian branch "
        "only for the teacher-forced probe, deterministic Delta_t during greedy decoding)",
        *([f"- spot check on the cells above tau: {config.spot_keys} exact keys read per checked cell with the "
           "meter's own randomness; its bound holds with probability >= 1 - delta per cell (column bounds)"]
          if config.certificate == "spot" else []),
        f"- mode: {'validation (the exact cache kept: true TV per cell)' if config.keep_exact else 'production (keep_exact=False: no exact cache, no true TV)'}",
        f"- context {config.context_tokens} tokens, {1 if cases is None else config.cases} case(s); cells = "
        "(layer, query head, query) over the probe chunk and the decode steps, after an exact prefill that is "
        "compressed on write",
        f"- wall time {wall_s:.1f} s",
    ]
    if "needle_acc" in baseline:
        lines.append(f"- needle accuracy without compression: {baseline['needle_acc']:.2f}")
    lines += ["", markdown_table(header, rows), "", "## How to read it", "", *COLUMN_DOCS, "",
              *[f"- {line}" for line in bound_lines(results)], "",
              "## Riskiest layers and heads", "",
              f"Ranked by the `{ranking.RANK_BY}` score of their cells; an order for triage, not a bound (the "
              "per-cell meter is the bound). Mean meter, fraction saturated and mean / max true TV beside it.", ""]
    for r in results:
        for label, by in (("layers", ("layer",)), ("heads", ("layer", "head"))):
            lines.append(f"- {r.scheme}, riskiest {label}: " + ", ".join(
                f"{_named(g)} (meter {g['mean_meter']:.3f}, saturated {g['saturated']:.2f}, "
                f"TV {fmt(g['mean_true_tv'], 4)} / max {fmt(g['max_true_tv'], 4)})" for g in riskiest(r.raw, by, 6)))
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


def _scatter(directory: Path, results, max_points: int = 20_000) -> Path | None:
    if not any((~np.isnan(r.raw["true_tv"])).any() for r in results if len(r.raw)):
        return None  # production: no true TV, nothing to set the meter against
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
    mixed = any(bound_kind.counts(r.raw).probabilistic for r in results)
    ax.set(xscale="log", yscale="log", xlabel="true TV (exact shadow)",
           ylabel="meter (proved, or with probability >= 1 - delta)" if mixed else "meter (proved bound)",
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
             title="risk-coverage across delta (Tier B; Tier A: delta = 0, or the spot check's)")
    ax_d.set_ylim(bottom=-0.01)
    ax_d.legend(fontsize=6)
    path = directory / "risk_coverage.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _run_pictures(directory: Path, results, tau: float) -> list[Path]:
    """One ``run-<scheme>.png`` per scheme (:func:`witcert.observatory.run_plot.plot_run`): meter and true TV per
    (layer, position), saturated and repaired cells marked (the gated run's cells when the gate ran)."""
    paths = []
    for r in results:
        table = r.gated if r.gated is not None else r.raw  # the gated run marks the cells it repaired
        if len(table):
            path = directory / f"run-{_file_name(r.scheme)}.png"
            plot_run(table, tau, path, title=f"{r.scheme} [{r.tier}]" + (", gated" if r.gated is not None else ""))
            paths.append(path)
    return paths


def _file_name(scheme: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in scheme)


def _delta_points(result, config_delta: float) -> list[tuple[str, np.ndarray]]:
    """(label, meter column) per budget: the run's delta_req plus any swept Tier B budgets."""
    if result.tier != "B":
        spot = bound_kind.counts(result.raw)
        return [(f"spot delta<={spot.max_delta:.0e}" if spot.probabilistic else "delta=0", result.raw["meter"])]
    points = [(f"delta={config_delta:g}", result.raw["meter"])]
    for name in result.raw.columns:
        if name.startswith("meter_delta="):
            points.append((name.removeprefix("meter_"), result.raw[name]))
    return sorted(points, key=lambda p: float(p[0].split("=")[1]))  # Tier B: every label is delta=<d>

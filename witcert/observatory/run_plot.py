"""A picture of one monitored run: the meter per (layer, step), the true TV beside it, and every cell's pair.

``run_grid`` reduces a cell table (:meth:`witcert.Monitor.table`, one row per request, layer, query
head and step) to a (layer x step) grid: a step is a query position, and each grid entry holds the
*largest* meter over the heads and requests at that layer and position, the largest true TV (where
the exact cache was kept), and whether any of those cells was saturated (meter >= 0.99) or repaired
by the gate. ``plot_run`` draws from it (a matplotlib ``Figure``; pyplot is not used), with the
exact cache kept (validation):

1. the meter heatmap, saturated entries marked ``x`` and repaired ones ``o``;
2. the true TV heatmap on the same colour scale;
3. every cell's true TV against its meter on log axes: each point must lie on or above the
   diagonal (the meter is an upper bound); after a gate, the repaired cells' meters after repair.

Without the exact cache (production, ``keep_exact=False``) there is no true TV to draw: one meter
heatmap per request instead (the first :data:`MAX_REQUESTS`), so no panel is empty and no request
is merged into another.

Every title says which bound it shows (:mod:`witcert.integrations.hf.bound_kind`): *proved*, or
holding with probability ``1 - delta`` (the spot check, Tier B's probabilistic branch), with the
count of each; the scatter draws the two kinds apart, and marks the spot-checked cells that read
every key they see (a context shorter than ``spot_keys``): their bound is their exact TV, which
says nothing about how tight a sampled check is.

The figure shows the data the table holds, nothing computed anew: ``tests/test_run_plot.py`` checks
the grid against the table cell by cell.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from witcert.integrations.hf import bound_kind
from witcert.integrations.hf.ranking import SATURATED

_FLOOR = 1e-8  # log axes: a meter or TV of 0 is drawn at this floor
MAX_REQUESTS = 4  # production pictures: one meter panel per request, at most this many
_COLOUR_FLOOR = 1e-4  # heatmaps: the colour scale spans [1e-4, 1] (a lossless cache's ~1e-13 meters would flatten it)


@dataclass(frozen=True)
class RunGrid:
    """A cell table reduced to (layer x step): each entry the worst cell over heads and requests."""

    layers: np.ndarray  # (L,) layer indices present in the table
    steps: np.ndarray  # (T,) query positions present in the table, ascending
    meter: np.ndarray  # (L, T) largest meter; NaN where no cell was measured
    true_tv: np.ndarray  # (L, T) largest true TV; NaN where unknown (keep_exact=False) or no cell
    saturated: np.ndarray  # (L, T) bool: some cell there has meter >= SATURATED
    repaired: np.ndarray  # (L, T) bool: the gate repaired some cell there


def run_grid(table) -> RunGrid:
    """Reduce ``table`` (a :class:`~witcert.integrations.hf.telemetry.CellTable`) to a :class:`RunGrid`."""
    if not len(table):
        raise ValueError("table: the run measured no cell (nothing to draw); run the model inside the monitor first")
    layers, layer_of = np.unique(table["layer"].astype(np.int64), return_inverse=True)
    steps, step_of = np.unique(table["pos"].astype(np.int64), return_inverse=True)
    shape = (len(layers), len(steps))
    meter, tv = table["meter"].astype(np.float64), table["true_tv"].astype(np.float64)
    repaired = table["repaired"].astype(bool) if "repaired" in table.columns else np.zeros(len(table), bool)
    return RunGrid(layers=layers, steps=steps,
                   meter=_largest(shape, layer_of, step_of, meter),
                   true_tv=_largest(shape, layer_of, step_of, tv),
                   saturated=_any(shape, layer_of, step_of, meter >= SATURATED),
                   repaired=_any(shape, layer_of, step_of, repaired))


def _largest(shape, rows, cols, values) -> np.ndarray:
    """Largest non-NaN value per (row, col); NaN where there is none."""
    out = np.full(shape, -np.inf)
    known = ~np.isnan(values)
    np.maximum.at(out, (rows[known], cols[known]), values[known])
    out[np.isneginf(out)] = np.nan
    return out


def _any(shape, rows, cols, flags) -> np.ndarray:
    out = np.zeros(shape, dtype=bool)
    out[rows[flags], cols[flags]] = True
    return out


def plot_run(table, tau: float = 0.2, path: str | Path | None = None, title: str | None = None):
    """Draw a run (see the module docstring); returns the matplotlib ``Figure``, saved to ``path`` if given.

    Parameters
    ----------
    table : CellTable
        The run's cells (:meth:`witcert.Monitor.table`).
    tau : float
        The certification threshold drawn as a contour level and a guide line in the scatter.
    path : str or Path, optional
        Where to save a PNG (its folder is created).
    title : str, optional
        Shown before the headline (cells, certified fraction, bounds of each kind, violations), e.g. the
        scheme's name.
    """
    grid = run_grid(table)
    bounds = bound_kind.counts(table)
    if np.isnan(grid.true_tv).all():
        fig = _production_figure(table, bounds)
    else:
        fig = _figure(figsize=(15, 4.6), layout="constrained")
        ax_m, ax_tv, ax_s = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1, 0.9]})
        image = _meter_panel(ax_m, grid, bounds)
        _heatmap(ax_tv, grid, grid.true_tv)
        ax_tv.set(title="true TV (exact cache), worst head")
        _colourbar(fig, image, [ax_m, ax_tv])
        _scatter(ax_s, table, tau)
    headline = _headline(table, tau, bounds)
    fig.suptitle(f"{title}: {headline}" if title else headline, fontsize=10)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


def _production_figure(table, bounds: bound_kind.BoundCounts):
    """No true TV: one meter heatmap per request (the first :data:`MAX_REQUESTS`), none merged, none empty."""
    requests = np.unique(table["request"].astype(np.int64)) if "request" in table.columns else np.array([0])
    shown = requests[:MAX_REQUESTS]
    fig = _figure(figsize=(4.6 * len(shown) + 1.5, 4.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(shown), squeeze=False)[0])
    for ax, request in zip(axes, shown):
        cells = table.where(table["request"] == request) if "request" in table.columns else table
        image = _meter_panel(ax, run_grid(cells), bounds, f"request {int(request)}: ")
    more = f" (requests {', '.join(map(str, shown))} of {len(requests)})" if len(requests) > len(shown) else ""
    axes[0].set_ylabel("layer")
    _colourbar(fig, image, list(axes), f"meter, no true TV (keep_exact=False){more}")
    return fig


def _meter_panel(ax, grid: RunGrid, bounds: bound_kind.BoundCounts, prefix: str = ""):
    """The meter heatmap of ``grid`` with its marks, titled with the kind of bound it shows."""
    image = _heatmap(ax, grid, grid.meter)
    _mark(ax, grid, grid.saturated, "x", "saturated (meter >= %g)" % SATURATED)
    _mark(ax, grid, grid.repaired, "o", "repaired by the gate")
    kind = (f"proved, or p >= 1 - {bounds.max_delta:.2g}" if bounds.probabilistic else "proved bound")
    ax.set(title=f"{prefix}meter ({kind}), worst head", ylabel="layer")
    if grid.saturated.any() or grid.repaired.any():
        ax.legend(loc="upper right", fontsize=7, framealpha=0.8)
    return image


def _colourbar(fig, image, axes, label: str | None = None) -> None:
    fig.colorbar(image, ax=axes, fraction=0.03, pad=0.01,
                 label=label or f"total variation (log; below {_COLOUR_FLOOR:g} drawn at the floor)")


def _heatmap(ax, grid: RunGrid, values: np.ndarray):
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import MaxNLocator

    image = ax.imshow(np.maximum(values, _COLOUR_FLOOR), aspect="auto", origin="lower", cmap="magma",
                      norm=LogNorm(_COLOUR_FLOOR, 1.0), extent=_extent(grid), interpolation="nearest")
    ax.set_xlabel("query position")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return image


def _extent(grid: RunGrid) -> tuple[float, float, float, float]:
    """Image extent so that each entry is centred on its position and layer (positions may have gaps)."""
    lo, hi = float(grid.steps[0]), float(grid.steps[-1])
    half = 0.5 * max((hi - lo) / max(len(grid.steps) - 1, 1), 1.0)
    return lo - half, hi + half, float(grid.layers[0]) - 0.5, float(grid.layers[-1]) + 0.5


# saturated entries are drawn near the top of the colour scale (pale): a black x; repaired ones are above tau: cyan
_MARKS = {"x": {"marker": "x", "c": "black"}, "o": {"marker": "o", "facecolors": "none", "edgecolors": "cyan"}}


def _mark(ax, grid: RunGrid, flags: np.ndarray, marker: str, label: str) -> None:
    rows, cols = np.nonzero(flags)
    if rows.size:
        ax.scatter(grid.steps[cols], grid.layers[rows], s=14, linewidths=0.8, label=label, **_MARKS[marker])


def _scatter(ax, table, tau: float, max_points: int = 20_000) -> None:
    meter, tv = table["meter"].astype(np.float64), table["true_tv"].astype(np.float64)
    known = np.flatnonzero(~np.isnan(tv) & ~np.isnan(meter))
    if known.size > max_points:  # a fixed subsample: the picture, not the data, is thinned
        known = np.random.default_rng(0).choice(known, max_points, replace=False)
    kind, delta = bound_kind.labels_of(table)
    whole = bound_kind.read_every_key(table)
    groups = [(kind[known] == bound_kind.PROVED, "cell, proved bound", {}),
              ((kind[known] == bound_kind.PROBABILISTIC) & ~whole[known],
               f"cell, bound with p >= 1 - {np.nanmax(delta[known], initial=0):.2g}", {}),
              (whole[known], "spot check read every key: bound = exact TV", {"marker": "s", "s": 6})]
    for chosen, label, style in groups:
        points = known[chosen]
        if points.size:
            ax.scatter(np.maximum(tv[points], _FLOOR), np.maximum(meter[points], _FLOOR), alpha=0.35, label=label,
                       **({"s": 2} | style))
    if "meter_after" in table.columns and "repaired" in table.columns:
        fixed = known[table["repaired"][known].astype(bool)]
        after = table["true_tv_after"][fixed].astype(np.float64)
        ax.scatter(np.maximum(after, _FLOOR), np.maximum(table["meter_after"][fixed].astype(np.float64), _FLOOR),
                   s=3, alpha=0.5, label="repaired cell, after repair")
    ax.plot([_FLOOR, 1], [_FLOOR, 1], "k--", lw=1, label="meter = true TV")
    ax.axhline(tau, color="grey", lw=0.8, ls=":", label=f"tau = {tau:g}")
    ax.set(xscale="log", yscale="log", xlabel="true TV", ylabel="meter",
           title="every cell on or above the diagonal")
    if whole.any():
        ax.text(0.02, 0.98, f"{int(whole.sum()):,d} spot-checked cells read every key\n(context shorter than "
                "spot_keys):\ntheir bound is the exact TV,\nnot a sign of tightness", transform=ax.transAxes,
                fontsize=7, va="top")
    ax.legend(fontsize=7, markerscale=3, loc="lower right")


def _headline(table, tau: float, bounds: bound_kind.BoundCounts) -> str:
    meter, tv = table["meter"].astype(np.float64), table["true_tv"].astype(np.float64)
    seen = ~np.isnan(meter)
    known = seen & ~np.isnan(tv)
    violations = f", violations {int(np.sum(tv[known] > meter[known]))}" if known.any() else ""
    kinds = (f" ({bounds.proved:,d} proved, {bounds.probabilistic:,d} with p >= 1 - {bounds.max_delta:.2g})"
             if bounds.probabilistic else " (every bound proved)")
    return (f"{int(seen.sum())} cells{kinds}, certified at tau = {tau:g}: {np.mean(meter[seen] <= tau):.3f}"
            f"{violations}")


def _figure(**kwargs):
    """A ``Figure`` outside pyplot: no backend is switched and no figure stays registered (a notebook shows it)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting a run needs matplotlib: pip install 'witcert[observatory]'") from None
    return Figure(**kwargs)

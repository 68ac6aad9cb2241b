"""Cell telemetry: flatten :class:`witcert.integrations.hf.cells.CellBatch` records into columns and JSONL.

Every column is listed with its meaning in :data:`COLUMNS` (and on the documentation's column
reference, generated from it). One JSONL line per cell: the run tags, ``request`` (the monitor's
request id of the cell's batch row), ``case`` (observatory workload case), ``layer``, ``head``, ``pos`` (absolute query
position), ``batch`` (row in its forward call), ``tier`` (the certificate actually used: ``"A"``
or ``"B"``, never ``"auto"``), ``adaptive`` (Tier B used only its deterministic branch), ``meter``,
``risk``, ``true_tv``, ``output_bound``, ``true_output_error``, ``joint``, ``c_max``,
``repaired``. ``risk`` is the raw e-form score (``inf`` on overflow, written as the string
``"inf"``): above 1 it carries no guarantee. ``true_tv`` is ``null`` when the exact keys were not
kept. Cells of a dithered cache also carry ``seed`` (the secret Philox seed drawn for the
request): with it and ``request`` a run can be replayed. Cells of a gated monitor also carry
``paged_fraction`` (fraction of the cell's visible tokens paged in), ``bytes_paged``,
``meter_after`` (the meter of the repaired attention: recomputed where the gate fired, the cell's
own meter elsewhere) and ``true_tv_after`` (its TV against the exact logits; ``null`` when the
exact keys were not kept). ``tier_b_delta`` is the failure probability of Tier B's probabilistic
branch per cell where it was used (0 elsewhere). Every table also carries the two label columns of
:mod:`witcert.integrations.hf.bound_kind`: ``bound_kind`` (``"proved"``, ``"probabilistic"``, or
``"none"`` for a cell without a meter) and ``bound_delta`` (the probability that the cell's bound
fails: 0 when proved).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from witcert.integrations.hf import bound_kind

# Every column a cell table (and its JSONL line) can carry: (name, when present, meaning). The one source of
# the column list: docs/reference/columns.md is generated from it (scripts/gen_cli_reference.py), and
# tests/test_columns_documented.py checks every column a monitored run produces is here.
COLUMNS = (
    ("case", "always", "the observatory's workload case (0 outside `witcert observe`)"),
    ("request", "always", "the monitor's request id of the cell's batch row (one per row of each cache)"),
    ("layer", "always", "decoder layer"),
    ("head", "always", "query head"),
    ("pos", "always", "absolute query position (one per decoded token at decode time)"),
    ("batch", "always", "row of the cell in its forward call"),
    ("tier", "always", "the certificate used: `A` (band-norm witness) or `B` (the dithered cache, with the Tier A "
     "minimum); never `auto`"),
    ("adaptive", "always", "the query may depend on the dither (inside `generate`, or not declared non-adaptive): "
     "Tier B used only its deterministic branch"),
    ("tier_b_delta", "always", "failure probability of Tier B's probabilistic branch for the cell where it was used "
     "(`delta_loc` of a non-adaptive call of the dithered cache), else 0"),
    ("meter", "always", "the reported upper bound on the cell's attention TV, in [0, 1]; NaN on a row that sees no "
     "token or a cell sampled metering left out"),
    ("risk", "always", "the raw e-form score behind the meter, not clamped at 1 (`inf` on overflow, written "
     "`\"inf\"`); above 1 no guarantee, an order for triage"),
    ("true_tv", "always", "TV between attention over the exact and over the compressed keys, measured against the "
     "exact cache; `null` with `keep_exact=False`"),
    ("output_bound", "always", "upper bound on the norm of the attention output's error `y - y^`: "
     "2 meter max_t norm(v_t) + sum_t p~_t norm(v^_t - v_t)"),
    ("true_output_error", "always", "the output's error measured against the exact cache; `null` with "
     "`keep_exact=False`"),
    ("joint", "always", "the cell passes both the key test (meter <= tau) and the value test"),
    ("c_max", "always", "the largest per-token logit-error radius over the visible tokens"),
    ("repaired", "always", "the gate fired on the cell (its output was recomputed over the repaired cache)"),
    ("bound_kind", "always", "`proved`, `probabilistic` (the meter holds with probability >= 1 - `bound_delta`: the "
     "spot check lowered it, or Tier B's probabilistic branch entered it) or `none` (no meter)"),
    ("bound_delta", "always", "probability that the cell's meter fails to bound its TV: 0 when proved, NaN for `none`"),
    ("seed", "the dithered cache", "the secret Philox seed drawn for the request (replay with `request`)"),
    ("meter_delta=<d>", "`witcert observe`, the dithered cache", "the Tier B meter at request budget `d` "
     "(the risk-coverage plot)"),
    ("meter_before_spot", "`certificate=\"spot\"`", "the meter before the spot check (proved; Tier B's "
     "probabilistic branch included on non-adaptive calls)"),
    ("spot_bound", "`certificate=\"spot\"`", "the spot check's bound, NaN where no check ran (meter <= tau)"),
    ("spot_keys", "`certificate=\"spot\"`", "exact keys the check read"),
    ("spot_rounds", "`certificate=\"spot\"`", "rounds of exact keys the adaptive check read (0 where no check ran)"),
    ("spot_bytes", "`certificate=\"spot\"`", "bytes those reads moved (the drawn key rows, each checked against its checksum in production)"),
    ("spot_delta", "`certificate=\"spot\"`", "failure probability of the cell's checks (0 where none ran; with "
     "the spot-certified gate, its checks' budgets added)"),
    ("paged_fraction", "a gate", "fraction of the cell's visible tokens paged in exactly"),
    ("bytes_paged", "a gate", "bytes paged in from the backing store (0 from the exact cache in memory)"),
    ("meter_after", "a gate", "the meter of the repaired attention (the cell's own meter where the gate did not fire)"),
    ("true_tv_after", "a gate", "its TV against the exact logits; `null` with `keep_exact=False`"),
    ("spot_gate_checks", "a gate with `certificate=\"spot\"`", "spot checks the spot-certified gate ran on the "
     "cell while repairing it"),
    ("spot_gate_keys", "a gate with `certificate=\"spot\"`", "distinct exact keys those checks read"),
    ("spot_gate_bytes", "a gate with `certificate=\"spot\"`", "bytes those checks read (the pages' bytes are "
     "`bytes_paged`)"),
    ("metered", "`sample=`, `audit=`", "whether the cell was metered (sampled metering or the audit's pick; False: "
     "every measurement NaN)"),
    ("audited", "`audit=`", "the request audit picked the cell (and it sees a token): its bound enters the statement"),
    ("flagged", "`audit=`", "a picked cell whose `audit_bound` exceeds the audit's tau"),
    ("audit_bound", "`audit=`", "the picked cell's bound: its meter where <= tau, else min(meter, spot check); NaN "
     "where not picked"),
    ("audit_check_delta", "`audit=`", "failure probability the cell's spot check spent (0: the meter certified or "
     "the check read every key; NaN where not picked)"),
    ("audit_keys", "`audit=`", "exact keys the picked cell's spot check read"),
)
"""(name, when present, meaning) of every cell column, in the order of :func:`cell_table`."""

_FLOATS = ("meter", "risk", "true_tv", "output_bound", "true_output_error", "c_max")
_BOOLS = ("joint", "repaired")


@dataclass(frozen=True)
class CellTable:
    """Column arrays over every cell of a run (all the same length)."""

    columns: dict

    def __post_init__(self):
        lengths = {len(v) for v in self.columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"columns differ in length: {sorted(lengths)}")

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def where(self, keep: np.ndarray) -> "CellTable":
        return CellTable({k: v[keep] for k, v in self.columns.items()})


def cell_table(batches, case: int = 0) -> CellTable:
    """Flatten a list of ``CellBatch`` into a :class:`CellTable` (``case`` fills the case column)."""
    extras = sorted(batches[0].extra) if batches else []
    dithered = bool(batches) and all(batch.seed is not None for batch in batches)
    cols = {k: [] for k in ("case", "request", "layer", "head", "pos", "batch", "tier", "adaptive", "tier_b_delta",
                            *_FLOATS, *_BOOLS, *extras, *(("seed",) if dithered else ()))}
    for batch in batches:
        b, hq, tq = batch.meter.shape
        grid_b, grid_h, grid_t = np.meshgrid(np.arange(b), np.arange(hq), np.arange(tq), indexing="ij")
        n = grid_b.size
        cols["case"].append(np.full(n, case))
        cols["request"].append(np.asarray(batch.requests, dtype=np.int64)[grid_b.ravel()])
        cols["layer"].append(np.full(n, batch.layer))
        cols["head"].append(grid_h.ravel())
        cols["pos"].append(batch.positions.numpy()[grid_t.ravel()])
        cols["batch"].append(grid_b.ravel())
        cols["tier"].append(np.full(n, batch.tier))
        cols["adaptive"].append(np.full(n, batch.adaptive))
        cols["tier_b_delta"].append(np.full(n, batch.tier_b_delta))
        for name in (*_FLOATS, *_BOOLS):
            cols[name].append(getattr(batch, name).numpy().ravel())
        for name in extras:
            cols[name].append(batch.extra[name].numpy().ravel())
        if dithered:
            cols["seed"].append(np.full(n, batch.seed, dtype=np.uint64))
    if not cols["layer"]:
        return CellTable({k: np.array([]) for k in (*cols, bound_kind.KIND, bound_kind.DELTA)})
    columns = {k: np.concatenate(v) for k, v in cols.items()}
    return CellTable({**columns, **bound_kind.label_columns(columns)})


def concat(tables) -> CellTable:
    tables = [t for t in tables if len(t)]
    if not tables:
        return CellTable({})
    return CellTable({k: np.concatenate([t[k] for t in tables]) for k in tables[0].columns})


def write_jsonl(path: Path, table: CellTable, run: dict) -> int:
    """Append one line per cell of ``table`` (tagged with ``run``) to ``path``; returns lines written.

    A column of the table wins over a run tag of the same name (a cell's ``tier`` is the tier it
    was certified with).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(table.columns)
    with path.open("a", encoding="utf-8") as out:
        for i in range(len(table)):
            row = dict(run)
            for name in names:
                row[name] = _json_value(table[name][i])
            out.write(json.dumps(row, separators=(",", ":")) + "\n")
    return len(table)


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _json_value(x):
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (str, np.str_)):
        return str(x)
    x = float(x)
    if math.isnan(x):
        return None
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x

"""Make the pictures of the documentation site: one from a real run, the others from the benchmark records.

``docs/assets/run-rtn-int4.png``: the getting-started page's run (SmolLM2-135M-Instruct, two prompts,
8 new tokens, greedy, ``rtn-int4`` keys and values, the certified gate at ``tau = 0.2``), drawn by
``Monitor.plot``. One torch thread, so the picture is the same on every run of the same machine.

From the records under ``benchmarks/results/`` (no model, seconds), each from one record so a
picture never sets figures of different runs side by side:

- ``docs/assets/spot-coverage.png`` (the spot-check page, the results page): coverage at ``tau``
  against the exact keys a check reads, per scheme, beside the deterministic meter's coverage
  (``spot_check.json``);
- ``docs/assets/gate-paged.png`` (the gate page, the results page): the tokens each kind of gate
  pages in, with the needle accuracy it kept (``study-spot-gate/report.json``);
- ``docs/assets/production-overhead.png`` (the production page, the results page): monitored
  generation's tokens/s against stock per configuration and context (``generation.json``).

Each record picture carries, in its PNG metadata, the SHA-256 of the numbers it draws; ``--check``
recomputes them from the records and fails when a picture is out of step (run by
``tests/test_docs_site.py``, like the other generated pages).

Usage::

    python scripts/docs_pictures.py             # every picture (the run picture loads the model)
    python scripts/docs_pictures.py --records   # the record pictures only
    python scripts/docs_pictures.py --check     # exit status 1 when a record picture is out of step
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "docs" / "assets"
RESULTS = ROOT / "benchmarks" / "results"
PROMPTS = ["The capital of France is", "Water boils at"]
DIGEST_KEY = "witcert-data-sha256"


def run_picture() -> None:
    """The getting-started page's run, on the embedded model."""
    import torch

    import witcert
    from witcert.integrations.hf.default_model import load_model

    torch.set_num_threads(1)
    loaded = load_model()
    model, tok = loaded.model, loaded.tokenizer
    tok.padding_side = "left"
    inputs = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad(), witcert.monitor(model, scheme="rtn-int4", gate=witcert.Gate(tau=0.2)) as mon:
        model.generate(**inputs, max_new_tokens=8, do_sample=False)
    path = ASSETS / "run-rtn-int4.png"
    mon.plot(path)
    print(f"wrote {path.relative_to(ROOT)}")


# -- the record pictures: data(record) -> the numbers drawn; draw(ax, data) -> the picture ------------------

def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def spot_coverage_data() -> dict:
    """Per scheme: the meter's coverage, the spot check's at each fixed key budget and the adaptive check's at
    the mean keys it read (``spot_check.json``)."""
    record = _load("spot_check.json")
    setup = record["setup"]
    schemes = {}
    for scheme, s in record["schemes"].items():
        if "all" not in s:
            continue
        by = s["all"]["by_config"]
        fixed = sorted((c for c in by if c.startswith("fixed ")), key=lambda c: int(c.split()[1]))
        adaptive = [c for c in by if c.split()[0] == "adaptive" and len(c.split()) == 2]
        schemes[scheme] = {"meter": s["all"]["coverage_deterministic"],
                           "keys": [by[c]["mean_keys_read"] for c in fixed],
                           "coverage": [by[c]["coverage"] for c in fixed],
                           "adaptive": [(c, by[c]["mean_keys_read"], by[c]["coverage"]) for c in adaptive]}
    return {"tau": setup["tau"], "delta": setup["delta_per_cell"], "context": setup["context_tokens"],
            "date": setup["date"], "schemes": schemes}


def draw_spot_coverage(fig, data: dict) -> None:
    ax = fig.subplots()
    for scheme, s in data["schemes"].items():
        line = ax.plot(s["keys"], s["coverage"], marker="o", label=f"{scheme}: spot check, fixed keys")[0]
        ax.axhline(s["meter"], color=line.get_color(), ls=":", lw=1)
        for _, keys, coverage in s["adaptive"]:
            ax.plot([keys], [coverage], marker="*", ms=10, color=line.get_color(), ls="none")
    ax.plot([], [], color="grey", ls=":", label="dotted: the deterministic meter alone")
    ax.plot([], [], color="grey", marker="*", ls="none", label="star: adaptive rounds, at the mean keys read")
    ax.set(xscale="log", xlabel="exact keys read per checked cell", ylim=(-0.02, 1.02),
           ylabel=f"fraction of cells certified at tau = {data['tau']:g}",
           title=f"Coverage against exact keys read (SmolLM2, {data['context']}-token contexts,\n"
                 f"delta = {data['delta']:g} per checked cell, measured {data['date']})")
    ax.set_xticks([32, 64, 128, 256, 512, 1024])
    ax.xaxis.set_major_formatter(_plain())
    ax.xaxis.set_minor_formatter(_blank())
    ax.legend(fontsize=7, loc="center left")


def gate_paged_data() -> dict:
    """Per scheme and gate kind: the fraction of tokens paged in and the accuracy (``study-spot-gate/report.json``)."""
    report = _load("study-spot-gate/report.json")
    tau = report["config"]["tau_certified"]
    rows = {row["name"]: row for row in report["repair"]}
    kinds = {"certified gate": "gated", "spot-certified gate": "spot-gated"}
    schemes = {}
    for scheme in report["config"]["spot_gated_schemes"]:
        schemes[scheme] = {kind: {"paged": rows[f"{scheme} {name} tau={tau:g}"]["paged_fraction"],
                                  "accuracy": rows[f"{scheme} {name} tau={tau:g}"]["accuracy"]}
                           for kind, name in kinds.items()}
        schemes[scheme]["uncompressed accuracy"] = rows["uncompressed"]["accuracy"]
    return {"tau": tau, "cases": report["config"]["cases"], "context": report["config"]["context_tokens"],
            "spot_keys": report["config"]["spot_keys"], "date": report["date"], "schemes": schemes}


def draw_gate_paged(fig, data: dict) -> None:
    ax = fig.subplots()
    kinds = ("certified gate", "spot-certified gate")
    width = 0.38
    for i, kind in enumerate(kinds):
        xs = [j + (i - 0.5) * width for j in range(len(data["schemes"]))]
        values = [s[kind]["paged"] for s in data["schemes"].values()]
        bars = ax.bar(xs, values, width, label=kind)
        for bar, s in zip(bars, data["schemes"].values()):
            ax.annotate(f"acc. {s[kind]['accuracy']:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(data["schemes"])), list(data["schemes"]))
    ax.set(ylim=(0, 1), ylabel="fraction of visible tokens paged in",
           title=f"Tokens paged by gate kind at tau = {data['tau']:g} ({data['cases']} needle cases, "
                 f"{data['context']} tokens,\nspot checks of {data['spot_keys']} keys; acc.: needle accuracy; "
                 f"measured {data['date']})")
    ax.legend(fontsize=8)


def production_overhead_data() -> dict:
    """Per context and configuration: tokens/s against stock (``generation.json``)."""
    record = _load("generation.json")
    return {"date": record["date"][:10], "runs": [{"context": run["context"], "ratio": run["ratio_to_stock"]}
                                                  for run in record["runs"]]}


def draw_production_overhead(fig, data: dict) -> None:
    ax = fig.subplots()
    configs = list(dict.fromkeys(name for run in data["runs"] for name in run["ratio"]))
    width = 0.8 / len(data["runs"])
    for i, run in enumerate(data["runs"]):
        xs = [j + (i - (len(data["runs"]) - 1) / 2) * width for j in range(len(configs))]
        bars = ax.bar(xs, [run["ratio"].get(c, 0.0) for c in configs], width,
                      label=f"{run['context']} tokens of context")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xticks(range(len(configs)), [c.replace(", ", ",\n") for c in configs], fontsize=7)
    ax.set(ylim=(0, 1.15), ylabel="tokens/s against stock (1 = no overhead)",
           title=f"Monitored generation, SmolLM2, rtn-int8, 16 new tokens (measured {data['date']})")
    ax.legend(fontsize=8, loc="lower right")


RECORD_PICTURES = {
    "spot-coverage.png": (spot_coverage_data, draw_spot_coverage, (7, 4.6)),
    "gate-paged.png": (gate_paged_data, draw_gate_paged, (7, 4.4)),
    "production-overhead.png": (production_overhead_data, draw_production_overhead, (8, 4.4)),
}
"""file name under docs/assets -> (numbers from the records, drawing, figure size in inches)."""


def _plain():
    from matplotlib.ticker import ScalarFormatter

    formatter = ScalarFormatter()
    formatter.set_scientific(False)
    return formatter


def _blank():
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def digest(data: dict) -> str:
    """SHA-256 of the numbers a picture draws (canonical JSON)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def write_record_pictures() -> None:
    from matplotlib.figure import Figure

    for name, (data_of, draw, size) in RECORD_PICTURES.items():
        data = data_of()
        fig = Figure(figsize=size, layout="constrained")
        draw(fig, data)
        path = ASSETS / name
        fig.savefig(path, dpi=100, metadata={"Software": None, DIGEST_KEY: digest(data)})
        print(f"wrote {path.relative_to(ROOT)}")


def stale_record_pictures() -> list[str]:
    """The record pictures whose embedded digest differs from their records' numbers (or that are missing)."""
    from PIL import Image

    stale = []
    for name, (data_of, _, _) in RECORD_PICTURES.items():
        path = ASSETS / name
        stored = Image.open(path).info.get(DIGEST_KEY) if path.exists() else None
        if stored != digest(data_of()):
            stale.append(str(path.relative_to(ROOT)))
    return stale


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--records", action="store_true", help="only the pictures made from benchmarks/results/")
    mode.add_argument("--check", action="store_true", help="exit status 1 when a record picture is out of step")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_record_pictures()
        for name in stale:
            print(f"{name} is out of step with its record: run python scripts/docs_pictures.py --records",
                  file=sys.stderr)
        return 1 if stale else 0
    ASSETS.mkdir(parents=True, exist_ok=True)
    write_record_pictures()
    if not args.records:
        run_picture()
    return 0


if __name__ == "__main__":
    sys.exit(main())

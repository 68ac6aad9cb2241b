"""``witcert observe``: run a workload on a real model under compressed KV caches and measure the meter."""
from __future__ import annotations

import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HELP = "run a real model (default: embedded SmolLM2-135M-Instruct) under compressed KV caches; report meter vs true TV"

DEMO_SCHEMES = ("fp8-e4m3", "rtn-int4", "kivi-2bit", "dithered-int8")


def add_arguments(parser) -> None:
    parser.add_argument("--scheme", action="append", default=None,
                        help="registered scheme (repeat or comma-separate for a comparison; `witcert schemes` lists them)")
    parser.add_argument("--tier", choices=("auto", "A", "B"), default="auto",
                        help="A: band-norm witness (adaptive-safe), every scheme; B: the dithered-int8 cache's "
                             "probabilistic certificate (min with A; non-adaptive scope); auto: B for dithered-int8, else A")
    parser.add_argument("--task", default="needle", help="needle | text | code | PATH to a text file")
    parser.add_argument("--tau", type=float, default=0.2, help="certified threshold for coverage and the gate (0 < tau < 1)")
    parser.add_argument("--gate", action="store_true", help="also run with the certified gate (block repair from the exact shadow)")
    parser.add_argument("--model", default=None, help="local Hugging Face checkpoint (dir, or .gguf file); default: embedded SmolLM2")
    parser.add_argument("--context", type=int, default=512, help="context tokens per case")
    parser.add_argument("--cases", type=int, default=4, help="cases per task")
    parser.add_argument("--probe", type=int, default=32, help="teacher-forced continuation tokens (text/code)")
    parser.add_argument("--new-tokens", type=int, default=6, help="greedy answer tokens (needle)")
    parser.add_argument("--bands", type=int, default=16, help="Tier A bands B (must divide head_dim/2)")
    parser.add_argument("--seed", type=int, default=None,
                        help="Philox seed of the dithered-int8 cache (default: a fresh secret seed per case from the OS, "
                             "recorded in telemetry.jsonl; give one only to replay a run: a known seed voids Tier B)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a small shared machine more threads oversubscribe)")
    parser.add_argument("--out", default=None, help="report directory (default reports/observe-<time>)")
    parser.add_argument("--demo", action="store_true",
                        help=f"the demo: {', '.join(DEMO_SCHEMES)} on the needle task with the gate")


def run(args) -> int:
    from witcert.observatory import runner as observatory, report, telemetry
    from witcert.integrations.hf.default_model import ModelUnavailable, load_model

    import torch

    if args.threads < 1:
        print("witcert observe: --threads must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    schemes = _schemes(args)
    try:
        config = observatory.ObserveConfig(
            schemes=schemes, task=args.task, tau=args.tau, gate=args.gate or args.demo, context_tokens=args.context,
            probe_tokens=args.probe, new_tokens=args.new_tokens, cases=args.cases, bands=args.bands, tier=args.tier,
            seed=args.seed,
        )
    except ValueError as err:
        print(f"witcert observe: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        loaded = load_model(args.model)
    except (ModelUnavailable, ValueError) as err:
        print(f"witcert observe: {err}", file=sys.stderr)
        return 2
    print(f"model: {loaded.source}")
    with _Progress() as progress:
        results, baseline = observatory.run_observe(loaded, config, progress)
    wall = time.perf_counter() - start
    out = Path(args.out) if args.out else Path("reports") / f"observe-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    jsonl = out / "telemetry.jsonl"
    for r in results:
        run_tag = {"scheme": r.scheme, "tier": config.tier, "task": r.task, "gated": False}
        telemetry.write_jsonl(jsonl, r.raw, run_tag)
        if r.gated is not None:
            telemetry.write_jsonl(jsonl, r.gated, {**run_tag, "gated": True})
    md = report.write_report(out, results, config, baseline, loaded.source, wall)
    _print_table(results, config, baseline)
    print(f"report: {md}\ntelemetry: {jsonl}\nwall time: {wall:.1f} s")
    violations = sum(report.summarize(r.raw, config.tau).violations for r in results)
    if violations:
        print(f"SOUNDNESS VIOLATION: {violations} cells with true TV above the meter", file=sys.stderr)
        return 1
    return 0


def _schemes(args) -> tuple[str, ...]:
    if args.demo and not args.scheme:
        return DEMO_SCHEMES
    names = []
    for item in args.scheme or ["rtn-int4"]:
        names += [s.strip() for s in item.split(",") if s.strip()]
    return tuple(names)


def _print_table(results, config, baseline) -> None:
    from rich.console import Console
    from rich.table import Table

    from witcert.observatory import report

    header, rows = report.table_rows(results, config.tau, baseline)
    title = f"WitCert observatory - task {config.task}, tier {config.tier}, tau {config.tau:g}"
    if "needle_acc" in baseline:
        title += f" (needle accuracy uncompressed: {baseline['needle_acc']:.2f})"
    table = Table(title=title)
    for name in header:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*row)
    Console(width=200).print(table)


class _Progress:
    """A rich progress bar; ``start(total)`` returns ``tick(label)`` (what ``run_observe`` expects)."""

    def __enter__(self):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("{task.description:<28}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                             TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
        self._bar.__enter__()
        return self

    def start(self, total: int):
        task = self._bar.add_task("starting", total=total)

        def tick(label: str) -> None:
            self._bar.update(task, advance=1, description=label)

        return tick

    def __exit__(self, *exc):
        return self._bar.__exit__(*exc)

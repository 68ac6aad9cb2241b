"""``witcert fuzz``: the adversarial regression of every bound, per query."""
import json
import os
import platform
import shlex
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from witcert.cli import _args

HELP = "adversarial per-query regression of every TV bound (sup-box adversary, golden re-checks)"


def add_arguments(parser) -> None:
    parser.add_argument("--trials", type=_args.positive_int, default=50_000,
                        help="queries to check (`make fuzz` runs 500000)")
    parser.add_argument("--seed", type=_args.non_negative_int, default=0, help="deterministic seed")
    parser.add_argument("--json", type=_args.output_file, metavar="PATH", help="also write the report as JSON")


def check(args) -> None:
    """The attack classes drive the Triton kernels and a small transformers model: both must be installed."""
    _args.require_installed("witcert fuzz", "verify", "triton", "transformers")


def _table(report) -> Table:
    table = Table(title=f"witcert fuzz: {report.trials} trials, {report.seconds:.1f} s, "
                  f"{report.trials / max(report.seconds, 1e-9):,.0f} trials/s")
    for column in ("bound", "cells", "violations", "worst TV/bound*", "median TV/bound*"):
        table.add_column(column, justify="left" if column == "bound" else "right")
    for name, tally in report.tallies.items():
        table.add_row(name, f"{tally.cells}", f"{tally.violations}",
                      f"{tally.worst_ratio():.4f}", f"{tally.median_ratio():.4f}")
    return table


def _run_record(args) -> dict:
    """When, where and how the run was made: the results page prints these beside the figures."""
    import torch  # the command line's help must not pay for torch

    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
               platform.processor() or "unknown")
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seed": args.seed,
            "command": shlex.join(["witcert", "fuzz", "--trials", str(args.trials), "--seed", str(args.seed),
                                   *(["--json", str(args.json)] if args.json else [])]),
            "machine": f"{cpu}, {os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch threads"}


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []


def _summary(report, attacks, args) -> dict:
    return {
        **_run_record(args),
        "trials": report.trials,
        "seconds": report.seconds,
        "trials_per_second": report.trials / max(report.seconds, 1e-9),
        "adversary_below_interior": report.adversary_below_interior,
        "local_search_beaten": report.local_search_beaten,
        "nonfinite_outputs": report.nonfinite_outputs,
        "golden_rechecks": report.golden_rechecks,
        "attacks": {
            a.name: {"cells": a.cells, "violations": a.violations, "rejected": a.rejected,
                     "worst_exact_over_bound": a.worst_ratio, "seconds": a.seconds}
            for a in attacks
        },
        "bounds": {
            name: {"cells": t.cells, "violations": t.violations,
                   "worst_tv_over_bound": t.worst_ratio(), "median_tv_over_bound": t.median_ratio()}
            for name, t in report.tallies.items()
        },
    }


def _attack_table(attacks) -> Table:
    table = Table(title="attack classes (public entry points, per query against an exact oracle)")
    for column in ("class", "cells", "violations", "rejected (clear error)", "worst exact/bound", "seconds"):
        table.add_column(column, justify="left" if column == "class" else "right")
    for a in attacks:
        table.add_row(a.name, f"{a.cells}", f"{a.violations}", f"{a.rejected}", f"{a.worst_ratio:.4f}", f"{a.seconds:.1f}")
    return table


def _choose_kernel_backend() -> None:
    """Without CUDA, run the kernel attack classes under Triton's CPU interpreter (an explicit setting wins).

    Triton reads ``TRITON_INTERPRET`` when a kernel module is first imported, so this command (an
    entry point, like the test run's conftest) sets it before any attack class imports one.
    """
    import torch  # here, not at the top: the command line's help must not pay for torch

    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def run(args) -> int:
    _choose_kernel_backend()
    from witcert.verification.fuzz import run_fuzz  # torch import deferred so `witcert --help` stays fast

    console = Console()
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("fuzzing", total=args.trials)
        report = run_fuzz(args.trials, args.seed, lambda n: progress.advance(task, n))
    from witcert.verification.attacks import run_attacks

    with console.status("attack classes"):
        attacks = run_attacks(args.trials, args.seed)
    console.print(_table(report))
    if attacks:
        console.print(_attack_table(attacks))
        for a in attacks:
            for note in a.notes:
                console.print(f"[red]{a.name}: {note}[/]")
    console.print("* over cells whose bound is <= 0.9 (near the trivial bound 1 any TV close to 1 looks tight)")
    console.print(f"adversary self-check (interior TV above the exhaustive sup): {report.adversary_below_interior}; "
                  f"local search (S > 12) beaten by a random interior error: {report.local_search_beaten}; "
                  f"NaN / out-of-range outputs: {report.nonfinite_outputs}; golden re-checks: {report.golden_rechecks}")
    dispersion = report.tallies["dispersion (known false)"].violations
    console.print(f"known-false dispersion form violated on {dispersion} cells (expected > 0: the adversary bites)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_summary(report, attacks, args), f, indent=2)
    ok = (report.sound_violations == 0 and report.nonfinite_outputs == 0 and report.adversary_below_interior == 0
          and all(a.violations == 0 for a in attacks))
    console.print("[bold green]0 violations of any sound bound[/]" if ok else "[bold red]SOUNDNESS FAILURE[/]")
    return 0 if ok else 1

"""What ``witcert observe`` prints: the comparison table with its legend, and progress.

The table has ten columns at most (:func:`witcert.observatory.report.terminal_rows`) and fits a
100-column terminal; every column is in ``report.md``. Progress: on a terminal a rich progress
bar; when stdout is not a terminal (a log, a pipe) one flushed line per finished case with the
elapsed time, the rate and the time left, so that a long run is never silent.
"""
from __future__ import annotations

import sys
import time

WIDTH = 100  # columns of the printed table and progress


def print_table(results, config, baseline, stream=None) -> None:
    """The comparison table of ``results`` and its legend, on ``stream`` (default stdout)."""
    from rich.console import Console

    from witcert.observatory import report

    console = Console(file=stream or sys.stdout, width=WIDTH)
    console.print(table(results, config, baseline))
    console.print(report.TERMINAL_LEGEND, highlight=False)


def table(results, config, baseline, title: str | None = None):
    """A rich table of :func:`witcert.observatory.report.terminal_rows` (tau and the task in the title)."""
    from rich import box
    from rich.table import Table

    from witcert.observatory import report

    header, rows = report.terminal_rows(results, config.tau)
    title = title or f"WitCert observatory: task {config.task}, tier {config.tier}, tau {config.tau:g}"
    if "needle_acc" in baseline:
        title += f", needle accuracy uncompressed {baseline['needle_acc']:.2f}"
    grid = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0))
    for name in header:
        grid.add_column(name, no_wrap=True)
    for row in rows:
        grid.add_row(*row)
    return grid


def _done(result, config) -> str:
    """The title of one scheme's table, printed as it finishes."""
    return f"{result.scheme}: done in {result.wall_s:.0f} s (task {config.task}, tau {config.tau:g})"


def progress_for(stream=None):
    """A rich progress bar on a terminal, else one log line per finished case (:class:`LogProgress`)."""
    stream = stream or sys.stdout
    return BarProgress() if stream.isatty() else LogProgress(stream)


class BarProgress:
    """A rich progress bar; ``start(total)`` returns ``tick(label)`` (what ``run_observe`` expects)."""

    def __enter__(self):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("{task.description:<24}"), BarColumn(bar_width=30),
                             TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), TimeRemainingColumn(),
                             transient=False, console=Console(width=WIDTH))
        self._bar.__enter__()
        return self

    def start(self, total: int):
        task = self._bar.add_task("starting", total=total)

        def tick(label: str) -> None:
            self._bar.update(task, advance=1, description=label)

        return tick

    def show(self, config):
        """``on_result`` for ``run_observe``: each scheme's row, printed above the bar as it finishes."""

        def on_result(result, baseline) -> None:
            self._bar.console.print(table([result], config, baseline, _done(result, config)))

        return on_result

    def __exit__(self, *exc):
        return self._bar.__exit__(*exc)


class LogProgress:
    """Progress for a log: ``[done/total] label: elapsed, seconds per case, time left`` per finished case."""

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        return self

    def start(self, total: int):
        started, done = time.perf_counter(), [0]

        def tick(label: str) -> None:
            done[0] += 1
            elapsed = time.perf_counter() - started
            per_case = elapsed / done[0]
            left = per_case * (total - done[0])
            print(f"[{done[0]}/{total}] {label}: {elapsed:.0f} s elapsed, {per_case:.1f} s per case, "
                  f"about {left:.0f} s left", file=self.stream, flush=True)

        return tick

    def show(self, config):
        """``on_result`` for ``run_observe``: each scheme's table as it finishes."""
        from rich.console import Console

        def on_result(result, baseline) -> None:
            Console(file=self.stream, width=WIDTH).print(table([result], config, baseline, _done(result, config)))
            self.stream.flush()

        return on_result

    def __exit__(self, *exc):
        return False

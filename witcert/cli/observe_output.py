"""What ``witcert observe`` prints: the comparison table with its legend, and progress.

The table has eleven columns at most (:func:`witcert.observatory.report.terminal_rows`) and fits a
100-column terminal; every column is in ``report.md``. Progress: on a terminal a rich progress
bar; when stdout is not a terminal (a log, a pipe) one flushed line per finished case with the
elapsed time and the time left, so that a long run is never silent. The time left comes from
:class:`witcert.observatory.plan.Pace` (each remaining case predicted from the finished cases of
its own kind), never from the mean time per case.
"""
from __future__ import annotations

import sys
import time

from witcert.observatory.plan import Pace, minutes

WIDTH = 100  # columns of the printed table and progress


def print_table(results, config, baseline, stream=None) -> None:
    """The comparison table of ``results`` and its legend, on ``stream`` (default stdout)."""
    from rich.console import Console

    from witcert.observatory import report

    console = Console(file=stream or sys.stdout, width=WIDTH)
    console.print(table(results, config, baseline))
    console.print(report.terminal_legend(config.cases if config.task != "prompt" else None), highlight=False)
    console.print("\n".join(report.bound_lines(results)), highlight=False)


def table(results, config, baseline, title: str | None = None):
    """A rich table of :func:`witcert.observatory.report.terminal_rows` (tau and the task in the title)."""
    from rich import box
    from rich.table import Table

    from witcert.observatory import report

    header, rows = report.terminal_rows(results, config.tau, config.cases if config.task != "prompt" else None)
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
    """A rich progress bar; ``start(steps)`` returns ``tick(label)`` (what ``run_observe`` expects)."""

    def __enter__(self):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("{task.description:<24}"), BarColumn(bar_width=30),
                             TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                             TextColumn("{task.fields[left]}"), transient=False, console=Console(width=WIDTH))
        self._bar.__enter__()
        return self

    def start(self, steps):
        task = self._bar.add_task("starting", total=len(steps), left="")
        pace, last = Pace(list(steps)), [time.perf_counter()]

        def tick(label: str) -> None:
            now = time.perf_counter()
            pace.record(now - last[0])
            last[0] = now
            left = pace.left()
            self._bar.update(task, advance=1, description=label, left=f"{minutes(left)} left" if left else "")

        return tick

    def show(self, config):
        """``on_result`` for ``run_observe``: each scheme's row, printed above the bar as it finishes."""

        def on_result(result, baseline) -> None:
            self._bar.console.print(table([result], config, baseline, _done(result, config)))

        return on_result

    def __exit__(self, *exc):
        return self._bar.__exit__(*exc)


class LogProgress:
    """Progress for a log: ``[done/total] label: elapsed, this case's seconds, time left`` per finished case."""

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        return self

    def start(self, steps):
        pace, started = Pace(list(steps)), time.perf_counter()
        last = [started]

        def tick(label: str) -> None:
            now = time.perf_counter()
            pace.record(now - last[0])
            last[0] = now
            done, total = len(pace.seconds), len(pace.plan)
            print(f"[{done}/{total}] {label}: {now - started:.0f} s elapsed, {pace.seconds[-1]:.1f} s this case, "
                  f"{minutes(pace.left())} left", file=self.stream, flush=True)

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

"""Wall-clock timing for side-by-side ratios: warm-up, then the median of ``reps`` runs.

Ratios (meter / attention) are formed from medians measured in the same process, interleaved
run by run so that background load on a shared machine hits both sides alike.
"""
import contextlib
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    """Median and spread (seconds) of ``reps`` timed calls."""

    median: float
    low: float
    high: float
    reps: int

    def __post_init__(self):
        if self.reps < 1 or not 0 <= self.low <= self.median <= self.high:
            raise ValueError(f"inconsistent timing {self}")


def _calls_per_sample(fn: Callable[[], object], min_sample_s: float) -> int:
    """Calls per timed sample so that one sample lasts at least ``min_sample_s`` (timer noise), from the second
    call (a first call that compiles, e.g. a new shape class, would make every sample a single call)."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    return max(1, math.ceil(min_sample_s / once))


def time_interleaved(fns: dict[str, Callable[[], object]], reps: int = 5, warmup: int = 1,
                     min_sample_s: float = 0.02) -> dict[str, Timing]:
    """Time every callable ``reps`` times, round-robin, after ``warmup`` untimed rounds.

    Each sample runs the callable ``n`` times (``n`` from the warm-up, so a sample lasts at least
    ``min_sample_s``) and records the mean per call.
    """
    if reps < 1 or warmup < 1:
        raise ValueError(f"reps and warmup must be >= 1, got reps={reps}, warmup={warmup}")
    calls = {name: _calls_per_sample(fn, min_sample_s) for name, fn in fns.items()}
    samples = {name: [] for name in fns}
    for round_ in range(warmup - 1 + reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            elapsed = (time.perf_counter() - start) / calls[name]
            if round_ >= warmup - 1:
                samples[name].append(elapsed)
    return {name: Timing(statistics.median(s), min(s), max(s), len(s)) for name, s in samples.items()}


def time_after(fns: dict[str, Callable[[], object]], before: Callable[[], object], reps: int = 5) -> dict[str, Timing]:
    """Each callable timed on one call right after ``before()`` (not timed), ``reps`` rounds after one untimed
    round: the cost with caches as ``before`` leaves them (after a decode attention step has streamed the
    layer's keys and values, the meter's inputs are no longer cached, as in a decode step)."""
    samples = {name: [] for name in fns}
    for round_ in range(reps + 1):
        for name, fn in fns.items():
            before()
            start = time.perf_counter()
            fn()
            if round_:
                samples[name].append(time.perf_counter() - start)
    return {name: Timing(statistics.median(s), min(s), max(s), len(s)) for name, s in samples.items()}


@contextlib.contextmanager
def compile_choice(compiled: bool):
    """``WITCERT_COMPILE`` set to ``compiled`` inside the block (the library reads it per call), restored after."""
    previous = os.environ.get("WITCERT_COMPILE")
    os.environ["WITCERT_COMPILE"] = "1" if compiled else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("WITCERT_COMPILE")
        else:
            os.environ["WITCERT_COMPILE"] = previous


def compiled_available() -> bool:
    """Whether ``torch.compile`` works here for the meter's passes (compiling the fused pass once if not yet)."""
    from witcert.fastpath import budgeted_pass
    from witcert.fastpath import compiled as compiled_mod

    return compiled_mod.compiled_of(budgeted_pass.lean_pass, budgeted_pass.probe) is not None

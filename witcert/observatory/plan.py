"""What a ``witcert observe`` run will do and how long it will take: the plan printed up front, the time left.

A run is a sequence of steps, each one case under one configuration: the uncompressed reference
cases first, then per scheme its metered cases (spot-checked where the certificate asks) and its
gated cases. Their costs differ by an order of magnitude: a spot-checked or gated case costs
several uncompressed ones. So the time left is never the mean time per finished step times the
steps left (the uncompressed cases, fastest, finish first and would make any run look short).
:class:`Pace` predicts each remaining step from the finished steps of its own kind, and a kind
not seen yet from its cost relative to the uncompressed case (:data:`RELATIVE_COST`, measured with
``witcert observe`` on SmolLM2 at a 512-token context) at the pace the finished steps set.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

# seconds per case of a kind / seconds of an uncompressed case (SmolLM2, 512 tokens, the full meter, 1 thread)
RELATIVE_COST = {"reference": 1.0, "metered": 1.6, "spot": 7.0, "gated": 5.0, "spot gated": 20.0,
                 "audited": 1.6}  # audited: taken as a metered case (nothing metered, a few picked cells read exactly)
REFERENCE_S = 2.0  # one uncompressed 512-token needle case, 1 torch thread, an idle 2-core x86-64 VM
REFERENCE_CONTEXT = 512


@dataclass(frozen=True)
class Step:
    """One case under one configuration: ``label`` as progress shows it, ``kind`` a key of :data:`RELATIVE_COST`."""

    label: str
    kind: str

    def __post_init__(self):
        if self.kind not in RELATIVE_COST:
            raise ValueError(f"kind must be one of {tuple(RELATIVE_COST)}, got {self.kind!r}")


def steps(config, n_cases: int) -> list[Step]:
    """The steps of an observe run (``config`` an :class:`~witcert.observatory.runner.ObserveConfig`), in order."""
    spot = config.certificate == "spot"
    plan = [Step("uncompressed reference", "reference")] * n_cases
    for scheme in config.schemes:
        plan += [Step(scheme, "spot" if spot else "metered")] * n_cases
        if config.gate:
            plan += [Step(f"{scheme} gated", "spot gated" if spot and config.keep_exact else "gated")] * n_cases
        if getattr(config, "audit", None) is not None:
            plan += [Step(f"{scheme} audited", "audited")] * n_cases
    return plan


def prior_seconds(plan: list[Step], context_tokens: int, threads: int = 1) -> float:
    """A-priori seconds of ``plan`` on the machine :data:`REFERENCE_S` was measured on (before anything ran).

    The cost of a case grows about linearly with its context; a second thread is taken to save a
    third at most (two threads on two shared cores rarely halve a run).
    """
    per_unit = REFERENCE_S * max(context_tokens, 1) / REFERENCE_CONTEXT * (1.0 if threads < 2 else 2.0 / 3.0)
    return per_unit * sum(RELATIVE_COST[step.kind] for step in plan)


@dataclass
class Pace:
    """Seconds of the finished steps of a plan, and the time its remaining steps will take."""

    plan: list[Step]
    seconds: list[float] = field(default_factory=list)  # of each finished step, in order

    def record(self, seconds: float) -> None:
        if len(self.seconds) >= len(self.plan):
            raise ValueError(f"every one of the {len(self.plan)} steps is already recorded")
        self.seconds.append(float(seconds))

    def left(self) -> float:
        """Predicted seconds of the remaining steps (NaN before any step finished)."""
        if not self.seconds:
            return math.nan
        done = self.plan[:len(self.seconds)]
        per_unit = sum(self.seconds) / sum(RELATIVE_COST[step.kind] for step in done)
        seen: dict[str, list[float]] = {}
        for step, seconds in zip(done, self.seconds):
            seen.setdefault(step.kind, []).append(seconds)
        return sum(sum(seen[s.kind]) / len(seen[s.kind]) if s.kind in seen else RELATIVE_COST[s.kind] * per_unit
                   for s in self.plan[len(self.seconds):])


def minutes(seconds: float) -> str:
    """``"about 40 s"`` or ``"about 3 min"``."""
    return f"about {seconds:.0f} s" if seconds < 90 else f"about {seconds / 60:.0f} min"


def share_of_machine(threads: int, load: float | None = None, cpus: int | None = None) -> float:
    """The fraction of its ``threads`` a run can expect on a machine with ``load`` runnable tasks on ``cpus``.

    With more runnable tasks than CPUs each gets about ``cpus / (load + threads)`` of one; default: the
    one-minute load average and the CPU count of this machine.
    """
    if load is None or cpus is None:
        try:
            load, cpus = os.getloadavg()[0], os.cpu_count() or 1
        except OSError:  # no load average on this platform
            return 1.0
    return min(1.0, cpus / max(load + threads, 1e-9))


def describe(config, n_cases: int, threads: int, demo: bool = False, share: float | None = None) -> list[str]:
    """The plan printed before the model loads: what runs, how many cases rest on, the a-priori time.

    ``share``: :func:`share_of_machine` (measured now by default); below one half the time is also
    given at that share, since a shared machine stretches every case alike.
    """
    plan = steps(config, n_cases)
    what = {"metered": "metered", "spot": f"metered and spot-checked ({config.spot_keys} exact keys per cell above tau)",
            "gated": "behind the certified gate", "spot gated": "behind the spot-certified gate",
            "audited": f"under the request audit (rate {getattr(config, 'audit', None)})"}
    kinds = list(dict.fromkeys(step.kind for step in plan if step.kind != "reference"))
    case_word = "case" if n_cases == 1 else "cases"
    context = "your prompt" if config.task == "prompt" else f"{config.context_tokens}-token context"
    lines = [f"plan: {len(config.schemes)} scheme(s) ({', '.join(config.schemes)}) x {n_cases} {config.task} "
             f"{case_word}, {context}, {threads} torch thread(s), "
             f"{'exact cache kept (true TV per cell)' if config.keep_exact else 'production: no exact cache'}",
             f"  each case runs uncompressed once, then per scheme: " + "; ".join(what[k] for k in kinds)]
    if demo and (n_cases == 1 or not config.gate):
        lines.append("  the full sweep: --demo --cases 4 --gate (4 cases per scheme, each also behind the gate)")
    idle = prior_seconds(plan, config.context_tokens, threads)
    share = share_of_machine(threads) if share is None else share
    lines.append(f"  time: {minutes(idle)} on an idle 2-core machine (re-estimated as cases finish)")
    if share < 0.5:
        lines.append(f"  this machine is busy (about {share:.0%} of a core for each thread now): expect "
                     f"{minutes(idle / share)}")
    return lines

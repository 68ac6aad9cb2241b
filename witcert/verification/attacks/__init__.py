"""Attack classes of ``witcert fuzz``: each attacks one public entry point the way a user can reach it.

The meter's own families (``witcert.verification.fuzz``) attack ``meter`` and its bounds on synthetic rows.
Soundness is judged at the API surface, so every class of input that once slipped through
(subnormal radii, an underflowing mass, RoPE applied in the cache dtype, a half-precision
model, a batch sharing one dither stream, an unreachable gate threshold, a scheme that mutates
its input, tiny kernel queries, a scheme or codec that reuses its output buffers or re-quantizes on
join, a token whose compressed weight underflows while its exact weight is large, an engine KV format or a
quantized query) has a module here that generates that class by itself and
checks every reported bound per query against an exact oracle.

A module defines ``NAME`` (one short label), ``SHARE`` (the fraction of ``--trials`` it runs;
at least one trial) and ``run(n, g) -> AttackTally`` with ``g`` a seeded ``torch.Generator``.
"""
import math
import time
from dataclasses import dataclass, field
from importlib import import_module

# module names under witcert.verification.attacks, in report order
ATTACKS: tuple[str, ...] = (
    "underflow", "split_mass", "gate_tau", "rope_frame", "mutating_scheme", "model_dtypes", "batched_dither",
    "kernel_range", "fast_path", "fast_radii", "user_components", "spot_underflow", "kv_formats",
)


@dataclass
class AttackTally:
    """What one attack class found. ``violations`` must be 0; ``rejected`` counts inputs outside
    the guarantee that raised a clear error instead of reporting a number (expected)."""

    name: str
    cells: int = 0
    violations: int = 0
    rejected: int = 0
    seconds: float = 0.0
    worst_ratio: float = math.nan  # max over cells of exact value / reported bound
    notes: list = field(default_factory=list)  # one line per violation (first few), for the report

    def add(self, exact, bound) -> None:
        """Count cells ``exact`` (true value) against ``bound`` (reported), both tensors of one shape."""
        import torch

        exact, bound = torch.as_tensor(exact, dtype=torch.float64), torch.as_tensor(bound, dtype=torch.float64)
        self.cells += exact.numel()
        bad = exact > bound
        self.violations += int(bad.sum())
        for i in bad.flatten().nonzero().flatten()[: max(0, 5 - len(self.notes))].tolist():
            self.notes.append(f"exact {exact.flatten()[i].item():.6g} > bound {bound.flatten()[i].item():.6g}")
        live = bound > 0
        if bool(live.any()):
            ratio = float((exact[live] / bound[live]).max())
            self.worst_ratio = ratio if math.isnan(self.worst_ratio) else max(self.worst_ratio, ratio)


def run_attacks(trials: int, seed: int = 0) -> list[AttackTally]:
    """Run every attack class with its share of ``trials`` (deterministic for a given seed)."""
    import torch

    tallies = []
    for index, name in enumerate(ATTACKS):
        module = import_module(f"witcert.verification.attacks.{name}")
        g = torch.Generator().manual_seed(seed * 1000 + index)
        started = time.perf_counter()
        tally = module.run(max(1, round(trials * module.SHARE)), g)
        tally.seconds = time.perf_counter() - started
        tallies.append(tally)
    return tallies

"""Adversarial regression of every bound, per query (docs/design.md "The meter and the risk score": never in aggregate).

Each trial is one query: compressed logits and per-token radii drawn from an adversarial
*family* (peaked and flat ``p~``, huge and tiny ``c``, one massive spike, masked tokens,
constant ``c`` -- the extremal case of ``tanh(D/2)`` -- and the two-token counterexample), at
``S`` from 1 to 4096. Inputs are drawn in fp32 and widened exactly, so the fp32 and fp64
paths are bounds for the *same* exact inputs. Every bound is checked against

* the sup-box adversary's vertex TV (exact sup for ``S <= 12``), and
* the true TV at a random interior error,

and any near-miss (``TV > bound (1 - 1e-9)``) is re-decided by the 50-digit golden at the
adversary's vertex. The known-false dispersion form is checked too: it must be violated.
"""
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from witcert.verification import adversary
from witcert.core import bounds
from witcert.core.metering import meter
from witcert.spec import golden

# family name -> weight of trials; S values with weights (large S are costly for the adversary)
SIZES = {1: 4, 2: 10, 3: 8, 4: 8, 5: 6, 8: 8, 12: 8, 16: 2, 32: 1, 64: 0.5, 512: 0.06, 4096: 0.006}
POLISHED_LARGE_S = 4  # starts polished by the adversary above S = 64 (all below)
BATCH_ELEMENTS = 1 << 16  # tokens per batch (trials x S)
RATIO_CAP = 0.9  # TV/bound statistics only where the bound is below this (see Tally)


def _loguniform(n, low, high, g):
    return torch.exp(torch.empty(n, 1, dtype=torch.float64).uniform_(math.log(low), math.log(high), generator=g))


def _family_random(n, s, g):
    scores = torch.randn(n, s, generator=g, dtype=torch.float64) * _loguniform(n, 0.1, 10, g)
    return scores, torch.rand(n, s, generator=g, dtype=torch.float64) * _loguniform(n, 1e-4, 5, g)


def _family_peaked(n, s, g):
    scores, c = _family_random(n, s, g)
    scores[:, 0] += torch.empty(n, dtype=torch.float64).uniform_(5, 30, generator=g)
    return scores, c


def _family_flat(n, s, g):
    scores = torch.randn(n, s, generator=g, dtype=torch.float64) * 1e-3
    return scores, torch.rand(n, s, generator=g, dtype=torch.float64) * _loguniform(n, 1e-3, 3, g)


def _family_constant_c(n, s, g):
    """Uniform radius D: the sup over the box reaches tanh(D/2) when a subset has mass 1/(1+e^D)."""
    scores = torch.randn(n, s, generator=g, dtype=torch.float64) * _loguniform(n, 0.01, 3, g)
    return scores, _loguniform(n, 1e-3, 6, g).expand(n, s).clone()


def _family_huge_c(n, s, g):
    scores, c = _family_random(n, s, g)
    huge = torch.tensor([30.0, 50.0, 100.0, 800.0, math.inf], dtype=torch.float64)
    pick = torch.randint(0, len(huge), (n, s), generator=g)
    where = torch.rand(n, s, generator=g) < 0.3
    return scores, torch.where(where, huge[pick], c)


def _family_tiny_c(n, s, g):
    scores = torch.randn(n, s, generator=g, dtype=torch.float64) * _loguniform(n, 0.1, 10, g)
    return scores, torch.rand(n, s, generator=g, dtype=torch.float64) * _loguniform(n, 1e-30, 1e-6, g)


def _family_spike(n, s, g):
    """One massive logit, with the largest radius on low-mass tokens."""
    scores, c = _family_random(n, s, g)
    scores[:, -1] += 50.0
    c[:, : max(s - 1, 1)] *= 20
    return scores, c


def _family_heavy_tail(n, s, g):
    scores = torch.randn(n, s, generator=g, dtype=torch.float64) * _loguniform(n, 0.1, 5, g)
    return scores, torch.exp(torch.randn(n, s, generator=g, dtype=torch.float64) * 3 - 4)


def _family_masked(n, s, g):
    scores, c = _family_random(n, s, g)
    masked = torch.rand(n, s, generator=g) < 0.4
    masked[:, 0] = False  # at least one live token per row
    c = torch.where(masked & (torch.rand(n, s, generator=g) < 0.5), torch.full_like(c, math.inf), c)
    return scores.masked_fill(masked, -math.inf), c


FAMILIES: dict[str, Callable] = {
    "random": _family_random,
    "peaked": _family_peaked,
    "flat": _family_flat,
    "constant-c": _family_constant_c,
    "huge-c": _family_huge_c,
    "tiny-c": _family_tiny_c,
    "spike": _family_spike,
    "heavy-tail-c": _family_heavy_tail,
    "masked": _family_masked,
}


def counterexample() -> tuple[torch.Tensor, torch.Tensor]:
    """docs/design.md "The meter and the risk score": p~ = (1/2, 1/2), c = (0.1, 0.1); eps = (0.1, -0.1) breaks the dispersion form."""
    return torch.zeros(1, 2, dtype=torch.float64), torch.full((1, 2), 0.1, dtype=torch.float64)


def unsound_dispersion(scores: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The KNOWN-FALSE form 1/2 e^{2 c_max}(E|c - c_bar| + c_bar (e^{c_max} - 1)), for the regression guard."""
    p = torch.softmax(scores, -1)
    c = torch.where(p > 0, c, torch.zeros_like(c))
    c_max = c.amax(-1)
    c_bar = (p * c).sum(-1)
    spread = (p * (c - c_bar.unsqueeze(-1)).abs()).sum(-1)
    return 0.5 * torch.exp(2 * c_max) * (spread + c_bar * torch.expm1(c_max))


# name -> (function of fp64 or fp32 inputs, uses fp32 inputs)
CHECKED: dict[str, tuple[Callable, bool]] = {
    "meter fp32": (meter, True),
    "meter fp64": (meter, False),
    "e-form (T1)": (bounds.eform_bound, False),
    "two-sided (P1)": (bounds.two_sided_bound, False),
    "retention (P1r)": (bounds.retention_bound, False),
    "tanh(D/2) (MN)": (bounds.maxnorm_bound, False),
    "tanh(D) competitor": (bounds.competitor_bound, False),
    "chi-square (CS)": (bounds.chi_square_bound, False),
    "mass-split (MS)": (bounds.mass_split_bound, False),
}


@dataclass
class Tally:
    """Per-bound counts; ``ratios`` keeps TV/bound on non-trivial cells (``0 < bound <= RATIO_CAP``):
    near the trivial bound 1 every TV close to 1 would read as a tight ratio."""

    cells: int = 0
    violations: int = 0
    ratios: list = field(default_factory=list)

    def add(self, tv: torch.Tensor, bound: torch.Tensor, violated: torch.Tensor) -> None:
        self.cells += tv.numel()
        self.violations += int(violated.sum())
        informative = (bound > 0) & (bound <= RATIO_CAP)
        self.ratios.append((tv[informative] / bound[informative]).float())

    def worst_ratio(self) -> float:
        joined = torch.cat(self.ratios) if self.ratios else torch.zeros(0)
        return float(joined.max()) if joined.numel() else float("nan")

    def median_ratio(self) -> float:
        joined = torch.cat(self.ratios) if self.ratios else torch.zeros(0)
        return float(joined.median()) if joined.numel() else float("nan")


@dataclass
class FuzzReport:
    """What ``witcert fuzz`` prints: per-bound tallies and the adversary's self-checks."""

    trials: int = 0
    seconds: float = 0.0
    tallies: dict = field(default_factory=lambda: {name: Tally() for name in (*CHECKED, "dispersion (known false)")})
    adversary_below_interior: int = 0  # exhaustive regime (S <= 12): interior TV above the sup: must stay 0
    local_search_beaten: int = 0  # S > 12: a random interior error beat the local search (information)
    nonfinite_outputs: int = 0  # NaN anywhere, or a meter outside [0, 1]: must stay 0
    golden_rechecks: int = 0

    @property
    def sound_violations(self) -> int:
        return sum(t.violations for name, t in self.tallies.items() if name in CHECKED)


def _true_tv(scores: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TV(softmax(scores - eps), softmax(scores)) in fp64, and an absolute error scale.

    Shifting ``eps`` by ``log Z`` (``Z = sum p~ e^{-eps}``) makes the new normaliser 1, so
    ``p_t - p~_t = p~_t expm1(-eps'_t)``: no overflow for huge errors. ``log Z`` is
    ``log1p(sum p~ expm1(-eps))`` while that sum is small (errors then scale with ``|eps|``, not
    with 1), else a log-sum-exp. The absolute error scale ``~u (max|eps| + |log Z|)`` is
    returned, so callers can tell rounding from a real excess.
    """
    p = torch.softmax(scores, -1)
    live = p > 0
    log_p = torch.where(live, torch.log(p), torch.full_like(p, -math.inf))
    z_minus_one = (p * torch.where(live, torch.expm1(-eps), torch.zeros_like(eps))).sum(-1, keepdim=True)
    log_z = torch.where(z_minus_one.abs() < 0.5, torch.log1p(z_minus_one), torch.logsumexp(log_p - eps, -1, keepdim=True))
    shifted = torch.where(live, eps + log_z, torch.zeros_like(eps))
    tv = (p * torch.expm1(-shifted)).clamp(min=0).sum(-1)
    return tv, 16 * 2.0**-53 * (eps.abs().amax(-1) + log_z.abs().squeeze(-1))


def _golden_tv(scores: list, eps: list) -> "golden.mpf":
    """50-digit TV at one error vector, in O(S) (the spec's cancellation-free golden is O(S^2))."""
    with golden.mp.workdps(60):
        live = [(golden.mpf(x), golden.mpf(e)) for x, e in zip(scores, eps) if x != -math.inf]
        top = max(x for x, _ in live)
        weights = [golden.mp.exp(x - top) for x, _ in live]
        shifted = [w * golden.mp.exp(-e) for w, (_, e) in zip(weights, live)]
        total, z = sum(weights), sum(shifted)
        return sum(max(a / z - b / total, 0) for a, b in zip(shifted, weights))


def _violations(tv, bound, scores, eps, report, slack=0.0) -> torch.Tensor:
    """Cells where ``tv > bound``; near-misses (within ``slack`` + 1e-9 relative) are re-decided
    by a 50-digit TV at that error."""
    near = (tv + slack > bound * (1 - 1e-9)) & (bound < 1)  # TV <= 1 always: a bound >= 1 cannot fail
    decided = torch.zeros_like(near)
    for i in near.nonzero().flatten().tolist():
        report.golden_rechecks += 1
        decided[i] = _golden_tv(scores[i].tolist(), eps[i].tolist()) > golden.mpf(float(bound[i]))
    return decided


def check_batch(scores32: torch.Tensor, c32: torch.Tensor, report: FuzzReport, g: torch.Generator) -> None:
    """Check every bound on one batch of queries (rows)."""
    scores, c = scores32.double(), c32.double()  # exact widening: both paths bound the same inputs
    sup = adversary.sup_box_tv(scores, c, polished=None if scores.shape[-1] <= 64 else POLISHED_LARGE_S)
    vertex = sup.eps(c)
    live_c = torch.where(scores > -math.inf, c.clamp(max=600), torch.zeros_like(c))
    interior_eps = live_c * (2 * torch.rand(c.shape, generator=g, dtype=torch.float64) - 1)
    interior, rounding_scale = _true_tv(scores, interior_eps)
    beaten = int((interior > sup.tv * (1 + 1e-9) + rounding_scale).sum())
    if scores.shape[-1] <= adversary.EXHAUSTIVE_MAX:
        report.adversary_below_interior += beaten
    else:
        report.local_search_beaten += beaten
    for name, (fn, fp32) in CHECKED.items():
        bound = fn(scores32, c32).double() if fp32 else fn(scores, c)
        report.nonfinite_outputs += int(torch.isnan(bound).sum())
        if name.startswith("meter"):
            report.nonfinite_outputs += int(((bound < 0) | (bound > 1)).sum())
        violated = _violations(sup.tv, bound, scores, vertex, report) | _violations(
            interior, bound, scores, interior_eps, report, rounding_scale)
        report.tallies[name].add(sup.tv, bound, violated)
    dispersion = unsound_dispersion(scores, c)
    report.tallies["dispersion (known false)"].add(sup.tv, dispersion, sup.tv > dispersion * (1 + 1e-9))


def batches(trials: int, seed: int) -> Iterator[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """Deterministic stream of (family, S, scores32, c32) batches totalling ``trials`` rows."""
    g = torch.Generator().manual_seed(seed)
    yield ("counterexample", 2, *(t.float() for t in counterexample()))
    sizes, weights = list(SIZES), torch.tensor(list(SIZES.values()))
    per_size = (weights / weights.sum() * (trials - 1)).floor().long()
    per_size[1] += trials - 1 - per_size.sum()  # the remainder goes to S = 2
    names = list(FAMILIES)
    for s, count in zip(sizes, per_size.tolist()):
        per_family = [count // len(names) + (i < count % len(names)) for i in range(len(names))]
        for name, n in zip(names, per_family):
            step = max(1, BATCH_ELEMENTS // s)
            for start in range(0, n, step):
                rows = min(step, n - start)
                scores, c = FAMILIES[name](rows, s, g)
                yield name, s, scores.float(), c.float()


def run_fuzz(trials: int, seed: int = 0, progress: Callable[[int], None] | None = None) -> FuzzReport:
    """Run ``trials`` adversarial per-query checks; ``progress(rows_done)`` after each batch."""
    report = FuzzReport()
    g = torch.Generator().manual_seed(seed + 1)
    started = time.perf_counter()
    for _, _, scores, c in batches(trials, seed):
        check_batch(scores, c, report, g)
        report.trials += scores.shape[0]
        if progress:
            progress(scores.shape[0])
    report.seconds = time.perf_counter() - started
    return report

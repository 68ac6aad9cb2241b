"""Measured effect of concrete optimisations proposed for the library's meter path (section 1).

Nothing here changes the library: each proposal is a benchmark-local variant, timed side by side
with the library call it would replace on the same inputs, and checked to give the same bound
(up to the rounding inflation the library already applies). Proposals:

1. ``logit_bound`` as one fp64 matmul ``W (S, B) @ ||q_b|| (B,)`` instead of a broadcast
   ``(G, S, B)`` product, a ``where`` and a sum (same B-term sums, any order: the existing
   ``(B + 8) 2^-52`` inflation still covers them);
2. Tier B for the token-group layout (m = 0): ``sum_c |q_c| s_{g(c),t} = sum_g s_{g,t} sum_{c in g} |q_c|``
   and the same for ``q_c^2 s^2`` -- a ``d/Gc``-length dot per token instead of ``d``-length fp64
   matmuls over a materialised ``(S, d)`` scale tensor (same sums regrouped; the ``(d + 16) 2^-52``
   inflation covers the reordering);
3. ``rounding.term_relative_error``: ``expm1(b) <= b (1 + b)`` for ``0 <= b <= 1`` replaces five
   fp64 ``expm1`` passes over the tokens by a multiply-add (``b`` is ~1e-6 here) when one scalar
   check ``max b <= 1`` passes (``torch.where`` would evaluate both branches);
4. ``bounds.moments`` with one transcendental pass besides the softmax's ``exp``: when
   ``max c <= 1`` (one scalar check; else the library path) the large-``c`` branch is skipped
   (``torch.where`` evaluates it for every token today), ``1 - e^{-c} = m/(1 + m)`` and
   ``e^{y - c} = e^{y}/(1 + m)`` with ``m = expm1(c)`` (a division each instead of an ``expm1``
   and an ``exp``; three more roundings charged to ``rho``), and the fp64 weighted-error sum of the
   masses is formed once instead of twice. On a GPU the softmax ``exp`` is shared with attention.

Proposal 4 is a cost estimate written here to size the change; its rounding budget follows the
library's but it has NOT been through the fuzz/golden suite: it is not a sound implementation
until the lead ports and tests it.
"""
import contextlib
import math

import torch

import witcert
from witcert.core import rounding
from witcert.core.rounding import round_up_to
from witcert.tier_b.certificate import DEQUANT_FACTOR, GRID_STEP, delta_local

from benchmarks.cost import SHAPES, _problem
from benchmarks.timing import time_interleaved


def fast_logit_bound(q: torch.Tensor, w: torch.Tensor, layout, sm: float) -> torch.Tensor:
    """Proposal 1: (Hkv, G, d) x (Hkv, S, B) -> (Hkv, G, S); same value as ``witcert.logit_bound``."""
    from witcert.core.norms import norms_upper_fp64

    qn = norms_upper_fp64(layout.split(q.double()))  # (Hkv, G, B)
    c = (qn @ w.double().transpose(-1, -2)) * sm  # (Hkv, G, S)
    return round_up_to(c * (1.0 + (layout.bands + 8) * 2.0**-52), torch.float32)


def fast_tier_b(q: torch.Tensor, store, delta_loc: float, sm: float) -> torch.Tensor:
    """Proposal 2 (token-group, no outliers): ``min(u + beta, Delta) + rho`` from group sums."""
    lay = store.layout
    if lay.granularity != "token-group" or lay.outlier_pairs:
        raise ValueError("proposal 2 covers the token-group layout without outliers")
    q64 = q.double()
    groups = q64.unflatten(-1, (-1, lay.group))  # (Hkv, G, d/Gc, Gc)
    s = store.scales.double()  # (Hkv, S, d/Gc)
    l1 = sm * (groups.abs().sum(-1) @ s.transpose(-1, -2))  # (Hkv, G, S)
    var = sm**2 * ((groups * groups).sum(-1) @ (s * s).transpose(-1, -2)) / 12
    u = torch.sqrt(2 * var * math.log(2 * store.n_tokens / delta_loc))
    c = torch.minimum(u + l1 * (GRID_STEP / 2), l1 / 2) + l1 * DEQUANT_FACTOR
    return round_up_to(c * (1 + (lay.head_dim + 16) * 2.0**-52), torch.float32)


def _cheap_term_relative_error(exponent_error, n_ops, dtype):
    budget = exponent_error + n_ops * rounding.exp_relative_error(dtype)
    if budget.numel() and float(budget.max()) <= 1:
        return budget * (1 + budget) * (1 + rounding.FP64_SLACK)  # expm1(b) <= b (1 + b) on [0, 1]
    return torch.expm1(budget) * (1 + rounding.FP64_SLACK)


def proposed_moments(scores: torch.Tensor, c: torch.Tensor):
    """Proposal 4 (cost estimate): the library's enclosures with one expm1 pass (see module doc)."""
    from witcert.core.bounds import _SPLIT_C, Enclosure, moments

    live = scores > float("-inf")
    c = torch.where(live, c, torch.zeros_like(c))
    if float(c.max()) > _SPLIT_C:
        return moments(scores, c)
    dtype = scores.dtype
    u_ratio = rounding.unit_roundoff(dtype) / (1 - rounding.unit_roundoff(dtype))
    y = scores - scores.amax(-1, keepdim=True)
    y_err = torch.where(live, y.double().abs() * u_ratio, torch.zeros_like(y, dtype=torch.float64))
    mass = torch.exp(y)
    mass_rho = _cheap_term_relative_error(y_err, 1, dtype)
    em1 = torch.expm1(c)
    grow = 1 + em1  # e^{c}
    k_terms = mass * em1
    j_terms = mass * (em1 / grow)
    shrunk = mass / grow
    rho3 = _cheap_term_relative_error(y_err, 3, dtype)
    rho6 = _cheap_term_relative_error(y_err, 6, dtype)  # + the add, the division and expm1 inside 1 + m
    total_err = rounding._weighted_error(mass, mass_rho)
    n = scores.shape[-1]
    gamma, underflow = rounding.summation_gamma(n, dtype), 4 * n * torch.finfo(dtype).tiny
    computed = mass.sum(-1).double()
    total_lo = ((computed / (1 + gamma) - total_err - underflow) * (1 - rounding.FP64_SLACK)).clamp(min=0)
    total_hi = (computed / (1 - gamma) + total_err + underflow) * (1 + rounding.FP64_SLACK)
    k_hi = rounding.up(rounding.sum_upper(k_terms, rho3) / total_lo)
    j_hi = rounding.up(rounding.sum_upper(j_terms, rho6) / total_lo)
    direct = rounding.sum_lower(shrunk, rho6) / total_hi
    a_minus_lo = torch.maximum(1 - j_hi, direct * (1 - 4 * rounding.FP64_SLACK))
    return Enclosure(k_hi, j_hi, a_minus_lo, c.amax(-1).double())  # the base meter's enclosure (no CS, MS)


def proposed_meter(scores: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``witcert.meter`` with proposal 4's moments (input checks kept)."""
    from witcert.core.checks import check_scores_and_bounds

    scores, c = check_scores_and_bounds(scores, c)
    return round_up_to(proposed_moments(scores, c).meter(), scores.dtype)


@contextlib.contextmanager
def cheap_rounding():
    """Proposal 3, patched in for the duration of a measurement only."""
    original = rounding.term_relative_error
    rounding.term_relative_error = _cheap_term_relative_error
    try:
        yield
    finally:
        rounding.term_relative_error = original


def measure(name: str, s: int, reps: int) -> dict:
    hq, hkv, d = SHAPES[name]
    p = _problem(hq, hkv, d, s)
    scores = (p["q"] @ p["k"].transpose(-1, -2)) * p["sm"]
    c_lib = witcert.logit_bound(p["q"], p["w"], p["layout"], p["sm"])
    c_fast = fast_logit_bound(p["q"], p["w"], p["layout"], p["sm"])
    b_lib = witcert.tier_b_logit_bound(p["q"], p["store"], p["delta_loc"], p["sm"])
    b_fast = fast_tier_b(p["q"], p["store"], p["delta_loc"], p["sm"])
    m_lib = witcert.meter(scores, c_lib)
    with cheap_rounding():
        m_cheap = witcert.meter(scores, c_lib)
    m_prop = proposed_meter(scores, c_lib)

    def cheap_meter(c):
        with cheap_rounding():
            return witcert.meter(scores, c)

    fns = {
        "attention": lambda: torch.softmax((p["q"] @ p["k"].transpose(-1, -2)) * p["sm"], -1) @ p["v"],
        "logit_bound (library)": lambda: witcert.logit_bound(p["q"], p["w"], p["layout"], p["sm"]),
        "logit_bound (proposal 1)": lambda: fast_logit_bound(p["q"], p["w"], p["layout"], p["sm"]),
        "tier_b c (library)": lambda: witcert.tier_b_logit_bound(p["q"], p["store"], p["delta_loc"], p["sm"]),
        "tier_b c (proposal 2)": lambda: fast_tier_b(p["q"], p["store"], p["delta_loc"], p["sm"]),
        "meter (library)": lambda: witcert.meter(scores, c_lib),
        "meter (proposal 3)": lambda: cheap_meter(c_lib),
        "meter (proposal 4)": lambda: proposed_meter(scores, c_lib),
        "Tier A all proposals": lambda: proposed_meter(scores, fast_logit_bound(p["q"], p["w"], p["layout"], p["sm"])),
        "Tier B all proposals": lambda: proposed_meter(scores, fast_tier_b(p["q"], p["store"], p["delta_loc"], p["sm"])),
    }
    t = time_interleaved(fns, reps=reps)
    att = t["attention"].median
    rel = lambda a, b: float(((a.double() - b.double()).abs() / b.double().clamp(min=1e-300)).max())  # noqa: E731
    return {
        "shape": name, "S": s,
        "ratio_to_attention": {k: v.median / att for k, v in t.items() if k != "attention"},
        "max_rel_diff": {"logit_bound": rel(c_fast, c_lib), "tier_b c": rel(b_fast, b_lib), "meter (3)": rel(m_cheap, m_lib),
                         "meter (4)": rel(m_prop, m_lib)},
    }


def run(quick: bool, reps: int) -> list[dict]:
    rows = []
    for name in SHAPES:
        rows.append(measure(name, 8192 if quick else 32768, reps))
        r = rows[-1]["ratio_to_attention"]
        print(f"  proposals {name}: Tier A {r['Tier A all proposals']:.2f}x, Tier B {r['Tier B all proposals']:.2f}x",
              flush=True)
    return rows

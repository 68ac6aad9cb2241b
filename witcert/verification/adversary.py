"""The sup-box adversary: the worst true TV over all logit errors with ``|eps_t| <= c_t``.

For fixed ``p~`` and ``c`` the supremum sits at a vertex ``eps = -c`` on a set ``T`` and ``+c``
off it (docs/design.md "How loose, and where")::

    sup TV = max_T  a_T / (a_T + b_T) - p~(T),   a_T = sum_T p~ e^{c},  b_T = sum_{not T} p~ e^{-c}.

The maximising ``T`` is not a threshold set in ``c``, so: exhaustive search for small ``S``;
otherwise several starts (prefix scans in two orders, a fixed-point of the first-order
inclusion rule ``e^{c_t} b + e^{-c_t} a > (a + b)^2``) polished by best single-token flips.
The result is always an *achieved* TV (recomputed from the final set), hence a lower bound
on the supremum: exactly what a soundness check needs. Used by ``witcert fuzz`` and by the
looseness split in benchmarks.
"""
from dataclasses import dataclass

import torch

EXHAUSTIVE_MAX = 12  # 2^12 subsets per query
_C_CAP = 600.0  # shrinking the box keeps the adversary's TV achievable (and avoids fp64 overflow)


@dataclass(frozen=True)
class SupBox:
    """Adversary result per query: ``tv`` (...) achieved at ``upward`` (..., S), the set T."""

    tv: torch.Tensor
    upward: torch.Tensor

    def eps(self, c: torch.Tensor) -> torch.Tensor:
        """The vertex logit error reaching ``tv``: ``-c`` on T (mass moves there), ``+c`` elsewhere."""
        c = c.double().clamp(max=_C_CAP)
        return torch.where(self.upward, -c, c)


@dataclass(frozen=True)
class _Weights:
    """Per-token fp64 weights: ``p~``, ``alpha = p~ e^c``, ``beta = p~ e^-c`` and the
    cancellation-free excesses ``rise = p~ (e^c - 1)``, ``drop = p~ (1 - e^-c)``."""

    p: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    rise: torch.Tensor
    drop: torch.Tensor
    c: torch.Tensor


def _weights(scores: torch.Tensor, c: torch.Tensor) -> _Weights:
    p = torch.softmax(scores.double(), dim=-1)
    c = torch.where(p > 0, c.double().clamp(max=_C_CAP), torch.zeros_like(p))
    return _Weights(p, p * torch.exp(c), p * torch.exp(-c), p * torch.expm1(c), -p * torch.expm1(-c), c)


def _objective(rise_in, drop_out, mass_in, mass_out, alpha_in, beta_out) -> torch.Tensor:
    """``a/(a+b) - P`` rewritten without cancellation: ``(a'(1-P) + P b') / (a + b)``.

    With ``a = P + a'`` (``a' = sum_T p~(e^c - 1)``) and ``b = (1-P) - b'``
    (``b' = sum_{not T} p~(1 - e^-c)``), the numerator ``a(1-P) - P b`` equals
    ``a'(1-P) + P b'``: a sum of non-negative terms, accurate even for ``c ~ 1e-30``.
    """
    value = (rise_in * mass_out + mass_in * drop_out) / (alpha_in + beta_out)
    return torch.nan_to_num(value)


def _set_sums(up: torch.Tensor, w: _Weights):
    """The six sums ``_objective`` needs for the sets ``up`` (..., S) of {0, 1} floats."""
    out = 1 - up
    return ((w.rise * up).sum(-1), (w.drop * out).sum(-1), (w.p * up).sum(-1), (w.p * out).sum(-1),
            (w.alpha * up).sum(-1), (w.beta * out).sum(-1))


def _tv_of(upward: torch.Tensor, w: _Weights) -> torch.Tensor:
    """Achieved TV ``p(T) - p~(T)`` of a vertex set, recomputed from scratch (not incrementally)."""
    return _objective(*_set_sums(upward.double(), w))


def _exhaustive(w: _Weights) -> torch.Tensor:
    n = w.p.shape[-1]
    codes = torch.arange(2**n)
    bits = ((codes.unsqueeze(-1) >> torch.arange(n)) & 1).double()  # (2^S, S)
    out = 1 - bits
    value = _objective(w.rise @ bits.T, w.drop @ out.T, w.p @ bits.T, w.p @ out.T, w.alpha @ bits.T, w.beta @ out.T)
    return bits[value.argmax(-1)].bool()


def _best_prefix(order: torch.Tensor, w: _Weights) -> torch.Tensor:
    """Best set among the prefixes of ``order`` (..., S), in one cumulative-sum scan."""

    def inside(v):
        return torch.cumsum(v.gather(-1, order), -1)

    def outside(v):
        return (v.sum(-1, keepdim=True) - inside(v)).clamp(min=0)

    value = _objective(inside(w.rise), outside(w.drop), inside(w.p), outside(w.p), inside(w.alpha), outside(w.beta))
    return _rank(order) <= value.argmax(-1, keepdim=True)


def _rank(order: torch.Tensor) -> torch.Tensor:
    """Position of each token in ``order``."""
    positions = torch.arange(order.shape[-1]).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions)


def _two_thresholds(w: _Weights, first: str, rounds: int = 4) -> torch.Tensor:
    """Coordinate ascent over sets {top-k by c} U {bottom-j by c}: the zonotope-vertex shape."""
    order = torch.argsort(w.c, dim=-1, descending=True)
    n = w.p.shape[-1]

    def cumulative(v):
        return torch.cat([torch.zeros_like(v[..., :1]), torch.cumsum(v, -1)], -1)

    fields = (w.rise, w.drop, w.p, w.alpha, w.beta)
    top = [cumulative(v.gather(-1, order)) for v in fields]
    bottom = [cumulative(v.gather(-1, order).flip(-1)) for v in fields]
    totals = [t[..., -1:] for t in top]

    def gain(k, j):
        inside = [t.gather(-1, k) + b.gather(-1, j) for t, b in zip(top, bottom)]
        outside = [(total - x).clamp(min=0) for total, x in zip(totals, inside)]
        f = _objective(inside[0], outside[1], inside[2], outside[2], inside[3], outside[4])
        return torch.where(k + j <= n, f, torch.full_like(f, -2.0))

    every = torch.arange(n + 1).expand(*w.p.shape[:-1], n + 1)
    k = torch.zeros_like(every[..., :1])
    j = torch.zeros_like(k)
    for step in range(rounds):
        if (step % 2 == 0) == (first == "top"):
            k = gain(every, j.expand_as(every)).argmax(-1, keepdim=True)
        else:
            j = gain(k.expand_as(every), every).argmax(-1, keepdim=True)
    rank = _rank(order)
    return (rank < k) | (rank >= n - j)


def _fixed_point(upward, w: _Weights, steps=4):
    """Iterate the first-order inclusion rule from ``upward``."""
    for _ in range(steps):
        up = upward.double()
        a, b = (w.alpha * up).sum(-1, keepdim=True), (w.beta * (1 - up)).sum(-1, keepdim=True)
        upward = torch.exp(w.c) * b + torch.exp(-w.c) * a > (a + b) ** 2
    return upward


def _polish(upward, w: _Weights, max_flips):
    """Best single-token flips until none improves by a relative 1e-12 (or ``max_flips``).

    A converged row stays converged, so rows are only set aside (compacted) once fewer than
    half of the working set still move: each step costs about the rows still moving.
    """
    shape = upward.shape
    result = upward.reshape(-1, shape[-1]).clone()
    rows = torch.arange(result.shape[0])  # which result rows the working set holds
    up = result.clone()
    rise, drop, p, alpha, beta = (v.expand(shape).reshape(-1, shape[-1]) for v in (w.rise, w.drop, w.p, w.alpha, w.beta))
    for _ in range(max_flips):
        inside = up.double()
        outside = 1 - inside
        sums = [(v * side).sum(-1, keepdim=True) for v, side in
                ((rise, inside), (drop, outside), (p, inside), (p, outside), (alpha, inside), (beta, outside))]
        current = _objective(*sums)
        sign = 1 - 2 * inside  # +1 joins T, -1 leaves it
        a1, b1, m_in, m_out, a, b = sums
        flipped = _objective(a1 + sign * rise, (b1 - sign * drop).clamp(min=0), m_in + sign * p,
                             (m_out - sign * p).clamp(min=0), a + sign * alpha, (b - sign * beta).clamp(min=0))
        gain = torch.where(p > 0, flipped - current, torch.full_like(inside, -1.0))
        best_gain, best = gain.max(-1)
        improve = best_gain > 1e-12 * current.squeeze(-1)
        if not improve.any():
            break
        moving = improve.nonzero().squeeze(-1)
        up[moving, best[moving]] ^= True
        if 2 * moving.numel() < up.shape[0]:  # compact: converged rows are final
            result[rows] = up
            rows, up = rows[moving], up[moving]
            rise, drop, p, alpha, beta = (v[moving] for v in (rise, drop, p, alpha, beta))
    result[rows] = up
    return result.reshape(shape)


def _starts(w: _Weights, restarts, generator):
    """Candidate sets: prefix scans in six orders (and their fixed points), two-threshold ascents, random sets."""
    log_p = torch.log(w.p)
    keys = (w.c, -w.c, w.p, -w.p, w.c + log_p, log_p - w.c)
    prefixes = [_best_prefix(torch.argsort(key, dim=-1, descending=True), w) for key in keys]
    starts = prefixes + [_fixed_point(s, w) for s in prefixes]
    starts += [_two_thresholds(w, first) for first in ("top", "bottom")]
    starts += [torch.rand(w.p.shape, generator=generator, dtype=torch.float64) < 0.5 for _ in range(restarts)]
    return torch.stack(starts)  # (K, ..., S)


def sup_box_tv(scores, c, *, max_flips: int = 64, restarts: int = 8, polished: int | None = None, seed: int = 0) -> SupBox:
    """Adversarial (near-)supremum of the true TV over ``|eps| <= c``, per query.

    Parameters
    ----------
    scores : Tensor (..., S)
        Compressed logits; ``-inf`` masks a token.
    c : Tensor (..., S)
        Per-token bounds ``>= 0``.
    max_flips, restarts, polished, seed : int
        Polishing steps, random starting sets, how many of the best starts are polished
        (``None``: all -- measured to close every gap to the exhaustive sup at S = 12 and 16),
        and the random sets' seed (deterministic).

    Returns
    -------
    SupBox
        ``tv`` (fp64) is exactly the sup for ``S <= EXHAUSTIVE_MAX`` and an achieved lower bound
        on it otherwise (all starts are polished, the best kept).
    """
    scores = torch.as_tensor(scores)
    c = torch.as_tensor(c).expand_as(scores)
    w = _weights(scores, c)
    if scores.shape[-1] <= EXHAUSTIVE_MAX:
        upward = _exhaustive(w)
    else:
        generator = torch.Generator().manual_seed(seed)
        starts = _starts(w, restarts, generator)  # (K, ..., S)
        best = _tv_of(starts, w).topk(min(polished or len(starts), len(starts)), dim=0).indices
        starts = starts.gather(0, best.unsqueeze(-1).expand(-1, *starts.shape[1:]))
        starts = _polish(starts, w, max_flips)
        index = _tv_of(starts, w).argmax(0)[None, ..., None].expand_as(starts[:1])
        upward = starts.gather(0, index).squeeze(0)
    return SupBox(_tv_of(upward, w), upward)

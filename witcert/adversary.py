"""The sup-box adversary: the worst true TV over all logit errors with ``|eps_t| <= c_t``.

For fixed ``p~`` and ``c`` the supremum sits at a vertex ``eps = -c`` on a set ``T`` and ``+c``
off it (DESIGN.md §2 "How loose, and where")::

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


def _weights(scores: torch.Tensor, c: torch.Tensor):
    p = torch.softmax(scores.double(), dim=-1)
    c = torch.where(p > 0, c.double().clamp(max=_C_CAP), torch.zeros_like(p))
    return p, p * torch.exp(c), p * torch.exp(-c), c


def _tv_of(upward: torch.Tensor, p, alpha, beta) -> torch.Tensor:
    """Achieved TV of a vertex set, recomputed from scratch (not incrementally)."""
    up = upward.double()
    a = (alpha * up).sum(-1)
    b = (beta * (1 - up)).sum(-1)
    return torch.nan_to_num(a / (a + b)) - (p * up).sum(-1)


def _exhaustive(p, alpha, beta) -> torch.Tensor:
    n = p.shape[-1]
    codes = torch.arange(2**n)
    bits = ((codes.unsqueeze(-1) >> torch.arange(n)) & 1).double()  # (2^S, S)
    a, b, mass = alpha @ bits.T, beta @ (1 - bits).T, p @ bits.T
    best = (torch.nan_to_num(a / (a + b)) - mass).argmax(-1)
    return bits[best].bool()


def _best_prefix(order: torch.Tensor, p, alpha, beta) -> torch.Tensor:
    """Best set among the prefixes of ``order`` (..., S), in one cumulative-sum scan."""
    a = torch.cumsum(alpha.gather(-1, order), -1)
    b = beta.sum(-1, keepdim=True) - torch.cumsum(beta.gather(-1, order), -1)
    mass = torch.cumsum(p.gather(-1, order), -1)
    gain = torch.nan_to_num(a / (a + b.clamp(min=0))) - mass
    return _rank(order) <= gain.argmax(-1, keepdim=True)


def _rank(order: torch.Tensor) -> torch.Tensor:
    """Position of each token in ``order``."""
    positions = torch.arange(order.shape[-1]).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions)


def _two_thresholds(c, p, alpha, beta, first: str, rounds: int = 4) -> torch.Tensor:
    """Coordinate ascent over sets {top-k by c} U {bottom-j by c}: the zonotope-vertex shape."""
    order = torch.argsort(c, dim=-1, descending=True)
    n = p.shape[-1]

    def cumulative(v):
        return torch.cat([torch.zeros_like(v[..., :1]), torch.cumsum(v, -1)], -1)

    top = [cumulative(v.gather(-1, order)) for v in (alpha, beta, p)]
    bottom = [cumulative(v.gather(-1, order).flip(-1)) for v in (alpha, beta, p)]
    beta_total = top[1][..., -1:]

    def gain(k, j):
        a = top[0].gather(-1, k) + bottom[0].gather(-1, j)
        b = (beta_total - top[1].gather(-1, k) - bottom[1].gather(-1, j)).clamp(min=0)
        f = torch.nan_to_num(a / (a + b)) - top[2].gather(-1, k) - bottom[2].gather(-1, j)
        return torch.where(k + j <= n, f, torch.full_like(f, -2.0))

    every = torch.arange(n + 1).expand(*p.shape[:-1], n + 1)
    k = torch.zeros_like(every[..., :1])
    j = torch.zeros_like(k)
    for step in range(rounds):
        if (step % 2 == 0) == (first == "top"):
            k = gain(every, j.expand_as(every)).argmax(-1, keepdim=True)
        else:
            j = gain(k.expand_as(every), every).argmax(-1, keepdim=True)
    rank = _rank(order)
    return (rank < k) | (rank >= n - j)


def _fixed_point(upward, c, alpha, beta, steps=4):
    """Iterate the first-order inclusion rule from ``upward``."""
    for _ in range(steps):
        up = upward.double()
        a, b = (alpha * up).sum(-1, keepdim=True), (beta * (1 - up)).sum(-1, keepdim=True)
        upward = torch.exp(c) * b + torch.exp(-c) * a > (a + b) ** 2
    return upward


def _polish(upward, p, alpha, beta, max_flips):
    """Best single-token flips until none improves (or ``max_flips``)."""
    for _ in range(max_flips):
        up = upward.double()
        a, b = (alpha * up).sum(-1, keepdim=True), (beta * (1 - up)).sum(-1, keepdim=True)
        mass = (p * up).sum(-1, keepdim=True)
        sign = 1 - 2 * up  # +1 joins T, -1 leaves it
        a2, b2, m2 = a + sign * alpha, (b - sign * beta).clamp(min=0), mass + sign * p
        gain = torch.nan_to_num(a2 / (a2 + b2)) - m2 - (torch.nan_to_num(a / (a + b)) - mass)
        gain = torch.where(p > 0, gain, torch.full_like(gain, -1.0))
        best_gain, best = gain.max(-1)
        improve = best_gain > 1e-15
        if not improve.any():
            break
        flip = torch.zeros_like(upward).scatter_(-1, best.unsqueeze(-1), improve.unsqueeze(-1))
        upward = upward ^ flip
    return upward


def _starts(p, alpha, beta, c, restarts, generator):
    """Candidate sets: prefix scans in six orders (and their fixed points), two-threshold ascents, random sets."""
    log_p = torch.log(p)
    keys = (c, -c, p, -p, c + log_p, log_p - c)
    prefixes = [_best_prefix(torch.argsort(key, dim=-1, descending=True), p, alpha, beta) for key in keys]
    starts = prefixes + [_fixed_point(s, c, alpha, beta) for s in prefixes]
    starts += [_two_thresholds(c, p, alpha, beta, first) for first in ("top", "bottom")]
    starts += [torch.rand(p.shape, generator=generator, dtype=torch.float64) < 0.5 for _ in range(restarts)]
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
    p, alpha, beta, c64 = _weights(scores, c)
    if scores.shape[-1] <= EXHAUSTIVE_MAX:
        upward = _exhaustive(p, alpha, beta)
    else:
        generator = torch.Generator().manual_seed(seed)
        starts = _starts(p, alpha, beta, c64, restarts, generator)  # (K, ..., S)
        best = _tv_of(starts, p, alpha, beta).topk(min(polished or len(starts), len(starts)), dim=0).indices
        starts = starts.gather(0, best.unsqueeze(-1).expand(-1, *starts.shape[1:]))
        starts = _polish(starts, p, alpha, beta, max_flips)
        tvs = _tv_of(starts, p, alpha, beta)  # (K', ...)
        index = tvs.argmax(0)[None, ..., None].expand_as(starts[:1])
        upward = starts.gather(0, index).squeeze(0)
    return SupBox(_tv_of(upward, p, alpha, beta), upward)

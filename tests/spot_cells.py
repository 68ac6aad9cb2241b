"""Synthetic spot-check cells shared by tests/test_spot_check.py and tests/test_spot_one_sided.py.

Adversarial families: peaked, flat, heavy-tailed scores and radii, errors aligned with ``c``, at
the vertices ``eps = +-c``, split by score, a few huge radii, masked tokens. Oracles: the true TV
at 30 digits and the binomial ceiling of a level-delta bound's failures.
"""
import math

import mpmath
import torch
from scipy import stats

from witcert.spec import bounds as spec_bounds

FAMILIES = ("peaked", "flat", "heavy", "aligned", "vertex", "split", "sparse_big", "masked")
GRID = 1 / 256  # the betting search's resolution (witcert.spot.confidence.GRID_CELLS)


def synthetic_cell(family: str, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores, c, eps) in fp64 with ``|eps| <= c``; ``-inf`` scores mark masked tokens."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    scores, c = 2 * randn(size), 0.8 * rand(size)
    sign = torch.where(rand(size) < 0.5, -1.0, 1.0)
    eps = sign * c * rand(size)
    if family == "peaked":
        scores[0] += 12
    elif family == "flat":
        scores = torch.zeros(size, dtype=torch.float64)
        c = 0.3 * rand(size)
        eps = sign * c * rand(size)
    elif family == "heavy":
        scores = torch.tan(math.pi * (rand(size) - 0.5)).clamp(-30, 30)
        c = torch.exp(randn(size)).clamp(max=6.0)
        eps = sign * c * rand(size)
    elif family == "aligned":
        eps = c.clone()
    elif family == "vertex":
        eps = sign * c
    elif family == "split":
        eps = torch.where(scores > scores.median(), c, -c)
    elif family == "sparse_big":
        c = 1e-3 * rand(size)
        big = torch.randperm(size, generator=g)[:5]
        c[big] = 5.0
        eps = sign * c
    elif family == "masked":
        scores[rand(size) < 0.3] = -torch.inf
        eps = sign * c
    return scores, c, eps


def true_tv(scores, eps) -> float:
    with mpmath.workdps(30):
        p = spec_bounds.softmax([float(v) for v in scores])
        e = [float(x) if p_t > 0 else 0.0 for x, p_t in zip(eps, p)]
        return float(spec_bounds.tv(spec_bounds.perturbed(p, e), p))  # O(S) literal form: TVs here are >> 1e-25


def reader_for(scores, eps):
    exact = scores - eps  # l = l~ - eps
    return lambda index: exact[index]


def binomial_ceiling(trials: int, delta: float) -> int:
    """Failures a correct level-delta bound exceeds with probability < 1e-4."""
    return int(stats.binom.ppf(1 - 1e-4, trials, delta))


class RecordingSampler:
    """Draws like the library's sampler and records each cell's rows of every call, in order (``cells`` names them;
    the one-cell form passes none: cell 0)."""

    def __init__(self, seed: int):
        from witcert.spot.randomness import MultinomialSampler, spot_randomness

        self.inner = MultinomialSampler(spot_randomness(seed).generator)
        self.rows: dict[int, list[torch.Tensor]] = {}

    def draw(self, weights, count, cells=None):
        draws = self.inner.draw(weights, count, cells)
        for i, cell in enumerate([0] if cells is None else cells.tolist()):
            self.rows.setdefault(cell, []).append(draws[i])
        return draws


class ReplaySampler:
    """Hands back recorded draws in order (the first ``count`` of each): the same draws in the other form."""

    def __init__(self, rows: list[torch.Tensor]):
        self.rows = list(rows)

    def draw(self, weights, count, cells=None):
        assert self.rows, "the form asked for more draws than the other form made"
        row = self.rows.pop(0)
        assert row.numel() >= count, (row.numel(), count)
        return row[:count].reshape(1, -1).expand(weights.shape[0], -1)


def stacked_cells(families, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores, c, eps) of one synthetic cell per family name, stacked (N, size)."""
    parts = [synthetic_cell(family, size, seed + i) for i, family in enumerate(families)]
    return tuple(torch.stack(part) for part in zip(*parts))

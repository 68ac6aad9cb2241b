"""The betting bound's searches (registry SCB; ``witcert.spot.confidence.row_betting_upper``): the two-level grid
search of small inputs and the bisection of large ones.

Each must return the full grid's first rejected point ``j* / GRID_CELLS`` of every row: the fp64 capital at ``j*`` is
rejected and the one at ``j* - 1`` is not, each up to the rounding of a sum (checked with a slack of ``1e-9``, far
above it, so no test depends on the order a CPU sums in). Rows of every length, cap, ``delta`` and spread, and rows
with no valid sample, are searched together, as the batched check does.
"""
import math

import pytest
import torch

from witcert.spot import confidence

SLACK = 1e-9


def log_capital(x: torch.Tensor, lambdas: torch.Tensor, point: int, cap: float) -> float:
    """fp64 ``log K`` of one row at grid point ``point`` with the cell's capped bets, as the scan evaluates it."""
    m = point / confidence.GRID_CELLS
    bets = torch.minimum(lambdas, torch.tensor(cap / (1 - m), dtype=torch.float64))
    return float(torch.log(1 + bets * (m - x)).sum())


def random_rows(seed: int, rows: int = 24, width: int = 400):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, width, generator=g, dtype=torch.float64) ** torch.randint(1, 8, (rows, 1), generator=g)
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    lengths[0] = 0  # a row with no sample: bound 1
    valid = torch.arange(width)[None, :] < lengths[:, None]
    delta = 10.0 ** -torch.randint(1, 9, (rows,), generator=g).to(torch.float64)
    planned = lengths.clamp(min=1).to(torch.float64) * torch.randint(1, 3, (rows,), generator=g)
    return x, valid, delta, planned


SEARCHES = {"grid": confidence._grid_search, "bisection": confidence._bisection,
            "row_betting_upper": lambda x, valid, delta, planned, cap: confidence.row_betting_upper(
                x, valid, delta, planned, float(cap))}


@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("cap", (confidence.BETTING_CAP, confidence.ONE_SIDED_CAP))
@pytest.mark.parametrize("seed", (0, 1, 2))
def test_search_finds_the_first_rejected_grid_point(search, cap, seed):
    x, valid, delta, planned = random_rows(seed)
    bound = SEARCHES[search](x, valid, delta, planned, torch.tensor(cap, dtype=torch.float64))
    assert_first_rejected(x, valid, delta, planned, cap, bound)


def assert_first_rejected(x, valid, delta, planned, cap: float, bound) -> None:
    """Each row's ``bound`` is the full grid's first rejected point (rejected there, not one point below, each up to
    ``SLACK``), 1 for a row without a valid sample."""
    lambdas = confidence.row_lambdas(torch.where(valid, x, 0.0), valid, delta, planned)
    grid = confidence.GRID_CELLS
    for row in range(x.shape[0]):
        n = int(valid[row].sum())
        if n == 0:
            assert float(bound[row]) == 1.0
            continue
        point = round(float(bound[row]) * grid)
        assert float(bound[row]) == point / grid
        threshold = math.log(1 / float(delta[row]))
        xs, lam = x[row, :n], lambdas[row, :n]
        if point < grid:  # rejected there (the margin: never accepted where the exact capital rejects)
            assert log_capital(xs, lam, point, cap) >= threshold + confidence.LOG_MARGIN - SLACK, (row, point)
        if point > 0:  # not rejected one point below: the search stops at the first rejection, not above it
            assert log_capital(xs, lam, point - 1, cap) < threshold + confidence.LOG_MARGIN + SLACK, (row, point)


@pytest.mark.parametrize("search", SEARCHES)
def test_search_bounds_every_grid_region(search):
    """Rows built to be rejected from every coarse block of the grid: the fine search covers each block."""
    means = torch.linspace(0.0, 0.99, 40, dtype=torch.float64)
    x = means[:, None].expand(-1, 600).clone()  # constant rows: the bound sits just above each mean
    valid = torch.ones_like(x, dtype=torch.bool)
    delta = torch.full((40,), 1e-3, dtype=torch.float64)
    bound = SEARCHES[search](x, valid, delta, torch.full((40,), 600.0, dtype=torch.float64),
                             torch.tensor(confidence.ONE_SIDED_CAP, dtype=torch.float64))
    assert bool((bound >= means).all())
    assert bool((bound <= means + 0.1).all())
    assert len(set((bound * confidence.GRID_CELLS).long().div(confidence.GRID_STRIDE, rounding_mode="floor")
                   .tolist())) == confidence.GRID_CELLS // confidence.GRID_STRIDE  # every coarse block


def test_the_searches_run_eager_under_witcert_compile(monkeypatch):
    """``WITCERT_COMPILE=1`` compiles neither search (torch 2.13's inductor miscompiled the grid search's first-point
    step in two forms, on AVX-512 and under AVX2 code): the bounds of single rows of a few draws, an audit's one-cell
    rounds, are the grid oracle's, and no compiled function is created."""
    from witcert.fastpath import compiled as compiled_mod

    monkeypatch.setenv("WITCERT_COMPILE", "1")
    monkeypatch.setattr(compiled_mod, "_state", {})
    g = torch.Generator().manual_seed(3)
    for width in (2, 3, 4, 7, 16, 33):
        for delta, scale in ((2.6e-8, 0.3), (1e-3, 0.05), (0.3, 1.0)):
            x = torch.rand(1, width, generator=g, dtype=torch.float64) * scale
            args = (x, torch.ones_like(x, dtype=torch.bool), torch.tensor([delta], dtype=torch.float64),
                    torch.tensor([float(width)], dtype=torch.float64))
            assert_first_rejected(*args, confidence.ONE_SIDED_CAP,
                                  confidence.row_betting_upper(*args, confidence.ONE_SIDED_CAP))
    assert compiled_mod._state == {}

"""The spot check's own randomness: drawn after the query is fixed, never fed to the model.

The draw must not be predictable by whatever produced the query (an adaptive query, a scheme
tuned against the meter), so by default the generator is seeded from the operating system's
cryptographic source; a fixed seed is an opt-in for replays and is recorded with the result.
"""
import secrets
from dataclasses import dataclass

import torch

MAX_DRAWS_PER_KEY = 8
"""A stage stops after this many draws per planned key even if fewer distinct keys turned up."""


@dataclass(frozen=True)
class SpotRandomness:
    """A CPU ``torch.Generator`` and the seed it was started from (recorded for replay)."""

    generator: torch.Generator
    seed: int
    from_os: bool  # True: the seed came from the OS's cryptographic source


def spot_randomness(seed: int | None = None) -> SpotRandomness:
    """A generator seeded from ``secrets`` (default) or from ``seed`` (replay opt-in)."""
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ValueError(f"seed: expected a non-negative int or None, got {seed!r}")
    chosen = secrets.randbits(63) if seed is None else seed
    generator = torch.Generator(device="cpu")
    generator.manual_seed(chosen)
    return SpotRandomness(generator=generator, seed=chosen, from_os=seed is None)


class MultinomialSampler:
    """The spot check's draws: i.i.d. with replacement from each row of a weight matrix, one call for all rows.

    ``draw(weights (R, S), count, cells=None) -> (R, count)`` int64, by the inverse of each row's cumulative
    weights at uniform points of the generator (one ``cumsum``, one ``searchsorted``): a token of weight 0 is
    never drawn; the fp64 cumulative sums move each token's probability by a relative ``~S 2^-53``, inside the
    estimators' rounding margins. ``cells`` names the rows' cells (a sampler that records or replays draws per
    cell uses them; this one does not).
    """

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def draw(self, weights: torch.Tensor, count: int, cells: torch.Tensor | None = None) -> torch.Tensor:
        cdf = torch.cumsum(weights.to(torch.float64), dim=-1)  # (R, S)
        points = torch.rand(weights.shape[0], count, generator=self.generator, dtype=torch.float64) * cdf[:, -1:]
        index = torch.searchsorted(cdf, points, right=True)  # first token whose cumulative weight exceeds the point
        beyond = index >= weights.shape[-1]  # a point rounded up to the total: the last token of positive weight
        if bool(beyond.any()):
            positions = torch.arange(weights.shape[-1]).expand_as(weights)
            last = torch.where(weights > 0, positions, -1).amax(-1, keepdim=True).expand_as(index)
            index = torch.where(beyond, last, index)
        return index


def draw_until_new(sampler, weights: torch.Tensor, counts: torch.Tensor, known: torch.Tensor,
                   cells: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(draws, valid)`` (R, T): each row draws i.i.d. from its ``weights`` until ``counts`` distinct tokens outside
    ``known`` (R, S) turned up, or ``MAX_DRAWS_PER_KEY counts`` draws: a stopping time of the sequential process.

    Rows draw in chunks (twice the count, then doubling up to the cap), each chunk one ``sampler.draw`` call
    for the rows still going; a row uses its own chunk sizes (past them a call's extra columns are not used,
    i.i.d. draws it never looks at), so its draws do not depend on the other rows. ``valid`` marks the prefix
    each row used; rows with ``counts < 1`` draw nothing.
    """
    rows = weights.shape[0]
    cap = counts.clamp(min=0) * MAX_DRAWS_PER_KEY
    drawn = torch.minimum(2 * counts.clamp(min=0), cap)  # each row's draws after its first chunk
    taken = torch.zeros(rows, dtype=torch.int64)
    seen = known
    new_so_far = torch.zeros(rows, dtype=torch.int64)
    going = (counts >= 1).nonzero().reshape(-1)  # rows still drawing
    chunks, masks, placed = [], [], []  # each chunk's draws, used draws and rows
    while going.numel():
        if chunks:  # a later chunk: the new tokens of the last one's used draws are known to it
            seen = seen.clone() if seen is known else seen
            last, used_new = chunks[-1], masks[-1] & fresh
            seen[placed[-1][:, None].expand_as(last)[used_new], last[used_new]] = True
        size = drawn[going] - taken[going]
        width = int(size.max())
        part = sampler.draw(weights[going], width, cells=None if cells is None else cells[going])[:, :width]
        step = torch.arange(width).expand_as(part)
        inside = step < size[:, None]
        fresh = _first_occurrence(torch.where(inside, part, weights.shape[-1])) & inside & ~seen[going[:, None], part]
        running = new_so_far[going, None] + torch.cumsum(fresh, -1)
        reached = (running >= counts[going, None]) & inside
        hit = reached.any(-1)
        end = torch.where(hit, reached.to(torch.int8).argmax(-1) + 1, size)  # draws of this chunk used
        used = step < end[:, None]
        new_so_far[going] = running.gather(1, (end - 1).clamp(min=0)[:, None])[:, 0]
        chunks.append(part)
        masks.append(used)
        placed.append(going)
        taken[going] += end
        capped = drawn[going] >= cap[going]
        drawn[going] = torch.where(hit | capped, drawn[going], torch.minimum(2 * drawn[going], cap[going]))
        going = going[~(hit | capped)]
    if not chunks:
        return torch.zeros(rows, 0, dtype=torch.int64), torch.zeros(rows, 0, dtype=torch.bool)
    if len(chunks) == 1 and chunks[0].shape[0] == rows:  # one chunk of every row: its used draws are a prefix
        width = int(taken.max())
        return chunks[0][:, :width], masks[0][:, :width]
    full = torch.zeros(rows, sum(c.shape[1] for c in chunks), dtype=torch.int64)
    mask = torch.zeros(full.shape, dtype=torch.bool)
    first = 0
    for part, used, going in zip(chunks, masks, placed):  # each chunk in its own columns, rows where they drew
        full[going, first:first + part.shape[1]], mask[going, first:first + part.shape[1]] = part, used
        first += part.shape[1]
    return _packed(full, mask)


def _first_occurrence(tokens: torch.Tensor) -> torch.Tensor:
    """(R, T) bool: the draws whose token did not occur earlier in the row (a stable sort per row, no (R, S) buffer)."""
    ordered, order = torch.sort(tokens, dim=-1, stable=True)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    return torch.zeros_like(starts).scatter_(1, order, starts)


def _packed(draws: torch.Tensor, used: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's used draws moved to the front, in order: ``(draws, valid)`` with a prefix ``valid``."""
    order = torch.sort((~used).to(torch.int8), dim=-1, stable=True).indices
    width = int(used.sum(-1).max()) if used.numel() else 0
    return draws.gather(1, order)[:, :width], used.gather(1, order)[:, :width]

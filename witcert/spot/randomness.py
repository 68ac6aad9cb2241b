"""The spot check's own randomness: drawn after the query is fixed, never fed to the model.

The draw must not be predictable by whatever produced the query (an adaptive query, a scheme
tuned against the meter), so by default the generator is seeded from the operating system's
cryptographic source; a fixed seed is an opt-in for replays and is recorded with the result.
"""
import secrets
from dataclasses import dataclass

import torch


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

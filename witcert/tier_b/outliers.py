"""Outlier RoPE pairs for Tier B: which pairs bypass INT8 and stay fp16.

Massive activations sit in a few RoPE frequency pairs; keeping ``m`` pairs in fp16 and
*excluding them from the group amax* (docs/design.md "Tier B: the dithered INT8 cache") stops them inflating every scale of
their group. A pair's energy ``sum_t x_{t,a}^2 + x_{t,b}^2`` is invariant under the RoPE
rotation (Lemma 1, "L1"), which is why a fixed per-(layer, kv_head) set learned from a
calibration prefix stays valid at every position.

Pair conventions (as ``witcert.tier_a.bands``): ``"rotate_half"`` pairs channel ``j`` with
``j + d/2``; ``"interleaved"`` pairs ``2j`` with ``2j + 1``.
"""
import torch

from witcert.tier_a.bands import ROPE_CONVENTIONS


def check_rope(rope: str) -> None:
    if rope not in ROPE_CONVENTIONS:
        raise ValueError(f"rope: expected one of {ROPE_CONVENTIONS}, got {rope!r}")


def pair_channels(pairs: torch.Tensor, head_dim: int, rope: str) -> torch.Tensor:
    """Channels (..., 2m) of pair indices (..., m): first members, then second members."""
    check_rope(rope)
    if rope == "rotate_half":
        return torch.cat((pairs, pairs + head_dim // 2), dim=-1)
    return torch.cat((2 * pairs, 2 * pairs + 1), dim=-1)


def pair_energy(x: torch.Tensor, rope: str) -> torch.Tensor:
    """Per-pair energy (..., S, d/2) of ``x`` (..., S, d), in fp64."""
    check_rope(rope)
    sq = x.to(torch.float64).square()
    half = x.shape[-1] // 2
    if rope == "rotate_half":
        return sq[..., :half] + sq[..., half:]
    return sq[..., 0::2] + sq[..., 1::2]


def top_pairs(energy: torch.Tensor, m: int) -> torch.Tensor:
    """Indices (..., m) of the ``m`` most energetic pairs of ``energy`` (..., d/2), sorted.

    Ties break toward the lower pair index (stable sort), so selection is deterministic.
    """
    order = torch.sort(energy, dim=-1, descending=True, stable=True).indices[..., :m]
    return torch.sort(order, dim=-1).values


def block_pairs(x: torch.Tensor, m: int, block: int, rope: str) -> torch.Tensor:
    """Per-block outlier pairs (..., n_blocks, m) of ``x`` (..., S, d) by summed pair energy."""
    energy = pair_energy(x, rope)  # (..., S, d/2)
    n_tokens = x.shape[-2]
    n_blocks = -(-n_tokens // block)
    pad = n_blocks * block - n_tokens
    energy = torch.nn.functional.pad(energy, (0, 0, 0, pad))
    energy = energy.view(*energy.shape[:-2], n_blocks, block, energy.shape[-1]).sum(-2)
    return top_pairs(energy, m)


def calibrate_pairs(x_prefix: torch.Tensor, m: int, rope: str) -> torch.Tensor:
    """A fixed outlier set (..., m) per (layer, kv_head) from a calibration prefix (..., S0, d)."""
    return top_pairs(pair_energy(x_prefix, rope).sum(-2), m)

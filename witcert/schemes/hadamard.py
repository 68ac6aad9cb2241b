"""Hadamard rotations of the rotation-based KV formats, evaluated exactly.

Two engines rotate a head before quantizing it per coordinate:

- vLLM's ``int4_per_token_head`` applies a randomized Hadamard transform ``RHT(x) = H (s * x)``
  (``H`` the unnormalised Sylvester matrix, ``H H = d I``; ``s`` a fixed vector of signs) to keys and
  values before packing, and to the query before attention (vLLM ``vllm/v1/attention/ops/
  int4_per_token_head.py`` at 055e47c28003156421365af985d676fc921cb075: ``single_rht``, ``_get_rht_signs``);
- vLLM's TurboQuant rotates by the orthonormal ``H / sqrt(d)`` (``turboquant_attn.py`` at
  0135d081c30fa476130ae77a152539ce317ab8b1: ``_build_hadamard``).

vLLM evaluates ``H x`` in three ways that round differently (a bf16 tensor-core kernel, a Triton MMA, an fp32
butterfly); none is specified to the bit. Here the butterfly runs in fp64, where a sum of ``d`` values held in a
model dtype is exact for every input whose exponents span fewer than ``53 - 24 - log2 d`` binades (all
realistic heads), and the caller rounds once. The meter never depends on it: the witness is formed on the
reconstruction returned.
"""
import functools

import torch

_RHT_SEED = 0x9E3779B9  # vLLM's _get_rht_signs(d, round_idx=0)
_RHT_ROUND_STRIDE = 0x517CC1B7


def check_power_of_two(head_dim: int, name: str) -> None:
    """``ValueError`` naming the format unless ``head_dim`` is a power of two (a Sylvester Hadamard size)."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"{name}: head_dim {head_dim} is not a power of two; the engine's Hadamard rotation "
                         "(and so this format) needs one")


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``H x`` along the last axis in fp64 (unnormalised Sylvester order, vLLM's ``fast_hadamard_transform``)."""
    d = x.shape[-1]
    check_power_of_two(d, "hadamard")
    y = x.to(torch.float64)
    h = 1
    while h < d:
        pairs = y.unflatten(-1, (d // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).flatten(-3)
        h *= 2
    return y


@functools.lru_cache(maxsize=16)
def rht_signs(d: int) -> torch.Tensor:
    """vLLM's fixed RHT signs for ``d`` channels (fp64 +-1), drawn as vLLM draws them (CPU generator, bernoulli)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(_RHT_SEED + 0 * _RHT_ROUND_STRIDE)
    return (2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=g) - 1.0).to(torch.float64)


def rht(x: torch.Tensor) -> torch.Tensor:
    """``H (s * x)`` in fp64 (vLLM ``single_rht``): the rotated head, norm ``sqrt(d)`` times the input's."""
    return hadamard(x.to(torch.float64) * rht_signs(x.shape[-1]).to(x.device))


def inverse_rht(y: torch.Tensor) -> torch.Tensor:
    """``s * (H y) / d`` in fp64: the model-frame vector whose :func:`rht` is ``y`` (``H H = d I``, ``s s = 1``)."""
    d = y.shape[-1]
    return hadamard(y) * rht_signs(d).to(y.device) / d


@functools.lru_cache(maxsize=16)
def turboquant_entry(d: int) -> float:
    """The magnitude of every entry of TurboQuant's fp32 rotation ``H / sqrt(d)`` as vLLM forms it (an fp32 tensor
    divided by ``math.sqrt(d)``): ``1/8`` at ``d = 64``, ``1/sqrt(d)`` rounded to fp32 where that is inexact."""
    return float(torch.ones((), dtype=torch.float32) / d**0.5)


def orthonormal_hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x (H c)`` in fp64, ``c`` = :func:`turboquant_entry`: TurboQuant's rotation ``Pi = PiT`` (symmetric; its own
    inverse up to the rounding of ``c``, which the reconstruction carries: the kernel's query ``q Pi`` against a
    rotated key ``k_rot`` is ``q . (k_rot Pi)``, so ``k_rot Pi`` is the key in the model's frame)."""
    return hadamard(x) * turboquant_entry(x.shape[-1])

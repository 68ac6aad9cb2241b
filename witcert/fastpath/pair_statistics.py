"""The statistics of a written run of tokens, keys and values stacked, in one pass (Lemma 1 ``L1``, ``T2``).

A store forms, for every token written, the band witness of its keys' residual (``L1``: each band norm of
``k^ - k`` rounded up to fp16), the value residual norm ``rho_t >= ||v^_t - v_t||`` and ``||v_t||`` from above
(:func:`witcert.tier_a.observation.stored_keys` computes the same three from four separate tensors). A store holds
keys and values stacked ``(2, ..., n, d)``; :func:`pair_statistics` takes both stacks as they are (no copy of a
view per role) and, for inputs of at most fp32 precision, forms every norm without the scaling pass a general
fp64 norm needs:

- a difference of two values of at most fp32 is computed in fp64 with one rounding (relative ``u = 2^-53``; it is
  exact unless their exponents are far apart), and is ``0`` or at least ``2^-149`` in magnitude and at most
  ``2^129``: its square lies in ``[2^-298, 2^258]``, inside fp64's normal range, so the squares neither overflow
  nor underflow (the reason :func:`witcert.core.norms.norms_upper_fp64` divides by the peak first);
- ``sqrt(sum of n squares)`` then carries at most ``(n + 4) u`` relative error (the difference, the squares,
  any-order summation ``gamma_{n-1}``, the sqrt), the same budget :func:`~witcert.core.norms.norms_upper_fp64`
  covers; the inflation ``1 + (n + 16) 2^-52`` (its own) lifts every norm above the exact one with room to spare,
  FMA contraction and any summation order included; a nonzero norm is at least ``2^-149``, normal in fp64, so the
  inflation is never lost to a subnormal result;
- the witness and ``rho`` are rounded up to fp16 and fp32 (:func:`witcert.core.rounding.round_up_to`), ``||v_t||``
  stays fp64.

fp64 inputs (whose squares can leave the range) take the general eager path. Under ``WITCERT_COMPILE=1`` the pass
is one compiled graph: measured 4096 tokens of SmolLM2's keys and values per layer 15.5 ms in the general compiled
statistics (plus 3.8 ms of copies of the four views) against the figures in the commit that added this file.
"""
from __future__ import annotations

import torch

from witcert.core.rounding import round_up_to
from witcert.fastpath.compiled import graph_input, pick
from witcert.tier_a.bands import BandLayout

NARROW_INPUTS = (torch.float32, torch.float16, torch.bfloat16)  # at most fp32: squares of differences stay normal
_U = 2.0**-52  # the inflation unit of witcert.core.norms


def pair_statistics(exact: torch.Tensor, decoded: torch.Tensor, layout: BandLayout,
                    compiled: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(witness, rho, v_norm, finite)`` of keys and values stacked (``L1``, ``T2``).

    Parameters
    ----------
    exact, decoded : Tensor (2, ..., n, d)
        Exact keys and values (``[0]``, ``[1]``) and their decodes, one dtype of :data:`NARROW_INPUTS`.
    layout : BandLayout
        Bands of the keys.
    compiled : bool or None
        Compile (default: ``WITCERT_COMPILE``).

    Returns
    -------
    witness : Tensor (..., n, B) float16, ``>=`` each band norm of ``decoded[0] - exact[0]`` (not band-major)
    rho : Tensor (..., n) float32, ``>= ||decoded[1]_t - exact[1]_t||``
    v_norm : Tensor (..., n) float64, ``>= ||exact[1]_t||``
    finite : Tensor () bool, whether every input entry is finite (the statistics mean nothing otherwise)
    """
    if not isinstance(layout, BandLayout):
        raise ValueError(f"layout must be a BandLayout, got {type(layout).__name__}")
    for name, x in (("exact", exact), ("decoded", decoded)):
        if not isinstance(x, torch.Tensor) or x.dtype not in NARROW_INPUTS or x.dim() < 3 or x.shape[0] != 2:
            raise ValueError(f"{name} must be a (2, ..., n, d) tensor of one of {NARROW_INPUTS}, got "
                             f"{tuple(getattr(x, 'shape', ()))} {getattr(x, 'dtype', type(x).__name__)}")
    if exact.shape != decoded.shape or exact.dtype != decoded.dtype:
        raise ValueError(f"exact and decoded must have one shape and dtype, got {tuple(exact.shape)} {exact.dtype} "
                         f"and {tuple(decoded.shape)} {decoded.dtype}")
    if exact.shape[-1] != layout.head_dim:
        raise ValueError(f"the last dim {exact.shape[-1]} must be the layout's head dim {layout.head_dim}")
    keys, rho, v_norm, finite = pair_norms(exact, decoded, layout, compiled)
    # rounded up outside the graph: measured cheaper eager than compiled (the fp16 step goes through its bits)
    return round_up_to(keys, torch.float16), round_up_to(rho, torch.float32), v_norm, finite


def pair_norms(exact: torch.Tensor, decoded: torch.Tensor, layout: BandLayout,
               compiled: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pair_statistics` before any rounding to storage: ``(keys, rho, v_norm, finite)``, the first three
    fp64 upper norms (``keys`` (..., n, B) the residual's band norms), on inputs :func:`pair_statistics` checks."""
    norms = pick(_norms, _probe, compiled)
    # canonical strides: a graph guards on them (a store passes its own stacks; a kept buffer's narrowed view copies)
    return norms(graph_input(exact), graph_input(decoded), layout)


def _norms(exact: torch.Tensor, decoded: torch.Tensor, layout: BandLayout) -> tuple:
    finite = torch.isfinite(exact).all() & torch.isfinite(decoded).all()
    residual = decoded.to(torch.float64) - exact.to(torch.float64)  # (2, ..., n, d): one rounding at most
    keys = _norms_in_range(layout.split(residual[0]))  # (..., n, B)
    return keys, _norms_in_range(residual[1]), _norms_in_range(exact[1].to(torch.float64)), finite


def _norms_in_range(x64: torch.Tensor) -> torch.Tensor:
    """``>=`` the Euclidean norms over the last axis of fp64 entries whose nonzero squares are normal (the module
    docstring): no scaling pass."""
    return torch.sqrt((x64 * x64).sum(-1)) * (1.0 + (x64.shape[-1] + 16) * _U)


def _probe() -> tuple:
    """A store's write of 33 tokens (B = 1, three kv heads, d = 64 in the default 16 bands)."""
    x = torch.ones(2, 1, 3, 33, 64)
    return x, x.clone(), BandLayout(64, 16)

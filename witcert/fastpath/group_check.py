"""The write-time check of a codec's error bound declared per channel group, in one pass (``DW``'s hypothesis).

A derived witness (``DW``) is sound only where ``|x_i - x^_i| <= e_i`` holds for every channel of every token
written, and the store checks it while the exact tokens exist
(:func:`witcert.tier_a.derived_witness.check_error_bound`). For a codec whose bound is constant over channel
groups (``group_error_bound``: the built-in rtn codecs, from their stored maxima) the elementwise check is the
same as comparing each group's largest error with the group's bound:

    ``|x_i - x^_i| <= E_g`` for every ``i`` in ``g``  <=>  ``max_{i in g} |x_i - x^_i| <= E_g``,

and a NaN error anywhere in a group makes its maximum NaN, which compares false: refused, as elementwise.
:func:`group_bound_holds` computes exactly the elementwise check's fp64 values (each ``|x^_i - x_i|`` from the
two inputs converted to fp64; a maximum selects one of them, so no order can change it) without expanding the
bounds to every channel; under ``WITCERT_COMPILE=1`` one compiled pass reads the exact and decoded tokens once
(measured: the prefill's check is the largest write-time cost of a production store at 4096 tokens).
"""
from __future__ import annotations

import torch

from witcert.fastpath.compiled import graph_input, pick


def group_bound_holds(x: torch.Tensor, x_hat: torch.Tensor, group_bound: torch.Tensor,
                      compiled: bool | None = None) -> bool:
    """Whether ``|x_i - x^_i| <= E_g`` in fp64 for every channel ``i`` of every group ``g`` (``DW``'s hypothesis).

    Parameters
    ----------
    x, x_hat : Tensor (..., T, d)
        Exact values and their decodes (at most fp64).
    group_bound : Tensor (..., T, G) float64
        The codec's bound per group of ``d / G`` contiguous channels (``inf`` allowed).
    compiled : bool or None
        Compile (default: ``WITCERT_COMPILE``).
    """
    if x.shape != x_hat.shape or x.dim() < 1:
        raise ValueError(f"x and x_hat must have one shape, got {tuple(x.shape)} and {tuple(x_hat.shape)}")
    if group_bound.dtype != torch.float64 or group_bound.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"group_bound must be float64 (..., T, G) over x {tuple(x.shape)}, got "
                         f"{tuple(group_bound.shape)} {group_bound.dtype}")
    groups = group_bound.shape[-1]
    if groups < 1 or x.shape[-1] % groups:
        raise ValueError(f"group_bound's {groups} groups must divide the {x.shape[-1]} channels")
    if not x.numel():
        return True
    check = pick(_holds, _probe, compiled)
    # canonical strides: a graph guards on them, and a store passes views (a narrowed history, stacked writes)
    return bool(check(graph_input(x), graph_input(x_hat), graph_input(group_bound)))


def _holds(x: torch.Tensor, x_hat: torch.Tensor, group_bound: torch.Tensor) -> torch.Tensor:
    error = (x_hat.to(torch.float64) - x.to(torch.float64)).abs()  # the elementwise check's values
    peak = error.unflatten(-1, (group_bound.shape[-1], -1)).amax(-1)  # (..., T, G); NaN propagates
    return (peak <= group_bound).all()


def _probe() -> tuple:
    """Arguments of the shape class a store passes (2 roles, batch, kv heads, tokens, 64 channels in 2 groups)."""
    x = torch.zeros(2, 1, 3, 40, 64)
    return x, x.clone(), torch.ones(2, 1, 3, 40, 2, dtype=torch.float64)

"""Schemes that misbehave the way real quantize kernels may (loaded as ``module:function`` specs).

``workspace_int4`` quantizes its input *in place*, then returns one workspace tensor it reuses for
every call (a fused or graph-captured kernel's output buffer) and scribbles over that workspace
on its next call. A write path that handed it the exact keys, or kept the returned tensor, would
see the exact keys zeroed or the stored reconstruction change under its witness.
"""
import torch

from witcert.schemes.builtin import rtn_int4

_WORKSPACE: dict = {}
CALLS = [0]


def workspace_int4(x: torch.Tensor) -> torch.Tensor:
    out = rtn_int4(x)
    x.zero_()  # mutates its input (the private copy it was handed)
    buf = _WORKSPACE.get((x.shape, x.dtype))
    if buf is not None:
        buf.fill_(float("nan") if CALLS[0] % 2 else 7.0)  # yesterday's result is overwritten first
    else:
        buf = _WORKSPACE[(x.shape, x.dtype)] = torch.empty_like(out)
    buf.copy_(out)
    CALLS[0] += 1
    return buf

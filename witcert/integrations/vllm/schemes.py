"""The schemes the plugin stores vLLM's keys and values with, resolved once per process.

A scheme runs in the write path: for each request's tokens of a cache write, the exact keys and
values ``(Hkv, n, d)`` (post-RoPE, in the model dtype) go through the scheme and what it returns
is written into vLLM's cache by vLLM's own writer. Names, as ``witcert schemes`` lists them:

- ``none``: nothing is changed (the cache holds what vLLM's writer makes of the exact keys);
- a registered tensor scheme (built-ins such as ``rtn-int8``, ``kivi-2bit``), a ``module:function``
  spec, or an installed ``witcert.schemes`` entry point: loaded and probed by
  :func:`witcert.schemes.plugins.resolve_scheme`, run through
  :func:`witcert.schemes.registry.apply_scheme` (a private copy of the exact tensor goes in, a
  copy of what the scheme returns comes out, shape, dtype and finiteness checked);
- ``dithered-int8``: Tier B's dithered INT8 quantizer (token groups of 32 channels, no outlier
  pairs) with the paged dither counter ``(layer, kv_head, slot, channel)`` and a secret seed per
  process; the cache holds the dequantized values and the plugin keeps the fp16 scales and INT8
  codes, so the meter can use the deterministic branch ``DB`` beside the Tier A witness.

Whatever a scheme returns, the witness is formed afterwards from the keys *read back* from the
cache, so it describes exactly what vLLM's kernel attends.
"""
from dataclasses import dataclass

import torch

from witcert.schemes.catalog import DITHERED
from witcert.schemes.plugins import resolve_scheme
from witcert.schemes.registry import apply_scheme

from . import config

TIER_B_GROUP = 32  # channels per fp16 scale of the dithered cache


@dataclass(frozen=True)
class Compressed:
    """What one request's write stores: keys and values ``(Hkv, n, d)`` in the model dtype, and
    for ``dithered-int8`` the Tier B codes ``(Hkv, n, d)`` int8 and scales ``(Hkv, n, d/32)`` fp16."""

    k: torch.Tensor
    v: torch.Tensor
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None


def load(cfg: config.PluginConfig) -> dict:
    """Resolve every scheme a request may choose; ``ValueError`` naming the variable otherwise."""
    loaded = {}
    for name in cfg.allowed_schemes:
        variable = config.SCHEME if name == cfg.scheme else config.SCHEMES
        if name in (config.NONE, DITHERED):
            loaded[name] = name
            continue
        try:
            loaded[name] = resolve_scheme(name)
        except ValueError as err:
            raise ValueError(f"{variable}: {err}") from None
    return loaded


def compress(name: str, key: torch.Tensor, value: torch.Tensor, *, layer: int, slots: torch.Tensor,
             kv_head_offset: int, seed: int) -> Compressed:
    """Keys and values ``(Hkv, n, d)`` as the scheme ``name`` stores them (the inputs are not changed).

    ``slots`` (n,) are the cache slots the tokens are written to (the dithered cache's counter);
    ``kv_head_offset`` this worker's first kv head under tensor parallelism; ``seed`` the
    dithered cache's secret seed.
    """
    if name == DITHERED:
        return _dithered(key, value, layer, slots, kv_head_offset, seed)
    return Compressed(k=apply_scheme(name, key, role="key"), v=apply_scheme(name, value, role="value"))


def _dithered(key, value, layer, slots, kv_head_offset, seed) -> Compressed:
    from witcert.tier_b.counters import PagedCounter
    from witcert.tier_b.quantizer import DitheredInt8

    quantizer = DitheredInt8(granularity="token-group", group=TIER_B_GROUP)
    out = {}
    for side, x in (("k", key), ("v", value)):
        counter = PagedCounter(layer=layer, slots=slots.to(torch.int64), seed=seed, side=side,
                               kv_head_offset=kv_head_offset)
        store = quantizer.quantize(x.clone(), counter)  # a private copy: the exact tensor is never handed out
        out[side] = (quantizer.dequantize(store, counter, dtype=x.dtype), store)
    store = out["k"][1]
    return Compressed(k=out["k"][0], v=out["v"][0], codes=store.payload.clone(), scales=store.scales.clone())

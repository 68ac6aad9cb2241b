"""Constructed requests for the audit's tests and benchmarks: a request whose one layer collapses.

:func:`collapse_layer` makes one layer of every request a monitor adopts store a destructive scheme's
keys (a scheme is one function for every layer, so the layer is chosen where the monitor builds each
layer's store). The model then really runs on that layer's broken keys: a request where a few
layers collapse, every other cell compressed as the monitor's own scheme does.
"""
from __future__ import annotations

import torch

from witcert.integrations.hf.codecs import codec_for
from witcert.integrations.hf.compressed_cache import CompressedLayer


def scrambled(x: torch.Tensor, role: str = "key") -> torch.Tensor:
    """Keys scaled by -8 (values kept): every logit flips sign and sharpens, attention lands elsewhere."""
    return x * -8.0 if role == "key" else x.clone()


def collapse_layer(monitor, layer: int, scheme=scrambled):
    """``monitor`` with layer ``layer`` of each request it adopts compressed by ``scheme`` (before entering it)."""
    original = monitor._store
    codec = codec_for(scheme, packed=not monitor.keep_exact)

    def store(index, record, backing):
        if index != layer:
            return original(index, record, backing)
        return CompressedLayer(codec, monitor.layout, keep_exact=monitor.keep_exact, backing=backing, backing_key=index,
                               backing_values=monitor.backing_values, statistics=monitor.statistics)

    monitor._store = store
    return monitor

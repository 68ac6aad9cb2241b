"""Bytes per token a production cache holds for a scheme at a head shape, and the capacity that buys.

:func:`footprint` writes one long prefill of synthetic tokens (``tokens`` of them, in the model's dtype,
bf16 by default) into the very store ``witcert.monitor(..., keep_exact=False)`` builds for the scheme, and
reads its :class:`~witcert.integrations.hf.memory.MemoryAccount` (the bytes of the tensors it holds,
``tests/test_memory_account.py``): per token and kv head, keys and values together,

- ``raw``: what the scheme itself stores (packed codes and their group statistics, fp8 values, a
  reconstruction, transformers' quantized history and its exact window);
- ``witness``: what the monitor adds (the Tier A witness and the value statistics, at the monitor's
  default bands and witness bits for the scheme unless given; a derived witness, ``witness_bits=0``, holds
  only the value norms);
- ``exact``: an uncompressed cache of the same token in the model's dtype;
- ``backing``: what a production gate or spot check keeps of each token apart, on the host (the exact keys
  and values, never on the device).

Capacity against the uncompressed cache is ``exact / (raw + witness)`` (with the monitor) or
``exact / raw`` (the scheme alone): the tokens that fit in the same bytes. The figure is the steady state
of a long context (a prefill of whole groups: KIVI's exact key tail and a quantized cache's exact
window, at most 31 and 127 tokens, are not in it; a generation's own figures are measured by
``benchmarks/capacity.py`` on SmolLM2). A scheme whose reconstruction no narrower float holds exactly is
held in the model's dtype: its capacity is below 1, as production would hold it.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness_code import DEFAULT_WITNESS_BITS, WitnessCode

KV_HEADS = 2  # heads of the synthetic prefill (per-head figures do not depend on it)


@dataclass(frozen=True)
class Footprint:
    """Bytes per token and kv head of one scheme at one head shape (see the module docstring)."""

    scheme: str
    head_dim: int
    raw: float
    witness: float
    exact: float
    backing: float
    witness_bits: int = 8  # the witness code of the store: 16, 8 or 0 (derived from the codec's error bound)

    @property
    def monitored(self) -> float:
        """Bytes per token and kv head of the production monitor's cache: the scheme's bytes and the witness."""
        return self.raw + self.witness

    def capacity(self, monitored: bool = True) -> float:
        """Tokens held in the bytes of one uncompressed token: ``exact / monitored`` (or ``exact / raw``)."""
        return self.exact / (self.monitored if monitored else self.raw)


def footprint(scheme, head_dim: int, dtype: torch.dtype = torch.bfloat16, bands: int | None = None,
              witness_bits: int | None = None, tokens: int = 1024, rope: str = "rotate_half") -> Footprint:
    """The :class:`Footprint` of ``scheme`` (a name, a codec, a callable or a ``QuantizedCacheSpec``) at ``head_dim``."""
    from witcert.integrations.hf.geometry import auto_bands

    layout = BandLayout(head_dim, auto_bands(head_dim) if bands is None else bands, rope)
    store = _production_store(scheme, layout, witness_bits)
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():  # a held reconstruction's warning: its bytes are the figure reported here
        warnings.simplefilter("ignore")
        store.append(*(torch.randn(1, KV_HEADS, tokens, head_dim, generator=gen).to(dtype) for _ in range(2)))
    store.read()  # as the monitor's layer does after every write; the model's tensors and the read are then freed
    account = store.memory()
    per = tokens * KV_HEADS
    name = scheme if isinstance(scheme, str) else getattr(scheme, "name", type(scheme).__name__)
    return Footprint(name, head_dim, raw=account.compressed / per, witness=account.witness / per,
                     exact=account.exact_cache / per, backing=account.exact_cache / per,
                     witness_bits=store.witness_code.bits)


def _production_store(scheme, layout: BandLayout, witness_bits: int | None):
    """The store ``witcert.monitor(model, scheme, keep_exact=False, witness_bits=witness_bits)`` builds for one layer
    (``None``: the monitor's default for the scheme)."""
    from witcert.integrations.hf.codecs import Dither, codec_for, default_witness_bits
    from witcert.integrations.hf.compressed_cache import CompressedLayer
    from witcert.integrations.hf.quantized_cache import cache_spec_of
    from witcert.integrations.hf.quantized_store import QuantizedLayerStore
    from witcert.schemes.catalog import DITHERED
    from witcert.schemes.plugins import resolve_scheme

    spec = cache_spec_of(scheme)
    code = WitnessCode(DEFAULT_WITNESS_BITS if witness_bits is None else witness_bits)
    if spec is not None:
        return QuantizedLayerStore(spec, layout, keep_exact=False, witness_code=code)
    if isinstance(scheme, str) and scheme == DITHERED:
        from witcert.tier_b.quantizer import DitheredInt8

        codec = Dither(DitheredInt8(rope=layout.rope), layer=0, seed=0)
    else:
        codec = codec_for(resolve_scheme(scheme) if isinstance(scheme, str) else scheme, packed=True)
        code = WitnessCode(default_witness_bits(codec) if witness_bits is None else witness_bits)
    return CompressedLayer(codec, layout, keep_exact=False, witness_code=code)

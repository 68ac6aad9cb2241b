"""Streaming schemes (exact window + group-wise flushes) and the faithful KIVI 2-bit cache (``WM``, ``T2``).

Implementations: ``witcert.schemes.streaming`` (``FlushPolicy``, ``StreamingScheme``,
``StreamingLayer``) and ``witcert.schemes.builtin.KIVI_2BIT``. Oracles: a direct transcription of
KIVI's reference cache (which tokens are quantized after ``t`` writes, and how), and the exact
per-(token, band) witness check of ``tests/maintenance_oracles.py``. Domain: prefills of 0-300
tokens, one-token and multi-token decode chunks, fp32 and fp16. Tolerance: none (bitwise
equality of caches; every witness >= its exact residual).
"""
import pytest
import torch

from maintenance_oracles import value_shortfalls, witness_shortfalls
from witcert.schemes import builtin
from witcert.schemes.builtin import KIVI_2BIT, KIVI_RESIDUAL
from witcert.schemes.registry import get_scheme
from witcert.schemes.streaming import (
    FlushPolicy,
    StreamingScheme,
    get_streaming_scheme,
    list_streaming_schemes,
    register_streaming_scheme,
)
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness import witness_of

LAYOUT = BandLayout(64, 8)


def _tokens(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 2, n, 64, generator=gen) * 3).to(dtype)


def _write(layer, keys, values, chunks):
    """Write ``keys``/``values`` in chunks of the given sizes; return the read snapshots."""
    reads, start = [], 0
    for n in chunks:
        layer.update(keys[..., start : start + n, :], values[..., start : start + n, :])
        reads.append((layer.keys, layer.values, layer.key_witness, layer.value_witness))
        start += n
    return reads


def _kivi_reference(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI's cache after all of ``keys``/``values`` were written (its reference code, any chunking):
    keys: the first ``S - S mod R`` tokens quantized per channel in 32-token groups, the rest exact;
    values: all but the ``R`` newest quantized per token."""
    s = keys.shape[-2]
    k_q = s // KIVI_RESIDUAL * KIVI_RESIDUAL
    v_q = max(0, s - KIVI_RESIDUAL)
    k = torch.cat([get_scheme("kivi-2bit")(keys[..., :k_q, :]), keys[..., k_q:, :]], dim=-2)
    v = torch.cat([get_scheme("kivi-2bit")(values[..., :v_q, :], role="value"), values[..., v_q:, :]], dim=-2)
    return k, v


def test_flush_policy_counts():
    keys, values = FlushPolicy(unit=128), FlushPolicy(unit=1, keep=128)
    assert [keys.flush_count(n) for n in (0, 1, 127, 128, 129, 300)] == [0, 0, 0, 128, 128, 256]
    assert [values.flush_count(n) for n in (0, 128, 129, 300)] == [0, 0, 1, 172]
    for bad in (dict(unit=0), dict(unit=1, keep=-1), dict(unit=True), dict(unit=2.0)):
        with pytest.raises(ValueError):
            FlushPolicy(**bad)


@pytest.mark.parametrize("chunks", [[300], [1] * 300, [20] + [1] * 280, [127, 1, 1, 171], [129, 50, 1, 120]])
def test_kivi_cache_is_kivi_and_does_not_depend_on_chunking(chunks):
    """After 300 tokens the stored cache equals KIVI's reference cache, whatever the chunking.

    The one-tensor scheme applied chunk by chunk (what the registry does) is the contrast: with
    one-token decode chunks it never quantizes a decode key.
    """
    keys, values = _tokens(300, 1), _tokens(300, 2)
    layer = KIVI_2BIT.layer(LAYOUT)
    _write(layer, keys, values, chunks)
    layer.update(keys[..., :0, :], values[..., :0, :])  # a read with nothing new: the state itself
    ref_k, ref_v = _kivi_reference(keys, values)
    assert torch.equal(layer.keys, ref_k) and torch.equal(layer.values, ref_v)
    chunkwise = torch.cat([get_scheme("kivi-2bit")(c) for c in keys.split(chunks, dim=-2)], dim=-2)
    if max(chunks[1:], default=0) < 32 and len(chunks) > 1:
        assert not torch.equal(chunkwise, ref_k)


def test_kivi_reads_exact_window_then_flushes_after_the_read():
    """KIVI's order: the step that fills the key window reads it exactly (witness 0), the flush comes after."""
    keys, values = _tokens(130, 3), _tokens(130, 4)
    layer = KIVI_2BIT.layer(LAYOUT)
    reads = _write(layer, keys, values, [100] + [1] * 30)
    k_read, v_read, k_w, v_w = reads[28]  # after 128 tokens: the window is full and read exactly
    assert torch.equal(k_read, keys[..., :128, :]) and not k_w.any()
    k_read, v_read, k_w, v_w = reads[29]  # 129 tokens: the first 128 are quantized, token 128 exact
    assert torch.equal(k_read[..., :128, :], get_scheme("kivi-2bit")(keys[..., :128, :]))
    assert k_w[..., :128, :].any() and not k_w[..., 128:, :].any()
    assert torch.equal(k_w[..., :128, :], witness_of(keys[..., :128, :], k_read[..., :128, :], LAYOUT))
    assert torch.equal(v_read, values[..., :129, :]) and not v_w.any()  # R + 1 exact values read, then one flushed
    _, v_read, _, v_w = reads[30]
    assert torch.equal(v_read[..., :1, :], get_scheme("kivi-2bit")(values[..., :1, :], role="value"))
    assert v_w[..., :1].all() and not v_w[..., 1:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_witness_covers_its_residual_at_every_step(dtype):
    keys, values = _tokens(290, 5, dtype), _tokens(290, 6, dtype)
    layer = KIVI_2BIT.layer(LAYOUT, keep_exact=True)
    start = 0
    for n in [150] + [1] * 100 + [40]:
        layer.update(keys[..., start : start + n, :], values[..., start : start + n, :])
        start += n
        assert torch.equal(layer.exact_keys, keys[..., :start, :])
        assert witness_shortfalls(layer.key_witness, layer.keys, keys[..., :start, :], LAYOUT) == 0
        assert value_shortfalls(layer.value_witness, layer.values, values[..., :start, :]) == 0
    assert layer.key_witness.any() and layer.value_witness.any()


def test_registry_of_streaming_schemes_and_checks():
    assert "kivi-2bit" in list_streaming_schemes() and get_streaming_scheme("kivi-2bit") is KIVI_2BIT
    with pytest.raises(ValueError, match="unknown streaming scheme"):
        get_streaming_scheme("nope")
    twin = StreamingScheme("kivi-2bit", builtin._kivi_keys, builtin._kivi_values, FlushPolicy(32), FlushPolicy(1))
    with pytest.raises(ValueError, match="already registered"):
        register_streaming_scheme(twin)
    with pytest.raises(ValueError, match="FlushPolicy"):
        StreamingScheme("x", builtin._kivi_keys, builtin._kivi_values, 32, FlushPolicy(1))
    with pytest.raises(ValueError, match="callables"):
        StreamingScheme("x", None, builtin._kivi_values, FlushPolicy(1), FlushPolicy(1))
    layer = KIVI_2BIT.layer(LAYOUT)
    with pytest.raises(ValueError, match="one \\(B, Hkv, n\\)"):
        layer.update(torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 4, 64))
    layer.update(torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 3, 64))
    layer.reset()
    assert layer.length == 0 and layer.keys is None


def test_a_flushing_quantizer_cannot_touch_the_window_or_the_exact_keys():
    """The quantizer gets a private copy (apply_scheme): quantizing in place changes neither the caller's keys nor the shadow."""

    def in_place(x):
        return x.mul_(0).add_(1.0)

    scheme = StreamingScheme("in-place-test", in_place, in_place, FlushPolicy(4), FlushPolicy(4))
    keys, values = _tokens(8, 9), _tokens(8, 10)
    before = keys.clone()
    layer = scheme.layer(LAYOUT, keep_exact=True)
    layer.update(keys, values)
    layer.update(keys[..., :0, :], values[..., :0, :])
    assert torch.equal(keys, before) and torch.equal(layer.exact_keys, before)
    assert torch.equal(layer.keys, torch.ones_like(keys))
    assert witness_shortfalls(layer.key_witness, layer.keys, keys, LAYOUT) == 0

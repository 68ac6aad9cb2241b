"""A scheme can never touch the exact keys (issue 16, item 9).

Implementations: ``witcert.schemes.registry.apply_scheme`` (and ``get_scheme``), ``witcert.observe``,
``witcert.integrations.hf.compressed_cache.CompressedLayer`` and ``witcert.monitor`` on a tiny random Llama;
the attack class ``witcert.verification.attacks.mutating_scheme``. Oracles: a saved copy of every exact
tensor (bitwise equality), the fp64 true TV against the *original* keys, the stock model's
cache. Domain: schemes that quantize in place, return views of their input, return the input
itself, or zero their input; fp16/fp32/fp64. Tolerance: none.
"""
import pytest
import torch

import witcert
from witcert.verification.attacks import mutating_scheme
from witcert.integrations.hf.codecs import Reconstruction
from witcert.integrations.hf.compressed_cache import CompressedLayer
from witcert.tier_a.bands import BandLayout
from witcert.schemes.registry import _REGISTRY, apply_scheme, shares_memory

LAYOUT = witcert.BandLayout(64, 16)


def inplace_int2(x):
    """The idiom of the issue: quantize in place and return the input."""
    s = x.abs().amax(-1, keepdim=True)
    return x.div_(s).round_().mul_(s)


def halve_view(x):
    """Mutate in place and return a view of the input."""
    return x.mul_(0.5)[..., :, :]


def identity_alias(x):
    """Return the input itself."""
    return x


def zero_input(x):
    """Return a fresh tensor but zero the input."""
    out = x.round()
    x.zero_()
    return out


MUTATORS = (inplace_int2, halve_view, identity_alias, zero_input)


@pytest.mark.parametrize("scheme", MUTATORS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_apply_scheme_never_changes_or_aliases_its_input(scheme, dtype):
    """Oracle: the saved copy of ``x`` and the scheme run on a copy; no tolerance."""
    x = (torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    x0 = x.clone()
    x_hat = apply_scheme(scheme, x)
    assert torch.equal(x, x0)
    assert not shares_memory(x_hat, x)
    assert torch.equal(x_hat, scheme(x0.clone()))  # the scheme's own reconstruction, unchanged


def test_get_scheme_wrapper_is_isolated_too():
    _REGISTRY.pop("test-inplace-int2", None)
    witcert.register_scheme("test-inplace-int2")(inplace_int2)
    try:
        x = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(1))
        x0 = x.clone()
        witcert.get_scheme("test-inplace-int2")(x)
        assert torch.equal(x, x0)
    finally:
        _REGISTRY.pop("test-inplace-int2", None)


@pytest.mark.parametrize("scheme", MUTATORS, ids=lambda f: f.__name__)
def test_observe_meter_bounds_the_tv_against_the_original_keys(scheme):
    """Per query: meter >= fp64 TV between softmax(q k0) and softmax(q k^), k0 the caller's keys.

    Before the fix the in-place scheme overwrote ``k`` and the meter read ~2e-13 against a TV of
    ~0.6 (the reproduction of the issue)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 3, 64, generator=g, dtype=torch.float64) * 3
    k = torch.randn(2, 40, 64, generator=g, dtype=torch.float64)
    v = torch.randn(2, 40, 64, generator=g, dtype=torch.float64)
    k0, v0 = k.clone(), v.clone()
    obs = witcert.observe(q, k, v, scheme, LAYOUT)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    k_hat = scheme(k0.clone())
    qg = q.reshape(2, 2, 3, 64)
    p = torch.softmax(qg @ k0[:, None].transpose(-1, -2) / 8, -1)
    p_hat = torch.softmax(qg @ k_hat[:, None].transpose(-1, -2) / 8, -1)
    tv = 0.5 * (p - p_hat).abs().sum(-1).reshape(4, 3)
    assert (tv <= obs.meter).all()
    torch.testing.assert_close(obs.true_tv, tv, rtol=1e-12, atol=1e-15)


def test_compressed_layer_leaves_the_cache_alone_and_passes_the_role():
    calls = []

    def scheme(x, role="key"):
        calls.append(role)
        return x.mul_(0.5)

    cache = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(2))
    saved = cache.clone()
    layer = CompressedLayer(Reconstruction(scheme), BandLayout(8, 2))
    layer.append(cache, cache)
    k_hat, v_hat = layer.read()
    assert torch.equal(cache, saved) and torch.equal(layer.exact()[0], saved)
    assert torch.equal(k_hat, saved * 0.5) and calls == ["key", "value"]
    assert not shares_memory(k_hat, cache) and not shares_memory(v_hat, cache)


def test_hf_path_keeps_the_exact_shadow():
    """Tiny random Llama under ``witcert.monitor`` with an in-place scheme: the monitored cache's exact
    keys (true-TV oracle, gate backing data) equal the stock run's, and every cell's meter is >= its
    true TV against them (fp64). Before the fix the cache was overwritten."""
    import transformers
    from transformers import DynamicCache

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stock = DynamicCache(config=model.config)
        model(ids[:, :32], past_key_values=stock)

    _REGISTRY.pop("test-inplace-int2", None)
    witcert.register_scheme("test-inplace-int2")(inplace_int2)
    try:
        with torch.no_grad(), witcert.monitor(model, "test-inplace-int2", bands=8) as mon:
            cache = DynamicCache(config=model.config)
            model(ids[:, :32], past_key_values=cache)
            shadow = [layer.keys[..., :32, :].clone() for layer in cache.layers]
            model(ids[:, 32:], past_key_values=cache)
    finally:
        _REGISTRY.pop("test-inplace-int2", None)
    for ours, theirs, before in zip(cache.layers, stock.layers, shadow):
        assert torch.equal(ours.keys[..., :32, :], theirs.keys) and torch.equal(ours.values[..., :32, :], theirs.values)
        assert torch.equal(ours.keys[..., :32, :], before)  # the decode step did not rewrite the prefix
    table = mon.table()
    assert len(table) == 2 * 4 * 8
    assert (table["true_tv"] <= table["meter"]).all()


def test_mutating_scheme_attack_finds_nothing():
    tally = mutating_scheme.run(64, torch.Generator().manual_seed(0))
    assert tally.cells > 0 and tally.violations == 0, tally.notes

"""Schemes in the plugin's write path (no vLLM needed): loading, the private copy, the dithered cache.

Implementation: ``witcert.integrations.vllm.schemes``. Oracles: the exact tensors (unchanged,
bit for bit), the scheme's own output on a fresh copy, Tier B's element bound ``|x^ - x| <= s/2``
and its paged dither counter (same slot, same dither; another slot or side, another).
"""
import pytest
import torch

from witcert.integrations.vllm import config, schemes
from witcert.schemes.builtin import rtn_int4
from witcert.schemes.registry import _REGISTRY

SPEC = "tests.vllm.adversarial_schemes:workspace_int4"


def _cfg(**env):
    return config.PluginConfig.from_env({f"WITCERT_VLLM_{k.upper()}": v for k, v in env.items()})


def test_load_resolves_builtins_specs_and_the_dithered_cache():
    loaded = schemes.load(_cfg(scheme="rtn-int8", schemes=f"kivi-2bit,dithered-int8,{SPEC}"))
    assert set(loaded) == {"rtn-int8", "kivi-2bit", "dithered-int8", SPEC, "none"}
    assert SPEC in _REGISTRY  # registered under the spec itself, so telemetry names what ran


@pytest.mark.parametrize("env,match", [
    ({"scheme": "rtn-int3"}, r"WITCERT_VLLM_SCHEME: unknown scheme 'rtn-int3'; registered schemes: .*rtn-int4"),
    ({"schemes": "rtn-int8,no_such_module:fn"}, r"WITCERT_VLLM_SCHEMES: .*no module named 'no_such_module'"),
    ({"schemes": "witcert.schemes.builtin:GROUP"}, r"WITCERT_VLLM_SCHEMES: .*is a int, not a callable"),
])
def test_a_scheme_that_cannot_load_names_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        schemes.load(_cfg(**env))


def test_compress_never_touches_the_exact_tensors_and_owns_its_output():
    schemes.load(_cfg(schemes=SPEC))
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 10, 64, generator=g), torch.randn(3, 10, 64, generator=g)
    k_copy, v_copy = k.clone(), v.clone()
    first = schemes.compress(SPEC, k, v, layer=0, slots=torch.arange(10), kv_head_offset=0, seed=1)
    assert torch.equal(k, k_copy) and torch.equal(v, v_copy)  # the scheme zeroed only its private copy
    assert torch.equal(first.k, rtn_int4(k_copy)) and torch.equal(first.v, rtn_int4(v_copy))
    kept = first.k.clone()
    schemes.compress(SPEC, k, v, layer=0, slots=torch.arange(10), kv_head_offset=0, seed=1)  # reuses its workspace
    assert torch.equal(first.k, kept)  # what was stored does not change under its witness


def test_dithered_cache_bound_and_paged_counter():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(3, 12, 64, generator=g)
    k[..., 3] *= 30
    slots = torch.arange(100, 112)
    a = schemes.compress("dithered-int8", k, k, layer=2, slots=slots, kv_head_offset=0, seed=99)
    s = a.scales.double().repeat_interleave(schemes.TIER_B_GROUP, dim=-1)
    assert ((a.k.double() - k.double()).abs() <= s / 2 + 2**-23 * a.k.double().abs()).all()
    assert a.codes.dtype == torch.int8 and a.codes.abs().max() <= 127
    again = schemes.compress("dithered-int8", k, k, layer=2, slots=slots, kv_head_offset=0, seed=99)
    assert torch.equal(again.k, a.k)  # the dither is a function of (seed, layer, kv head, slot, channel, side)
    moved = schemes.compress("dithered-int8", k, k, layer=2, slots=slots + 1, kv_head_offset=0, seed=99)
    other_worker = schemes.compress("dithered-int8", k, k, layer=2, slots=slots, kv_head_offset=3, seed=99)
    assert not torch.equal(moved.k, a.k) and not torch.equal(other_worker.k, a.k)
    assert not torch.equal(a.k, a.v)  # keys and values draw from distinct streams

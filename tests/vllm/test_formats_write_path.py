"""The engine KV formats in the vLLM plugin's write path (no vLLM needed): the plugin serves them as it serves
any registered scheme.

Implementation: :func:`witcert.integrations.vllm.schemes.load` and ``compress`` with the formats of
:mod:`witcert.schemes.engine_formats`. Oracles: each format's own reconstruction of a fresh copy (bit for bit),
the exact tensors (unchanged), and the unknown-name error for an engine spelling (``turboquant_k8v4``).
Domain: a write of ``(Hkv, n, d)`` keys and values in fp32 and bf16. Tolerance: none.
"""
import pytest
import torch

from witcert.integrations.vllm import config, schemes
from witcert.schemes.engine_formats import FORMATS


def _cfg(**env):
    return config.PluginConfig.from_env({f"WITCERT_VLLM_{k.upper()}": v for k, v in env.items()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_format_is_stored_as_its_reconstruction(dtype):
    loaded = schemes.load(_cfg(scheme="nvfp4", schemes=",".join(name for name in FORMATS if name != "nvfp4")))
    assert set(FORMATS) <= set(loaded)
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(2, 6, 64, generator=g) * 3).to(dtype), (torch.randn(2, 6, 64, generator=g)).to(dtype)
    k_copy, v_copy = k.clone(), v.clone()
    for name, fmt in FORMATS.items():
        stored = schemes.compress(name, k, v, layer=0, slots=torch.arange(6), kv_head_offset=0, seed=1)
        assert torch.equal(stored.k, fmt(k_copy, "key")) and torch.equal(stored.v, fmt(v_copy, "value"))
        assert torch.equal(k, k_copy) and torch.equal(v, v_copy)


def test_an_engine_format_without_a_witcert_scheme_is_refused_by_name():
    with pytest.raises(ValueError, match="WITCERT_VLLM_SCHEME: vLLM's 'turboquant_k8v4' is refused"):
        schemes.load(_cfg(scheme="turboquant_k8v4"))

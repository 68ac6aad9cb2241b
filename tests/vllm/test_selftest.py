"""The start-up self-test against vLLM's real C++ cache writer and attention kernel.

Implementation: ``selftest.check_cache`` / ``backend._refuse_unsupported``. Oracle: the C++ ops
themselves (the self-test must pass on the layout vLLM uses and fail on any other), and the
configurations the meter does not cover. Needs vLLM (ISA ``vec``: every x86 CPU).
"""
from types import SimpleNamespace

import pytest
import torch

from tests.vllm.engines import HAS_VLLM, NO_VLLM

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM)

SMOLLM2 = dict(num_heads=9, num_kv_heads=3, head_size=64, block_size=128, k_scale=1.0, v_scale=1.0, scale=0.125)


AMX = torch.cpu._is_amx_tile_supported()
# (isa, model dtype, cache dtype, storage): vec on every x86 CPU; amx (bf16 models) where the CPU has AMX tiles
CONFIGS = [("vec", torch.float32, "auto", torch.float32), ("vec", torch.bfloat16, "auto", torch.bfloat16),
           ("vec", torch.float16, "auto", torch.float16), ("amx", torch.bfloat16, "auto", torch.bfloat16),
           ("amx", torch.bfloat16, "fp8_e4m3", torch.uint8), ("amx", torch.bfloat16, "fp8_e5m2", torch.uint8)]


@pytest.mark.parametrize("isa,dtype,kv_cache_dtype,storage", CONFIGS)
def test_passes_on_vllm_layout(isa, dtype, kv_cache_dtype, storage):
    from witcert.integrations.vllm import layout, selftest

    if isa == "amx" and not AMX:
        pytest.skip("vLLM's AMX kernels need a CPU with AMX tiles; this one has none")
    checked = selftest._run(isa, dtype, storage, kv_cache_dtype, *SMOLLM2.values())
    assert checked.report["passed"] and checked.report["kernel_gap"] <= checked.report["kernel_gap_limit"]
    vec_order = layout.CacheLayout.transposed_keys(SMOLLM2["block_size"], SMOLLM2["head_size"])
    # the vec kernels keep keys transposed; the amx ones pack pairs for their tiles (measured, not assumed)
    assert torch.equal(checked.layout.key_index, vec_order.key_index) == (isa == "vec")


def test_refuses_a_wrong_layout(monkeypatch):
    # the measured order replaced by one with keys and values swapped: caught by the read-back
    from witcert.integrations.vllm import layout, selftest

    measure = layout.measure

    def swapped(*args, **kwargs):
        right = measure(*args, **kwargs)
        return layout.CacheLayout(key_index=right.value_index, value_index=right.key_index)

    monkeypatch.setattr(layout, "measure", swapped)
    with pytest.raises(selftest.CacheLayoutError, match="stored keys read back differ"):
        selftest._run("vec", torch.float32, torch.float32, "auto", *SMOLLM2.values())


def test_refuses_a_writer_writing_outside_its_slots(monkeypatch):
    # the measured key order shifted by one token: the writer changes entries the layout gives to no written slot
    from witcert.integrations.vllm import layout, selftest

    measure = layout.measure

    def shifted(*args, **kwargs):
        right = measure(*args, **kwargs)
        return layout.CacheLayout(key_index=right.key_index.roll(1, dims=0), value_index=right.value_index)

    monkeypatch.setattr(layout, "measure", shifted)
    with pytest.raises(selftest.CacheLayoutError, match="outside the written slots"):
        selftest._run("vec", torch.float32, torch.float32, "auto", *SMOLLM2.values())


def test_refuses_a_kernel_reading_other_keys(monkeypatch):
    # a read-back that matches the written keys but not what the kernel attends: caught by (3)
    from witcert.integrations.vllm import layout, selftest

    decode = layout.decode
    monkeypatch.setattr(layout, "decode", lambda stored, kv, scale: decode(stored, kv, scale) * 1.01)
    monkeypatch.setattr(selftest, "_CAST_TOLERANCE", {"auto": (0.02, 0.0)})
    with pytest.raises(selftest.CacheLayoutError, match="kernel's output differs"):
        selftest._run("vec", torch.float32, torch.float32, "auto", *SMOLLM2.values())


def _impl(**overrides):
    base = dict(sliding_window=-1, logits_soft_cap=0, alibi_slopes=None, sinks=None,
                kv_sharing_target_layer_name=None, kv_cache_dtype="auto",
                runtime=SimpleNamespace(config=SimpleNamespace(gate=False)))
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize("overrides,match", [
    ({"kv_cache_dtype": "bfloat16"}, "kv_cache_dtype 'bfloat16'"),  # vLLM 0.32 CPU writes it wrongly
    ({"sliding_window": 4096}, "sliding window"),
    ({"logits_soft_cap": 30.0}, "soft cap"),
    ({"sinks": torch.zeros(9)}, "sinks"),
])
def test_refuses_attention_the_meter_does_not_cover(overrides, match):
    from witcert.integrations.vllm.backend import _refuse_unsupported

    _refuse_unsupported(_impl())  # plain causal attention passes
    with pytest.raises(ValueError, match=match):
        _refuse_unsupported(_impl(**overrides))


@pytest.mark.parametrize("kv_cache_dtype,expected", [("fp8_e4m3", float("inf")), ("auto", 0.25)])
def test_key_scale_change_voids_fp8_witnesses(kv_cache_dtype, expected):
    # an fp8 entry written under scale s0 is read at the new scale: its witness no longer holds
    from witcert.integrations.vllm.backend import WitCertCPUAttentionImpl

    impl = SimpleNamespace(kv_cache_dtype=kv_cache_dtype, k_scale=1.0, witness=torch.full((2, 3), 0.25),
                           state=SimpleNamespace(witness=torch.full((1, 2, 3), 0.25)),  # the sequences' copy too
                           _enter_journal=lambda: None)  # nothing journaled: every witness is in the side tensor
    WitCertCPUAttentionImpl._follow_scale(impl, SimpleNamespace(_k_scale_float=1.0))
    assert (impl.witness == 0.25).all() and (impl.state.witness == 0.25).all()
    WitCertCPUAttentionImpl._follow_scale(impl, SimpleNamespace(_k_scale_float=2.0))
    assert (impl.witness == expected).all() and (impl.state.witness == expected).all() and impl.k_scale == 2.0

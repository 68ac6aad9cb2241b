"""The backend's write path and gate on vLLM's real C++ writer and kernel, two steps, no engine.

Implementation: ``WitCertCPUAttentionImpl.do_kv_cache_update`` / ``forward`` (scheme on write,
read-back witness, meter, gate, write-back, recomputed attention). Domain: two requests (a
40-token and a 20-token prompt, then one decode step each) on a scratch cache of SmolLM2's
head layout, keys with a massive channel; one request rtn-int4 with the gate, one through a
scheme that mutates its input and reuses its output buffer (``tests.vllm.adversarial_schemes``).
Oracles: the scheme applied to the exact keys (what the cache must hold after the step), the
exact keys (the shadow, the store, repaired slots: bit for bit), the fp64 true TV (every cell),
attention recomputed in fp64 from the cache read back (the kernel's output after repair).
"""
from types import SimpleNamespace

import pytest
import torch

from tests.vllm.engines import HAS_VLLM, NO_VLLM

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM)

SPEC = "tests.vllm.adversarial_schemes:workspace_int4"
HQ, HKV, D, BS = 9, 3, 64, 32
BLOCKS = [[4, 1], [2]]  # the two requests' cache blocks
PROMPTS = [40, 20]


def _impl(cfg):
    import witcert
    from vllm.v1.attention.backend import AttentionType

    from witcert.integrations.vllm import runtime
    from witcert.integrations.vllm.backend import WitCertCPUAttentionImpl
    from witcert.integrations.vllm.journal import WriteJournal

    impl = object.__new__(WitCertCPUAttentionImpl)  # vLLM's own __init__ wants an engine's config
    impl.__dict__.update(
        num_heads=HQ, num_kv_heads=HKV, head_size=D, scale=D**-0.5, kv_cache_dtype="auto",
        attn_type=AttentionType.DECODER, metered=True, layout=witcert.BandLayout(D, 16), runtime=runtime.Runtime(cfg),
        witness=None, state=None, shadow=None, store=None, cache_layout=None, tier_b=None, repaired=None, k_scale=None,
        _pending=None, _deferred=[], defer=8, spot=None, journal=WriteJournal(), _written_to=None,
        head_offset=0, kv_head_offset=0, layer_index=None, sinks=None, alibi_slopes=None, sliding_window=-1,
        logits_soft_cap=0, num_queries_per_kv=HQ // HKV, is_fp8_kv_cache=False, use_zentorch_sdpa=False,
        kv_sharing_target_layer_name=None)
    return impl


def _metadata(ops, query_lens, seq_lens, dtype, isa):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    table = torch.tensor([b + [0] * (2 - len(b)) for b in BLOCKS], dtype=torch.int32)
    slots = torch.cat([torch.tensor(BLOCKS[r])[torch.arange(s - q, s) // BS] * BS + torch.arange(s - q, s) % BS
                       for r, (q, s) in enumerate(zip(query_lens, seq_lens))])
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=2, num_heads=HQ, num_kv_heads=HKV, head_dim=D, seq_lens=seq, dtype=dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        dynamic_causal=None, kv_cache_dtype="auto")
    md = CPUAttentionMetadata(num_actual_tokens=int(starts[-1]), max_query_len=max(query_lens), query_start_loc=starts,
                              max_seq_len=max(seq_lens), seq_lens=seq, block_table=table, slot_mapping=slots,
                              scheduler_metadata=meta, causal=True)
    return md, slots


def _step(impl, layer, kv_cache, query_lens, seq_lens, g):
    from vllm import _custom_ops as ops

    dtype = kv_cache.dtype
    md, slots = _metadata(ops, query_lens, seq_lens, dtype, layer.isa)
    n = slots.numel()
    key = torch.randn(n, HKV, D, generator=g) * 2
    key[..., 11] *= 25  # a massive channel
    key = key.to(dtype)
    value = torch.randn(n, HKV, D, generator=g).to(dtype)
    query = (torch.randn(n, HQ, D, generator=g) * 2).to(dtype)
    output = torch.zeros(n, HQ, D, dtype=dtype)
    impl.runtime.step += 1  # the model runner's step (runtime.track_request_ids)
    impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
    impl.forward(layer, query, key, value, kv_cache, md, output)
    return key, value, slots, output


def _read_keys(impl, kv_cache, slots):
    from witcert.integrations.vllm import layout

    return layout.decode(impl.cache_layout.keys_at_slots(kv_cache, slots), "auto", 1.0)  # (N, Hkv, d) fp64


@pytest.mark.parametrize("isa,dtype", [("vec", torch.float32), ("vec", torch.bfloat16), ("amx", torch.bfloat16)])
@pytest.mark.parametrize("scheme", ["rtn-int4", "dithered-int8"])
def test_two_steps_scheme_witness_meter_gate_on_vllm_kernels(scheme, isa, dtype):
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM's AMX kernels (bf16 models on CPUs with AMX tiles) need AMX; this CPU has none")
    from witcert.integrations.vllm import config, layout, schemes
    from witcert.tier_a.witness import witness_of

    cfg = config.PluginConfig(enabled=True, shadow=True, gate=True, scheme=scheme, schemes=(SPEC,), tau=0.2)
    impl = _impl(cfg)
    rt = impl.runtime
    rt.request_ids, rt.prompt_lens = ["a", "b"], PROMPTS
    rt.row_settings = [config.RequestSettings(scheme, True), config.RequestSettings(SPEC, False)]
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0, layer_name="model.layers.0.self_attn.attn")
    kv_cache = torch.zeros(6, HKV, BS, 2 * D, dtype=dtype)
    g = torch.Generator().manual_seed(0)

    def stored_by(name, exact, slots):  # what the scheme makes of the exact keys (N, Hkv, d), as the cache holds it
        out = schemes.compress(rt.schemes[name], exact.transpose(0, 1), exact.transpose(0, 1), layer=0, slots=slots,
                               kv_head_offset=0, seed=rt.dither_seed)
        return out.k.transpose(0, 1).double()

    # step 1: prefill, attended exactly in flight, then stored as each request's scheme reconstructs it
    key, value, slots, _ = _step(impl, layer, kv_cache, PROMPTS, PROMPTS, g)
    for r, span in enumerate((slice(0, 40), slice(40, 60))):
        exact = key[span]
        stored = _read_keys(impl, kv_cache, slots[span])
        assert torch.equal(stored, stored_by((scheme, SPEC)[r], exact, slots[span]))
        assert torch.equal(layout.rows_of_blocks(impl.witness, torch.tensor(BLOCKS[r]), span.stop - span.start),
                           witness_of(exact, stored, impl.layout).transpose(0, 1))
    assert torch.equal(impl.shadow[slots // BS, :, slots % BS], key)  # exact keys untouched by the mutating scheme
    k_store, v_store = impl.store.page_in(slots)
    assert torch.equal(k_store, key) and torch.equal(v_store, value)
    snap = rt.telemetry.snapshot()
    assert snap["cells"] == 0 and snap["prefill_tokens"] == 60 and snap["prefill_tokens_lossy"] == 0

    # step 2: one decode token each, over the compressed cache; request a is gated
    key2, _, slots2, output = _step(impl, layer, kv_cache, [1, 1], [41, 21], g)
    snap = rt.telemetry.snapshot()
    a, b = snap["schemes"][scheme], snap["schemes"][SPEC]
    assert a["cells"] == b["cells"] == HQ and snap["shadow_violations"] == 0
    assert a["fired"] > 0 and a["unreachable"] == 0 and a["certified"] == HQ  # every fired cell repaired below tau
    assert b["gated_cells"] == 0 and b["raw_certified"] == b["certified"]
    counts = snap["gate_counts"]
    assert counts["blocks_repaired"] > 0 and counts["bytes_paged"] > 0
    assert counts["shadow_repair_checked"] > 0 and counts["shadow_repair_mismatches"] == 0
    assert snap["shadow_max_output_gap_ratio"] <= 1.0  # over the repaired cache: within the kernel's rounding
    if dtype == torch.float32:
        assert snap["shadow_max_output_gap"] < 1e-4
    repaired = impl.repaired.nonzero().flatten()
    assert repaired.numel() == counts["slots_repaired"] > 0
    assert torch.equal(_read_keys(impl, kv_cache, repaired), impl.shadow[repaired // BS, :, repaired % BS].double())
    assert (impl.witness[repaired // BS, :, repaired % BS] == 0).all()  # persistent: never paged again
    for r in range(2):  # the new tokens: attended exactly in this step, stored compressed after it
        assert torch.equal(_read_keys(impl, kv_cache, slots2[r:r + 1]), stored_by((scheme, SPEC)[r], key2[r:r + 1],
                                                                             slots2[r:r + 1]))
    if scheme == "dithered-int8":  # the deterministic branch is kept for the slots it describes, and only those
        assert impl.tier_b["valid"][slots2[:1]].all() and not impl.tier_b["valid"][repaired].any()
        assert not impl.tier_b["valid"][slots[40:]].any()  # request b's keys are not dithered

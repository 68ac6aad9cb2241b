"""vLLM's own fp8 KV cache (``fp8``, its alias for e4m3, ``fp8_e4m3``, ``fp8_e5m2``) metered, every cell checked
against the exact shadow.

Oracle: the fp64 true TV against the exact post-RoPE keys (shadow), per cell; the kernel's
output against attention recomputed from the read-back cache. Needs an x86 CPU with AVX-512 or
AMX (vLLM's CPU fp8 path); skipped with the reason elsewhere. Each case runs its own engine.
"""
import pytest

from tests.vllm.engines import HAS_VLLM, NO_VLLM, fp8_unsupported_reason, run_engine

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM)


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "fp8"), ("float32", "fp8_e4m3"), ("bfloat16", "fp8_e4m3"),
                                                  ("float32", "fp8_e5m2"), ("bfloat16", "fp8_e5m2")])
def test_fp8_cache_every_cell_within_its_meter(smollm2, dtype, kv_cache_dtype):
    reason = fp8_unsupported_reason()
    if reason:
        pytest.skip(reason)
    w = run_engine("--dtype", dtype, "--kv-cache-dtype", kv_cache_dtype, "--plugin", "--shadow",
                   "--max-tokens", "16")["witcert"]
    assert w["selftest"]["passed"] is True
    assert w["cells"] > 0 and w["shadow_cells"] == w["cells"]
    assert w["shadow_violations"] == 0
    assert w["shadow_max_true_tv"] > 0  # the cache is lossy: the check is not vacuous
    assert w["shadow_max_output_gap_ratio"] <= 1.0  # the kernel's output within its rounding in the model dtype
    if dtype == "float32":
        assert w["shadow_max_output_gap"] < 1e-3


def test_fp8_cache_sampled_every_other_step_stays_within_its_meter(smollm2):
    """Every third step metered: the unmetered steps' writes are journaled and entered at the next pass (one
    read-back for several steps); every metered cell still within its meter against the exact shadow."""
    reason = fp8_unsupported_reason()
    if reason:
        pytest.skip(reason)
    w = run_engine("--kv-cache-dtype", "fp8_e4m3", "--plugin", "--shadow", "--max-tokens", "12",
                   "--xargs", '{"witcert_meter_every": 3}')["witcert"]
    assert w["cells"] > 0 and w["unmetered"] > 0 and w["shadow_cells"] == w["cells"]
    assert w["shadow_violations"] == 0 and w["shadow_max_true_tv"] > 0

"""The plugin inside a real vLLM engine (CPU build, SmolLM2, in-process, one engine per session).

Oracle: the exact shadow (WITCERT_VLLM_SHADOW=1) keeps the exact post-RoPE keys beside the
cache; every metered cell's meter is compared with the fp64 true TV against them, and the
kernel's attention output with attention recomputed from the read-back cache. On this machine's
cache dtypes (``auto``: fp32 keys stored as fp32) the cache is lossless: the witness is 0 and
the checks certify the plumbing (layout, block tables, request ids, telemetry), not a lossy
cache -- the fp8 runs are in ``test_fp8.py``.
"""
import json
import math

import pytest

from tests.vllm.engines import HAS_VLLM, NO_VLLM, run_engine

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM)

PROMPTS = ("The capital of France is", "def add(a, b):\n    return", "Once upon a time, a fisherman")
TOKENS = 12


@pytest.fixture(scope="module")
def generated(engine):
    from vllm import SamplingParams

    from witcert.integrations.vllm import runtime

    llm, out = engine
    outs = llm.generate(list(PROMPTS), SamplingParams(max_tokens=TOKENS, temperature=0, logprobs=5,
                                                      ignore_eos=True), use_tqdm=False)
    return outs, runtime.get().snapshot(), out


def test_plugin_replaces_cpu_backend(engine):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from witcert.integrations.vllm.backend import WitCertCPUAttentionBackend

    assert AttentionBackendEnum.CPU_ATTN.get_class() is WitCertCPUAttentionBackend


def test_selftest_measured_layout_and_kernel(generated):
    _, snap, _ = generated
    assert snap["selftest"]["passed"] is True
    assert snap["selftest"]["kernel_gap"] <= snap["selftest"]["kernel_gap_limit"]


def test_every_decode_cell_metered_and_sound(generated):
    outs, snap, _ = generated
    layers, heads = 30, 9  # SmolLM2-135M: 30 layers, 9 query heads
    decode_steps = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    assert snap["cells"] == decode_steps * layers * heads
    assert snap["shadow_cells"] == snap["cells"]
    assert snap["shadow_violations"] == 0
    assert snap["shadow_max_true_tv"] == 0.0  # lossless cache: nothing lossy was certified here
    assert snap["certified"] == snap["cells"] and snap["saturated"] == 0
    assert sorted(map(int, snap["layer_max"])) == list(range(layers))
    assert max(snap["layer_max"].values()) < 1e-9  # only the fp64 score-rounding slack
    assert len(snap["request_max"]) == len(PROMPTS)
    assert snap["shadow_max_output_gap"] < 1e-4  # the kernel attended what the plugin read back
    assert snap["shadow_max_output_gap_ratio"] <= 1.0


def test_jsonl_has_one_line_per_cell(generated):
    _, snap, out = generated
    rows = [json.loads(line) for path in out.glob("cells.jsonl.*") for line in open(path)]
    assert len(rows) == snap["cells"]
    assert {r["layer"] for r in rows} == set(range(30)) and {r["head"] for r in rows} == set(range(9))
    assert all(r["true_tv"] <= r["meter"] for r in rows)
    assert all(r["step"] == r["tokens"] - 1 for r in rows)


def test_snapshot_published_for_metrics(generated):
    _, snap, out = generated
    published = json.loads((out / f"witcert-{snap['pid']}.json").read_text())
    assert published["cells"] == snap["cells"]


def test_plugin_off_is_bit_identical(generated):
    # the same prompts in a fresh engine with the plugin off: identical tokens and logprobs
    outs, _, _ = generated
    off = run_engine("--max-tokens", str(TOKENS), "--prompts", *PROMPTS)
    assert off["witcert"] is None
    for mine, ref in zip(outs, off["outputs"]):
        assert list(mine.outputs[0].token_ids) == ref["token_ids"]
        logprobs = [{str(k): v.logprob for k, v in step.items()} for step in mine.outputs[0].logprobs]
        assert logprobs == ref["logprobs"]  # exact float equality, not a tolerance
        assert all(math.isfinite(v) for step in logprobs for v in step.values())

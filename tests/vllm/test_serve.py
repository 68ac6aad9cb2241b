"""``vllm serve`` with the plugin: OpenAI-client requests, then the WitCert series on ``/metrics``.

The server runs as vLLM runs in production (API server process + engine process, bf16 model) on
127.0.0.1; the plugin's exact shadow is on, so ``/metrics`` also reports the checks against the
exact keys. The engine loads five lossy schemes (``WITCERT_VLLM_SCHEMES``) and the gate; the
default scheme is ``none``, so requests that name no scheme are served from an uncompressed
cache and requests choose a lossy one with ``vllm_xargs``. Oracle for the counts: completion
token usage (each completion token after the first is one decode step, metered for 30 layers
x 9 query heads); for soundness, the shadow's fp64 true TV of every cell against its meter.
"""
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.vllm.engines import HAS_VLLM, NO_VLLM

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM)

PROMPTS = ("The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,")
LOSSY = ("rtn-int8", "fp8-e4m3", "rtn-int4", "kivi-2bit", "dithered-int8")
CELLS_PER_STEP = 30 * 9  # layers x query heads


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve") / "server.log", "w+")
    env = dict(os.environ, WITCERT_VLLM="1", WITCERT_VLLM_SHADOW="1", VLLM_ENABLE_V1_MULTIPROCESSING="1",
               WITCERT_VLLM_SCHEMES=",".join(LOSSY), WITCERT_VLLM_GATE="1")
    env.pop("WITCERT_VLLM_SCHEME", None)  # default scheme: none
    env.pop("WITCERT_VLLM_METRICS_DIR", None)  # the server makes its own
    cmd = [sys.executable, "-m", "witcert.integrations.vllm.cli", "serve", str(smollm2), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "1024",
           "--kv-cache-memory-bytes", str(128 << 20), "--served-model-name", "smollm2", "--seed", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                if _get(base + "/health") is not None:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("vllm serve did not become healthy within 600 s")
            time.sleep(2)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the group this fixture started (server + engine)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _scrape(base: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(_get(base + "/metrics")):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_openai_requests_then_witcert_metrics(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused")
    decode_steps = 0
    for prompt in PROMPTS:
        done = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
        assert done.choices[0].text
        decode_steps += done.usage.completion_tokens - 1
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi!"}],
                                          max_tokens=6, temperature=0)
    decode_steps += chat.usage.completion_tokens - 1

    m = _scrape(server)
    cells = decode_steps * CELLS_PER_STEP
    assert m[("witcert_engines", ())] == 1
    assert m[("witcert_cells_total", ())] == cells
    assert m[("witcert_meter_count", ())] == cells
    assert m[("witcert_meter_bucket", (("le", "+Inf"),))] == cells
    assert m[("witcert_certified_fraction", (("tau", "0.2"),))] == 1.0
    assert m[("witcert_saturated_cells_total", ())] == 0
    layers = {dict(k[1])["layer"] for k in m if k[0] == "witcert_layer_max_meter"}
    assert layers == {str(i) for i in range(30)}
    requests = [k for k in m if k[0] == "witcert_request_max_meter"]
    assert len(requests) == len(PROMPTS) + 1
    assert m[("witcert_shadow_cells_total", ())] == cells
    assert m[("witcert_shadow_violations_total", ())] == 0
    assert m[("witcert_shadow_max_output_gap", ())] > 0  # bf16: the kernel rounds (the check is not vacuous)
    assert m[("witcert_shadow_max_output_gap_ratio", ())] <= 1.0  # within what bf16 rounding explains
    assert any(name.startswith("vllm:") for name, _ in m)  # vLLM's own endpoint, not a second one


def test_lossy_schemes_served_metered_and_sound(server):
    """A bounded request loop: every lossy scheme, raw and gated, then per-scheme series on /metrics."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)
    before = _scrape(server)
    steps = {s: 0 for s in LOSSY}
    # longer than 32 tokens: kivi-2bit, as a tensor function per write, quantizes whole 32-token groups
    prompt = " ".join(["The old lighthouse keeper climbed the stairs every night to light the lamp."] * 5) + " He"
    for scheme in LOSSY:  # 5 schemes x 2 gate settings = 10 requests
        for gate in (False, True):
            done = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0,
                                             extra_body={"vllm_xargs": {"witcert_scheme": scheme,
                                                                        "witcert_gate": gate}})
            assert done.choices[0].text
            steps[scheme] += done.usage.completion_tokens - 1
    with pytest.raises(BadRequestError, match="witcert_scheme='rtn-int3' is not a scheme this engine loaded"):
        client.completions.create(model="smollm2", prompt=prompt, max_tokens=2,
                                  extra_body={"vllm_xargs": {"witcert_scheme": "rtn-int3"}})

    m = _scrape(server)

    def grew(name, labels=()):
        return m.get((name, labels), 0) - before.get((name, labels), 0)

    for scheme in LOSSY:
        label = (("scheme", scheme),)
        assert grew("witcert_scheme_cells_total", label) == steps[scheme] * CELLS_PER_STEP, scheme
        assert m[("witcert_scheme_shadow_violations_total", label)] == 0, scheme
        assert m[("witcert_scheme_mean_meter", label)] > 0, scheme  # lossy: the witness is not 0
        assert m[("witcert_scheme_shadow_max_true_tv", label)] > 0, scheme
        tau = (("scheme", scheme), ("tau", "0.2"))
        assert m[("witcert_scheme_certified_fraction", tau)] >= m[("witcert_scheme_raw_certified_fraction", tau)]
    assert grew("witcert_shadow_cells_total") == sum(steps.values()) * CELLS_PER_STEP
    assert m[("witcert_shadow_violations_total", ())] == 0
    assert m[("witcert_shadow_repair_mismatches_total", ())] == 0
    assert m[("witcert_shadow_repair_checked_total", ())] == m[("witcert_gate_slots_repaired_total", ())]
    if m[("witcert_gate_blocks_repaired_total", ())]:
        assert m[("witcert_gate_bytes_paged_total", ())] > 0

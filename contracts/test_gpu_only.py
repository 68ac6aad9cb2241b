"""GPU-only contracts: CUDA-graph replay is bit-identical to eager, with a certificate at every step.

Implementation: ``decode_attention`` / ``decode_attention_packed`` compiled for CUDA (no
interpreter), launched with ``validate=False`` (value checks read data back to the host and
cannot run inside a capture; shapes and dtypes are still checked).
Oracle: the same call run eagerly, step by step.
Domain: 8 captured decode steps (the query changes every step, the caches are fixed-address
buffers), Tier A dense keys and Tier B packed keys.
Tolerance: none -- bitwise equality of output, lse and meter; the meter is finite and in
[0, 1] at every captured step.
Skipped cleanly without CUDA (``pytest.mark.gpu``); CI has no GPU.
"""
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs, compiled Triton)"),
]

STEPS = 8


def _tier_a_problem(device):
    from witcert import BandLayout, get_scheme
    from witcert.kernels.witness_write import witness_write

    generator = torch.Generator().manual_seed(0)
    k = torch.randn(2, 4, 512, 128, generator=generator).half()
    k_hat = get_scheme("rtn-int4")(k, role="key")
    layout = BandLayout(128, 16)
    witness = witness_write(k.to(device), k_hat.to(device), layout)
    v = torch.randn(2, 4, 512, 128, generator=generator).half()
    queries = torch.randn(STEPS, 2, 32, 128, generator=generator).half()
    return queries.to(device), k_hat.to(device), v.to(device), witness, layout


def _tier_b_problem(device):
    from witcert import DitheredInt8
    from witcert.tier_b.counters import StandaloneCounter
    from witcert.kernels.dither_write import dither_write
    from witcert.kernels.packed_keys import PackedKeys

    generator = torch.Generator().manual_seed(1)
    k = torch.randn(2, 4, 512, 128, generator=generator).half().to(device)
    counter = StandaloneCounter(request=torch.tensor([0, 1]), layer=0, seed=7)
    store = dither_write(k, DitheredInt8(), counter)
    plan = PackedKeys.from_store(store, counter)
    v = torch.randn(2, 4, 512, 128, generator=generator).half().to(device)
    queries = torch.randn(STEPS, 2, 32, 128, generator=generator).half().to(device)
    return queries, plan, v


def _replay_equals_eager(step_fn, queries):
    static_q = queries[0].clone()
    for _ in range(2):  # warm-up compiles the kernels and fills caches outside the capture
        step_fn(static_q)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step_fn(static_q)
    for step in range(STEPS):
        static_q.copy_(queries[step])
        graph.replay()
        torch.cuda.synchronize()
        eager = step_fn(queries[step].clone())
        assert torch.equal(captured.out, eager.out), f"step {step}: output differs"
        assert torch.equal(captured.lse, eager.lse), f"step {step}: lse differs"
        meter = captured.certificate.meter
        assert torch.equal(meter, eager.certificate.meter), f"step {step}: meter differs"
        assert bool(torch.isfinite(meter).all()) and bool(((meter >= 0) & (meter <= 1)).all()), f"step {step}"


def test_tier_a_graph_replay_is_bit_identical_with_a_certificate_every_step():
    from witcert.kernels.decode_attention import decode_attention

    queries, k_hat, v, witness, layout = _tier_a_problem("cuda")
    _replay_equals_eager(lambda q: decode_attention(q, k_hat, v, witness, layout, validate=False), queries)


def test_tier_b_graph_replay_is_bit_identical_with_a_certificate_every_step():
    from witcert.kernels.decode_attention import decode_attention_packed

    queries, plan, v = _tier_b_problem("cuda")
    _replay_equals_eager(
        lambda q: decode_attention_packed(q, plan, v, delta_loc=1e-6, mode="delta", validate=False), queries)

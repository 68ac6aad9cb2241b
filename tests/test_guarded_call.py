"""A compiled function's cached graph run after its guards alone (:mod:`witcert.fastpath.guarded_call`).

What must hold: a hit runs the very graph dynamo would (same result as the compiled function and as eager, bit for
bit, without entering dynamo); anything the guards reject (another dtype, rank, size class, grad mode, thread count)
goes through dynamo, which compiles, and is served by the new graph from then on; closure values and defaults are read
at each call; graphs of another ``torch.compile`` of the same function are never run; a call the function cannot take
raises as the compiled function does.
"""
import warnings

import pytest
import torch

from witcert.fastpath import compiled as compiled_mod
from witcert.fastpath.guarded_call import guarded_call
from witcert.fastpath.packed_decode import _DECODERS, held_decode


def _scaled(x, y, shift: int = 3):
    return (torch.maximum(x * y, x) * shift,)  # one rounding per operation (no multiply-add a compiler could fuse)


def _factory(k: int):
    def scaled_by_closure(x):
        return x * k

    return scaled_by_closure


class _Counting:
    """``torch.compile(fn)`` behind a counter of the calls that reach dynamo."""

    def __init__(self, fn, **options):
        self.compiled = torch.compile(fn, dynamic=True, fullgraph=True, **options)
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return self.compiled(*args)


@pytest.fixture(autouse=True)
def _room_for_recompiles():
    """The tests compile the same functions many times over (one code object, one cache of graphs)."""
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(recompile_limit=64):
        yield


@pytest.fixture(scope="module")
def compiler():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if compiled_mod.compiled_of(lambda x: x + 1, lambda: (torch.ones(2),)) is None:
            pytest.skip("torch.compile unavailable on this machine")


def _guarded(fn, *first):
    counting = _Counting(fn)
    counting(*first)
    call = guarded_call(fn, counting)
    assert call is not None
    return call, counting


def test_a_hit_runs_the_cached_graph_without_dynamo_and_equals_eager(compiler):
    x, y = torch.randn(5, 7), torch.randn(5, 7)
    call, counting = _guarded(_scaled, x, y)
    for rows in (5, 6, 9):  # one dynamic graph serves every size of the class
        a, b = torch.randn(rows, 7), torch.randn(rows, 7)
        assert torch.equal(call(a, b)[0], _scaled(a, b)[0])
    assert counting.calls == 1  # the first call only: every later one ran the cached graph


def test_what_the_guards_reject_goes_through_dynamo_then_hits(compiler):
    x = torch.randn(4, 3)
    call, counting = _guarded(_scaled, x, x)
    cases = [(x.double(), x.double()), (x[0].clone(), x[1].clone()), (torch.randn(2, 4, 3), torch.randn(2, 4, 3))]
    for a, b in cases:  # another dtype, rank: a miss each, compiled once, then served from the cache
        before = counting.calls
        assert torch.equal(call(a, b)[0], _scaled(a, b)[0])
        assert counting.calls == before + 1
        assert torch.equal(call(a + 1, b)[0], _scaled(a + 1, b)[0])
        assert counting.calls == before + 1


def test_grad_mode_and_thread_count_are_guarded(compiler):
    x = torch.randn(4, 3)
    with torch.no_grad():
        call, counting = _guarded(_scaled, x, x)
    out = call(x.requires_grad_(), x)[0]  # grad mode on: dynamo's graph with autograd, not the no_grad one
    assert out.requires_grad and counting.calls == 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        with torch.no_grad():
            assert torch.equal(call(x, x)[0], _scaled(x, x)[0])
        assert counting.calls == 3
    finally:
        torch.set_num_threads(threads)


def test_defaults_and_closures_are_read_at_each_call(compiler):
    x = torch.randn(3, 2)
    call, _ = _guarded(_scaled, x, x)
    assert torch.equal(call(x, x, 5)[0], _scaled(x, x, 5)[0])
    assert torch.equal(call(x, x)[0], _scaled(x, x)[0])
    fn = _factory(7)
    closure_call, counting = _guarded(fn, x)
    assert torch.equal(closure_call(x), fn(x))
    fn.__closure__[0].cell_contents = 11  # a closure value the graph reads as an input
    assert torch.equal(closure_call(x), x * 11)


def test_graphs_of_another_compile_of_the_function_are_never_run(compiler):
    x = torch.randn(3, 2)
    seen = []

    def spying_backend(gm, example_inputs):
        seen.append(1)

        def run(*args):
            seen.append(2)
            return gm(*args)

        return run

    other = torch.compile(_scaled, backend=spying_backend, dynamic=True, fullgraph=True)
    other(x, x)
    call, counting = _guarded(_scaled, x, x)  # this compile's own entry, made after the other's
    runs = seen.count(2)
    for _ in range(3):
        assert torch.equal(call(x, x)[0], _scaled(x, x)[0])
    assert seen.count(2) == runs


def test_a_wrong_call_raises_as_the_compiled_function_does(compiler):
    x = torch.randn(3, 2)
    call, _ = _guarded(_scaled, x, x)
    with pytest.raises(TypeError):
        call(x)  # y missing: no default
    with pytest.raises(TypeError):
        call(x, x, 1, 2)


def test_variadic_functions_are_left_to_dynamo(compiler):
    def variadic(*xs):
        return (sum(xs),)

    compiled = torch.compile(variadic, dynamic=True, fullgraph=True)
    compiled(torch.ones(2), torch.ones(2))
    assert guarded_call(variadic, compiled) is None


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_held_decode_through_the_cached_graph_equals_the_eager_decode(compiler, bits):
    """The production store's read, the call this path was made for: every length of a growing buffer, a read of
    the whole buffer first (the length equal to the capacity), bit for bit the eager decode."""
    width = 64 * bits // 8 if bits < 8 else 64
    capacity = 40
    g = torch.Generator().manual_seed(bits)
    dtype = torch.uint8 if bits < 8 else torch.int8
    codes = torch.randint(0, 256, (2, 1, 3, capacity, width), generator=g).to(dtype)
    amax = torch.rand(2, 1, 3, capacity, 2, 1, generator=g)
    amax[0, 0, 1, 5] = 0  # a zero group: scale 1
    for length in (capacity, 2, 3, 17, capacity - 1, capacity):
        got = held_decode(codes, amax, length, bits, torch.float32, compiled=True)
        want = _DECODERS[bits](codes, amax, 0, length, torch.float32)
        assert got.shape[-2] == length and torch.equal(got, want)

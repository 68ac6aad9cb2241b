"""``torch.compile`` of the fast path's pure functions, falling back to eager (said once, never an error).

``WITCERT_COMPILE`` chooses: ``1`` compile (the first call of a new shape class takes seconds;
inductor caches the code on disk, so a second process starts warm), ``0`` (the default) eager.
Soundness does not depend on the choice: each function's budget (:mod:`witcert.fastpath.budgeted_pass`,
:mod:`witcert.fastpath.radius`) covers any evaluation order, FMA contraction and an ``exp`` within
its assumed error, which ``tests/test_fastpath.py`` measures for the compiled code on a dense grid; where this
machine's vectorised code selects lanes wrongly, every function is compiled to scalar code (:func:`compile_options`).
"""
import functools
import os
import warnings
from typing import Callable

_CHOICES = ("0", "1")
RECOMPILE_LIMIT = 64  # graphs per function; a model uses a handful, the fuzz sprays ranks, dtypes and group counts
_state: dict = {}


def compile_requested() -> bool:
    """Whether ``WITCERT_COMPILE`` asks for the compiled pass (checked: a clear error on any other value)."""
    choice = os.environ.get("WITCERT_COMPILE", "0")
    if choice not in _CHOICES:
        raise ValueError(f"WITCERT_COMPILE must be one of {_CHOICES}, got {choice!r}")
    return choice == "1"


def compiled_of(fn: Callable, probe: Callable[[], tuple]):
    """``torch.compile(fn)``, compiled now on ``probe()``'s arguments (a missing compiler fails here, not
    mid-generation), or ``None`` (with one warning per function) where ``torch.compile`` is unavailable."""
    if fn not in _state:
        _state[fn] = _compile(fn, probe)
    return _state[fn]


def _compile(fn: Callable, probe: Callable[[], tuple]):
    import torch
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as shape_config

    def run(*args):  # each shape class (rank, dtype, a size of 1, the Tier B group count) is its own graph:
        saved = dynamo_config.recompile_limit  # more than torch's 8, for these functions only; set directly, not
        dynamo_config.recompile_limit = max(saved, RECOMPILE_LIMIT)  # with config.patch (measured 50-80 us a call)
        # no duck shaping: sizes that happen to be equal at the first call (3 kv heads, 3 rows of a view's base)
        # would be guarded equal, and a cache growing in place (views of a buffer) would recompile at each growth
        saved_duck, shape_config.use_duck_shape = shape_config.use_duck_shape, False
        try:
            return compiled(*args)
        finally:
            dynamo_config.recompile_limit = saved
            shape_config.use_duck_shape = saved_duck

    try:
        compiled = torch.compile(fn, dynamic=True, fullgraph=True, options=compile_options())
        run(*probe())
    except Exception as err:  # any failure of the toolchain: the eager function is the same computation
        _fall_back(fn, err)
        return None
    try:  # a cached graph after its guards alone: dynamo's hook only on a miss
        from witcert.fastpath.guarded_call import guarded_call

        cached = guarded_call(fn, run) or run
    except Exception:  # torch's cache-entry API not as pinned: dynamo's path, the same computation
        cached = run

    def call(*args):
        if _state.get(fn) is None:  # an earlier call failed: eager from now on
            return fn(*args)
        try:
            return cached(*args)
        except Exception as err:  # e.g. a recompile limit; a real input error recurs in the eager call
            _state[fn] = None
            _fall_back(fn, err)
            return fn(*args)

    return call


@functools.cache  # probed once per process
def compile_options() -> dict | None:
    """Inductor options of every compiled function: none, or scalar CPU code (``cpp.simdlen`` 1) where this machine's
    vectorised code selects fp32 lanes by an fp64 comparison wrongly. torch 2.13's AVX2 code does (measured: the
    compiled ``round_up_to(x64, float32)``, ``where(x64.float().double() < x64, next_up(y), y)``, rounded half of
    100,003 values down), so a rounded-up bound would come out below its value. Probed by :func:`_lanes_sound`; a
    probe the compiler cannot build leaves the options alone (the compile of the function itself then falls back to
    eager)."""
    return None if _lanes_sound() else {"cpp.simdlen": 1}


def _lanes_sound() -> bool:
    """Whether compiled code picks fp32 lanes by an fp64 comparison as eager code does (``round_up_to``'s select:
    67 values, some rounding down to fp32 and some up, so the vectorised loop and its tail are both exercised)."""
    import torch

    def probe(x64):
        y = x64.float()
        return torch.where(y.double() < x64, y + 1.0, y)

    x = 1.0 + torch.arange(67, dtype=torch.float64) * 2.0**-26
    try:
        got = torch.compile(probe, dynamic=True, fullgraph=True)(x)
    except Exception:
        return True
    return bool(torch.equal(got, probe(x)))


def _fall_back(fn: Callable, err: Exception) -> None:
    warnings.warn(f"witcert.fastpath: torch.compile unavailable ({type(err).__name__}: {str(err)[:300]}); "
                  f"using the eager {fn.__name__}", RuntimeWarning, stacklevel=5)


def graph_input(x):
    """``x`` as a compiled graph's argument: its own storage (no view base) and the canonical contiguous strides,
    copied only when it is not already. A graph guards on its inputs' strides and on a view's base, so a view of a
    cache growing in place, an expanded mask or a transposed one-token key would each recompile it."""
    import torch

    if x._base is None and x.stride() == _canonical_strides(x.shape):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _canonical_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def pick(fn: Callable, probe: Callable[[], tuple], compiled: bool | None = None) -> Callable:
    """``fn`` compiled when asked for (``compiled``, default ``WITCERT_COMPILE``) and available, else ``fn``."""
    want = compile_requested() if compiled is None else compiled
    fast = compiled_of(fn, probe) if want else None
    return fn if fast is None else fast

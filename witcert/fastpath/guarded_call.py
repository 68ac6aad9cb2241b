"""A compiled function's cached graph, run as dynamo runs it once its guards pass, without dynamo's frame hook.

Every call of a ``torch.compile`` d function enters dynamo's frame-evaluation hook: Python callbacks, context
managers and config patches around the one thing that decides what runs, the guard check of each graph dynamo
cached for the function's code. In a generating model that hook costs far more than in a loop (each step's layers
evict its code and data from the caches): a few tens of microseconds in a loop, about 0.4 ms per call behind the
production ``rtn-int4`` store's one compiled decode per layer-step (a 53 us kernel; SmolLM2, 512 tokens). The
audited production monitor there generated at 0.864x of stock CPU time through this path against 0.846x through
the hook (2026-12-07, Intel Xeon, 1 thread, audit at rate 0.02, 16 new tokens, both in one process, median of 5).

:func:`guarded_call` does what dynamo does after its hook, and nothing else: for each cached entry of the
function's code that the same ``torch.compile`` made (newest first), run the entry's guard manager on the call's
locals (arguments, defaults, closure variables: what dynamo's guards read as ``L[...]``; the global guards,
grad mode and thread count among them, read their own scope); the first entry whose guards pass runs its
transformed code (the bytecode that calls the compiled graph) with the function's globals and closure. When no
entry's guards pass, the call goes through dynamo as before (which compiles a new graph, or fails and is
caught by :mod:`witcert.fastpath.compiled`). Same guards, same graph: the same result, bit for bit
(``tests/test_guarded_call.py``).
"""
from __future__ import annotations

import inspect
import types
from typing import Callable

from torch._dynamo.eval_frame import _debug_get_cache_entry_list

_VARIADIC = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS


def guarded_call(fn: Callable, compiled: Callable) -> Callable | None:
    """``compiled`` (``torch.compile(fn)``, called once already) with its cached graphs run after their guards alone;
    ``None`` where that cannot apply (a function with ``*args``, ``**kwargs`` or keyword-only arguments, or nothing
    cached yet)."""
    code = fn.__code__
    entries = _debug_get_cache_entry_list(code)
    if code.co_flags & _VARIADIC or code.co_kwonlyargcount or not entries:
        return None
    backend = entries[0].backend  # the entry the last call used or made is first: this compile's backend
    names = code.co_varnames[:code.co_argcount]
    defaults = dict(zip(names[len(names) - len(fn.__defaults__ or ()):], fn.__defaults__ or ()))
    cells = tuple(zip(code.co_freevars, fn.__closure__ or ()))
    bodies: dict = {}  # transformed code -> the function running it

    def body(entry) -> Callable:
        run = bodies.get(entry.code)
        if run is None:
            run = bodies[entry.code] = types.FunctionType(entry.code, fn.__globals__, fn.__name__, fn.__defaults__,
                                                          fn.__closure__)
        return run

    def call(*args):
        if len(args) > len(names) or any(name not in defaults for name in names[len(args):]):
            return compiled(*args)  # dynamo's own error for a wrong call
        local = dict(defaults)
        local.update(zip(names, args))
        for name, cell in cells:
            local[name] = cell.cell_contents
        for entry in _debug_get_cache_entry_list(code):
            if entry.backend is backend and entry.guard_manager.check(local):
                return body(entry)(*args)
        return compiled(*args)

    return call

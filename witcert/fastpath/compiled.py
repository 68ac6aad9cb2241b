"""``torch.compile`` of the fused pass, falling back to eager (said once, never an error).

``WITCERT_COMPILE`` chooses: ``1`` compile (the first call of a new shape class takes seconds;
inductor caches the code on disk, so a second process starts warm), ``0`` (the default) eager.
Soundness does not depend on the choice: the pass's budget (:mod:`witcert.fastpath.budgeted_pass`)
covers any evaluation order, FMA contraction and exp/expm1/tanh within ``REL`` of the true value,
which ``tests/test_fastpath.py`` measures for the compiled code on a dense grid.
"""
import os
import warnings

from witcert.fastpath.budgeted_pass import lean_cells_kernel

_CHOICES = ("0", "1")
_state: dict = {}


def compile_requested() -> bool:
    """Whether ``WITCERT_COMPILE`` asks for the compiled pass (checked: a clear error on any other value)."""
    choice = os.environ.get("WITCERT_COMPILE", "0")
    if choice not in _CHOICES:
        raise ValueError(f"WITCERT_COMPILE must be one of {_CHOICES}, got {choice!r}")
    return choice == "1"


def compiled_kernel():
    """The compiled fused pass, or ``None`` (with one warning) where ``torch.compile`` is unavailable."""
    if "compiled" not in _state:
        _state["compiled"] = _compile()
    return _state["compiled"]


def _compile():
    import torch

    try:
        fn = torch.compile(lean_cells_kernel, dynamic=True, fullgraph=True)
        probe = torch.zeros(2, 2, dtype=torch.float64)  # sizes >= 2: no 0/1 specialisation
        fn(probe, probe, probe, probe)  # compile now: a missing compiler fails here, not mid-generation
        return fn
    except Exception as err:  # any failure of the toolchain: the eager pass is the same function
        warnings.warn(f"witcert.fastpath: torch.compile unavailable ({type(err).__name__}: {err}); "
                      "using the eager fused pass", RuntimeWarning, stacklevel=3)
        return None


def lean_cells_fn(compiled: bool | None = None):
    """The fused pass to call: compiled when asked for (``compiled``, default ``WITCERT_COMPILE``) and
    available, else the eager :func:`~witcert.fastpath.budgeted_pass.lean_cells_kernel`."""
    want = compile_requested() if compiled is None else compiled
    fn = compiled_kernel() if want else None
    return lean_cells_kernel if fn is None else fn

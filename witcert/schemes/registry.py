"""Scheme registry: any cache-preserving quantizer, registered as one tensor function (Tier A).

A scheme is ``fn(x) -> x_hat``: ``x`` is a cache tensor ``(..., S, d)`` (tokens on axis -2,
channels on axis -1) and ``x_hat`` its reconstruction: a plain ``torch.Tensor`` with the **same
shape, dtype and device** (a quantized-tensor wrapper is not a reconstruction: call its
``dequantize()``).
Tier A (Theorem 2, ``T2``) covers exactly such cache-preserving schemes; eviction, merging or
latent caches store no per-token reconstruction, and :func:`apply_scheme` rejects them.

A scheme never sees the caller's tensor: :func:`apply_scheme` hands it a private copy, so a
scheme that quantizes in place (``x.div_(s).round_().mul_(s); return x``, a common
memory-saving idiom) or returns a view of its input reconstructs that copy and cannot touch
the exact keys (the witness is a function of the exact and the reconstructed keys; a scheme
that overwrote the exact ones would make it 0 and destroy the gate's backing data).

The caller owns what :func:`apply_scheme` returns: the output is always copied once the scheme
has returned. A scheme may write its result into a workspace it reuses for the next call (what
a fused or CUDA-graph-captured quantize kernel does: one instance serves every layer), keep its
input and write it later, or return a tensor that shares memory with the exact one; a store that
held the scheme's own tensor would see it change under its witness (issue 28: 2,291 of 2,430
SmolLM2 cells above their meter).

A scheme may optionally take a keyword ``role`` (``"key"`` or ``"value"``) when it treats the
two differently (e.g. KIVI: keys per-channel, values per-token); it is passed only to schemes
whose signature accepts it.

Example
-------
>>> import witcert
>>> @witcert.register_scheme("halve")
... def halve(x):
...     '''Toy: x / 2 (for docs).'''
...     return x / 2
"""
import functools
import inspect
from collections.abc import Callable

import torch

ROLES = ("key", "value")
_REGISTRY: dict[str, Callable] = {}
_TAKES_ROLE: dict[str, bool] = {}


def register_scheme(name: str, *, replace: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn(x) -> x_hat`` under ``name`` and return ``fn`` unchanged.

    Raises ``ValueError`` for an empty name or a name already taken (unless ``replace``).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"scheme name must be a non-empty str, got {name!r}")

    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise ValueError(f"scheme {name!r} must be callable, got {type(fn).__name__}")
        if name in _REGISTRY and not replace and _REGISTRY[name] is not fn:
            raise ValueError(f"scheme {name!r} is already registered (pass replace=True to override)")
        _REGISTRY[name] = fn
        _TAKES_ROLE[name] = _accepts_role(fn)
        return fn

    return decorate


def list_schemes() -> list[str]:
    """Sorted names of every registered scheme (built-ins included)."""
    return sorted(_REGISTRY)


def get_scheme(name: str) -> Callable[..., torch.Tensor]:
    """The registered scheme ``name`` run through :func:`apply_scheme` (private copy, checked output).

    The returned callable is ``checked(x, role="key") -> x_hat``.
    """
    if name not in _REGISTRY:
        from witcert.schemes.engine_names import engine_name_note  # an engine's spelling: say which scheme it is

        note = engine_name_note(name)
        raise ValueError((f"{note}; " if note else "") + f"unknown scheme {name!r}; known schemes: "
                         f"{', '.join(sorted(_REGISTRY))}")

    @functools.wraps(_REGISTRY[name])
    def checked(x: torch.Tensor, role: str = "key") -> torch.Tensor:
        return apply_scheme(name, x, role=role)

    return checked


def apply_scheme(scheme: str | Callable, x: torch.Tensor, role: str = "key") -> torch.Tensor:
    """Run a scheme (name or callable) on a private copy of ``x`` (..., S, d); check the output.

    ``x`` is never handed to the scheme and never changed: the scheme gets ``x.clone()`` (it
    may mutate or return it), and the returned reconstruction is a copy of the scheme's output
    that nothing else references (never the exact tensor, never a workspace the scheme writes
    again, never the input copy the scheme may have kept). Raises ``ValueError`` unless the output is a
    plain dense ``torch.Tensor`` (not a subclass such as a quantized-tensor wrapper, whose values
    the witness could not read) of ``x``'s shape, dtype and device (Tier A needs one
    reconstructed vector per cached token), with no NaN/Inf.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x) or x.dim() < 2:
        raise ValueError(f"x must be a floating tensor (..., S, d), got {getattr(x, 'shape', type(x))}")
    name, fn, takes_role = _resolve(scheme)
    private = x.clone()  # the scheme may quantize in place or return a view: never of x
    x_hat = fn(private, role=role) if takes_role else fn(private)
    _check_output(name, x, x_hat)
    # owned: whatever the scheme returned (its workspace, the input copy it may keep) it may write again
    return x_hat.clone(memory_format=torch.contiguous_format)


def _check_output(name: str, x: torch.Tensor, x_hat) -> None:
    """Raise ``ValueError`` unless ``x_hat`` is a plain finite reconstruction of ``x`` (say what to return).

    The plain-tensor check comes first: a wrapper subclass (e.g. optimum-quanto's ``QTensor``)
    reports the shape and dtype of the data it packs, so it would pass the later checks and fail
    opaquely downstream, or be read as something other than the values attention uses.
    """
    wanted = f"a plain torch.Tensor of the input's shape {tuple(x.shape)} and dtype {x.dtype}"
    if not isinstance(x_hat, torch.Tensor):
        raise ValueError(f"scheme {name!r} returned {_type_name(x_hat)}; it must return {wanted}, "
                         "the reconstruction of every cached token")
    if type(x_hat) is not torch.Tensor:
        hint = (f"call .dequantize() on it and return that" if _overrides_dequantize(x_hat)
                else "return the reconstructed values as a plain tensor")
        raise ValueError(f"scheme {name!r} returned a tensor subclass ({_type_name(x_hat)}); it must return "
                         f"{wanted}: {hint}")
    if x_hat.is_quantized:
        raise ValueError(f"scheme {name!r} returned a quantized tensor (dtype {x_hat.dtype}); it must return "
                         f"{wanted}: call .dequantize() on it and return that")
    if x_hat.layout != torch.strided or x_hat.is_nested:
        raise ValueError(f"scheme {name!r} returned a {x_hat.layout} tensor; it must return {wanted} (dense)")
    if x_hat.shape != x.shape:
        raise ValueError(
            f"scheme {name!r} is not shape-preserving: input {tuple(x.shape)}, output {tuple(x_hat.shape)}. "
            "Tier A covers cache-preserving schemes only (one reconstruction per cached token)."
        )
    if x_hat.dtype != x.dtype:
        raise ValueError(f"scheme {name!r} changed dtype {x.dtype} -> {x_hat.dtype}; it must return {wanted} "
                         "(cast the reconstruction back)")
    if x_hat.device != x.device:
        raise ValueError(f"scheme {name!r} moved the tensor from {x.device} to {x_hat.device}; it must return "
                         f"{wanted} on the input's device")
    if not torch.isfinite(x_hat).all():
        raise ValueError(f"scheme {name!r} produced NaN/Inf on finite input")


def _overrides_dequantize(x_hat: torch.Tensor) -> bool:
    """Whether a tensor subclass defines its own ``dequantize`` (``torch.Tensor`` has one for qint types)."""
    return callable(getattr(type(x_hat), "dequantize", None)) and type(x_hat).dequantize is not torch.Tensor.dequantize


def _type_name(obj) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are backed by the same storage (one may be a view of the other)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _resolve(scheme: str | Callable) -> tuple[str, Callable, bool]:
    if isinstance(scheme, str):
        get_scheme(scheme)  # raises with the known names when unknown
        return scheme, _REGISTRY[scheme], _TAKES_ROLE[scheme]
    if callable(scheme):
        return getattr(scheme, "__name__", repr(scheme)), scheme, _accepts_role(scheme)
    raise ValueError(f"scheme must be a registered name or a callable, got {type(scheme).__name__}")


def _accepts_role(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "role" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

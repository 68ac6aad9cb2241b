"""Triton kernels; each names the theorem hypothesis it serves (``spec/registry.py``).

Backend. On a CUDA GPU the kernels compile for it. Without one they run under Triton's CPU
interpreter, selected by the environment variable ``TRITON_INTERPRET=1``. Triton reads it when a
``@triton.jit`` decorator runs, i.e. when a kernel module is first imported, so it must be set
before that: the test suites' ``conftest.py`` and ``.ci/run`` set it, a script sets it itself.
Importing this package never changes the process environment: a kernel module imports anywhere,
and launching a kernel compiled for a GPU on a machine without CUDA raises the clear
:class:`KernelBackendError` of :func:`require_backend` (every launcher calls it first).
"""


class KernelBackendError(RuntimeError):
    """A kernel was launched with neither a CUDA GPU nor Triton's CPU interpreter."""


def require_backend(kernel) -> None:
    """Raise :class:`KernelBackendError` unless ``kernel`` (a ``@triton.jit`` object) can run here.

    An interpreted kernel runs on the CPU; a compiled one needs CUDA (without it Triton fails deep
    in its driver lookup with "0 active drivers").
    """
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction) or torch.cuda.is_available():
        return
    raise KernelBackendError(
        f"the Triton kernel {getattr(kernel, '__name__', kernel)!s} needs a CUDA GPU or Triton's CPU "
        "interpreter: no CUDA device is available, so set TRITON_INTERPRET=1 in the environment before the "
        "first witcert.kernels module is imported (e.g. `TRITON_INTERPRET=1 python ...`)"
    )

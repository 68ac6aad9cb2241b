"""Contract suite set-up: the Triton interpreter on machines without CUDA.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` decorator runs, i.e. when a kernel module
is first imported, so it is set here, before any test module (or ``witcert.kernels``) imports
Triton. pytest loads this file at start-up, before collecting ``tests/``, so the setting also
holds if a unit test imports a kernel first. With CUDA present the kernels compile for the GPU.
"""
import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

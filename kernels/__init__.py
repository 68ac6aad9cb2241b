"""Triton kernels (TRITON_INTERPRET=1 on CPU); each names the theorem hypothesis it serves.

Without CUDA the kernels run under Triton's interpreter. ``TRITON_INTERPRET`` is read when a
``@triton.jit`` decorator runs (at import of a kernel module), so the default is set here,
before any kernel module is imported; an explicit setting in the environment wins.
"""
import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

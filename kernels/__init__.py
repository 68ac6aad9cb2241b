"""Triton kernels (TRITON_INTERPRET=1 on CPU); each names the theorem hypothesis it serves."""

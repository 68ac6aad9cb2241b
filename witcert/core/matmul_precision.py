"""Whether torch may run an fp32 matmul below fp32 precision (TF32 or bf16 inputs), and the radius lift that covers it.

An fp32 GEMM under TF32 (``torch.backends.cuda.matmul.allow_tf32``, ``fp32_precision = "tf32"``) or
``torch.set_float32_matmul_precision("high" / "medium")`` rounds its inputs to 10 (TF32) or 7 (bf16)
mantissa bits before multiplying, then accumulates in fp32: each product of two non-negative inputs is
off by less than ``(1 + 2^-7)^2 - 1 < 2^-5.9`` relative, far beyond a lift of ``(B + 4) 2^-23``. A bound
formed by such a matmul over non-negative terms (the fast Tier A radius, :mod:`witcert.fastpath.radius`)
is multiplied by :data:`REDUCED_PRECISION_LIFT` when :func:`reduced_fp32_matmul` names a setting.
"""
import torch

REDUCED_PRECISION_LIFT = 1.0 + 2.0**-4  # >= (1 + 2^-7)^2 (1 + 2^-24): bf16 or TF32 inputs, one more fp32 rounding
_REDUCED = ("tf32", "bf16")


def reduced_fp32_matmul() -> str | None:
    """The torch setting under which an fp32 matmul may round its inputs below fp32 (on any backend), or ``None``.

    Read on every call (the settings are global and may change between calls); no device work, and no
    warnings filter touched (reading them does not warn; a filter change would race other threads).
    """
    if torch.backends.cuda.matmul.allow_tf32:
        return "torch.backends.cuda.matmul.allow_tf32"
    backends = {"torch.backends.fp32_precision": getattr(torch.backends, "fp32_precision", "none"),
                "torch.backends.cuda.matmul.fp32_precision": torch.backends.cuda.matmul.fp32_precision,
                "torch.backends.mkldnn.matmul.fp32_precision": torch.backends.mkldnn.matmul.fp32_precision}
    for name, value in backends.items():
        if value in _REDUCED:
            return f"{name} = {value!r}"
    try:
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:  # legacy and new settings mixed: the backend settings above decide
        return None
    return None if precision == "highest" else f"torch.get_float32_matmul_precision() = {precision!r}"

"""Compile every kernel for a CUDA target without a GPU (run as a script, outside the interpreter).

Triton can lower a kernel all the way to a cubin on a machine with no GPU (its wheel ships
``ptxas``); only launching needs a device. This script replaces ``JITFunction.run`` by a
recorder that compiles each launch for ``sm_90`` (H100/H200) from the argument types and
constexprs the real launchers pass, then drives every public entry point of ``kernels/`` over
the configurations the contracts use. It prints one line per compiled variant and exits 1 if
any failed. ``contracts/test_gpu_compile.py`` runs it in a subprocess with
``TRITON_INTERPRET=0`` (the interpreter would hand back interpreted functions instead).
"""
import inspect
import os
import sys
import traceback

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8"}
COMPILED: dict[str, str] = {}  # variant -> "ok" or the error


class Recorded(Exception):
    """Raised after compiling, so the launcher does not go on with unwritten outputs."""


def _type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _compile_instead(self, *args, grid, warmup, **kwargs):
    bound = inspect.signature(self.fn).bind(*args, **kwargs)
    signature, constexprs = {}, {}
    for param in self.params:
        value = bound.arguments[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        else:
            signature[param.name] = _type_of(value)
    flags = ",".join(f"{k}={v}" for k, v in constexprs.items() if k.isupper() and not k.startswith("BLOCK"))
    variant = f"{self.fn.__name__}[{flags}]"
    if variant not in COMPILED:
        try:
            compiled = triton.compile(ASTSource(fn=self, signature=signature, constexprs=constexprs), target=TARGET)
            COMPILED[variant] = f"ok ({len(compiled.asm['cubin'])} B cubin)"
        except Exception as error:  # noqa: BLE001 - report every failure, keep going
            COMPILED[variant] = "FAILED: " + "".join(traceback.format_exception_only(error)).strip()[-600:]
    raise Recorded


def _drive(call):
    try:
        call()
    except Recorded:
        pass


def _problems():
    from witcert import BandLayout, DitheredInt8
    from witcert.tier_b.counters import StandaloneCounter
    from witcert.kernels.packed_keys import PackedKeys

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 64, generator=generator).half()
    k = torch.randn(2, 3, 40, 64, generator=generator).half()
    v = torch.randn(2, 3, 40, 64, generator=generator).half()
    layout = BandLayout(64, 16)
    witness = torch.rand(2, 3, 40, 16, generator=generator).half()
    counter = StandaloneCounter(request=torch.tensor([0, 1]), layer=0, seed=3)
    quantizer = DitheredInt8(outlier_pairs=2).calibrate(k.float())
    store = quantizer.quantize(k.float(), counter)  # fp32 source: outlier slack on
    plan = PackedKeys.from_store(store, counter)
    # per-channel (block-channel) and per-token scales: scale groups of 1 and of d channels
    per_scale = [PackedKeys.from_store(DitheredInt8(granularity=granularity, block=16).quantize(k, counter), counter)
                 for granularity in ("block-channel", "token")]
    return q, k, v, layout, witness, counter, quantizer, plan, per_scale


def _skip_backend_check() -> None:
    """Let launchers reach ``JITFunction.run`` without CUDA: the recorder compiles, it never launches."""
    for name, module in list(sys.modules.items()):
        if name.startswith("witcert.kernels.") and hasattr(module, "require_backend"):
            module.require_backend = lambda kernel: None


def main() -> int:
    JITFunction.run = _compile_instead
    from witcert import DitheredInt8
    from witcert.kernels.decode_attention import decode_attention, decode_attention_packed
    from witcert.kernels.dither_write import dither_stream, dither_write
    from witcert.kernels.merge import merge_splits
    from witcert.kernels.packed_keys import dequantize_packed
    from witcert.kernels.philox import philox4x32_10
    from witcert.kernels.witness_write import witness_write

    _skip_backend_check()
    q, k, v, layout, witness, counter, quantizer, plan, per_scale = _problems()
    calls = [
        lambda: philox4x32_10(torch.zeros(4, 4, dtype=torch.int64), torch.zeros(4, 2, dtype=torch.int64)),
        lambda: witness_write(k, k, layout),
        lambda: witness_write(k, k, layout, bits=8),  # the e5m3 byte store
        lambda: dither_write(k, DitheredInt8(), counter),
        lambda: dither_write(k, quantizer, counter),
        lambda: dither_stream(counter, tuple(k.shape)),
        lambda: dequantize_packed(plan),
        lambda: merge_splits(torch.zeros(2, 9, 3, 64), torch.zeros(2, 9, 3, 8, dtype=torch.float64)),
        lambda: decode_attention(q, k, v, witness, layout, validate=False),
        lambda: decode_attention(q, k, v, witness, layout, certify=False, validate=False),
        lambda: decode_attention_packed(q, plan, v, delta_loc=1e-6, mode="min", witness=witness, layout=layout,
                                        validate=False),
        lambda: decode_attention_packed(q, plan, v, mode="delta", validate=False),
        lambda: decode_attention_packed(q, plan, v, delta_loc=1e-6, mode="u", validate=False),
        lambda: decode_attention_packed(q, plan, v, certify=False, dithered=False, mode="delta", validate=False),
        *(lambda p=p: decode_attention_packed(q, p, v, delta_loc=1e-6, mode="min", validate=False) for p in per_scale),
    ]
    sys.path.insert(0, os.path.dirname(__file__))
    import test_kernel_arithmetic

    calls.append(lambda: test_kernel_arithmetic._run(torch.linspace(-1, 1, 16)))
    for call in calls:
        _drive(call)
    for variant, status in COMPILED.items():
        print(f"{variant}: {status}")
    return 0 if all(status.startswith("ok") for status in COMPILED.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

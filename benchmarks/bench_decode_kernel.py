"""Time the decode kernel with the certificate on and off, and an RTN-INT8 baseline (GPU only).

What is timed (``triton.testing.do_bench``, median over repetitions, CUDA):

* ``packed  cert off / on`` -- the dithered INT8 store (in-kernel Philox dither), stages 1 + 2;
  the certificate adds the Tier B radius and the ``k``/``j`` moments in the same pass.
  Target: on/off <= +2% (the paper measured +0.35% on its quantized path);
* ``packed  cert on + meter`` -- the same plus the fp64 meter finalisation (a few tiny torch ops);
* ``rtn-int8 baseline`` -- the same kernel over a plain round-to-nearest INT8 store (no dither,
  no certificate): the cost of the dither itself;
* ``fp16    cert off / on`` -- Tier A over a dense fp16 store with a witness (the paper measured
  +11.9% for a certificate on an fp16 store).

On a machine without CUDA the kernels run under the Triton interpreter: the script says so,
runs each configuration once on a tiny shape as a smoke test and reports no timings, because
interpreter timings are not timings.

Usage: ``.venv/bin/python benchmarks/bench_decode_kernel.py [--batch 8 --heads 32 --kv-heads 8
--seq 8192 --head-dim 128 --splits 16]``
"""
import argparse
import json
import os
import time

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # Triton's CPU interpreter; read when the first kernel module is imported

from witcert import BandLayout, DitheredInt8, get_scheme
from witcert.tier_b.counters import StandaloneCounter
from witcert.tier_b.quantizer import Q_LEVELS
from witcert.kernels.decode_attention import decode_attention, decode_attention_packed
from witcert.kernels.dither_write import dither_write
from witcert.kernels.packed_keys import PackedKeys
from witcert.kernels.witness_write import witness_write


def _problem(args, device):
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, args.kv_heads, args.seq, args.head_dim)
    k = torch.randn(shape, generator=generator).half().to(device)
    v = torch.randn(shape, generator=generator).half().to(device)
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=generator).half().to(device)
    counter = StandaloneCounter(request=torch.arange(args.batch), layer=0, seed=1)
    store = dither_write(k, DitheredInt8(), counter)
    packed = PackedKeys.from_store(store, counter)
    scale = store.scales.double().repeat_interleave(store.layout.group, dim=-1)  # token-group, no outliers
    rtn_codes = torch.round(k.double() / scale).clamp(-Q_LEVELS, Q_LEVELS)
    rtn = PackedKeys.from_store(type(store)(store.layout, rtn_codes.to(torch.int8), store.scales, store.outliers,
                                            None, None, store.source_dtype), counter)
    layout = BandLayout(args.head_dim, 16)
    k_hat = get_scheme("rtn-int8")(k, role="key")
    witness = witness_write(k, k_hat, layout)
    return q, v, packed, rtn, k_hat, witness, layout


def _configurations(args, problem):
    q, v, packed, rtn, k_hat, witness, layout = problem
    common = dict(num_splits=args.splits, validate=False)
    packed_kw = dict(delta_loc=1e-6, mode="min", **common)
    return {
        "packed  cert off": lambda: decode_attention_packed(q, packed, v, certify=False, **packed_kw),
        "packed  cert on": lambda: decode_attention_packed(q, packed, v, certify=True, **packed_kw),
        "rtn-int8 baseline": lambda: decode_attention_packed(q, rtn, v, certify=False, dithered=False,
                                                             delta_loc=1e-6, mode="delta", **common),
        "fp16    cert off": lambda: decode_attention(q, k_hat, v, witness, layout, certify=False, **common),
        "fp16    cert on": lambda: decode_attention(q, k_hat, v, witness, layout, certify=True, **common),
    }


def _gpu(args):
    import triton.testing

    problem = _problem(args, "cuda")
    results = {}
    for name, run in _configurations(args, problem).items():
        results[name] = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")  # ms
    overhead = {
        "packed cert on/off": results["packed  cert on"] / results["packed  cert off"] - 1,
        "fp16 cert on/off": results["fp16    cert on"] / results["fp16    cert off"] - 1,
        "dither vs rtn-int8": results["packed  cert off"] / results["rtn-int8 baseline"] - 1,
    }
    print(json.dumps({"device": torch.cuda.get_device_name(), "args": vars(args),
                      "median_ms": results, "overhead": overhead}, indent=2))
    print("note: the meter's fp64 finalisation (a few tiny torch ops) is included in every 'cert on' time.")


def _cpu(args):
    print("No CUDA: the kernels run under the Triton interpreter (TRITON_INTERPRET=1).")
    print("Interpreter timings are not timings: nothing below measures kernel speed.")
    small = argparse.Namespace(**{**vars(args), "batch": 1, "heads": 4, "kv_heads": 2, "seq": 64,
                                  "head_dim": 64, "splits": 2})
    problem = _problem(small, "cpu")
    for name, run in _configurations(small, problem).items():
        start = time.perf_counter()
        result = run()
        meter = "-" if result.certificate is None else f"{float(result.certificate.meter.max()):.4f}"
        print(f"  smoke {name:18s} ran ({time.perf_counter() - start:.1f} s in the interpreter; max meter {meter})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--splits", type=int, default=16)
    args = parser.parse_args()
    if torch.cuda.is_available():
        _gpu(args)
    else:
        _cpu(args)


if __name__ == "__main__":
    main()

"""Capacity: tokens that fit in a fixed KV budget, per scheme, raw and with the production monitor.

``python -m benchmarks.capacity`` (writes ``benchmarks/results/capacity.json``), two ways:

- **accounting** (:func:`witcert.integrations.hf.footprint.footprint`): the bytes per token the production
  store (``keep_exact=False``) holds for a long bf16 prefill, read from its memory account (the bytes of its
  tensors, ``tests/test_memory_account.py``), at SmolLM2-135M's shape and at a 7B-class one; tokens in a
  1 GiB KV budget for an uncompressed bf16 cache, for each scheme alone (its codes and statistics) and with
  the monitor (its witness added, at the monitor's default for the scheme: 16 bands in one byte each, or derived
  from the codec's error bound for the 4- and 2-bit codecs; and in fp16 and derived for comparison);
  the host backing store a gate or spot check keeps (the exact bf16 keys and values) apart;
- **generation**: SmolLM2-135M-Instruct in bf16 generating ``--new`` tokens after a ``--context``-token text
  prompt under ``witcert.monitor(scheme, keep_exact=False)``: ``mon.memory()`` against the bf16 cache of the
  same tokens (decode tokens included: KIVI's exact key tails, a quantized cache's exact window).

The user codec is :class:`UserInt4`, an int4 codec written as a user would (two codes per byte, one scale
per token in the model's dtype, and its elementwise error bound: docs/guides/own-scheme.md).
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

from benchmarks.record import write_json

OUT = Path(__file__).with_name("results") / "capacity.json"
BUDGET = 2**30  # bytes of KV cache
SHAPES = {  # name -> (layers, kv heads, head dim)
    "SmolLM2-135M": (30, 3, 64),
    "7B-class (Qwen2-7B: 28 layers, 4 kv heads)": (28, 4, 128),
}
SCHEMES = ("rtn-int8", "rtn-int4", "fp8-e4m3", "kivi-2bit", "dithered-int8", "hf-quanto-int4", "hf-hqq-int4",
           "user int4 codec")
TARGETS = {"rtn-int4": 3.0, "rtn-int8": 1.8, "fp8-e4m3": 1.8, "kivi-2bit": 4.0, "hf-quanto-int4": 2.5,
           "user int4 codec": 3.0}  # issue 44: production monitor, witness included, against bf16


class UserInt4:
    """A user's int4 codec: two codes per byte and one scale per token, kept in the model's dtype."""

    name = "user int4 codec"

    def encode(self, x, role, start):
        scale = (x.abs().amax(-1, keepdim=True).float() / 7).clamp(min=1e-12).to(x.dtype)  # the scale kept
        codes = (torch.round(x.float() / scale.float()).clamp(-7, 7) + 8).to(torch.uint8)
        return (codes[..., ::2] | (codes[..., 1::2] << 4), scale)

    def decode(self, packed, dtype):
        payload, scale = packed
        codes = torch.stack([payload & 15, payload >> 4], dim=-1).flatten(-2).float() - 8
        return (codes * scale.float()).to(dtype)

    def nbytes(self, packed):
        return sum(t.numel() * t.element_size() for t in packed)

    def join(self, first, second):  # lossless: per-token codes and scales concatenate along the tokens
        return tuple(torch.cat([a, b], dim=-2) for a, b in zip(first, second))

    def error_bound(self, packed, decoded):  # half a step, fp32 roundings, the cast to the model dtype
        info = torch.finfo(decoded.dtype)
        half_step = packed[1].double() * (0.5 + 2.0**-20)
        return half_step + info.eps / 2 * (1 + 2.0**-20) * decoded.double().abs() + info.smallest_normal * info.eps


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--context", type=int, default=512, help="prompt tokens of the generation runs")
    p.add_argument("--new", type=int, default=16, help="tokens generated")
    p.add_argument("--skip-generation", action="store_true", help="the accounting only")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


def scheme_object(name: str):
    """What ``witcert.monitor`` is given for a scheme name of this benchmark."""
    return UserInt4() if name == UserInt4.name else name


def accounting_rows(schemes, layers: int, kv_heads: int, head_dim: int) -> list[dict]:
    """Bytes per token (every layer and kv head) and tokens in :data:`BUDGET`, per scheme."""
    from witcert.integrations.hf.footprint import footprint

    per_token = layers * kv_heads
    rows = []
    for name in schemes:
        f = footprint(scheme_object(name), head_dim)
        fp16 = footprint(scheme_object(name), head_dim, witness_bits=16)
        derived = _derived_footprint(name, head_dim)
        bf16, raw, monitored = f.exact * per_token, f.raw * per_token, f.monitored * per_token
        rows.append(dict(scheme=name, witness_bits=f.witness_bits, bytes_per_token_bf16=bf16, bytes_per_token_raw=raw,
                         bytes_per_token_monitored=monitored, bytes_per_token_monitored_fp16_witness=fp16.monitored * per_token,
                         witness_bytes_per_token_and_head=f.witness, host_backing_per_token=f.backing * per_token,
                         tokens_in_budget=dict(bf16=int(BUDGET // bf16), raw=int(BUDGET // raw),
                                               monitored=int(BUDGET // monitored)),
                         capacity_raw=f.capacity(monitored=False), capacity_monitored=f.capacity(),
                         capacity_monitored_fp16_witness=fp16.capacity(),
                         capacity_monitored_derived_witness=None if derived is None else derived.capacity()))
    return rows


def _derived_footprint(name: str, head_dim: int):
    """The footprint with the witness derived from the codec's error bound (``witness_bits=0``), ``None`` where the
    scheme's codec declares no bound (transformers' quantized caches, the dithered cache)."""
    from witcert.integrations.hf.footprint import footprint

    try:
        return footprint(scheme_object(name), head_dim, witness_bits=0)
    except ValueError:
        return None


def generation_rows(schemes, context: int, new: int) -> list[dict]:
    """``mon.memory()`` of SmolLM2 (bf16) generating under each scheme, production mode."""
    import witcert
    from benchmarks.capture import prompt_ids
    from witcert.integrations.hf.default_model import load_model

    loaded = load_model()
    model = loaded.model.to(torch.bfloat16)
    ids = prompt_ids(loaded.tokenizer, "text", context)
    rows = []
    for name in schemes:
        started = time.perf_counter()
        with torch.no_grad(), witcert.monitor(model, scheme_object(name), keep_exact=False) as mon:
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False)
        t = mon.memory().total
        rows.append(dict(scheme=name, tokens=int(ids.shape[1] + new - 1), exact_cache_bf16=t.exact_cache, held=t.held,
                         compressed=t.compressed, witness=t.witness, spare_buffer_room=t.reserved,
                         capacity=t.exact_cache / t.held, wall_s=round(time.perf_counter() - started, 1)))
        print(f"generation {name}: held {t.held:,d} of {t.exact_cache:,d} B -> {t.exact_cache / t.held:.2f}x", flush=True)
    return rows


def target_check(record: dict) -> list[dict]:
    """Each issue-44 target against the accounting at each shape and the generation run."""
    rows = []
    for name, target in TARGETS.items():
        row = dict(scheme=name, target=target)
        for shape, accounting in record["accounting"].items():
            row[shape] = next((r["capacity_monitored"] for r in accounting if r["scheme"] == name), None)
        generated = next((r for r in record.get("generation", []) if r["scheme"] == name), None)
        row["generation"] = None if generated is None else generated["capacity"]
        rows.append(row)
    return rows


def run(args) -> dict:
    from benchmarks.spot_check import machine
    from witcert.integrations.hf.geometry import auto_bands
    from witcert.tier_a.witness_code import DEFAULT_WITNESS_BITS

    torch.set_num_threads(args.threads)
    schemes = tuple(s for s in args.schemes.split(",") if s)
    record = dict(setup=dict(budget_bytes=BUDGET, dtype="bfloat16", witness_bits=DEFAULT_WITNESS_BITS,
                             bands={name: auto_bands(d) for name, (_, _, d) in SHAPES.items()},
                             generation=None if args.skip_generation else dict(
                                 model="SmolLM2-135M-Instruct in bf16", context_tokens=args.context,
                                 new_tokens=args.new),
                             date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                             machine=machine(args.threads) + " (shared with other jobs)",
                             command=" ".join(["python -m benchmarks.capacity", *sys.argv[1:]])),
                  accounting={name: accounting_rows(schemes, *shape) for name, shape in SHAPES.items()})
    if not args.skip_generation:
        record["generation"] = generation_rows(schemes, args.context, args.new)
    record["targets"] = target_check(record)
    return record


def main(argv=None) -> int:
    args = parse(argv)
    record = run(args)
    for name, rows in record["accounting"].items():
        for r in rows:
            derived = r["capacity_monitored_derived_witness"]
            print(f"{name:<44} {r['scheme']:<16} raw {r['capacity_raw']:.2f}x  monitored {r['capacity_monitored']:.2f}x "
                  f"(fp16 witness {r['capacity_monitored_fp16_witness']:.2f}x, derived "
                  f"{'n/a' if derived is None else f'{derived:.2f}x'})")
    write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())

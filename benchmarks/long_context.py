"""Long context measured (issue 32): ``python -m benchmarks.long_context``.

Two parts, both ``rtn-int8``, batch 1, greedy, CPU, ``--threads`` torch threads (default 1).

1. Decode at long context on SmolLM2-135M (30 layers, 9 query / 3 kv heads, d=64, fp32). The
   prompt is real offline text: the files of ``/usr/share/common-licenses`` (sorted, symlinks
   skipped), then Python stdlib sources if more is needed, tokenized, the first ``context``
   tokens. Only DECODE is timed, never the prefill: at 16k tokens one prefill takes minutes on a
   CPU and would drown the per-token cost a long conversation pays on every token. So the stock
   model prefills ``context - 1`` tokens once into an exact ``DynamicCache``; every timed run gets
   a ``copy.deepcopy`` of it (copied outside the timed region) with all ``context`` ids, so
   ``generate`` runs only the last prompt token and then decodes. Under ``witcert.monitor`` the
   first forward call adopts the cached exact prefix (compresses it and forms its witness:
   :func:`witcert.integrations.hf.cache_layer.adopt`), a one-off cost per request. To keep it out
   of the per-token figure, every round times ``generate`` with 1 new token and with ``N + 1`` new
   tokens per config, and the decode rate is ``N / (t(N+1) - t(1))`` (median over rounds of the
   per-round difference); ``t(1)`` is reported too (it holds the adoption). Configs, interleaved
   round-robin: ``stock`` (no monitor), ``monitored`` (``keep_exact=False``, production: packed
   int8 codes decoded on every read, no exact shadow), ``observed`` (``keep_exact=True``: exact
   shadow and true TV per cell), and both with the meter's compiled pass (``WITCERT_COMPILE=1``)
   where ``torch.compile`` works here.

2. One attention layer at a 7B-class shape (Hq=32, Hkv=8, d=128), one decode query, ``S`` cached
   tokens, float32 keys and values (a CPU run: no fp16/bf16 storage). Synthetic keys: standard
   normal with a few large channels, rotated by RoPE (base 10000) at their positions; the query
   likewise at position ``S``. Per layer-step: ``sdpa`` (stock attention of the query over the exact
   cache, ``scaled_dot_product_attention(enable_gqa=True)`` as transformers' sdpa path), ``stock
   step`` (a ``DynamicLayer`` appending the token, then sdpa), and the meter: what the monitor adds in
   production for that step, ``MonitoredLayer.update`` of the new token (compress it, decode the
   whole store for the read) and then either its record for deferred metering with the request's
   flush every :data:`FLUSH_EVERY` steps counted in (``meter``, what production monitoring pays) or
   :func:`witcert.integrations.hf.attention.attend` in the step (``meter, in step``: what a gate, a spot
   check or Tier B pays), eager and compiled. The store is built the way the monitor builds it for
   ``"rtn-int8"`` with ``keep_exact=False`` and prefilled with ``S`` tokens outside the timing; every
   timed call appends one token, so ``S`` grows during the timing (the final lengths are recorded).
   Ratios: ``(sdpa + meter) / sdpa`` and ``(sdpa + meter) / stock step``.

Writes ``--out`` (default ``benchmarks/results/long_context.json``). The machine is shared:
timings are indicative; every ratio is formed from interleaved runs in one process.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from benchmarks import generation
from benchmarks.timing import compile_choice, compiled_available, time_interleaved

OUT = Path(__file__).with_name("results") / "long_context.json"
SCHEME = generation.SCHEME
FLUSH_EVERY = 16  # layer part: decode steps per flush of the deferred meter (as a 16-token generate)
LAYER_SHAPE = dict(query_heads=32, kv_heads=8, head_dim=128)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="*", default=[4096, 16384], help="decode contexts (tokens; none: skip)")
    p.add_argument("--new-tokens", type=int, default=16, help="N: decode steps timed per run")
    p.add_argument("--reps", type=int, default=7, help="rounds per context (median)")
    p.add_argument("--long-reps", type=int, default=None, help="rounds at contexts above 4096 (default --reps)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layer-contexts", type=int, nargs="*", default=[4096, 16384, 32768])
    p.add_argument("--layer-reps", type=int, default=7)
    p.add_argument("--no-compiled", action="store_true", help="skip the compiled configs")
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


# -- part 1: decode on SmolLM2 -----------------------------------------------------------------------------

def text_sources() -> list[Path]:
    """The prompt's files, in order: common licenses (sorted, no symlinks), then stdlib sources."""
    licenses = sorted(p for p in Path("/usr/share/common-licenses").glob("*") if p.is_file() and not p.is_symlink())
    return licenses + sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def prompt_ids(tokenizer, context: int) -> torch.Tensor:
    """The first ``context`` tokens of the concatenated sources, (1, context)."""
    ids: list[int] = []
    for path in text_sources():
        ids += tokenizer(path.read_text(encoding="utf-8", errors="replace")).input_ids
        if len(ids) >= context:
            return torch.tensor([ids[:context]])
    raise ValueError(f"only {len(ids)} tokens of offline text, {context} asked")


def exact_prefix(model, ids: torch.Tensor):
    """A ``DynamicCache`` of the stock model's exact keys and values for all but the last prompt token."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
    return cache


def decode_configs(compiled: bool) -> dict[str, tuple]:
    """name -> (keep_exact or None for stock, compiled meter)."""
    configs = {"stock": (None, False), "monitored": (False, False), "observed": (True, False)}
    if compiled and compiled_available():
        configs |= {"monitored, compiled": (False, True), "observed, compiled": (True, True)}
    return configs


def timed_generate(model, ids, prefix, new_tokens: int, keep_exact, compiled: bool) -> float:
    """Seconds of one ``generate`` of ``new_tokens`` over a fresh copy of ``prefix`` (the copy not timed)."""
    return generation.timed_generate(model, ids, new_tokens, keep_exact, compiled, past_key_values=copy.deepcopy(prefix))


def decode_at(model, tokenizer, context: int, new_tokens: int, reps: int, configs: dict) -> dict:
    """Per-token decode rate of every config at ``context``, interleaved round-robin."""
    ids = prompt_ids(tokenizer, context)
    started = time.perf_counter()
    prefix = exact_prefix(model, ids)
    prefill_s = time.perf_counter() - started
    for keep, comp in configs.values():  # warm-up: first calls (and compiles) out of the timing
        timed_generate(model, ids, prefix, 2, keep, comp)
    one = {name: [] for name in configs}
    many = {name: [] for name in configs}
    for _ in range(reps):
        for name, (keep, comp) in configs.items():
            one[name].append(timed_generate(model, ids, prefix, 1, keep, comp))
            many[name].append(timed_generate(model, ids, prefix, new_tokens + 1, keep, comp))
    per_token = {name: statistics.median(b - a for a, b in zip(one[name], many[name])) / new_tokens
                 for name in configs}
    rate = {name: 1.0 / s for name, s in per_token.items()}
    return {"context": context, "new_tokens": new_tokens, "reps": reps, "prefill_s_untimed": prefill_s,
            "tokens_per_s": rate, "ms_per_token": {n: 1e3 * s for n, s in per_token.items()},
            "ratio_to_stock": {n: rate[n] / rate["stock"] for n in configs if n != "stock"},
            "first_step_s": {n: statistics.median(v) for n, v in one.items()},
            "wall_s_n_plus_1": {n: statistics.median(v) for n, v in many.items()},
            "note": "tokens_per_s = N / median(t(N+1 new) - t(1 new)); first_step_s = t(1 new): the last prompt "
                    "token's forward, plus, under the monitor, adopting (compressing) the cached exact prefix"}


def decode_part(args) -> list[dict]:
    from witcert.integrations.hf.default_model import load_model

    loaded = load_model()
    model, tok = loaded.model, loaded.tokenizer
    configs = decode_configs(not args.no_compiled)
    rows = []
    for context in args.contexts:
        reps = args.reps if context <= 4096 or args.long_reps is None else args.long_reps
        started = time.perf_counter()
        row = decode_at(model, tok, context, args.new_tokens, reps, configs)
        row["wall_s_total"] = time.perf_counter() - started
        print(f"decode @ {context}: " + ", ".join(f"{n} {r:.2f} tok/s" for n, r in row["tokens_per_s"].items())
              + f"  ({row['wall_s_total']:.0f} s)", flush=True)
        rows.append(row)
    return rows


# -- part 2: one attention layer at a 7B shape ---------------------------------------------------------------

def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """``x`` (..., T, d) rotated by RoPE (rotate_half pairs ``(j, j + d/2)``) at ``positions`` (T,)."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = positions.to(torch.float64)[:, None] * freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def synthetic_keys(heads: int, start: int, tokens: int, d: int, generator) -> torch.Tensor:
    """(1, heads, tokens, d) fp32: standard normal, 8 channel pairs x4 (outlier-like), RoPE at their positions."""
    x = torch.randn(1, heads, tokens, d, generator=generator)
    gain = torch.ones(d)
    gain[:4], gain[d // 2:d // 2 + 4] = 4.0, 4.0
    return rope(x * gain, torch.arange(start, start + tokens))


def production_layer(d: int):
    """A ``MonitoredLayer`` over the store the monitor builds for ``rtn-int8`` with ``keep_exact=False``, and its scope."""
    from witcert.integrations.hf.attention import CallScope
    from witcert.integrations.hf.cache_layer import MonitoredLayer
    from witcert.integrations.hf.codecs import codec_for
    from witcert.integrations.hf.compressed_cache import CompressedLayer
    from witcert.integrations.hf.geometry import auto_bands
    from witcert.schemes.plugins import resolve_scheme
    from witcert.tier_a.bands import BandLayout

    layout = BandLayout(d, auto_bands(d), "rotate_half")
    store = CompressedLayer(codec_for(resolve_scheme(SCHEME), packed=True), layout, keep_exact=False)
    scope = CallScope(layout=layout, tier="A", adaptive=True, truth=False, record=lambda batch: None,
                      rows=(0,), fused=True)
    return MonitoredLayer(store, 0), scope


def layer_at(context: int, reps: int, compiled: bool) -> dict:
    """ms per layer-step at ``context`` cached tokens: sdpa, stock step, meter eager (and compiled)."""
    from transformers.cache_utils import DynamicLayer

    from witcert.integrations.hf.attention import attend
    from witcert.integrations.hf.pending import PendingCells

    hq, hkv, d = LAYER_SHAPE["query_heads"], LAYER_SHAPE["kv_heads"], LAYER_SHAPE["head_dim"]
    g = torch.Generator().manual_seed(context)
    keys, values = synthetic_keys(hkv, 0, context, d, g), torch.randn(1, hkv, context, d, generator=g)
    query = rope(torch.randn(1, hq, 1, d, generator=g), torch.tensor([context]))
    new_k, new_v = synthetic_keys(hkv, context, 1, d, g), torch.randn(1, hkv, 1, d, generator=g)
    scale = d ** -0.5
    stock = DynamicLayer()
    stock.update(keys, values)
    stores = {}
    names = ("meter", "meter, in step") + (("meter, compiled", "meter, in step, compiled") if compiled else ())
    for name in names:
        stores[name] = production_layer(d)
        stores[name][0].update(keys, values)  # the prefill: the store's first write, outside the timing

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True)

    def stock_step():
        k, v = stock.update(new_k, new_v)
        return torch.nn.functional.scaled_dot_product_attention(query, k, v, scale=scale, enable_gqa=True)

    def meter(name: str):
        layer, scope = stores[name]
        pending = PendingCells(scope, [layer])
        steps = [0]

        def step():
            with compile_choice(name.endswith("compiled")):
                k, v = layer.update(new_k, new_v)
                if "in step" in name:
                    return attend(scope, layer, query, (k, v), None, scale, output=None)
                pending.defer(0, query, None, k.shape[-2], scale, adaptive=True)
                steps[0] += 1
                if steps[0] % FLUSH_EVERY == 0:
                    pending.flush()
        return step

    fns = {"sdpa": sdpa, "stock step": stock_step} | {name: meter(name) for name in stores}
    timed = time_interleaved(fns, reps=reps)
    ms = {name: 1e3 * t.median for name, t in timed.items()}
    row = {"context": context, "reps": reps, "ms_per_layer_step": ms,
           "final_lengths": {"stock step": stock.get_seq_length()} | {n: s[0].store.length for n, s in stores.items()}}
    for name in stores:
        row[f"ratio_sdpa_plus_{name.replace(', ', '_')}_over_sdpa"] = (ms["sdpa"] + ms[name]) / ms["sdpa"]
        row[f"ratio_sdpa_plus_{name.replace(', ', '_')}_over_stock_step"] = (ms["sdpa"] + ms[name]) / ms["stock step"]
    return row


def layer_part(args) -> list[dict]:
    compiled = not args.no_compiled and compiled_available()
    rows = []
    for context in args.layer_contexts:
        row = layer_at(context, args.layer_reps, compiled)
        print(f"layer @ {context}: " + ", ".join(f"{n} {v:.2f} ms" for n, v in row["ms_per_layer_step"].items()),
              flush=True)
        rows.append(row)
    return rows


# -- the record ----------------------------------------------------------------------------------------------

def check_finite(record: dict) -> None:
    """Raise unless every timing and ratio is a positive finite number."""
    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, float) and not (math.isfinite(x) and x > 0):
            raise ValueError(f"a non-positive or non-finite figure in the record: {x}")
    walk({"decode": record["decode"], "layer": record["layer"]})


def table(record: dict) -> str:
    lines = ["decode (tokens/s, ratio to stock):"]
    for row in record["decode"]:
        cells = [f"{n} {r:.2f}" + ("" if n == "stock" else f" ({row['ratio_to_stock'][n]:.2f}x)")
                 for n, r in row["tokens_per_s"].items()]
        lines.append(f"  {row['context']:>6}  N={row['new_tokens']} reps={row['reps']}:  " + ", ".join(cells))
    lines.append("one layer, Hq=32 Hkv=8 d=128 fp32 (ms per layer-step; (sdpa + meter) / sdpa):")
    for row in record["layer"]:
        ms = row["ms_per_layer_step"]
        cells = [f"{n} {v:.2f}" for n, v in ms.items()]
        ratios = [f"{k.split('_plus_')[1].split('_over')[0]} {v:.2f}x" for k, v in row.items() if k.endswith("over_sdpa")]
        lines.append(f"  {row['context']:>6}:  " + ", ".join(cells) + "  |  " + ", ".join(ratios))
    return "\n".join(lines)


def run(args, argv=None) -> dict:
    from benchmarks.machine import describe

    torch.set_num_threads(args.threads)
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": describe(args.threads),
              "command": " ".join(["python -m benchmarks.long_context", *(sys.argv[1:] if argv is None else argv)]),
              "scheme": SCHEME, "threads": args.threads,
              "setup": {"decode_model": "SmolLM2-135M-Instruct (default model, fp32; max_position_embeddings 8192: "
                                        "contexts above it run past its trained range, speed only)",
                        "prompt": "common-licenses files (sorted, no symlinks) then stdlib *.py, first `context` tokens",
                        "layer": LAYER_SHAPE | {"dtype": "float32", "keys": "N(0,1), 8 channels x4, RoPE base 1e4",
                                                "store": "CompressedLayer(IntCodes(8), keep_exact=False), as the "
                                                         "monitor builds it; one token appended per timed call"}}}
    record["decode"] = decode_part(args) if args.contexts else []
    record["layer"] = layer_part(args) if args.layer_contexts else []
    check_finite(record)
    return record


def main(argv=None) -> int:
    args = parse(argv)
    record = run(args, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(table(record))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

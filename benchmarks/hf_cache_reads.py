"""transformers' quantized cache in production: what a store holds between reads, and what its reads cost.

``python -m benchmarks.hf_cache_reads --label NAME --out FILE`` appends one JSON line: SmolLM2-135M-Instruct
(fp32, 1 torch thread) generating ``--new`` tokens after a ``--context``-token text prompt under
``witcert.monitor("hf-quanto-int4", keep_exact=False)``, with its tokens/s, the same ``generate`` without the
monitor over a stock ``QuantizedCache`` of the same configuration (tokens/s, the ratio), and ``mon.memory()``
(held, decoded copy, witness, exact cache). It uses the public API only, so the same file measures two
checkouts: run it alternately from each (interleaved, on a shared machine) and compare the medians
(``benchmarks/results/hf_cache_reads.json`` records one such comparison and its commands).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.record import write_json


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", help="what this checkout is (written with the figures)")
    p.add_argument("--summarize", type=Path, help="write the medians per label of this file's lines to --out")
    p.add_argument("--command", default="", help="with --summarize: how the lines were measured (recorded)")
    p.add_argument("--scheme", default="hf-quanto-int4")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new", type=int, default=140, help="tokens generated (past 128: one flush of the window)")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def run(args) -> dict:
    import witcert
    from benchmarks.capture import prompt_ids
    from transformers.cache_utils import QuantizedCache
    from witcert.integrations.hf.default_model import load_model
    from witcert.integrations.hf.quantized_cache import HF_CACHE_SCHEMES

    torch.set_num_threads(1)
    loaded = load_model()
    model, ids = loaded.model, prompt_ids(loaded.tokenizer, "text", args.context)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                  min_new_tokens=args.new, do_sample=False)
    spec = HF_CACHE_SCHEMES[args.scheme]
    with torch.no_grad():
        started = time.perf_counter()
        model.generate(**kwargs, past_key_values=QuantizedCache(spec.backend, model.config, nbits=spec.nbits))
        stock_s = time.perf_counter() - started
        with witcert.monitor(model, args.scheme, keep_exact=False) as mon:
            started = time.perf_counter()
            model.generate(**kwargs)
            monitored_s = time.perf_counter() - started
    total = mon.memory().total
    return dict(label=args.label, scheme=args.scheme, context=args.context, new_tokens=args.new,
                stock_tokens_per_s=args.new / stock_s, monitored_tokens_per_s=args.new / monitored_s,
                ratio_to_stock=stock_s / monitored_s, held=total.held, decoded=total.decoded,
                witness=total.witness, compressed=total.compressed, exact_cache=total.exact_cache)


def summarize(path: Path, command: str) -> dict:
    """The medians per label of the JSON lines in ``path`` (runs interleaved by whoever ran them)."""
    import datetime
    import statistics

    from benchmarks.spot_check import machine

    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    labels = {}
    for row in rows:
        labels.setdefault(row["label"], []).append(row)
    medians = {label: dict(runs=len(runs), **{key: statistics.median(r[key] for r in runs)
                                               for key in ("ratio_to_stock", "stock_tokens_per_s",
                                                           "monitored_tokens_per_s", "held", "decoded", "witness",
                                                           "compressed", "exact_cache")})
               for label, runs in labels.items()}
    first = rows[0]
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=machine(1) + " (shared with other jobs)", command=command, scheme=first["scheme"],
                context=first["context"], new_tokens=first["new_tokens"], medians=medians, runs=rows)


def main(argv=None) -> int:
    args = parse(argv)
    if args.summarize is not None:
        write_json(args.out, summarize(args.summarize, args.command))
        return 0
    if not args.label:
        raise SystemExit("--label is required to measure")
    row = run(args)
    with args.out.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())

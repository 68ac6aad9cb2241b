"""Meter transformers' own QuantizedCache (quanto, HQQ) on the default model during ``generate``.

A manual measurement, independent of the monitor: each layer of a witnessed ``QuantizedCache``
(:mod:`witcert.integrations.hf.quantized_cache`, maintained witnesses, no exact shadow) is
spied on to keep the truly exact post-RoPE keys the model wrote, and an attention function
(registered for this script only, then the stock sdpa) forms, for every decode step, layer and
query head, from the keys attention read and their maintained witnesses:

- the meter (T1/P1/MN over Theorem 2's ``c_t``, plus the fp64 score rounding, as ``observe`` does);
- the true TV against the exact keys (fp64);
- the competitor's shape ``tanh(max_t c_t)`` (RC) from the same ``c``;
- the meter from the exact witness ``witness_of(exact, read)`` (what an exact shadow would give,
  kept here by a separate ``WitnessedTensor(keep_exact=True)``), to price the maintenance.

Columns: cells, violations (true TV > meter; must be 0), witness shortfalls (per token and band,
fp64 check; must be 0), coverage at tau, median meter and median true TV, the same for the
competitor, the share of cells where the meter is below the competitor, and the median meter with
exact witnesses.

Usage: ``WITCERT_CACHE=... python scripts/hf_cache_table.py [--schemes hf-quanto-int4,hf-hqq-int4,hf-hqq-int8]
[--context 256] [--new-tokens 300] [--tasks text,code]``.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from witcert.core import bounds  # noqa: E402
from witcert.integrations.hf.attention import layout_for  # noqa: E402
from witcert.integrations.hf.default_model import load_model  # noqa: E402
from witcert.integrations.hf.quantized_cache import quantized_cache  # noqa: E402
from witcert.observatory import workloads  # noqa: E402
from witcert.tier_a.observation import score_rounding  # noqa: E402
from witcert.tier_a.maintenance import WitnessedTensor  # noqa: E402
from witcert.tier_a.witness import logit_bound  # noqa: E402

ATTN = "witcert-hf-cache-table"
_RUN: dict = {}  # the measurement in progress: witnesses, exact keys, rows


def _attention(module, query, key, value, attention_mask, **kwargs):
    """Stock sdpa; on decode steps, also one row per (query head) of the layer."""
    if query.shape[-2] == 1 and _RUN:
        _measure(module.layer_idx, query, key, module.scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _measure(layer: int, query, key, scale: float) -> None:
    witness, shadow = _RUN["witnesses"][layer], _RUN["shadows"][layer]
    assert key is witness.keys, "attention must read the witnessed keys"
    layout, exact = _RUN["layout"], _RUN["exact"][layer][0]  # (Hkv, S, d), the script's own copy
    hkv, s, d = exact.shape
    qg = query[0].double().reshape(hkv, -1, 1, d)  # (Hkv, G, 1, d)
    read64 = key[0].double()
    rounding = score_rounding(qg, read64, scale)
    scores = scale * qg @ read64[:, None].transpose(-1, -2)  # (Hkv, G, 1, S)
    c = logit_bound(qg, witness.key_witness[0][:, None, None], layout, scale) + rounding
    c_exact = logit_bound(qg, shadow.witness[0][:, None, None], layout, scale) + rounding
    exact_scores = scale * qg @ exact.double()[:, None].transpose(-1, -2)
    tv = 0.5 * (torch.softmax(exact_scores, -1) - torch.softmax(scores, -1)).abs().sum(-1)
    moments = bounds.moments(scores, c)
    rows = _RUN["rows"]
    rows["meter"] += moments.meter().flatten().tolist()
    rows["competitor"] += moments.competitor().clamp(max=1.0).flatten().tolist()
    rows["exact_meter"] += bounds.moments(scores, c_exact).meter().flatten().tolist()
    rows["tv"] += tv.flatten().tolist()
    residual = layout.band_norms(read64 - exact.double())  # (Hkv, S, B)
    _RUN["shortfalls"] += int((residual > witness.key_witness[0].double()).sum())


def run(loaded, scheme: str, prompt: str, args) -> dict:
    model, tokenizer = loaded.model, loaded.tokenizer
    layout = layout_for(model, args.bands)
    cache, witnesses = quantized_cache(scheme, model.config, layout)
    exact = [[None] for _ in witnesses]
    shadows = [WitnessedTensor(layout, keep_exact=True) for _ in witnesses]  # exact witnesses, for comparison
    for index, layer in enumerate(cache.layers):
        wrapped = layer.update

        def spy(k, v, *a, _held=exact[index], _shadow=shadows[index], _wrapped=wrapped, **kw):
            _held[0] = k[0].clone() if _held[0] is None else torch.cat([_held[0], k[0]], dim=-2)
            _shadow.append_exact(k.clone())
            keys, values = _wrapped(k, v, *a, **kw)
            _shadow.move(keys)
            return keys, values

        layer.update = spy
    _RUN.update(witnesses=witnesses, shadows=shadows, exact=exact, layout=layout, shortfalls=0,
                rows={"meter": [], "competitor": [], "exact_meter": [], "tv": []})
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        model.generate(ids, past_key_values=cache, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                       do_sample=False, pad_token_id=tokenizer.eos_token_id)
    result = dict(_RUN["rows"], shortfalls=_RUN["shortfalls"], prompt_tokens=ids.shape[-1])
    _RUN.clear()
    return result


def summarize(rows: dict, tau: float) -> dict:
    meter, tv, comp, exact = rows["meter"], rows["tv"], rows["competitor"], rows["exact_meter"]
    n = len(meter)
    return {
        "cells": n,
        "violations": sum(m < t for m, t in zip(meter, tv)),
        "shortfalls": rows["shortfalls"],
        "coverage": sum(m <= tau for m in meter) / n,
        "median meter": statistics.median(meter),
        "median TV": statistics.median(tv),
        "competitor coverage": sum(x <= tau for x in comp) / n,
        "median competitor": statistics.median(comp),
        "meter < competitor": sum(m < x for m, x in zip(meter, comp)) / n,
        "meter <= competitor": sum(m <= x for m, x in zip(meter, comp)) / n,
        "median meter (exact witness)": statistics.median(exact),
        "exact-witness violations": sum(m < t for m, t in zip(exact, tv)),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", default="hf-quanto-int4,hf-hqq-int4,hf-hqq-int8")
    parser.add_argument("--tasks", default="text,code")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=300)
    parser.add_argument("--bands", type=int, default=16)
    parser.add_argument("--tau", type=float, default=0.2)
    args = parser.parse_args(argv)
    AttentionInterface.register(ATTN, _attention)
    loaded = load_model(attn_implementation=ATTN)
    prompts = {task: workloads.text_cases(loaded.tokenizer, task, args.context, 1)[0].context for task in args.tasks.split(",")}
    for scheme in args.schemes.split(","):
        pooled: dict = {"meter": [], "competitor": [], "exact_meter": [], "tv": [], "shortfalls": 0}
        for task, prompt in prompts.items():
            start = time.time()
            rows = run(loaded, scheme, prompt, args)
            for key in pooled:
                pooled[key] += rows[key]
            print(f"{scheme} {task}: {summarize(rows, args.tau)} ({time.time() - start:.0f} s)", flush=True)
        print(f"{scheme} pooled: {summarize(pooled, args.tau)}", flush=True)


if __name__ == "__main__":
    main()

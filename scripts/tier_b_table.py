"""Tier B measurements for the closing note (dithered INT8 cache; docs/design.md "Tier B: the dithered INT8 cache").

Tables printed (and written as JSON with ``--json``):

1. bytes per token per head against the paper's figures (d = 128, Gc = 32), and capacity;
2. Kolmogorov-Smirnov p-values of the residual ``(n - xi) - x/s`` against U[-1/2, 1/2);
3. violation counts: the request-level test (R requests x every (layer, head, step, token)
   cell of a synthetic request) and the fp32-scale negative control;
4. coverage (fraction of (head, query) cells with meter <= tau = 0.2) on synthetic keys with
   and without massive-activation pairs for m in {0, 2, 4, 8, 16}, next to the deterministic
   ``tanh(max c)`` shape computed from the same cache;
5. SmolLM2-135M real activations (teacher-forced text): how much the per-token minimum
   ``min(u_t, Delta_t)`` recovers against ``u_t`` alone and the Tier A band witness.

Every Tier B number is for NON-ADAPTIVE queries (teacher forcing / fixed trajectories).
"""
import argparse
import json
import math
import sys

import torch
from scipy import stats

import witcert
from witcert import DitheredInt8, meter, tier_b_logit_bound
from witcert.tier_b.counters import StandaloneCounter
from witcert.tier_b.dither import dither_of
from witcert.tier_b.quantizer import SCALE_DIVISOR
from witcert.tier_b.packed_store import StoreLayout
from witcert.tier_b.certificate import delta_local

TAU = 0.2
DELTA_REQ = 1e-2
M_VALUES = (0, 2, 4, 8, 16)


# ----------------------------------------------------------------------------- 1. bytes

PAPER_ROWS = [  # (label, K layout kwargs, V layout kwargs or None, paper figure)
    ("K+V block-channel, m=0", dict(granularity="block-channel"), dict(granularity="block-channel"), 258),
    ("K token-group m=4 + V token-group m=0", dict(granularity="token-group", outlier_pairs=4, outlier_mode="fixed"),
     dict(granularity="token-group"), 288),
    ("K+V token-group, m=0", dict(granularity="token-group"), dict(granularity="token-group"), 272),
    ("K+V per-token scalar", dict(granularity="token"), dict(granularity="token"), 260),
    *[(f"per side token-group, m={m} (fixed set)", dict(granularity="token-group", outlier_pairs=m, outlier_mode="fixed"),
       None, 136 + 4 * m) for m in M_VALUES],
    ("K block-channel, m=4 (per-block pair indices)", dict(granularity="block-channel", outlier_pairs=4), None, 145.1),
]


def measured_bytes(kwargs: dict, head_dim: int = 128, n_tokens: int = 512) -> float:
    """Bytes per token per head of a store actually allocated (asserted against the account)."""
    quantizer = DitheredInt8(**{k: v for k, v in kwargs.items() if k != "outlier_mode"})
    x = torch.randn(2, n_tokens, head_dim, generator=torch.Generator().manual_seed(0))
    if kwargs.get("outlier_mode") == "fixed":
        quantizer = quantizer.calibrate(x[:, :32])
    store = quantizer.quantize(x, StandaloneCounter(request=0, layer=0))
    assert store.nbytes() == store.layout.expected_nbytes(2, n_tokens)
    return store.bytes_per_token_per_head()


def byte_table() -> list[dict]:
    rows = []
    for label, k_kw, v_kw, paper in PAPER_ROWS:
        analytic = StoreLayout(head_dim=128, **k_kw).bytes_per_token_per_head()
        measured = measured_bytes(k_kw)
        if v_kw is not None:
            analytic += StoreLayout(head_dim=128, **v_kw).bytes_per_token_per_head()
            measured += measured_bytes(v_kw)
        fp16 = 256 * (2 if v_kw is not None else 1)
        rows.append(dict(config=label, ours=analytic, allocated=measured, paper=paper,
                         capacity_vs_fp16=fp16 / analytic))
    return rows


# ----------------------------------------------------------------------------- 2. KS


def synthetic_keys(shape, massive_pairs=0, seed=0):
    """Gaussian keys with per-token and per-channel spread; optional massive RoPE pairs (rotate_half)."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = shape[-1]
    channel_scale = torch.exp(0.5 * torch.randn(head_dim, generator=gen))
    x = torch.randn(shape, generator=gen) * channel_scale * (0.5 + torch.rand(*shape[:-1], 1, generator=gen))
    half = head_dim // 2
    for i in range(massive_pairs):  # low-frequency pairs (high indices), sink-like constant direction
        pair = half - 1 - 3 * i
        x[..., pair] += 40.0 + 10 * i
        x[..., pair + half] -= 30.0
    return x


def ks_rows(real_keys: torch.Tensor | None) -> list[dict]:
    rows = []
    sources = [("synthetic", synthetic_keys((4, 512, 128), massive_pairs=2, seed=1))]
    if real_keys is not None:
        sources.append(("SmolLM2 keys", real_keys))
    for source, x in sources:
        for granularity, m in (("token-group", 0), ("token-group", 4), ("block-channel", 4), ("token", 0)):
            counter = StandaloneCounter(request=1, layer=0)
            store = DitheredInt8(granularity=granularity, outlier_pairs=m).quantize(x, counter)
            s = store.scale_per_element()
            live = s > 0
            ratio = x.double() / torch.where(live, s, 1.0)
            residual = (store.payload.double() - dither_of(counter, x.shape) - ratio)[live]
            ks = stats.kstest(residual.numpy(), "uniform", args=(-0.5, 1.0))
            corr = stats.pearsonr(residual.numpy(), ratio[live].numpy()).statistic
            rows.append(dict(source=source, granularity=granularity, m=m, n=int(residual.numel()),
                             ks_p=float(ks.pvalue), corr_with_input=float(corr),
                             max_abs_residual=float(residual.abs().max())))
    return rows


# ----------------------------------------------------------------------------- 3. violations


def request_violations(n_requests=200, n_layers=2, n_heads=2, n_tokens=64, n_steps=4, head_dim=64,
                       massive_pairs=0, outlier_pairs=0, delta_req=DELTA_REQ) -> list[dict]:
    """Requests with any (layer, head, step, token) cell where |eps| > c, per bound branch."""
    shape = (n_requests, n_layers, n_heads, n_tokens, head_dim)
    x = synthetic_keys(shape[1:], massive_pairs=massive_pairs, seed=9).expand(shape)
    q = synthetic_keys((n_layers, n_heads, n_steps, head_dim), seed=10)
    counter = StandaloneCounter(request=torch.arange(n_requests).view(-1, 1), layer=torch.arange(n_layers))
    quantizer = DitheredInt8(outlier_pairs=outlier_pairs)
    store = quantizer.quantize(x, counter)
    x_hat = quantizer.dequantize(store, counter).double()
    eps = (q.double() @ (x_hat - x.double()).transpose(-1, -2)) / math.sqrt(head_dim)
    loc = delta_local(delta_req, n_layers, n_heads, n_steps)
    rows = []
    for mode in ("u", "min", "delta"):
        c = tier_b_logit_bound(q.expand(n_requests, *q.shape), store, loc, mode=mode).double()
        bad = eps.abs() > c
        rows.append(dict(mode=mode, massive_pairs=massive_pairs, m=outlier_pairs, requests=n_requests,
                         cells=int(bad.numel()), bad_requests=int(bad.flatten(1).any(1).sum()),
                         bad_cells=int(bad.sum()), max_eps_over_c=float((eps.abs() / c).max()),
                         delta_req=delta_req, rule_of_three_95=3 / n_requests))
    return rows


def negative_control(n_tokens=256) -> dict:
    """The paper's bug: quantize with the fp32 scale while storing fp16 (token-group, Gc = 32)."""
    x = synthetic_keys((8, n_tokens, 128), seed=3).double()
    counter = StandaloneCounter(request=0, layer=0)
    xi = dither_of(counter, x.shape)
    amax = x.abs().view(8, n_tokens, 4, 32).amax(-1).float()
    s32 = (amax / SCALE_DIVISOR).repeat_interleave(32, -1).double()
    n = torch.round(x / s32 + xi)
    s16 = s32.half().double()
    fp32_scale_violations = int(((s16 * (n - xi) - x).abs() > s16 / 2).sum())
    store = DitheredInt8().quantize(x, counter)
    s = store.scale_per_element()
    nn = store.payload.double()
    ours = int(((x < s * (nn - xi - 0.5)) | (x > s * (nn - xi + 0.5))).sum())
    return dict(elements=int(x.numel()), fp32_scale_violations=fp32_scale_violations, fp16_scale_violations=ours)


# ----------------------------------------------------------------------------- 4. coverage


def coverage_cells(x, q, quantizer, counter, sm, delta_loc, mask=None) -> dict:
    """Per-cell meters (…, Tq) for every per-token bound choice, plus the competitor shapes."""
    store = quantizer.quantize(x, counter)
    x_hat = quantizer.dequantize(store, counter).double()
    scores = sm * (q.double() @ x_hat.transpose(-1, -2))  # compressed logits
    exact = sm * (q.double() @ x.double().transpose(-1, -2))
    if mask is not None:
        scores, exact = scores.masked_fill(~mask, -math.inf), exact.masked_fill(~mask, -math.inf)
    tv = 0.5 * (torch.softmax(exact, -1) - torch.softmax(scores, -1)).abs().sum(-1)
    bounds = {mode: tier_b_logit_bound(q, store, delta_loc, sm_scale=sm, mode=mode).double() for mode in ("u", "delta", "min")}
    out = {f"meter[{mode}]": meter(scores, c) for mode, c in bounds.items()}
    live = torch.ones_like(scores, dtype=torch.bool) if mask is None else mask
    for mode in ("delta", "min"):
        c_max = bounds[mode].masked_fill(~live, 0).amax(-1)
        out[f"tanh(max c[{mode}])"] = torch.tanh(c_max)
    out["true TV"] = tv
    out["_bounds"] = bounds
    out["_store"] = store
    return out


def synthetic_coverage(n_heads=8, n_tokens=512, n_queries=16, head_dim=128) -> list[dict]:
    rows = []
    sm = 1 / math.sqrt(head_dim)
    loc = delta_local(DELTA_REQ, 1, n_heads, n_queries)
    for massive_pairs in (0, 4):
        x = synthetic_keys((n_heads, n_tokens, head_dim), massive_pairs=massive_pairs, seed=20)
        q = 1.5 * synthetic_keys((n_heads, n_queries, head_dim), seed=21)
        for m in M_VALUES:
            quantizer = DitheredInt8(outlier_pairs=m)
            cells = coverage_cells(x, q, quantizer, StandaloneCounter(request=0, layer=0), sm, loc)
            row = dict(massive_pairs=massive_pairs, m=m, cells=int(cells["true TV"].numel()))
            for name, value in cells.items():
                if not name.startswith("_"):
                    row[f"cov {name}"] = float((value <= TAU).double().mean())
                    row[f"median {name}"] = float(value.median())
            assert (cells["true TV"] <= cells["meter[min]"]).all()
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- 5. SmolLM2


def capture_smollm2(n_tokens: int, n_queries: int):
    """Post-RoPE keys (L, Hkv, S, d) and the last ``n_queries`` queries (L, Hkv, G*Tq, d), teacher-forced."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from witcert.integrations.hf.default_model import load_model
    from witcert.observatory.workloads import natural_text

    loaded = load_model(attn_implementation="eager")
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = tokenizer(natural_text()[0], return_tensors="pt").input_ids[:, : n_tokens]
    captured = []

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        d = module.head_dim
        q = module.q_proj(hidden).view(1, -1, module.config.num_attention_heads, d).transpose(1, 2)
        k = module.k_proj(hidden).view(1, -1, module.config.num_key_value_heads, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        captured.append((q[0].detach(), k[0].detach()))

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    keys = torch.stack([k for _, k in captured])  # (L, Hkv, S, d)
    n_kv = keys.shape[1]
    queries = torch.stack([q[:, -n_queries:] for q, _ in captured])  # (L, Hq, Tq, d)
    group = queries.shape[1] // n_kv
    queries = queries.reshape(queries.shape[0], n_kv, group * n_queries, queries.shape[-1])
    positions = torch.arange(ids.shape[1] - n_queries, ids.shape[1]).repeat(group)  # (G*Tq,)
    mask = torch.arange(ids.shape[1]).view(1, -1) <= positions.view(-1, 1)  # causal (G*Tq, S)
    return keys.float(), queries.float(), mask, loaded.source


def smollm2_rows(n_tokens=512, n_queries=16) -> tuple[list[dict], torch.Tensor | None, str]:
    try:
        keys, queries, mask, source = capture_smollm2(n_tokens, n_queries)
    except Exception as err:  # model package missing: say so, measure the rest
        print(f"SmolLM2 unavailable ({err}); section 5 skipped", file=sys.stderr)
        return [], None, ""
    n_layers, n_kv, _, head_dim = keys.shape
    sm = 1 / math.sqrt(head_dim)
    loc = delta_local(DELTA_REQ, n_layers, n_kv * queries.shape[2] // n_queries, n_queries)
    layout = witcert.BandLayout(head_dim, 16, "rotate_half")
    rows = []
    for m in (0, 4):
        quantizer = DitheredInt8(outlier_pairs=m)
        counter = StandaloneCounter(request=0, layer=torch.arange(n_layers).view(-1))
        cells = coverage_cells(keys, queries, quantizer, counter, sm, loc, mask=mask)
        store = cells["_store"]
        witness = witcert.witness_of(keys, quantizer.dequantize(store, counter), layout)
        c_a = witcert.logit_bound(queries, witness, layout, sm_scale=sm).double()  # (L, H, Tq, S)
        b = cells["_bounds"]
        live = mask.expand_as(c_a)
        c_best = torch.minimum(b["min"], c_a)
        scores = sm * (queries.double() @ quantizer.dequantize(store, counter).double().transpose(-1, -2))
        scores = scores.masked_fill(~mask, -math.inf)
        meters = {"Tier A": meter(scores, c_a), "u only": cells["meter[u]"], "Delta only": cells["meter[delta]"],
                  "min(u, Delta)": cells["meter[min]"], "min(u, Delta, Tier A)": meter(scores, c_best),
                  "tanh(max Delta)": cells["tanh(max c[delta])"]}
        assert (cells["true TV"] <= meters["min(u, Delta, Tier A)"]).all()
        row = dict(m=m, cells=int(cells["true TV"].numel()), tokens=n_tokens,
                   median_u_over_tierA=float((b["u"] / c_a)[live].median()),
                   median_delta_over_tierA=float((b["delta"] / c_a)[live].median()),
                   median_min_over_tierA=float((b["min"] / c_a)[live].median()),
                   median_min_over_u=float((b["min"] / b["u"])[live].median()),
                   frac_tokens_delta_wins=float((b["delta"] < b["u"])[live].double().mean()))
        for name, value in meters.items():
            row[f"cov {name}"] = float((value <= TAU).double().mean())
            row[f"median {name}"] = float(value.median())
        rows.append(row)
    return rows, keys[:4].reshape(-1, *keys.shape[-2:]), source


# ----------------------------------------------------------------------------- output


def show(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}\n")
    if not rows:
        print("(none)")
        return
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()]
        print("| " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write every table to this JSON file")
    parser.add_argument("--no-model", action="store_true", help="skip the SmolLM2 section")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    results = {"bytes": byte_table()}
    smol, real_keys, source = ([], None, "") if args.no_model else smollm2_rows()
    results["ks"] = ks_rows(real_keys)
    results["violations"] = request_violations() + request_violations(massive_pairs=4, outlier_pairs=4)
    results["negative_control"] = [negative_control()]
    results["coverage_synthetic"] = synthetic_coverage()
    results["smollm2"] = smol
    print("Tier B (dithered INT8). Scope: non-adaptive queries; delta_req =", DELTA_REQ, "tau =", TAU)
    show("1. bytes per token per head (d = 128, Gc = 32)", results["bytes"])
    show("2. residual vs U[-1/2, 1/2): KS p-values", results["ks"])
    show("3a. request-level violations (synthetic request L=2, H=2, S=64, T=4, d=64)", results["violations"])
    show("3b. negative control: fp32 scale, fp16 store", results["negative_control"])
    show("4. coverage at tau = 0.2, synthetic keys (H=8, S=512, 16 queries, d=128)", results["coverage_synthetic"])
    show(f"5. SmolLM2 real activations ({source})", results["smollm2"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

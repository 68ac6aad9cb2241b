"""Section 3 -- certificate quality on SmolLM2 (teacher forcing, three domains).

Per (layer, query head, query) cell, for each scheme:

* the meter (``witcert.meter``: min of T1, P1, MN) and each bound alone (e-form T1, two-sided P1,
  ``tanh(D/2)`` MN, retention P1r) on the same per-token ``c``;
* the competitor (Runtime-Certified [5]): ``tanh(max_t Delta_t)``, ``Delta_t = sm sum_c |q_c| e_{t,c}``.
  For the dithered cache ``e = s/2`` exactly (``witcert.tier_b.certificate.deterministic_delta``). For a
  black-box Tier A scheme the step is not exposed, so ``e`` is the largest ``|residual|`` in the
  scheme's quantization group (token x 32 channels for RTN, 32 tokens x channel for KIVI keys,
  the element itself for raw FP8): never above ``s/2``, i.e. favourable to the competitor;
* true TV (fp64, exact keys) -- a violation is ``true TV > meter`` in any cell (must be 0);
* the value side ``pass_V`` (``witcert.core.values``) for the joint event ``pass_K and pass_V``.

Tier A schemes use the band witness (``witcert.observe``). The dithered INT8 cache (Tier B, keys
with ``m`` outlier pairs by block energy, values with ``m = 0``) reports ``c = min(u + beta, Delta)``
("min"), each branch alone, and the per-token minimum with a stored Tier A witness ("min & A",
which costs ``2B`` more bytes per token per head). ``delta_req`` in {1e-4, 1e-2, 5e-2} is spread
over (layers x query heads x queries) (Lemma 3). Tier B holds for NON-ADAPTIVE queries only
(teacher forcing here); Tier A and ``Delta`` hold for every query.
"""
import math
from collections import defaultdict

import torch

import witcert
from witcert.core import bounds
from witcert.tier_a.score_rounding import score_rounding_bound
from witcert.schemes.registry import apply_scheme
from witcert.tier_b.certificate import deterministic_delta, delta_local, tier_b_logit_bound

from benchmarks.capture import Capture

TAU_K, TAU_V = 0.2, 0.05
DELTAS = (1e-4, 1e-2, 5e-2)
HEADLINE_DELTA = 1e-2
TIER_A_SCHEMES = ("rtn-int8", "fp8-e4m3", "rtn-int4", "kivi-2bit")
OUTLIER_BUDGETS = (0, 2, 4, 8, 16)
GROUP = 32


def competitor_element_bound(scheme: str, residual: torch.Tensor) -> torch.Tensor:
    """``e >= |residual|`` per element (Hkv, S, d): the group max of |r| in the scheme's quantization group."""
    r = residual.abs()
    if scheme.startswith("rtn-"):
        return r.unflatten(-1, (-1, GROUP)).amax(-1, keepdim=True).expand(*r.shape[:-1], -1, GROUP).flatten(-2)
    if scheme == "kivi-2bit":
        s = r.shape[-2]
        full = (s // GROUP) * GROUP
        head = r[..., :full, :].unflatten(-2, (-1, GROUP))
        head = head.amax(-2, keepdim=True).expand_as(head).flatten(-3, -2)
        return torch.cat([head, r[..., full:, :]], dim=-2)
    return r  # raw casts (FP8): the element's own error


def _bounds_of(scores: torch.Tensor, c: torch.Tensor, prefix: str = "") -> dict:
    return {
        f"{prefix}meter": witcert.meter(scores, c),
        f"{prefix}eform": bounds.eform_bound(scores, c).clamp(max=1),
        f"{prefix}two_sided": bounds.two_sided_bound(scores, c).clamp(max=1),
        f"{prefix}maxnorm": bounds.maxnorm_bound(scores, c),
    }


def _competitor(delta_c: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    return torch.tanh(delta_c.masked_fill(~live, 0.0).amax(-1))


class Layer:
    """One layer of a capture, with the shapes and tensors every scheme needs."""

    def __init__(self, cap: Capture, index: int, layout: witcert.BandLayout):
        self.q, self.k, self.v = cap.q[index], cap.k[index], cap.v[index]  # (Hq,Tq,d), (Hkv,S,d)
        self.hq, self.tq, self.d = self.q.shape
        self.hkv, self.s = self.k.shape[:2]
        self.groups = self.hq // self.hkv
        self.sm = self.d**-0.5
        self.layout = layout
        self.mask = cap.mask.expand(self.hq, self.tq, self.s)
        self.index = index
        self.qg = self.q.double().reshape(self.hkv, self.groups, self.tq, self.d)

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.hq, self.tq, *x.shape[3:])

    def scores(self, k_hat: torch.Tensor) -> torch.Tensor:
        s = (self.qg @ k_hat.double()[:, None].transpose(-1, -2)) * self.sm
        return self.flat(s).masked_fill(~self.mask, -math.inf)  # (Hq, Tq, S)

    def rounding(self, k_hat: torch.Tensor) -> torch.Tensor:
        return score_rounding_bound(self.q.double(), k_hat.double(), self.sm, score_dtype=torch.float64,
                                    accumulate_dtype=torch.float64)  # (Hq, Tq, S)

    def observe(self, k_hat, v_hat):
        return witcert.observe(self.q, self.k, self.v, "rtn-int8", self.layout, sm_scale=self.sm, mask=self.mask,
                               k_hat=k_hat, v_hat=v_hat, tau_k=TAU_K, tau_v=TAU_V)


def tier_a_cells(layer: Layer, scheme: str) -> dict:
    k_hat, v_hat = apply_scheme(scheme, layer.k, "key"), apply_scheme(scheme, layer.v, "value")
    obs = layer.observe(k_hat, v_hat)
    scores = layer.scores(k_hat)
    out = _bounds_of(scores, obs.c)
    out["retention"] = bounds.retention_bound(scores, obs.c).clamp(max=1)
    e = competitor_element_bound(scheme, k_hat.double() - layer.k.double())  # (Hkv, S, d)
    delta_c = layer.flat(layer.sm * layer.qg.abs() @ e[:, None].transpose(-1, -2)) + layer.rounding(k_hat)
    out["competitor"] = _competitor(delta_c, layer.mask)
    out["meter on competitor Delta"] = witcert.meter(scores, delta_c)
    out["true_tv"], out["pass_v"] = obs.true_tv, obs.pass_v
    out["_scores"], out["_c"] = scores, obs.c
    return out


def dithered_cells(layer: Layer, m: int, request: int, n_layers: int) -> dict:
    counter_k = witcert.tier_b.counters.StandaloneCounter(request=request, layer=layer.index, side="k")
    counter_v = witcert.tier_b.counters.StandaloneCounter(request=request, layer=layer.index, side="v")
    qk = witcert.DitheredInt8(outlier_pairs=m)
    store = qk.quantize(layer.k, counter_k)
    k_hat = qk.dequantize(store, counter_k)
    qv = witcert.DitheredInt8()
    v_hat = qv.dequantize(qv.quantize(layer.v, counter_v), counter_v)
    obs = layer.observe(k_hat, v_hat)
    scores, slack = layer.scores(k_hat), layer.rounding(k_hat)

    def c_of(mode, delta_req):
        loc = delta_local(delta_req, n_layers, layer.hq, layer.tq)
        c = tier_b_logit_bound(layer.q, store, loc, sm_scale=layer.sm, mode=mode).double()  # (Hq, Tq, S)
        return (c + slack) * (1 + 2.0**-50)

    out = {"meter[A]": witcert.meter(scores, obs.c), "meter[delta]": witcert.meter(scores, c_of("delta", 0.5))}
    for delta_req in DELTAS:
        c_min = c_of("min", delta_req)
        out[f"meter[min] d={delta_req:g}"] = witcert.meter(scores, c_min)
        out[f"meter[u] d={delta_req:g}"] = witcert.meter(scores, c_of("u", delta_req))
        out[f"meter[min&A] d={delta_req:g}"] = witcert.meter(scores, torch.minimum(c_min, obs.c))
        if delta_req == HEADLINE_DELTA:
            out.update(_bounds_of(scores, c_min, prefix="[min] "))
            out["_c"] = c_min
    delta_c = deterministic_delta(layer.q, store, layer.sm)  # (Hq, Tq, S)
    out["competitor"] = _competitor(delta_c + slack, layer.mask)
    out["meter"] = out[f"meter[min] d={HEADLINE_DELTA:g}"]
    out["true_tv"], out["pass_v"] = obs.true_tv, obs.pass_v
    out["_scores"] = scores
    return out


def configs(quick: bool) -> list[str]:
    budgets = (0, 4) if quick else OUTLIER_BUDGETS
    return [*TIER_A_SCHEMES, *(f"dithered-int8 m={m}" for m in budgets)]


def measure(captures: list[Capture], quick: bool, looseness_rows: int, seed: int = 0) -> tuple[dict, dict]:
    """Per (domain, config): pooled per-cell tensors; plus sampled (scores, c, meter, tv) rows for section 4."""
    cells = defaultdict(lambda: defaultdict(list))
    samples = defaultdict(lambda: defaultdict(list))
    g = torch.Generator().manual_seed(seed)
    for request, cap in enumerate(captures):
        layout = witcert.BandLayout(cap.q.shape[-1], 16)
        for index in range(cap.n_layers):
            layer = Layer(cap, index, layout)
            for config in configs(quick):
                if config.startswith("dithered"):
                    got = dithered_cells(layer, int(config.split("=")[1]), request, cap.n_layers)
                else:
                    got = tier_a_cells(layer, config)
                for name, value in got.items():
                    if not name.startswith("_"):
                        cells[(cap.domain, config)][name].append(value.flatten().double())
                pick = torch.randperm(layer.hq * layer.tq, generator=g)[: max(1, looseness_rows // cap.n_layers)]
                bucket = samples[config]
                bucket["scores"].append(got["_scores"].flatten(0, 1)[pick])
                bucket["c"].append(got["_c"].flatten(0, 1)[pick].double())
                bucket["meter"].append(got["meter"].flatten()[pick].double())
                bucket["true_tv"].append(got["true_tv"].flatten()[pick].double())
            print(f"  quality {cap.domain} layer {index + 1}/{cap.n_layers}", end="\r", flush=True)
        print()
    pooled = {key: {n: torch.cat(v) for n, v in d.items()} for key, d in cells.items()}
    sampled = {key: {n: _cat_padded(v, n) for n, v in d.items()} for key, d in samples.items()}
    return pooled, sampled


def _cat_padded(rows: list[torch.Tensor], name: str) -> torch.Tensor:
    """Concatenate per-layer samples whose token axis differs across domains: pad masked (-inf, c = 0)."""
    if rows[0].dim() == 1:
        return torch.cat(rows)
    s = max(r.shape[-1] for r in rows)
    fill = -math.inf if name == "scores" else 0.0
    return torch.cat([torch.nn.functional.pad(r, (0, s - r.shape[-1]), value=fill) for r in rows])


def _cov(x: torch.Tensor) -> float:
    return float((x <= TAU_K).double().mean())


def summarize(pooled: dict) -> list[dict]:
    """One row per (domain, config): coverage of every bound, joint coverage, competitor, violations."""
    rows = []
    for (domain, config), t in sorted(pooled.items(), key=lambda kv: (kv[0][0], configs(False).index(kv[0][1])
                                                                       if kv[0][1] in configs(False) else 99)):
        ours, comp = _cov(t["meter"]), _cov(t["competitor"])
        fail_ours, fail_comp = 1 - ours, 1 - comp
        row = dict(domain=domain, config=config, cells=int(t["meter"].numel()), coverage_K=ours,
                   joint_coverage=float(((t["meter"] <= TAU_K) & (t["pass_v"] > 0)).double().mean()),
                   competitor_coverage=comp,
                   coverage_over_competitor=(ours / comp) if comp > 0 else math.inf,
                   page_in_reduction=(fail_comp - fail_ours) / fail_comp if fail_comp > 0 else None,
                   violations=int((t["true_tv"] > t["meter"]).sum()),
                   median_meter=float(t["meter"].median()), median_true_tv=float(t["true_tv"].median()))
        for name, value in t.items():
            if name not in ("meter", "true_tv", "pass_v", "competitor"):
                row[f"cov {name}"] = _cov(value)
        if config.startswith("dithered"):
            for d in DELTAS:
                m = t[f"meter[min] d={d:g}"]
                row[f"joint d={d:g}"] = float(((m <= TAU_K) & (t["pass_v"] > 0)).double().mean())
                row[f"violations d={d:g}"] = int((t["true_tv"] > m).sum())
        eform = t["eform"] if "eform" in t else t["[min] eform"]
        two = t["two_sided"] if "two_sided" in t else t["[min] two_sided"]
        mn = t["maxnorm"] if "maxnorm" in t else t["[min] maxnorm"]
        without_p1 = torch.minimum(eform, mn)
        row["P1 tighter (share of cells)"] = float((two < without_p1).double().mean())
        row["P1 coverage gain"] = ours - _cov(without_p1)
        rows.append(row)
    return rows

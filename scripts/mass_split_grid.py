"""Measure the threshold grid of the mass-split bound (registry MS) against today's meter.

For each row set, in fp64 (a measurement, not a certificate: no rounding enclosure), report per
meter variant the median ratio ``meter / base`` with ``base = min(1, T1, P1, tanh(D/2))``, the
coverage ``P(meter <= tau)`` (tau = 0.2) and the median ``meter / sup-box`` (the adversary's
achieved worst TV over the same box: exact for S <= 12). Variants:

* ``+CS``: ``min(base, CS)``;
* ``+CS+MS[grid]``: also the mass-split bound minimised over the grid's thresholds, first term
  ``min(T1, P1, CS, tanh(max_L c / 2))`` on ``c 1_L``;
* grids (K thresholds each, ``D = max c`` always one of them): ``rel2 K`` = ``D 2^-k``;
  ``q4 K`` = ``D 2^(-k/4)`` (both need ``D`` before the sums: a second pass); ``pow2 K`` = ``D`` and
  the powers of two ``2^(e - k)``, ``e = ceil(log2 D)``; ``pow2q K`` = the same in quarter-octaves;
  ``fp2 K`` = ``D`` and the ``K - 1`` largest floats with a 2-bit mantissa, ``(1 + r/4) 2^q``,
  strictly below ``D`` (the spec's default, ``spec.bounds.mass_split_thresholds``); ``fp3`` the same
  with 3 bits; ``all`` = every distinct radius (the best any ``{c <= g}`` can do). ``pow2``,
  ``pow2q`` and ``fp*`` are fixed grids: one pass with per-bucket sums rebased on the running max.

Row sets: ``adversarial`` (S in {4, 8, 12}, random scores and radii, mixed shapes), ``real-like``
(S = 256, a peaked ``p~`` with a sink, the largest radii on low-mass tokens) and, with ``--model``,
SmolLM2 rtn-int8 Tier A cells (six layers, every query head, three domains, 8 queries each).

The last three rows of every table are the shipped code itself (``witcert.core.bounds.moments``,
with its rounding enclosure): ``torch before`` is its enclosure without CS and MS (the meter
before issue 12, and what the Triton kernel still reports), ``torch after`` is ``witcert.meter``;
then the fast path's fused pass (``witcert.fastpath.fused.lean_cells``).
``--final-only`` skips the grid study and reports just those and the sup box.

Usage: ``PYTHONPATH=. python scripts/mass_split_grid.py [--rows N] [--model] [--cache FILE] [--final-only]``
(``--model`` needs ``WITCERT_CACHE``; ~15 min on 2 busy cores, mostly the ``all`` column).
"""
import argparse
import math
import os

import torch

TAU = 0.2


# ----------------------------------------------------------------------------- bounds (fp64)


def _parts(p, c):
    """A - 1, A-, sum p expm1(c)^2 per row (masked tokens carry p = 0)."""
    em1 = torch.expm1(c)
    a_m1 = (p * em1).sum(-1)
    a_minus = (p * torch.exp(-c)).sum(-1)
    second = (p * em1 * em1).sum(-1)
    return a_m1, a_minus, second


def base_bounds(p, c):
    """(T1, P1, MN, CS) per row for radii ``c`` (..., S)."""
    a_m1, a_minus, second = _parts(p, c)
    a = 1 + a_m1
    t1 = a_m1 * (a_m1 + 2) / 2
    p1 = (a - a_minus) * (a + a_minus) / (2 * a * a_minus)
    d = torch.where(p > 0, c, torch.zeros_like(c)).amax(-1)
    mn = torch.tanh(d / 2)
    cs = torch.sqrt(second) / (2 * a_minus)
    return t1, p1, mn, cs


def mass_split(p, c, thresholds, chunk: int = 2**22):
    """min over thresholds (rows, K) of min(T1, P1, CS, MN)(c 1_L) + 1/2 ((1 + delta)^2 - 1)."""
    step = max(1, chunk // (thresholds.shape[-1] * c.shape[-1]))
    if len(c) > step:
        return torch.cat([mass_split(p[i:i + step], c[i:i + step], thresholds[i:i + step], chunk)
                          for i in range(0, len(c), step)])
    low = c[:, None, :] <= thresholds[:, :, None]  # (R, K, S)
    c_low = torch.where(low, c[:, None, :], torch.zeros_like(c[:, None, :]))
    pk = p[:, None, :].expand_as(c_low)
    t1, p1, mn, cs = base_bounds(pk, c_low)
    first = torch.minimum(torch.minimum(t1, p1), torch.minimum(cs, mn))
    _, a_minus_low, _ = _parts(pk, c_low)
    high = (pk * torch.expm1(c[:, None, :]) * (~low)).sum(-1)
    delta = high / a_minus_low
    return (first + delta * (delta + 2) / 2).amin(-1)


def grid(kind: str, k: int, c: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    d = torch.where(p > 0, c, torch.zeros_like(c)).amax(-1, keepdim=True)  # (R, 1)
    if kind == "rel2":
        return d * 2.0 ** -torch.arange(k, dtype=c.dtype)
    if kind == "q4":
        return d * 2.0 ** (-torch.arange(k, dtype=c.dtype) / 4)
    if kind == "pow2":
        e = torch.ceil(torch.log2(d.clamp(min=1e-300)))
        return torch.cat([d, 2.0 ** (e - torch.arange(1, k, dtype=c.dtype))], -1)
    if kind == "pow2q":  # quarter-octaves below D's quarter-binade
        e = torch.ceil(4 * torch.log2(d.clamp(min=1e-300)))
        return torch.cat([d, 2.0 ** ((e - torch.arange(1, k, dtype=c.dtype)) / 4)], -1)
    if kind.startswith("fp"):  # floats with b mantissa bits strictly below D (b = 2: steps 1, 1.25, 1.5, 1.75)
        bits = int(kind[2:])
        return torch.cat([d, fp_grid(d, k - 1, bits)], -1)
    raise ValueError(kind)


def fp_grid(d: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The ``count`` largest floats with ``bits`` mantissa bits below ``d`` (R, 1) -> (R, count)."""
    steps = 2**bits
    q = torch.floor(torch.log2(d.clamp(min=1e-300)))
    r = torch.ceil((d / 2.0**q - 1) * steps)  # d <= (1 + r/steps) 2^q
    n = steps * q + r  # index of the least grid value >= d
    m = n - torch.arange(1, count + 1, dtype=d.dtype)
    return (1 + torch.remainder(m, steps) / steps) * 2.0 ** torch.floor(m / steps)


def mass_split_all(p, c):
    """MS minimised over every distinct radius as threshold (the best any ``{c <= g}`` can do)."""
    out = torch.empty(len(c), dtype=c.dtype)
    for i in range(len(c)):
        live = p[i] > 0
        out[i] = mass_split(p[i:i + 1], c[i:i + 1], torch.unique(c[i][live])[None])
    return out


# ----------------------------------------------------------------------------- row sets


def adversarial(n: int, g: torch.Generator):
    rows = []
    for i in range(n):
        s = (4, 8, 12)[i % 3]
        temp = float(torch.empty(1).uniform_(0.5, 6.0, generator=g))
        scores = torch.randn(s, generator=g, dtype=torch.float64) * temp
        base = 10 ** float(torch.empty(1).uniform_(-3, 0, generator=g))
        shape = i % 4
        if shape == 0:  # uniform c
            c = torch.full((s,), base, dtype=torch.float64)
        elif shape == 1:  # log-normal spread
            c = base * torch.exp(torch.randn(s, generator=g, dtype=torch.float64))
        elif shape == 2:  # large c on the lowest-mass tokens
            order = torch.argsort(scores)
            c = torch.full((s,), base, dtype=torch.float64)
            c[order[: max(1, s // 4)]] *= 10
        else:  # uniform random in [0, 2 base]
            c = 2 * base * torch.rand(s, generator=g, dtype=torch.float64)
        rows.append((scores, c))
    return rows


def real_like(n: int, g: torch.Generator, s: int = 256):
    """Peaked p~ (a sink plus a few strong tokens), radii growing on low-mass tokens."""
    rows = []
    for _ in range(n):
        scores = torch.randn(s, generator=g, dtype=torch.float64) * 1.5
        scores[0] += float(torch.empty(1).uniform_(4, 9, generator=g))  # attention sink
        strong = torch.randint(1, s, (4,), generator=g)
        scores[strong] += 3.0
        base = 10 ** float(torch.empty(1).uniform_(-2.5, -0.7, generator=g))
        rank = torch.argsort(torch.argsort(scores)).double() / (s - 1)  # 0 = lowest score
        c = base * torch.exp(0.4 * torch.randn(s, generator=g, dtype=torch.float64)) * (1 + 2 * (1 - rank))
        outliers = torch.rand(s, generator=g) < 0.02
        c[outliers] *= 8
        rows.append((scores, c))
    return rows


def smollm2_rtn_int8():
    """SmolLM2 rtn-int8 Tier A cells: 6 layers x 9 heads x 8 queries x 3 domains (scores, c)."""
    os.environ.setdefault("WITCERT_CACHE", "/work/models-cache")
    from benchmarks import capture, quality

    loaded = capture.load()
    rows = []
    for domain in capture.DOMAINS:
        cap = capture.capture(loaded, domain, 512, 8)
        layers = list(range(0, cap.n_layers, max(1, cap.n_layers // 6)))[:6]
        import witcert

        layout = witcert.BandLayout(cap.q.shape[-1], 16)
        for index in layers:
            layer = quality.Layer(cap, index, layout)
            got = quality.tier_a_cells(layer, "rtn-int8")
            scores, c = got["_scores"].flatten(0, 1), got["_c"].flatten(0, 1).double()
            rows += list(zip(scores.double(), c))
        print(f"  captured {domain}", flush=True)
    return rows


# ----------------------------------------------------------------------------- report


def _pad(rows):
    s = max(len(r[0]) for r in rows)
    scores = torch.full((len(rows), s), -math.inf, dtype=torch.float64)
    c = torch.zeros((len(rows), s), dtype=torch.float64)
    for i, (sc, cc) in enumerate(rows):
        scores[i, : len(sc)], c[i, : len(cc)] = sc, cc
    return scores, torch.where(scores > -math.inf, c, torch.zeros_like(c))


def shipped_meters(scores, c) -> dict:
    """The torch meter as shipped, before (enclosure without CS, MS) and after issue 12, fp64."""
    from witcert.core import bounds
    from witcert.core.metering import meter
    from witcert.fastpath.fused import lean_cells

    m = bounds.moments(scores, c)
    before = bounds.Enclosure(m.k_hi, m.j_hi, m.a_minus_lo, m.max_c).meter()
    return {"torch before: min(1, T1, P1, MN)": before, "torch after: witcert.meter (+CS+MS)": meter(scores, c),
            "fast path: lean_cells (+CS+MS on 4 sets)": lean_cells(scores, c).meter}


def evaluate(name: str, rows, variants) -> list[str]:
    from witcert.verification import adversary

    scores, c = _pad(rows)
    p = torch.softmax(scores, -1)
    t1, p1, mn, cs = base_bounds(p, c)
    base = torch.minimum(torch.minimum(t1, p1), mn).clamp(max=1)
    sup = adversary.sup_box_tv(scores, c).tv
    meters = {"base: min(1, T1, P1, MN)": base, "+CS": torch.minimum(base, cs)}
    for kind, k in variants:
        ms = mass_split_all(p, c) if kind == "all" else mass_split(p, c, grid(kind, k, c, p))
        meters[f"+CS+MS[{kind} {k}]" if kind != "all" else "+CS+MS[all]"] = torch.minimum(meters["+CS"], ms)
    meters.update(shipped_meters(scores, c))
    live = sup > 0
    out = [f"\n### {name} ({len(rows)} rows, S <= {scores.shape[-1]})\n",
           "| meter | median meter/base | coverage@0.2 | median meter/sup-box | rows below sup-box |",
           "| --- | --- | --- | --- | --- |"]
    for label, m in meters.items():
        ratio = (m[base > 0] / base[base > 0]).median()
        shape = (m[live] / sup[live]).median()
        below = int((m < sup * (1 - 1e-9)).sum())
        out.append(f"| {label} | {ratio:.3f} | {(m <= TAU).double().mean():.3f} | {shape:.3f} | {below} |")
    out.append(f"| sup-box itself | — | {(sup <= TAU).double().mean():.3f} | 1 | — |")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=600, help="rows per synthetic set")
    ap.add_argument("--model", action="store_true", help="also measure SmolLM2 rtn-int8 cells")
    ap.add_argument("--cache", default=None, help="file to keep the captured SmolLM2 rows in (torch.save)")
    ap.add_argument("--final-only", action="store_true", help="only the shipped meter before/after (no grid study)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    variants = [("rel2", 4), ("pow2", 4), ("pow2", 8), ("q4", 8), ("q4", 12), ("pow2q", 12),
                ("fp2", 2), ("fp2", 4), ("fp2", 6), ("fp2", 8), ("fp2", 12), ("fp2", 16), ("fp3", 24), ("all", 0)]
    if args.final_only:
        variants = [("fp2", 12)]
    lines = evaluate("adversarial", adversarial(args.rows, g), variants)
    lines += evaluate("real-like", real_like(args.rows, g), variants)
    if args.model:
        if args.cache and os.path.exists(args.cache):
            rows = torch.load(args.cache)
        else:
            rows = smollm2_rtn_int8()
            if args.cache:
                torch.save(rows, args.cache)
        lines += evaluate("SmolLM2 rtn-int8 (Tier A)", rows, variants)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

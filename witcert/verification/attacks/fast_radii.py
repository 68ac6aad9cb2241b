"""Attack class ``fast radii``: the fast path's fp32 per-token bounds against their exact values.

:func:`~witcert.fastpath.radius.fast_logit_bound` (Tier A, T2) and
:func:`~witcert.fastpath.tier_b_radius.fast_tier_b_logit_bound` (Tier B, TB/DB) replace fp64 directed
rounding by an a-priori fp32 budget, with lifted floors against underflow and a per-row ``inf`` against
overflow. Attacked where that budget could break: query entries from ``1e-38`` to ``1e30`` (fp64
queries beyond fp32 included), softmax scales down to ``2^-140``, fp16-subnormal witness entries and
scales, all-zero key groups (scale 0, ``c = 0`` exactly), token-group and token layouts, both Tier B
modes. Per token, the reported ``c`` against the 40-digit spec of the same stored data
(``witcert.spec.bands.bound_band_witness``, ``witcert.spec.dither.logit_bound``); ``NaN`` is a violation.
Per row also the cell meter of :func:`~witcert.fastpath.fused.tier_a_cells` and
:func:`~witcert.fastpath.fused.tier_b_cells` (the bound's kernel, then the pass) against the 50-digit
meter at those exact radii, MS on the pass's own low sets. Eager by default; the compiled band dot,
Tier A pass, the Tier B kernel and the meter pass when ``WITCERT_COMPILE=1``.
"""
import math

import torch
from mpmath import mp, mpf

from witcert.fastpath.budgeted_pass import split_low_sets
from witcert.fastpath.fused import tier_a_cells, tier_b_cells
from witcert.fastpath.radius import fast_logit_bound
from witcert.fastpath.tier_b_radius import fast_tier_b_logit_bound
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness import witness_of
from witcert.tier_b.counters import StandaloneCounter
from witcert.tier_b.quantizer import DitheredInt8
from witcert.verification.attacks import AttackTally

NAME = "fast radii"
SHARE = 0.002  # one trial: 2 queries x 6 tokens of 40-digit spec per tier (~30 ms): 1,000 trials at --trials 500000
_DPS = 40
_MAGNITUDES = (1e-38, 1e-20, 1.0, 1e4, 1e19, 1e30)
_SCALES = (None, 1.0, 2.0**-140, 30.0)
_TOKENS, _QUERIES, _DIM = 6, 2, 32


def _pick(options, g: torch.Generator):
    return options[int(torch.randint(len(options), (1,), generator=g))]


def _vectors(shape, g: torch.Generator) -> torch.Tensor:
    """fp64 entries of random sign and magnitude; some exact zeros."""
    x = torch.randn(shape, generator=g, dtype=torch.float64) * _pick(_MAGNITUDES, g)
    return x.masked_fill(torch.rand(shape, generator=g) < 0.15, 0.0)


def _keys(g: torch.Generator) -> torch.Tensor:
    keys = torch.randn(1, _TOKENS, _DIM, generator=g) * _pick((1.0, 1e-6, 300.0), g)
    keys[0, int(torch.randint(_TOKENS, (1,), generator=g))] = 0.0  # every scale 0
    keys[0, int(torch.randint(_TOKENS, (1,), generator=g)), :8] = 0.0  # one zero group of 8
    return keys


def _judge(tally: AttackTally, label: str, exact, reported: float) -> None:
    tally.cells += 1
    bad = math.isnan(reported) or mpf(reported) < exact
    if bad:
        tally.violations += 1
        if len(tally.notes) < 5:
            tally.notes.append(f"{label}: {reported!r} < exact {mp.nstr(exact, 8)}")
    elif 0 < reported < math.inf and exact < mp.inf:
        ratio = float(exact / mpf(reported))
        tally.worst_ratio = ratio if math.isnan(tally.worst_ratio) else max(tally.worst_ratio, ratio)


def _tier_a(tally: AttackTally, g: torch.Generator) -> None:
    from witcert.spec import bands as spec
    from witcert.spec import golden

    layout = BandLayout(_DIM, _pick((2, 4, 16), g), _pick(("rotate_half", "interleaved"), g))
    keys = _keys(g).double()
    witness = witness_of(keys, keys + _vectors(keys.shape, g) * 1e-3, layout)  # fp16, subnormals too
    q = _vectors((1, _QUERIES, _DIM), g).to(_pick((torch.float32, torch.float64), g))
    sm = _pick(_SCALES, g)
    c = fast_logit_bound(q[:, :, None], witness[:, None], layout, sm)  # 2 query heads on one kv head: (1, 2, 1, S)
    scores = (torch.randn(1, _QUERIES, 1, _TOKENS, generator=g, dtype=torch.float64) * _pick((0.1, 3.0, 40.0), g)).to(q.dtype)
    cells = tier_a_cells(scores, q[:, :, None], witness[:, None], layout, sm)  # the radius inside the pass
    with mp.workdps(_DPS):
        for i in range(_QUERIES):
            exact = [spec.bound_band_witness(q[0, i].double().tolist(), witness[0, t].tolist(), layout.bands,
                                             layout.rope, sm) for t in range(_TOKENS)]
            label = f"tier A |q|~{q[0, i].abs().max().item():.1e} sm={sm}"
            for t in range(_TOKENS):
                _judge(tally, label, exact[t], float(c[0, i, 0, t]))
            with mp.workdps(50):  # MS on the sets the pass splits at (its fp32 radius decides them)
                meter = golden.meter_on_sets_from_scores(scores[0, i, 0].double().tolist(),
                                                         [mp.inf if mp.isnan(x) else x for x in exact],  # 0 * inf: trivial
                                                         split_low_sets(scores[0, i, 0], c[0, i, 0]).tolist())
            _judge(tally, f"{label} cell meter", meter, float(cells.meter[0, i, 0]))


def _tier_b(tally: AttackTally, g: torch.Generator) -> None:
    from witcert.spec import dither as spec

    config = _pick((dict(group=8), dict(group=16), dict(group=32), dict(granularity="token")), g)
    store = DitheredInt8(**config).quantize(_keys(g), StandaloneCounter(request=0, layer=0))
    q = _vectors((1, _QUERIES, _DIM), g).to(_pick((torch.float32, torch.float64), g))
    sm, mode = _pick(_SCALES, g), _pick(("min", "delta"), g)
    from witcert.spec import golden

    c = fast_tier_b_logit_bound(q, store, 1e-6, sm, mode)
    scores = (torch.randn(1, _QUERIES, _TOKENS, generator=g, dtype=torch.float64) * _pick((0.1, 3.0, 40.0), g)).to(q.dtype)
    cells = tier_b_cells(scores, q, store, 1e-6, sm, mode)  # the bound inside the pass
    sets = split_low_sets(scores, c)
    sm_value = _DIM**-0.5 if sm is None else sm
    with mp.workdps(_DPS):
        for i in range(_QUERIES):
            label = f"tier B {mode} {config} |q|~{q[0, i].abs().max().item():.1e} sm={sm}"
            exact = [spec.logit_bound(q[0, i].double().tolist(), store.scale_per_element()[0, t].tolist(),
                                      sm_value, store.n_tokens, 1e-6, mode=mode) for t in range(_TOKENS)]
            for t in range(_TOKENS):
                _judge(tally, label, exact[t], float(c[0, i, t]))
            with mp.workdps(50):  # MS on the sets the pass splits at
                meter = golden.meter_on_sets_from_scores(scores[0, i].double().tolist(), exact, sets[0, i].tolist())
            _judge(tally, f"{label} cell meter", meter, float(cells.meter[0, i]))


def run(n: int, g: torch.Generator) -> AttackTally:
    """``n`` trials, each one Tier A and one Tier B problem (``2 x 6`` tokens each)."""
    tally = AttackTally(NAME)
    for _ in range(n):
        _tier_a(tally, g)
        _tier_b(tally, g)
    return tally

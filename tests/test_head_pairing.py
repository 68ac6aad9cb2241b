"""Shape safety of the per-token bounds: query heads against kv heads, named by position, never broadcast.

Implementations: ``witcert.logit_bound`` (T2) and ``witcert.tier_b_logit_bound`` (TB/DB), with
``q`` (..., Hq, Tq, d) against ``w`` (..., Hkv, S, B) / a packed store (..., Hkv, S, d).
Oracles: one head at a time (the bound of query head ``h`` against kv head ``h // G``, computed
alone), and the fp64 true TV per cell. Domain: random keys with per-head residual scales that
differ by 100x (a wrong pairing shows). Tolerance: none.
"""
import pytest
import torch

import witcert
from witcert.tier_b.counters import StandaloneCounter

LAYOUT = witcert.BandLayout(32, 8)
SCALE = 32**-0.5


def _heads(h: int, s: int, seed: int):
    """Keys (H, S, d) and reconstructions whose residual grows 10x per head."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(h, s, 32, generator=g, dtype=torch.float64)
    noise = torch.randn(h, s, 32, generator=g, dtype=torch.float64)
    k_hat = k + noise * (10.0 ** torch.arange(h, dtype=torch.float64) * 1e-3)[:, None, None]
    return k, k_hat


def _true_tv(q, k, k_hat, groups=1):
    k, k_hat = (x.repeat_interleave(groups, dim=-3) for x in (k, k_hat))
    exact = torch.softmax((q @ k.transpose(-1, -2)) * SCALE, -1)
    approx = torch.softmax((q @ k_hat.transpose(-1, -2)) * SCALE, -1)
    return 0.5 * (exact - approx).abs().sum(-1), (q @ k_hat.transpose(-1, -2)) * SCALE


def test_reviewer_pairing_is_paired_head_by_head():
    """q (H, Tq, d) with w (H, S, B) and Tq == H: the bound used to broadcast w's head axis against
    q's query axis (query i of every head read head i's witness); the meter came out below the
    true TV on some cells (3 of 16 in the report, e.g. 0.2752 vs 0.3957). Now head h reads head
    h's witness, and every cell's meter is >= its true TV."""
    heads = tq = 4
    k, k_hat = _heads(heads, 24, seed=0)
    q = torch.randn(heads, tq, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    w = witcert.witness_of(k, k_hat, LAYOUT)  # (H, S, B)
    c = witcert.logit_bound(q, w, LAYOUT, SCALE)  # (H, Tq, S)
    assert c.shape == (heads, tq, 24)
    tv, scores = _true_tv(q, k, k_hat)
    meter = witcert.meter(scores, c)
    assert (tv <= meter).all(), f"{int((tv > meter).sum())} cells below the true TV, e.g. {meter[tv > meter][:2]} < {tv[tv > meter][:2]}"
    for h in range(heads):
        alone = witcert.logit_bound(q[h][None], w[h][None], LAYOUT, SCALE)[0]
        assert torch.equal(c[h], alone)


@pytest.mark.parametrize("q_shape, w_shape, match", [
    ((4, 32), (4, 24, 8), "explicit query-head and query axes"),  # (H, d): where is the query axis?
    ((2, 2, 3, 32), (2, 1, 1, 24, 8), "same leading dims"),  # the old GQA recipe w[:, None, None]
    ((3, 4, 32), (1, 3, 24, 8), "same leading dims"),
    ((3, 4, 32), (2, 24, 8), "multiple of kv heads"),
    ((2, 3, 4, 32), (3, 2, 24, 8), "same leading dims"),
])
def test_ambiguous_shapes_are_rejected(q_shape, w_shape, match):
    with pytest.raises(ValueError, match=match):
        witcert.logit_bound(torch.zeros(q_shape), torch.zeros(w_shape), LAYOUT)


@pytest.mark.parametrize("hkv, groups", [(1, 3), (2, 2), (3, 1)])
def test_gqa_is_done_inside_both_tiers(hkv, groups):
    """Query head h reads kv head h // G (HF ``repeat_kv`` order): the batched bound equals the
    bound of each query head against its kv head alone, for Tier A and Tier B."""
    k, k_hat = _heads(hkv, 40, seed=2)
    q = torch.randn(2, hkv * groups, 3, 32, generator=torch.Generator().manual_seed(3))  # (batch, Hq, Tq, d)
    w = witcert.witness_of(k, k_hat, LAYOUT)[None].expand(2, -1, -1, -1)  # (batch, Hkv, S, B)
    keys = k.float()[None].expand(2, -1, -1, -1).contiguous()
    store = witcert.DitheredInt8().quantize(keys, StandaloneCounter(request=0, layer=0, seed=5))
    c_a = witcert.logit_bound(q, w, LAYOUT)
    c_b = witcert.tier_b_logit_bound(q, store, 1e-4)
    assert c_a.shape == c_b.shape == (2, hkv * groups, 3, 40)
    for h in range(hkv * groups):
        kv = h // groups
        alone_a = witcert.logit_bound(q[:, h:h + 1], w[:, kv:kv + 1], LAYOUT)
        one_head = witcert.DitheredInt8().quantize(keys[:, kv:kv + 1], StandaloneCounter(request=0, layer=0, seed=5,
                                                                                         kv_head_offset=kv))
        alone_b = witcert.tier_b_logit_bound(q[:, h:h + 1], one_head, 1e-4)
        assert torch.equal(c_a[:, h:h + 1], alone_a) and torch.equal(c_b[:, h:h + 1], alone_b)
    with pytest.raises(ValueError, match="explicit query-head and query axes"):
        witcert.tier_b_logit_bound(q[0, 0], store, 1e-4)
    if hkv > 1:
        with pytest.raises(ValueError, match="multiple of kv heads"):
            witcert.tier_b_logit_bound(q[:, :1].expand(2, hkv + 1, 3, 32), store, 1e-4)

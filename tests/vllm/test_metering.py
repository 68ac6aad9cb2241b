"""The plugin's decode meter against an fp64 oracle, per query (no vLLM needed).

Implementation: ``witcert.integrations.vllm.metering.meter_decode`` (Tier A: ``T2`` + meter).
Oracle: the true TV between softmax over exact keys and over stored keys, in fp64, per
(row, query head). Domain: SmolLM2-like heads (d = 64, 9 query heads on 3 kv heads), keys cast
to fp8 e4m3 / e5m2 by rounding to nearest and by truncation toward zero (the two casts vLLM's
CPU kernels use), ragged lengths, large-norm queries. Tolerance: none (meter >= true TV).
"""
import math

import pytest
import torch

import witcert
from witcert.integrations.vllm.metering import meter_decode, score_slack

LAYOUT = witcert.BandLayout(64, 16)
SCALE = 64**-0.5


def _truncate_fp8(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """Round toward zero into ``fmt`` (the CPU kernel's cast), saturating at the format's max."""
    top = torch.finfo(fmt).max
    x = x.clamp(-top, top)
    near = x.to(fmt).to(x.dtype)
    over = near.abs() > x.abs()  # rounded away from zero: step one code toward zero
    codes = x.to(fmt).view(torch.uint8)
    down = (codes.to(torch.int16) - 1).clamp(min=0).to(torch.uint8).view(fmt).to(x.dtype)
    return torch.where(over & (near != 0), down, near)


def _batch(rows, lengths, fmt, cast, g, q_scale=1.0):
    s = max(lengths)
    q = torch.randn(rows, 9, 64, generator=g) * q_scale
    k = torch.randn(rows, 3, s, 64, generator=g) * 2
    k[..., 5] *= 20  # a massive channel, as real keys have
    k_hat = (cast(k, fmt) if cast else k.to(fmt).to(torch.float32)).to(torch.float64)
    for r, n in enumerate(lengths):
        k[r, :, n:] = 0
        k_hat[r, :, n:] = 0
    w = witcert.witness_of(k, k_hat, LAYOUT)
    return q, k, k_hat, w, torch.tensor(lengths)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("cast", [None, _truncate_fp8], ids=["nearest", "toward-zero"])
@pytest.mark.parametrize("q_scale", [1.0, 8.0])
def test_meter_bounds_true_tv_per_cell(fmt, cast, q_scale):
    g = torch.Generator().manual_seed(7)
    q, k, k_hat, w, lengths = _batch(4, [1, 17, 40, 129], fmt, cast, g, q_scale)
    cells = meter_decode(q, k_hat, w, lengths, LAYOUT, SCALE, k_exact=k, with_risk=True)
    for r, n in enumerate(lengths.tolist()):  # independent oracle, row by row, no padding
        qg = q[r].double().view(3, 3, 64)
        exact = torch.softmax(SCALE * qg @ k[r, :, :n].double().transpose(-1, -2), -1)
        comp = torch.softmax(SCALE * qg @ k_hat[r, :, :n].transpose(-1, -2), -1)
        tv = 0.5 * (exact - comp).abs().sum(-1).reshape(9)
        assert (cells.meter[r] >= tv).all(), (r, (tv - cells.meter[r]).max())
        torch.testing.assert_close(cells.true_tv[r], tv, rtol=1e-12, atol=1e-15)
    assert (cells.true_tv > 0).any()  # the casts are lossy: the check is not vacuous
    assert (cells.risk >= 0).all()


def test_lossless_cache_meters_only_rounding_slack():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 9, 64, generator=g)
    k = torch.randn(2, 3, 10, 64, generator=g)
    w = witcert.witness_of(k, k, LAYOUT)
    cells = meter_decode(q, k.double(), w, torch.tensor([10, 10]), LAYOUT, SCALE, k_exact=k)
    assert (w == 0).all()
    assert (cells.true_tv == 0).all()
    assert (cells.meter < 1e-12).all()


def test_gqa_query_heads_read_their_kv_head():
    # only kv head 1 is compressed: exactly query heads 3, 4, 5 (h // G == 1) see a nonzero bound
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 9, 64, generator=g)
    k = torch.randn(1, 3, 12, 64, generator=g)
    k_hat = k.clone().double()
    k_hat[0, 1] += 0.05
    w = witcert.witness_of(k, k_hat, LAYOUT)
    cells = meter_decode(q, k_hat, w, torch.tensor([12]), LAYOUT, SCALE, k_exact=k)
    lossy = cells.meter[0] > 1e-9
    assert lossy.tolist() == [False] * 3 + [True] * 3 + [False] * 3
    assert (cells.meter[0] >= cells.true_tv[0]).all()


def test_padding_is_masked():
    # a row padded with garbage keys beyond its length meters as the unpadded row
    g = torch.Generator().manual_seed(3)
    q, k, k_hat, w, _ = _batch(1, [20], torch.float8_e4m3fn, None, g)
    short = meter_decode(q, k_hat[:, :, :8], w[:, :, :8], torch.tensor([8]), LAYOUT, SCALE, k_exact=k[:, :, :8])
    k_hat[:, :, 8:] += 100
    long = meter_decode(q, k_hat, w, torch.tensor([8]), LAYOUT, SCALE, k_exact=k)
    # equal up to the summation order of a longer matmul (a few ulps), and still a bound
    torch.testing.assert_close(long.meter, short.meter, rtol=1e-12, atol=0)
    torch.testing.assert_close(long.true_tv, short.true_tv, rtol=1e-12, atol=1e-16)
    assert (long.meter >= long.true_tv).all()


def test_score_slack_covers_fp64_rounding():
    # oracle: exact rational dot products (fractions) of fp64 inputs
    from fractions import Fraction

    g = torch.Generator().manual_seed(4)
    qg = (torch.randn(1, 1, 1, 1, 64, generator=g, dtype=torch.float64) * 1e3)
    k_hat = torch.randn(1, 1, 5, 64, generator=g, dtype=torch.float64) * 1e-3
    scores = SCALE * qg @ k_hat[:, :, None].transpose(-1, -2)
    slack = score_slack(qg, k_hat, SCALE)
    for t in range(5):
        exact = Fraction(SCALE) * sum(Fraction(a) * Fraction(b) for a, b in zip(qg.flatten().tolist(),
                                                                               k_hat[0, 0, t].tolist()))
        err = abs(Fraction(scores.flatten()[t].item()) - exact)
        assert err <= Fraction(slack.flatten()[t].item())
    assert math.isfinite(float(slack.max()))


def _dithered_rows(rows, s, dtype, g):
    """Keys (R, 3, S, 64) with a massive channel, stored by the plugin's dithered-int8 path."""
    from witcert.integrations.vllm import schemes
    from witcert.integrations.vllm.metering import TierBKeys

    k = torch.randn(rows, 3, s, 64, generator=g) * 2
    k[..., 5] *= 20
    k = k.to(dtype)
    k_hat, codes, scales = torch.empty_like(k), [], []
    for r in range(rows):
        out = schemes.compress("dithered-int8", k[r], k[r], layer=3, slots=torch.arange(s) + 1000 * r,
                               kv_head_offset=0, seed=12345)
        k_hat[r] = out.k
        codes.append(out.codes)
        scales.append(out.scales)
    tier_b = TierBKeys(codes=torch.stack(codes), scales=torch.stack(scales),
                       valid=torch.ones(rows, 3, s, dtype=torch.bool), key_dtype=dtype)
    return k, k_hat, tier_b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query", ["dense", "one-channel"])
def test_tier_b_deterministic_branch_lowers_c_and_stays_sound(dtype, query):
    # DB (valid for every query) enters the per-token minimum; oracle: fp64 true TV per cell
    from witcert.integrations.vllm.metering import decode_terms

    g = torch.Generator().manual_seed(11)
    k, k_hat, tier_b = _dithered_rows(3, 40, dtype, g)
    q = torch.randn(3, 9, 64, generator=g) * 4
    if query == "one-channel":  # aligned with a single channel: where Delta beats the band norm
        q = torch.zeros(3, 9, 64)
        q[..., 7] = 30.0
    lengths = torch.tensor([40, 23, 1])
    w = witcert.witness_of(k, k_hat, LAYOUT)
    _, c_a = decode_terms(q, k_hat.double(), w, lengths, LAYOUT, SCALE)
    _, c_ab = decode_terms(q, k_hat.double(), w, lengths, LAYOUT, SCALE, tier_b)
    assert (c_ab <= c_a).all()
    if query == "one-channel":
        assert (c_ab < c_a).any()  # not vacuous: the minimum takes DB on some tokens (measured: 16%)
    cells = meter_decode(q, k_hat.double(), w, lengths, LAYOUT, SCALE, k_exact=k, tier_b=tier_b)
    assert (cells.meter >= cells.true_tv).all()
    assert (cells.true_tv > 0).any()
    if dtype == torch.float32:  # the elementwise premise of DB: |k^ - k| <= s/2 (+ the fp32 chain's rounding)
        s = tier_b.scales.double().repeat_interleave(32, dim=-1)
        assert ((k_hat.double() - k.double()).abs() <= s / 2 + 2**-23 * k_hat.double().abs()).all()


def test_tier_b_is_ignored_where_not_valid():
    from witcert.integrations.vllm.metering import decode_terms

    g = torch.Generator().manual_seed(12)
    k, k_hat, tier_b = _dithered_rows(1, 16, torch.float32, g)
    q = torch.zeros(1, 9, 64)
    q[..., 7] = 30.0
    w = witcert.witness_of(k, k_hat, LAYOUT)
    invalid = type(tier_b)(codes=tier_b.codes, scales=tier_b.scales, valid=torch.zeros_like(tier_b.valid),
                           key_dtype=tier_b.key_dtype)
    _, c_a = decode_terms(q, k_hat.double(), w, torch.tensor([16]), LAYOUT, SCALE)
    _, c_invalid = decode_terms(q, k_hat.double(), w, torch.tensor([16]), LAYOUT, SCALE, invalid)
    assert torch.equal(c_a, c_invalid)

"""Dithered INT8 quantizer and packed store (Tier B, registry "L2", "TB").

Implementation: ``witcert.DitheredInt8`` / ``witcert.tier_b.packed_store.PackedStore``. Oracles: the exact
interval check ``s (n - xi - 1/2) <= x <= s (n - xi + 1/2)`` (both ends exact in fp64), a
Kolmogorov-Smirnov test against U[-1/2, 1/2), the analytic byte formulas and the paper's byte
figures. Domain: fp16/bf16/fp32 inputs including adversarial ones (exact amax, ties at .5,
subnormal and huge scales, all-zero groups). Tolerance: zero violations.
"""
from dataclasses import replace

import pytest
import torch
from scipy import stats

from witcert import DitheredInt8
from witcert.tier_b.packed_store import PackedStore
from witcert.tier_b.counters import PagedCounter, StandaloneCounter
from witcert.tier_b.dither import dither_of
from witcert.tier_b.quantizer import SCALE_DIVISOR
from witcert.tier_b.packed_store import StoreLayout

CONFIGS = [
    dict(granularity="token-group"),
    dict(granularity="token-group", group=16, outlier_pairs=2),
    dict(granularity="block-channel", block=32, outlier_pairs=4),
    dict(granularity="token", outlier_pairs=1, rope="interleaved"),
]
COUNTER = StandaloneCounter(request=3, layer=1, seed=12345)


# ------------------------------------------------------------------ oracle machinery


def codes_and_dither(quantizer, store, counter):
    """(n, xi, s) per element in fp64."""
    return store.payload.double(), dither_of(counter, store.shape), store.scale_per_element()


def exact_half_scale_violations(x, quantizer, store, counter):
    """Non-outlier elements with ``|s (n - xi) - x| > s/2``, decided exactly in fp64."""
    n, xi, s = codes_and_dither(quantizer, store, counter)
    x64 = x.double()
    outside = (x64 < s * (n - xi - 0.5)) | (x64 > s * (n - xi + 0.5))
    return int((outside & ~store.outlier_mask()).sum())


def adversarial_cache(dtype=torch.float32):
    """(H=4, S=64, d=64) rows: exact amax, ties at .5, subnormal/huge scales, zero groups, massive pair."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 64, 64, generator=gen, dtype=torch.float64)
    x[0, :8] = 0.0  # all-zero tokens / groups
    x[0, 8:16, :32] = 0.0
    step = 2.0 ** -6  # s = 2^-6 exactly when the amax is 126.5 * 2^-6
    ties = (torch.randint(-126, 126, (8, 64), generator=gen) + 0.5) * step
    ties[:, ::16] = 126.5 * step  # the amax itself, in every group
    x[0, 16:24] = ties
    x[0, 24:32] = -126.5 * step  # every value exactly at -amax
    x[1] *= 1e-7  # fp16 scales in the subnormal range (and below: rounded up to 2^-24)
    x[1, :4] *= 1e-3
    x[2] *= 1.4e4 if dtype != torch.float16 else 1.0  # huge scales (s ~ 500; fp16 outliers stay finite)
    x[3, :, 5] = 3000.0  # a massive channel: the outlier pair (5, 37) under rotate_half
    x[3, :, 37] = -2500.0
    return x.to(dtype)


# ------------------------------------------------------------------ |err| <= s/2, no clipping


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_error_within_half_scale_on_adversarial_inputs(config, dtype):
    x = adversarial_cache(dtype)
    quantizer = DitheredInt8(**config)
    store = quantizer.quantize(x, COUNTER)
    assert exact_half_scale_violations(x, quantizer, store, COUNTER) == 0
    assert store.payload.abs().max() <= 127  # no clipping: codes are the exact nearest integers
    s = store.scale_per_element()
    assert ((x.double().abs() <= s * SCALE_DIVISOR) | store.outlier_mask()).all()
    x_hat = quantizer.dequantize(store, COUNTER)  # fp32, one rounding of the exact value
    err = (x_hat.double() - x.double()).abs()
    assert ((err <= s / 2 + s * 127.5 * 2.0**-23) | store.outlier_mask()).all()
    outlier_err = err.masked_select(store.outlier_mask())
    outlier_x = x.double().masked_select(store.outlier_mask()).abs()
    assert (outlier_err <= outlier_x * 2.0**-11 + 2.0**-25).all()


def test_subnormal_and_zero_scales_round_up_never_to_zero():
    x = adversarial_cache()
    store = DitheredInt8().quantize(x, COUNTER)
    scales = store.scales.double()
    amax = x.double().abs().view(4, 64, 2, 32).amax(-1)
    assert ((scales == 0) == (amax == 0)).all()
    assert (scales * SCALE_DIVISOR >= amax).all()
    assert (scales[1][scales[1] > 0] >= 2.0**-24).all()


def test_ties_follow_the_documented_rule():
    """At an exact tie ``x/s + xi = k + 1/2`` the code is ``floor(. + 1/2) = k + 1``."""
    s = 2.0**-6
    xi = dither_of(COUNTER, (1, 1, 32))
    x = torch.full((1, 1, 32), 126.5 * s, dtype=torch.float64)  # fixes s = 2^-6 in the group
    x[..., 1:] = (torch.arange(31).double() - 15.0 + 0.5 - xi[..., 1:]) * s  # exact ties
    store = DitheredInt8().quantize(x, COUNTER)
    assert store.scales.double().item() == s
    assert store.payload[0, 0, 1:].tolist() == (torch.arange(31) - 15 + 1).tolist()


@pytest.mark.parametrize("value, match", [(float("nan"), "NaN"), (float("inf"), "Inf"), (-float("inf"), "Inf")])
def test_nan_and_inf_are_rejected(value, match):
    x = torch.zeros(1, 4, 32)
    x[0, 2, 3] = value
    with pytest.raises(ValueError, match=match):
        DitheredInt8().quantize(x, COUNTER)


def test_out_of_range_inputs_are_rejected():
    with pytest.raises(ValueError, match="fp16 scale range"):
        DitheredInt8().quantize(torch.full((1, 1, 32), 1e7), COUNTER)
    x = torch.zeros(1, 1, 32)
    x[..., 0] = 7e4
    with pytest.raises(ValueError, match="outlier channel exceeds"):
        DitheredInt8(outlier_pairs=1).quantize(x, COUNTER)
    with pytest.raises(ValueError, match="shape"):
        DitheredInt8().quantize(torch.zeros(4, 32), COUNTER)
    with pytest.raises(ValueError, match="float"):
        DitheredInt8().quantize(torch.zeros(1, 4, 32, dtype=torch.int32), COUNTER)
    with pytest.raises(ValueError, match="divisible"):
        DitheredInt8(group=24).quantize(torch.zeros(1, 4, 32), COUNTER)
    with pytest.raises(ValueError, match="granularity"):
        DitheredInt8(granularity="channel")
    with pytest.raises(ValueError, match="fixed_pairs"):
        DitheredInt8(outlier_pairs=2, outlier_mode="fixed").quantize(torch.zeros(1, 4, 32), COUNTER)


# ------------------------------------------------------------------ negative control


def quantize_with_fp32_scale_store_fp16(x64, xi):
    """The paper's bug: quantize with the fp32 scale, store (round-to-nearest) fp16, dequantize with fp16."""
    amax = x64.abs().view(*x64.shape[:-1], -1, 32).amax(-1).float()
    s32 = (amax / SCALE_DIVISOR).repeat_interleave(32, -1).double()
    n = torch.round(x64 / s32 + xi)
    s16 = s32.half().double()
    return s16 * (n - xi) - x64, s16


def test_negative_control_fp32_scale_breaks_half_scale_bound():
    x = torch.randn(8, 256, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    xi = dither_of(COUNTER, x.shape)
    err, s16 = quantize_with_fp32_scale_store_fp16(x, xi)
    violations = int((err.abs() > s16 / 2).sum())
    store = DitheredInt8().quantize(x, COUNTER)
    print(f"negative control: {violations} violations of |err| <= s16/2 with an fp32 scale; "
          f"{exact_half_scale_violations(x, DitheredInt8(), store, COUNTER)} with the stored fp16 scale")
    assert violations > 100
    assert exact_half_scale_violations(x, DitheredInt8(), store, COUNTER) == 0


# ------------------------------------------------------------------ residual statistics


def test_residual_is_uniform_and_uncorrelated_with_input():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 256, 64, generator=gen, dtype=torch.float64) * torch.rand(4, 256, 1, generator=gen) * 5
    store = DitheredInt8().quantize(x, COUNTER)
    n, xi, s = codes_and_dither(DitheredInt8(), store, COUNTER)
    live = s > 0
    residual = ((n - xi) - x / torch.where(live, s, 1.0))[live]
    ks = stats.kstest(residual.numpy(), "uniform", args=(-0.5, 1.0))
    corr = stats.pearsonr(residual.numpy(), (x / torch.where(live, s, 1.0))[live].numpy())
    print(f"KS p = {ks.pvalue:.3f} on {residual.numel()} residuals; corr with x/s = {corr.statistic:.2e}")
    assert ks.pvalue > 1e-3
    assert abs(corr.statistic) < 5 / residual.numel() ** 0.5


# ------------------------------------------------------------------ streams


def test_write_and_read_streams_are_identical():
    x = adversarial_cache()
    quantizer = DitheredInt8(outlier_pairs=2)
    store = quantizer.quantize(x, COUNTER)
    again = StandaloneCounter(request=3, layer=1, seed=12345)  # a fresh object, same tuple
    assert torch.equal(quantizer.dequantize(store, COUNTER), quantizer.dequantize(store, again))
    other = StandaloneCounter(request=4, layer=1, seed=12345)
    wrong = quantizer.dequantize(store, other).double()  # a read with another tuple's stream
    s = store.scale_per_element()
    assert ((wrong - x.double()).abs() > s / 2 * (1 + 1e-3)).sum() > x.numel() // 10


def test_invariance_to_batch_order_and_decode_steps():
    x = torch.randn(3, 2, 16, 64, generator=torch.Generator().manual_seed(5))
    requests = torch.tensor([10, 2, 7])
    quantizer = DitheredInt8(outlier_pairs=2).calibrate(x[..., :4, :])  # fixed set: paging-safe
    store = quantizer.quantize(x, StandaloneCounter(request=requests, layer=0, seed=12345))
    perm = torch.tensor([1, 2, 0])
    permuted = replace(quantizer, fixed_pairs=quantizer.fixed_pairs[perm]).quantize(
        x[perm], StandaloneCounter(request=requests[perm], layer=0, seed=12345))
    assert torch.equal(store.payload[perm], permuted.payload)
    one = replace(quantizer, fixed_pairs=quantizer.fixed_pairs[2:3])
    step = one.quantize(x[2:3, :, 9:10], StandaloneCounter(request=torch.tensor([7]), layer=0, token_offset=9, seed=12345))
    assert torch.equal(step.payload, store.payload[2:3, :, 9:10])  # a decode step = its prefill slice
    assert torch.equal(step.outliers, store.outliers[2:3, :, 9:10])


def test_paged_stream_round_trip_follows_slots():
    x = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(8))
    slots = torch.tensor([40, 3, 17, 8, 2**33 + 1, 0])
    quantizer = DitheredInt8(granularity="token")
    store = quantizer.quantize(x, PagedCounter(layer=4, slots=slots, side="v", seed=12345))
    assert exact_half_scale_violations(x, quantizer, store, PagedCounter(layer=4, slots=slots, side="v", seed=12345)) == 0
    order = torch.tensor([5, 2, 0, 1, 4, 3])  # the same tokens held in a reordered batch
    moved = quantizer.quantize(x[:, order], PagedCounter(layer=4, slots=slots[order], side="v", seed=12345))
    assert torch.equal(moved.payload, store.payload[:, order])
    k_side = quantizer.quantize(x, PagedCounter(layer=4, slots=slots, side="k", seed=12345))
    assert not torch.equal(k_side.payload, store.payload)  # K and V streams differ


# ------------------------------------------------------------------ outliers


@pytest.mark.parametrize("rope, pair", [("rotate_half", (5, 37)), ("interleaved", (4, 5))])
def test_energy_selection_finds_the_massive_pair(rope, pair):
    x = torch.randn(1, 300, 64, generator=torch.Generator().manual_seed(2))
    x[..., pair[0]] += 500.0
    x[..., pair[1]] -= 400.0
    store = DitheredInt8(outlier_pairs=1, rope=rope, block=128).quantize(x, COUNTER)
    assert store.pair_index.shape == (1, 3, 1)
    assert (store.outlier_channels() == torch.tensor(pair)).all()
    calibrated = DitheredInt8(outlier_pairs=1, rope=rope).calibrate(x[:, :32])
    assert calibrated.outlier_mode == "fixed"
    fixed_store = calibrated.quantize(x, COUNTER)
    assert (fixed_store.outlier_channels() == torch.tensor(pair)).all()
    assert fixed_store.pair_index is None and fixed_store.metadata_nbytes() == 4
    bypass = DitheredInt8(outlier_pairs=1, rope=rope).quantize(x, COUNTER).scales.max()
    plain = DitheredInt8(rope=rope).quantize(x, COUNTER).scales.max()
    assert bypass < plain / 50  # excluded from the group amax


# ------------------------------------------------------------------ bytes


PAPER_PER_SIDE = {0: 136, 2: 144, 4: 152, 8: 168, 16: 200}  # d = 128, Gc = 32, fixed pair set


@pytest.mark.parametrize("m, paper", sorted(PAPER_PER_SIDE.items()))
def test_per_side_bytes_match_the_paper(m, paper):
    assert StoreLayout("token-group", 128, outlier_pairs=m, outlier_mode="fixed").bytes_per_token_per_head() == paper


def test_other_paper_byte_figures():
    def side(granularity, **kw):
        return StoreLayout(granularity, 128, **kw).bytes_per_token_per_head()
    assert side("block-channel") * 2 == 258
    assert side("token-group", outlier_pairs=4, outlier_mode="fixed") + side("token-group") == 288
    assert side("token-group") * 2 == 272
    assert side("token") * 2 == 260
    assert round(side("block-channel", outlier_pairs=4), 1) == 145.1  # 145.0625 with int32 pair indices


@pytest.mark.parametrize("config", CONFIGS + [dict(granularity="block-channel", outlier_pairs=3)])
@pytest.mark.parametrize("n_tokens", [1, 31, 256, 300])
def test_allocated_bytes_equal_the_account(config, n_tokens):
    x = torch.randn(2, n_tokens, 64, generator=torch.Generator().manual_seed(n_tokens))
    store = DitheredInt8(**config).quantize(x, StandaloneCounter(request=0, layer=0))
    assert isinstance(store, PackedStore)
    assert store.nbytes() == store.layout.expected_nbytes(2, n_tokens)
    assert store.nbytes() == sum(t.nbytes for t in (store.payload, store.scales, store.outliers,
                                                    *(() if store.pair_index is None else (store.pair_index,))))
    if n_tokens % store.layout.block == 0 or store.layout.granularity != "block-channel" and not store.layout.per_block_index:
        assert store.bytes_per_token_per_head() == store.layout.bytes_per_token_per_head()

"""Contract: the write kernel never clips a non-outlier channel and ``|err| <= s16/2`` (L2, TB).

Hypothesis served: Tier B's ``Delta_t`` and the sub-Gaussian residual (Lemma 2) need, for every
INT8 channel, ``|s16 (n - xi) - x| <= s16/2`` with ``s16`` the STORED fp16 scale (docs/design.md "Tier B: the dithered INT8 cache").
Implementation: ``witcert.kernels.dither_write.dither_write``.
Oracle: exact fp64 comparisons ``s16 (n - xi -+ 1/2)`` vs ``x`` (both sides exact: 11 x 33 bits),
the dither from ``witcert.tier_b.dither.dither_of``.
Domain: adversarial groups -- channel scales 1e-3..1e3, a channel exactly at the amax (both
signs), amax/126.5 just above / below / on fp16 rounding points, fp16-subnormal scales,
all-zero groups, massive fixed outlier pairs (excluded from the amax), fp16/bf16/fp32 inputs,
token-group and per-token scales.
Tolerance: none. Negative control: quantizing with the fp32 scale while storing fp16 (the
paper's bug) must violate the bound on the same data.
"""
import pytest
import torch

from witcert.tier_b.counters import StandaloneCounter
from witcert.tier_b.dither import dither_of
from witcert.tier_b.quantizer import Q_LEVELS, SCALE_DIVISOR, DitheredInt8, nearest_code
from witcert.kernels.dither_write import dither_write

COUNTER = StandaloneCounter(request=torch.tensor([4, 5]), layer=2, seed=1234)
HEAD_DIM, GROUP = 64, 32


def adversarial_keys(seed: int) -> torch.Tensor:
    """(2, 2, 64, 64) fp32 keys whose groups stress the scale rounding and the amax channel."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, 64, HEAD_DIM, generator=generator) * torch.logspace(-3, 3, HEAD_DIM)
    fp16_points = torch.tensor([1.0, 1.0009765625, 0.0009765625, 3.0517578125e-05, 65504 / 1024.0]).double()
    # amax / 126.5 exactly on, just above and just below fp16 values of various exponents
    for i, point in enumerate(fp16_points):
        for j, nudge in enumerate((0.0, 2.0**-30, -(2.0**-30))):
            token = 3 * i + j
            amax = float(point * SCALE_DIVISOR * (1 + nudge))
            x[..., token, :GROUP] = x[..., token, :GROUP].clamp(-amax, amax)
            x[..., token, token % GROUP] = amax if token % 2 else -amax  # a channel exactly at the amax
    x[..., 20, :] = 0.0  # all-zero groups: scale 0, code 0
    x[..., 21, :GROUP] = 2.0**-20  # fp16-subnormal scale
    x[..., 22, :] = torch.where(torch.arange(HEAD_DIM) % 2 == 0, 7.5e3, -7.5e3)  # near the fp16 scale range
    return x


def violations(x: torch.Tensor, store, counter) -> tuple[int, int]:
    """(#elements with |s16 (n - xi) - x| > s16/2 on INT8 channels, #codes outside [-Q, Q])."""
    x64 = x.to(torch.float64)
    scale = store.scale_per_element()  # fp16 scales as fp64, 0 on outliers
    xi = dither_of(counter, x.shape)
    n = store.payload.to(torch.float64)
    int8_channel = ~store.outlier_mask()
    below = x64 < scale * (n - xi - 0.5)
    above = x64 > scale * (n - xi + 0.5)
    bad = ((below | above) & int8_channel).sum().item()
    return bad, (n.abs() > Q_LEVELS).sum().item()


def fp32_scale_quantize(x: torch.Tensor, counter):
    """The negative control: quantize with the fp32 scale, store it as fp16 (docs/design.md "Tier B: the dithered INT8 cache")."""
    x64 = x.to(torch.float64)
    amax = x64.abs().view(*x.shape[:-1], HEAD_DIM // GROUP, GROUP).amax(-1)
    scale32 = (amax / SCALE_DIVISOR).to(torch.float32).to(torch.float64)
    scale32_elem = scale32.repeat_interleave(GROUP, dim=-1)
    code = nearest_code(x64, scale32_elem, dither_of(counter, x.shape))
    stored16 = scale32.to(torch.float16).to(torch.float64).repeat_interleave(GROUP, dim=-1)
    err = stored16 * (code - dither_of(counter, x.shape)) - x64
    return int((err.abs() > stored16 / 2).sum().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("granularity", ["token-group", "token"])
def test_stored_fp16_scale_bounds_every_int8_channel(dtype, granularity):
    x = adversarial_keys(seed=1).to(dtype)
    store = dither_write(x, DitheredInt8(granularity=granularity), COUNTER)
    bad, clipped = violations(x, store, COUNTER)
    assert (bad, clipped) == (0, 0)


def test_massive_fixed_outliers_do_not_widen_or_clip_the_rest():
    x = adversarial_keys(seed=2)
    massive = torch.randn(x.shape[:-1], generator=torch.Generator().manual_seed(4)) * 2e4
    x[..., 0], x[..., 32] = massive.clamp(-6e4, 6e4), -massive.clamp(-6e4, 6e4)  # pair 0 under rotate_half
    quantizer = DitheredInt8(outlier_pairs=1).calibrate(x[..., :8, :])
    store = dither_write(x, quantizer, COUNTER)
    bad, clipped = violations(x, store, COUNTER)
    assert (bad, clipped) == (0, 0)
    assert bool((store.payload[..., [0, 32]] == 0).all())  # outlier slots hold 0
    assert torch.equal(store.outliers, x[..., [0, 32]].to(torch.float16))


def test_negative_control_fp32_scale_violates_the_bound():
    """Quantizing with the fp32 scale while storing fp16 breaks |err| <= s16/2 (paper: 1639 cases)."""
    x = adversarial_keys(seed=3)
    assert fp32_scale_quantize(x, COUNTER) > 0
    store = dither_write(x, DitheredInt8(), COUNTER)
    assert violations(x, store, COUNTER) == (0, 0)

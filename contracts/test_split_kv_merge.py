"""Contract: split-KV merges the certificate with the output's LSE weights (Lemma 4, L4).

Implementation: ``witcert.kernels.merge.merge_splits`` (stage 2) over the stage-1 partials of
``decode_attention``.
Oracles: the unsplit run (``num_splits = 1``); the spec ``witcert.spec.bounds.a_merge`` (50-digit
mpmath) applied to the kernel's own partials ``(lse_i, A_i)``; the torch fp64 mirror
``witcert.kernels.merge.merge_splits_reference``.
Domain: 1, 2, 5 and 7 splits; a row with ``S = 1`` (most splits empty, ``lse_i = -inf``) next to a
row with 70 tokens; Tier A and Tier B; block sizes 16, 32 and 64 (``TILINGS``).
Tolerances: ``A - 1`` of a split run vs the unsplit run within the sum of both runs' stated
budgets (``kernel_relative_budget``: every split count has its own rounding), outputs within
``2 x 2^-11 max|v|`` (each run rounds its own softmax weights to fp16); the spec merge of
the partials vs the kernel merge within ``2^-19`` relative (stage 2 adds one exp (<= 8 ulps),
a product and a ``splits``-term fp32 sum per term); ``D`` exactly: a max is exact, and every
token's radius is a fixed number whatever the tiling (``kernels/radius.py``: fp64, summed over
bands or scale groups in index order, no position-dependent ``tl.dot``).
"""
import mpmath
import pytest
import torch

from contract_oracles import case, kernel_relative_budget, kernel_run
from witcert.kernels.merge import (STAT_C_MAX, STAT_K, STAT_L, STAT_M, merge_splits, merge_splits_reference,
                                   stat_column)
from witcert.spec.bounds import a_merge

SPLIT_CASES = [("A-rtn-int4", 2), ("A-rtn-int4", 5), ("A-fp8-masked", 7), ("B-min-standalone", 2)]
# (case, num_splits, block_n) against the case's default run (3 splits, blocks of 32)
TILINGS = [("A-fp8-masked", 5, 64), ("B-delta-paged-outliers-fp32", 2, 16), ("B-min-with-witness", 5, 64)]
STAGE2_RELATIVE = 2.0**-19


def _a_minus_one(stats: torch.Tensor) -> torch.Tensor:
    return stat_column(stats, STAT_K) / stat_column(stats, STAT_L)


@pytest.mark.parametrize(("name", "splits"), SPLIT_CASES)
def test_split_a_equals_unsplit_a(name, splits):
    one, many = kernel_run(name, 1), kernel_run(name, splits)
    budget = kernel_relative_budget(name, 1) + kernel_relative_budget(name, splits)
    a_one, a_many = _a_minus_one(one.stats), _a_minus_one(many.stats)
    assert bool(((a_many - a_one).abs() <= budget * a_one + 1e-30).all())
    assert torch.equal(stat_column(one.stats, STAT_C_MAX), stat_column(many.stats, STAT_C_MAX))
    assert bool(((one.certificate.meter.double() - many.certificate.meter.double()).abs()
                 <= 2 * budget * one.certificate.meter.double() + 1e-30).all())
    # the output merges with the same weights; each run rounds its own p to fp16 for p V
    # (relative to its own running max): both within 2^-11 max|v| of the fp64 output
    assert (one.out - many.out).abs().max().item() <= 2 * 2.0**-11 * case(name).v.abs().max().item()


@pytest.mark.parametrize(("name", "splits"), SPLIT_CASES)
def test_kernel_merge_equals_spec_a_merge_of_the_partials(name, splits):
    run = kernel_run(name, splits)
    partial = run.partial_stats  # (B, Hq, splits, 8)
    merged = _a_minus_one(run.stats)
    with mpmath.workdps(60):
        for b in range(partial.shape[0]):
            for h in range(partial.shape[1]):
                parts = []
                for i in range(splits):
                    m, l, k = (float(partial[b, h, i, col]) for col in (int(STAT_M), int(STAT_L), int(STAT_K)))
                    if l > 0:
                        parts.append((mpmath.mpf(m) + mpmath.log(l), 1 + mpmath.mpf(k) / mpmath.mpf(l)))
                    else:
                        parts.append((mpmath.mpf("-inf"), mpmath.mpf(1)))
                spec = a_merge(parts) - 1
                kernel = mpmath.mpf(float(merged[b, h]))
                assert abs(kernel - spec) <= STAGE2_RELATIVE * spec + mpmath.mpf("1e-30")


@pytest.mark.parametrize(("name", "splits"), SPLIT_CASES)
def test_kernel_merge_equals_torch_mirror(name, splits):
    run = kernel_run(name, splits)
    part_acc = torch.zeros(run.partial_stats.shape[:-1] + (64,), dtype=torch.float32)  # outputs unused here
    _, kernel_stats = merge_splits(part_acc, run.partial_stats)
    _, mirror_stats = merge_splits_reference(part_acc, run.partial_stats)
    kernel_a, mirror_a = _a_minus_one(kernel_stats), _a_minus_one(mirror_stats)
    assert bool(((kernel_a - mirror_a).abs() <= STAGE2_RELATIVE * mirror_a + 1e-30).all())


@pytest.mark.parametrize(("name", "splits", "block_n"), TILINGS)
def test_max_radius_is_the_same_for_every_tiling(name, splits, block_n):
    """A token's radius does not depend on its split or its column in a block (what L4 merges)."""
    default, other = kernel_run(name), kernel_run(name, splits, block_n=block_n)
    assert torch.equal(stat_column(default.stats, STAT_C_MAX), stat_column(other.stats, STAT_C_MAX))


def test_empty_splits_carry_no_weight_and_no_nan():
    run = kernel_run("A-fp8-masked", 7)  # row 0 has S = 1: six of its seven splits are empty
    empty = stat_column(run.partial_stats, STAT_L)[0] == 0
    assert bool(empty.any())
    assert bool(torch.isfinite(run.out).all()) and bool(torch.isfinite(run.certificate.meter).all())

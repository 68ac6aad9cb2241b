"""Split-KV stage 2: merge outputs and the certificate with the same LSE weights (Lemma 4, L4).

Split ``i`` of a (batch, query head) row holds ``m_i`` (max logit, fp64), ``l_i = sum e^{s - m_i}``,
``k_i``, ``j_i``, ``s_i`` (the moments of ``A - 1``, ``1 - A-`` and the chi-square bound's
``sum p~ expm1(c)^2``, see ``kernels/decode_attention.py``),
the unnormalised output ``acc_i``, and maxima of ``c``. With ``M = max_i m_i`` and
``r_i = e^{m_i - M}``, the merged row is ``l = sum r_i l_i``, ``k = sum r_i k_i``, ... so that

    A - 1 = k / l = sum_i w_i (k_i / l_i),   w_i = r_i l_i / l = e^{lse_i - LSE},

the same weights that merge the attention output ``o = sum_i w_i o_i`` (both are linear in
``p~``; Lean ``WitCert.block_sum_eq_token_sum``, spec ``witcert.spec.bounds.a_merge``). An empty
split (``m_i = -inf``) has ``r_i = 0``.
"""
import operator

import torch
import triton
import triton.language as tl

from . import require_backend

# Column of each statistic in the (..., NUM_STATS) fp64 split buffers.
STAT_M, STAT_L, STAT_K, STAT_J, STAT_C_MAX, STAT_CP_MAX, STAT_DELTA_MAX, STAT_S = (tl.constexpr(i) for i in range(8))
NUM_STATS = 8  # a power of two


def stat_column(stats: torch.Tensor, column) -> torch.Tensor:
    """``stats[..., column]`` for a ``STAT_*`` constant (a ``tl.constexpr``)."""
    return stats[..., operator.index(column)]


@triton.jit
def _merge_kernel(
    part_acc_ptr, part_stat_ptr, out_ptr, stat_ptr,
    stride_acc_b, stride_acc_h, stride_acc_split,
    stride_pstat_b, stride_pstat_h, stride_pstat_split,
    stride_out_b, stride_out_h,
    stride_stat_b, stride_stat_h,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SPLIT: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_split = tl.arange(0, BLOCK_SPLIT)
    mask_split = offs_split < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    stat_rows = part_stat_ptr + pid_b * stride_pstat_b + pid_h * stride_pstat_h + offs_split * stride_pstat_split
    m_i = tl.load(stat_rows + STAT_M, mask=mask_split, other=float("-inf"))  # fp64
    m = tl.max(m_i, axis=0)
    r = tl.exp((m_i - m).to(tl.float32))  # e^{m_i - M} <= 1; 0 for empty or padded splits
    l_i = tl.load(stat_rows + STAT_L, mask=mask_split, other=0.0).to(tl.float32)
    k_i = tl.load(stat_rows + STAT_K, mask=mask_split, other=0.0).to(tl.float32)
    j_i = tl.load(stat_rows + STAT_J, mask=mask_split, other=0.0).to(tl.float32)
    s_i = tl.load(stat_rows + STAT_S, mask=mask_split, other=0.0).to(tl.float32)
    l_sum = tl.sum(r * l_i, axis=0)
    k_sum = tl.sum(r * k_i, axis=0)  # A - 1 = k/l = sum_i w_i (k_i/l_i): same weights as the output (L4)
    j_sum = tl.sum(r * j_i, axis=0)
    s_sum = tl.sum(r * s_i, axis=0)  # finite: the kernel caps each term (kernels/certificate.py)

    acc_rows = part_acc_ptr + pid_b * stride_acc_b + pid_h * stride_acc_h + offs_split * stride_acc_split
    acc = tl.load(acc_rows[:, None] + offs_d[None, :], mask=mask_split[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(r[:, None] * acc, axis=0) / l_sum
    tl.store(out_ptr + pid_b * stride_out_b + pid_h * stride_out_h + offs_d, out, mask=mask_d)

    c_max = tl.max(tl.load(stat_rows + STAT_C_MAX, mask=mask_split, other=0.0), axis=0)
    cp_max = tl.max(tl.load(stat_rows + STAT_CP_MAX, mask=mask_split, other=0.0), axis=0)
    delta_max = tl.max(tl.load(stat_rows + STAT_DELTA_MAX, mask=mask_split, other=0.0), axis=0)
    row = stat_ptr + pid_b * stride_stat_b + pid_h * stride_stat_h
    tl.store(row + STAT_M, m)
    tl.store(row + STAT_L, l_sum.to(tl.float64))
    tl.store(row + STAT_K, k_sum.to(tl.float64))
    tl.store(row + STAT_J, j_sum.to(tl.float64))
    tl.store(row + STAT_S, s_sum.to(tl.float64))
    tl.store(row + STAT_C_MAX, c_max)
    tl.store(row + STAT_CP_MAX, cp_max)
    tl.store(row + STAT_DELTA_MAX, delta_max)


def merge_splits(part_acc: torch.Tensor, part_stat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2 of split-KV decode: (batch, Hq, splits, d) fp32 + (batch, Hq, splits, 8) fp64.

    Returns
    -------
    out : Tensor (batch, Hq, d), fp32
        The normalised attention output.
    stat : Tensor (batch, Hq, 8), fp64
        Merged ``(M, l, k, j, c_max, c'_max, delta_max, s)`` (L4), columns as ``STAT_*``.
    """
    batch, heads, splits, head_dim = part_acc.shape
    out = torch.empty((batch, heads, head_dim), dtype=torch.float32, device=part_acc.device)
    stat = torch.zeros((batch, heads, NUM_STATS), dtype=torch.float64, device=part_acc.device)
    require_backend(_merge_kernel)
    _merge_kernel[(batch, heads)](
        part_acc, part_stat, out, stat,
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_stat.stride(0), part_stat.stride(1), part_stat.stride(2),
        out.stride(0), out.stride(1),
        stat.stride(0), stat.stride(1),
        NUM_SPLITS=splits, HEAD_DIM=head_dim,
        BLOCK_SPLIT=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out, stat


def merge_splits_reference(part_acc: torch.Tensor, part_stat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch fp64 oracle of :func:`merge_splits` (Lemma 4, ``L4``): the same formulas, no Triton.

    ``A - 1 = sum_i w_i (k_i / l_i)`` with ``w_i = e^{lse_i - LSE}``, ``lse_i = m_i + log l_i``;
    returns ``(out, stat)`` like :func:`merge_splits` (fp64).
    """
    m_i = stat_column(part_stat, STAT_M)  # (B, Hq, splits)
    l_i = stat_column(part_stat, STAT_L)
    live = l_i > 0
    lse_i = torch.where(live, m_i + torch.log(torch.where(live, l_i, torch.ones_like(l_i))), -torch.inf)
    lse = torch.logsumexp(lse_i, dim=-1, keepdim=True)
    weight = torch.exp(lse_i - lse)  # e^{lse_i - LSE}: 0 for empty splits
    safe_l = torch.where(live, l_i, torch.ones_like(l_i))
    out = (weight[..., None] * part_acc.double() / safe_l[..., None]).sum(-2)
    stat = torch.zeros(part_stat.shape[:-2] + (NUM_STATS,), dtype=torch.float64, device=part_stat.device)
    m = m_i.amax(-1)
    l_sum = torch.exp(lse.squeeze(-1) - m)  # so that l / e^{-m} reproduces LSE
    stat[..., operator.index(STAT_M)] = m
    stat[..., operator.index(STAT_L)] = l_sum
    for column in (STAT_K, STAT_J, STAT_S):
        ratio = torch.where(live, stat_column(part_stat, column) / safe_l, torch.zeros_like(l_i))
        stat[..., operator.index(column)] = l_sum * (weight * ratio).sum(-1)
    for column in (STAT_C_MAX, STAT_CP_MAX, STAT_DELTA_MAX):
        stat[..., operator.index(column)] = stat_column(part_stat, column).amax(-1)
    return out, stat

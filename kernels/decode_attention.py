"""GQA decode attention that emits the WitCert certificate in the same pass (T1, P1, MN, T2, L4).

One decode query per (batch, query head) attends over ``S`` cached tokens. Alongside the
attention output, every program accumulates the meter's moments over its tokens
(DESIGN.md §2, notation of ``witcert.bounds``):

* ``l = sum_t e^{y_t}`` with ``y_t = s_t - m`` (``m`` the running max of the logits ``s``),
* ``k = sum_t e^{y_t} (e^{c'_t} - 1)``  (``A - 1 = k / l``, Theorem 1 ``T1``),
* ``j = sum_t e^{y_t} (1 - e^{-c'_t})`` (``1 - A- = j / l``, Proposition 1 ``P1``),
* ``D = max_t c_t`` (max-norm bound ``MN``),

where ``c_t`` is the per-token logit-error bound. Tier A (this module's key source): ``c_t``
is computed in-kernel from the band norms of ``q`` and the stored fp16 witness (Theorem 2
``T2``, Lemma 1 ``L1``), rounded up by ``kappa_c``. ``c'_t = (c_t + delta_t)(1 + 2^-22)``
also covers ``delta_t``, a bound on the rounding of the kernel's own logit (see
``kernels/certificate.py``), and is rounded up once more.

Split-KV: stage 1 (this file) runs a program per (batch, kv head, split) for all the query
heads of that kv head (GQA) and writes per split the unnormalised output and the raw
``(m, l, k, j, c_max, c'_max, delta_max)``. Stage 2 (``kernels/merge.py``) merges them with the
same log-sum-exp weights for the output and for ``A`` (Lemma 4 ``L4``). The fp64 meter with
its a-priori rounding slack is formed in ``kernels/certificate.py``.

Logits are computed in fp64 (``q . k^`` and the subtraction of the running max), so the
fp32 exponent arguments are off by at most ``u |y_t|`` -- relative to the distance from the
max, not to the logit's size (see the rounding budget in ``kernels/certificate.py``).
"""
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from witcert.bands import BandLayout

from ._validate import require, require_finite, require_nonnegative, require_tensor
from .certificate import C_CAP, Certificate, KernelRounding, certificate_from_moments
from .expm1 import expm1_nonneg, one_minus_exp_neg
from .merge import NUM_STATS, stat_column, STAT_C_MAX, STAT_CP_MAX, STAT_DELTA_MAX, STAT_J, STAT_K, STAT_L, STAT_M, merge_splits

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ONE_PLUS_2U = tl.constexpr(1.0 + 2.0**-22)  # rounds c + delta up past one fp32 rounding of the sum


@triton.jit
def _query_band_norms(q_rows, band_ptr, mask_h, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr,
                      BANDS: tl.constexpr, BAND_WIDTH: tl.constexpr):
    """fp32 ``||q_b||`` for every head row and band (T2): (BLOCK_H, BLOCK_B), rounded to nearest.

    ``band_ptr`` holds ``BandLayout.index`` (B, 2P): the coordinates of each band, so the
    kernel uses the model's RoPE pair convention exactly as the torch reference does.
    """
    offs_b = tl.arange(0, BLOCK_B)
    offs_w = tl.arange(0, BLOCK_W)
    mask_bw = (offs_b[:, None] < BANDS) & (offs_w[None, :] < BAND_WIDTH)
    coords = tl.load(band_ptr + offs_b[:, None] * BAND_WIDTH + offs_w[None, :], mask=mask_bw, other=0)
    q_band = tl.load(q_rows[:, None, None] + coords[None, :, :],
                     mask=mask_h[:, None, None] & mask_bw[None, :, :], other=0.0).to(tl.float32)
    return tl.sqrt_rn(tl.sum(q_band * q_band, axis=2))  # (BLOCK_H, BLOCK_B)


@triton.jit
def _witness_radius(w_rows, offs_n, mask_n, q_norms, sm_scale, kappa_c,
                    BLOCK_B: tl.constexpr, BANDS: tl.constexpr):
    """Tier A ``c_t = sm_scale sum_b ||q_b|| w_{t,b}`` rounded up by ``(1 + kappa_c)`` (T2).

    A token with an infinite witness band gets ``c_t = inf`` (the trivial bound), never NaN.
    """
    offs_b = tl.arange(0, BLOCK_B)
    w = tl.load(w_rows[:, None] + offs_b[None, :], mask=mask_n[:, None] & (offs_b[None, :] < BANDS),
                other=0.0).to(tl.float32)  # (BLOCK_N, BLOCK_B)
    unbounded = tl.sum((w == float("inf")).to(tl.float32), axis=1) > 0  # (BLOCK_N,)
    w = tl.where(w == float("inf"), 0.0, w)
    c = tl.dot(q_norms, tl.trans(w), input_precision="ieee")  # (BLOCK_H, BLOCK_N)
    c = c * sm_scale * (1.0 + kappa_c)
    return tl.where(unbounded[None, :], float("inf"), c)


@triton.jit
def _decode_stage1_kernel(
    q_ptr, k_ptr, v_ptr, w_ptr, band_ptr, seq_lens_ptr, scale_ptr, part_acc_ptr, part_stat_ptr,
    kappa_c, kappa_dot,
    stride_q_b, stride_q_h,
    stride_k_b, stride_k_h, stride_k_s,
    stride_v_b, stride_v_h, stride_v_s,
    stride_w_b, stride_w_h, stride_w_s,
    stride_acc_b, stride_acc_h, stride_acc_split,
    stride_stat_b, stride_stat_h, stride_stat_split,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BANDS: tl.constexpr, BAND_WIDTH: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr,
    CERTIFY: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_kvh = tl.program_id(1)
    pid_split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + pid_b)
    sm_scale = tl.load(scale_ptr)  # fp64: the exact logits' scale up to 2^-53 (in kappa_dot)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    split_start = pid_split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    offs_h = pid_kvh * GROUP + offs_g  # query heads served by this kv head (HF GQA order)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    q_rows = q_ptr + pid_b * stride_q_b + offs_h * stride_q_h
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    q64 = q.to(tl.float64)  # logits in fp64: exponent arguments then err by u|y|, not u|s|

    m = tl.full([BLOCK_H], float("-inf"), tl.float64)
    l_acc = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_acc = tl.zeros([BLOCK_H], tl.float32)
    j_acc = tl.zeros([BLOCK_H], tl.float32)
    c_max = tl.zeros([BLOCK_H], tl.float32)
    cp_max = tl.zeros([BLOCK_H], tl.float32)
    delta_max = tl.zeros([BLOCK_H], tl.float32)
    if CERTIFY:
        sm_scale32 = sm_scale.to(tl.float32)  # may round down by u: inside kappa_c
        q_norms = _query_band_norms(q_rows, band_ptr, mask_h, BLOCK_B, BLOCK_W, BANDS, BAND_WIDTH)
        q_abs = tl.abs(q)

    k_base = k_ptr + pid_b * stride_k_b + pid_kvh * stride_k_h
    v_base = v_ptr + pid_b * stride_v_b + pid_kvh * stride_v_h
    w_base = w_ptr + pid_b * stride_w_b + pid_kvh * stride_w_h
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < split_end
        mask_nd = mask_n[:, None] & mask_d[None, :]
        keys = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :], mask=mask_nd, other=0.0)
        s = tl.dot(q64, tl.trans(keys.to(tl.float64))) * sm_scale  # (BLOCK_H, BLOCK_N) fp64
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp((m - m_new).to(tl.float32))  # first block: exp(-inf) = 0
        y = (s - m_new[:, None]).to(tl.float32)  # <= 0; -inf on masked tokens
        mass = tl.exp(y)  # e^{y_t}: p~_t times the normaliser l
        l_acc = l_acc * alpha + tl.sum(mass, axis=1)
        values = tl.load(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :], mask=mask_nd, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(mass.to(values.dtype), values)
        if CERTIFY:
            c = _witness_radius(w_base + offs_n * stride_w_s, offs_n, mask_n, q_norms, sm_scale32, kappa_c,
                                BLOCK_B, BANDS)
            # |s'_t - s_t| <= delta_t: the fp64 logit's own rounding (kernels/certificate.py)
            s_abs = tl.dot(q_abs, tl.trans(tl.abs(keys)))  # (BLOCK_H, BLOCK_N) fp32, = sum |q||k|
            delta = s_abs * (sm_scale32 * kappa_dot)
            c = tl.where(mask_n[None, :], c, 0.0)
            delta = tl.where(mask_n[None, :], delta, 0.0)
            c_prime = (c + delta) * ONE_PLUS_2U  # >= c + delta despite the fp32 sum
            c_max = tl.maximum(c_max, tl.max(c, axis=1))
            cp_max = tl.maximum(cp_max, tl.max(c_prime, axis=1))
            delta_max = tl.maximum(delta_max, tl.max(delta, axis=1))
            # beyond C_CAP the meter is the trivial 1 (kernels/certificate.py): cap to stay finite
            c_prime = tl.minimum(c_prime, C_CAP)
            k_acc = k_acc * alpha + tl.sum(mass * expm1_nonneg(c_prime), axis=1)
            j_acc = j_acc * alpha + tl.sum(mass * one_minus_exp_neg(c_prime), axis=1)
        m = m_new

    acc_rows = part_acc_ptr + pid_b * stride_acc_b + offs_h * stride_acc_h + pid_split * stride_acc_split
    tl.store(acc_rows[:, None] + offs_d[None, :], acc, mask=mask_h[:, None] & mask_d[None, :])
    stat_rows = part_stat_ptr + pid_b * stride_stat_b + offs_h * stride_stat_h + pid_split * stride_stat_split
    tl.store(stat_rows + STAT_M, m, mask=mask_h)  # fp64; -inf for an empty split
    tl.store(stat_rows + STAT_L, l_acc.to(tl.float64), mask=mask_h)
    tl.store(stat_rows + STAT_K, k_acc.to(tl.float64), mask=mask_h)
    tl.store(stat_rows + STAT_J, j_acc.to(tl.float64), mask=mask_h)
    tl.store(stat_rows + STAT_C_MAX, c_max.to(tl.float64), mask=mask_h)
    tl.store(stat_rows + STAT_CP_MAX, cp_max.to(tl.float64), mask=mask_h)
    tl.store(stat_rows + STAT_DELTA_MAX, delta_max.to(tl.float64), mask=mask_h)


@dataclass(frozen=True)
class DecodeAttention:
    """Result of :func:`decode_attention`.

    Attributes
    ----------
    out : Tensor (batch, Hq, d), fp32
        Attention output over the given (compressed) keys.
    lse : Tensor (batch, Hq), fp64
        Log-sum-exp of the kernel's logits.
    certificate : Certificate or None
        Meter, risk score, ``A - 1``, ``1 - A-``, ``D`` (None when ``certify=False``).
    stats : Tensor (batch, Hq, 8), fp64
        Merged accumulators ``(m, l, k, j, c_max, c'_max, delta_max)`` (columns ``STAT_*``).
    partial_stats : Tensor (batch, Hq, splits, 8), fp64
        The same per split, before the stage-2 merge (Lemma 4 contracts read them).
    """

    out: torch.Tensor
    lse: torch.Tensor
    certificate: Certificate | None
    stats: torch.Tensor
    partial_stats: torch.Tensor


def _launch_stage1(q, keys, values, witness, band_index, seq_lens, scale, shape, certify, block_n):
    batch, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    splits = shape.num_splits
    part_acc = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32, device=q.device)
    part_stat = torch.zeros((batch, heads, splits, NUM_STATS), dtype=torch.float64, device=q.device)
    bands, band_width = band_index.shape
    _decode_stage1_kernel[(batch, kv_heads, splits)](
        q, keys, values, witness, band_index, seq_lens, scale, part_acc, part_stat,
        shape.kappa_c, shape.kappa_dot,
        q.stride(0), q.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        witness.stride(0), witness.stride(1), witness.stride(2),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_stat.stride(0), part_stat.stride(1), part_stat.stride(2),
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=splits, BANDS=bands, BAND_WIDTH=band_width,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_B=max(16, triton.next_power_of_2(bands)), BLOCK_W=triton.next_power_of_2(band_width),
        CERTIFY=certify,
    )
    return part_acc, part_stat


def _check_inputs(q, k_hat, v, witness, layout, seq_lens, certify, num_splits, block_n):
    require_tensor("q", q, dtypes=FLOAT_DTYPES, dim=3)
    batch, heads, head_dim = q.shape
    require_tensor("k_hat", k_hat, dtypes=FLOAT_DTYPES, dim=4, device=q.device)
    require(k_hat.shape[0] == batch and k_hat.shape[3] == head_dim, "k_hat",
            f"must be (batch={batch}, Hkv, S, d={head_dim}), got {tuple(k_hat.shape)}")
    kv_heads, seq = k_hat.shape[1], k_hat.shape[2]
    require(seq >= 1, "k_hat", "must hold at least one token")
    require(heads % kv_heads == 0, "q", f"heads {heads} must be a multiple of kv heads {kv_heads} (GQA)")
    require_tensor("v", v, dtypes=FLOAT_DTYPES, shape=k_hat.shape, device=q.device)
    require_finite("q", q)
    require_finite("k_hat", k_hat)
    require_finite("v", v)
    require(isinstance(num_splits, int) and num_splits >= 1, "num_splits", f"must be an int >= 1, got {num_splits!r}")
    require(isinstance(block_n, int) and block_n >= 16 and block_n & (block_n - 1) == 0, "block_n",
            f"must be a power of two >= 16, got {block_n!r}")
    if seq_lens is not None:
        require_tensor("seq_lens", seq_lens, dtypes=(torch.int32, torch.int64), shape=(batch,), device=q.device)
        require(bool(((seq_lens >= 1) & (seq_lens <= seq)).all()), "seq_lens", f"must lie in [1, S={seq}]")
    if certify:
        require(isinstance(layout, BandLayout), "layout", f"must be a BandLayout, got {type(layout).__name__}")
        require(layout.head_dim == head_dim, "layout", f"head_dim {layout.head_dim} != q's {head_dim}")
        require_tensor("witness", witness, dtypes=FLOAT_DTYPES, shape=(batch, kv_heads, seq, layout.bands),
                       device=q.device)
        require(not bool(torch.isnan(witness).any()), "witness", "must not contain NaN")
        require_nonnegative("witness", witness)


def decode_attention(q, k_hat, v, witness=None, layout=None, *, seq_lens=None, sm_scale=None,
                     num_splits=4, block_n=32, certify=True) -> DecodeAttention:
    """GQA decode attention over reconstructed keys with the Tier A certificate in the same pass.

    Implements the attention and the meter of Theorem 1 (``T1``), Proposition 1 (``P1``) and the
    max-norm bound (``MN``), with ``c_t`` from the band witness (Theorem 2 ``T2``) and the
    split-KV merge of Lemma 4 (``L4``); torch oracle: ``witcert.meter`` on
    ``witcert.logit_bound``.

    Parameters
    ----------
    q : Tensor (batch, Hq, d)
        One decode query per head (fp16/bf16/fp32), in the keys' RoPE frame.
    k_hat, v : Tensor (batch, Hkv, S, d)
        Reconstructed (compressed) keys and values; query head ``h`` reads kv head ``h // (Hq/Hkv)``.
    witness : Tensor (batch, Hkv, S, B)
        Band witnesses ``w_{t,b} >= ||(k_hat - k)_{t,b}||`` (``witcert.witness_of``, fp16 rounded up).
    layout : BandLayout
        The band layout the witness was written with.
    seq_lens : IntTensor (batch,), optional
        Valid tokens per row (the rest is masked); default ``S``.
    sm_scale : float, optional
        Softmax scale; default ``1/sqrt(d)``.
    num_splits : int
        Split-KV partitions (stage 2 merges them; the certificate is the same up to rounding).
    block_n : int
        Tokens per inner block (power of two >= 16).
    certify : bool
        Accumulate the certificate (False: plain attention, for the overhead benchmark).

    Returns
    -------
    DecodeAttention
    """
    _check_inputs(q, k_hat, v, witness, layout, seq_lens, certify, num_splits, block_n)
    batch, heads, head_dim = q.shape
    seq = k_hat.shape[2]
    if seq_lens is None:
        seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=q.device)
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    require(math.isfinite(scale) and scale > 0, "sm_scale", f"must be finite and > 0, got {sm_scale!r}")
    if not certify:  # the kernel never reads them; any well-formed placeholders do
        layout = layout if isinstance(layout, BandLayout) else BandLayout(head_dim, _any_bands(head_dim))
        witness = torch.zeros((1, 1, 1, layout.bands), dtype=torch.float16, device=q.device)
    shape = KernelRounding(max_seq_len=seq, block_n=block_n, num_splits=num_splits,
                           head_dim=head_dim, bands=layout.bands)
    band_index = layout.index.to(device=q.device, dtype=torch.int32).contiguous()
    scale_t = torch.tensor([scale], dtype=torch.float64, device=q.device)
    part_acc, part_stat = _launch_stage1(q, k_hat, v, witness, band_index, seq_lens.to(torch.int32), scale_t,
                                         shape, certify, block_n)
    out, stats = merge_splits(part_acc, part_stat)
    lse = stat_column(stats, STAT_M) + torch.log(stat_column(stats, STAT_L))
    certificate = None
    if certify:
        certificate = certificate_from_moments(
            stat_column(stats, STAT_L), stat_column(stats, STAT_K), stat_column(stats, STAT_J), stat_column(stats, STAT_C_MAX),
            stat_column(stats, STAT_CP_MAX), stat_column(stats, STAT_DELTA_MAX), seq_lens[:, None], shape)
    return DecodeAttention(out=out, lse=lse, certificate=certificate, stats=stats, partial_stats=part_stat)


def _any_bands(head_dim: int) -> int:
    """Largest band count <= 16 dividing d/2 (only for the unused placeholder layout)."""
    return max(b for b in range(1, 17) if (head_dim // 2) % b == 0)

"""Reading the packed dithered INT8 keys inside the decode kernel, and their Tier B radius (L2, TB).

:class:`PackedKeys` is the read plan of a ``witcert.tier_b.packed_store.PackedStore`` (built once, reused every
decode step): the store's tensors plus the counter words that let the kernel regenerate the
dither with in-kernel Philox. Three ``@triton.jit`` helpers serve ``kernels/decode_attention.py``:

* :func:`load_packed_keys` -- dequantize ``k^ = s (n - xi)`` in fp64 (exact: ``s`` has 11
  significant bits and ``n - xi`` at most 33) with the dither regenerated from the counter,
  and the fp16 outlier channels, in the same pass over the data;
* :func:`query_group_sums` -- once per program, ``sum |q_c|`` and ``sum q_c^2`` over the INT8
  channels of every scale group (fp64: exact squares, no under- or overflow for any fp32 query);
* :func:`dither_radius` -- the per-token Tier B bound of ``witcert.tier_b.certificate`` from those group
  sums and the token's scales: ``c_t = min(u_t + beta_t, Delta_t) + rho_t + o_t``
  (``RADIUS_MIN``), or one branch (``RADIUS_DELTA``: deterministic, valid for every query;
  ``RADIUS_U``), in fp64 with the groups (and outlier channels) summed in index order, so
  that ``c_t`` does not depend on the tiling (``kernels/radius.py``).

Rounding of :func:`dither_radius` (``u64 = 2^-53``): a group sum of ``Gc`` terms, its product
with the exact fp64 image of an fp16 scale (or its square), the ``d/Gc``-term sum over groups:
at most ``d + 1`` roundings on a term's path (``Gc + d/Gc <= d + 1``); then the softmax scale,
``log_term/6``, two products, the sqrt, ``l1`` times the slack constants and up to four
additions: below ``(d + 24) u64`` relative. ``KernelRounding.kappa_b`` is twice that; the
fp32 round-up (``kernels/radius.py``) covers it.

Scope as ``witcert.tier_b.certificate``: the ``u_t`` branch is for NON-ADAPTIVE queries; ``Delta_t`` and
the Tier A witness hold for every query.
"""
import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from witcert.tier_b.counters import PagedCounter, StandaloneCounter, _key_of
from witcert.tier_b.dither import GRID_STEP
from witcert.tier_b.outliers import pair_channels
from witcert.tier_b.packed_store import PackedStore
from witcert.tier_b.certificate import DEQUANT_FACTOR, FP16_ABS_FLOOR, FP16_UNIT

from . import require_backend
from ._validate import require
from .dither_write import dither_block
from .radius import column

RADIUS_NONE, RADIUS_MIN, RADIUS_DELTA, RADIUS_U = (tl.constexpr(i) for i in range(4))
MODES = {"min": 1, "delta": 2, "u": 3}  # Tier B branch -> the RADIUS_* code
HALF_GRID = tl.constexpr(GRID_STEP / 2)
DEQUANT = tl.constexpr(DEQUANT_FACTOR)
OUTLIER_REL = tl.constexpr(FP16_UNIT / (1 - FP16_UNIT))
OUTLIER_ABS = tl.constexpr(FP16_ABS_FLOOR)


@dataclass(frozen=True)
class PackedKeys:
    """Read plan of a packed key store (batch, Hkv, S, d) for the decode kernel.

    Attributes
    ----------
    store : PackedStore
        The dithered INT8 keys (no outliers, or a fixed pair set).
    scales : Tensor
        ``store.scales`` with strides ``(b, h, token, group)``: token index ``t // token_div``,
        group index ``c // group``.
    token_words : LongTensor (batch, S, 2)
        Counter words ``(c0, c2)`` of every token (position or pool slot).
    head_words : LongTensor (batch, Hkv, 2)
        Counter words ``(c1 without the channel bits, c3)`` of every (batch, kv head).
    key : LongTensor (2,)
        Philox key words (the seed).
    outlier_slot : IntTensor (batch * Hkv, d)
        Position of each channel in ``store.outliers`` (``-1``: not an outlier).
    outlier_channels : IntTensor (batch * Hkv, 2m)
        The channel of each position of ``store.outliers`` (the inverse of ``outlier_slot``).
    """

    store: PackedStore
    scales: torch.Tensor
    token_div: int
    group: int
    token_words: torch.Tensor
    head_words: torch.Tensor
    key: torch.Tensor
    outlier_slot: torch.Tensor
    outlier_channels: torch.Tensor

    @classmethod
    def from_store(cls, store: PackedStore, counter) -> "PackedKeys":
        """Build the plan; ``counter`` is the stream the store was written with."""
        require(isinstance(store, PackedStore), "store", f"must be a PackedStore, got {type(store).__name__}")
        require(store.payload.dim() == 4, "store", f"must be (batch, Hkv, S, d), got {tuple(store.shape)}")
        require(isinstance(counter, (StandaloneCounter, PagedCounter)), "counter",
                f"must be a StandaloneCounter or PagedCounter, got {type(counter).__name__}")
        lay = store.layout
        require(not lay.per_block_index, "store",
                "energy-mode outliers change per block; the decode kernel reads a fixed pair set")
        batch, heads, tokens, head_dim = store.shape
        words = counter.counters((batch, heads, tokens, 1))[..., 0, :]  # (B, H, S, 4)
        token_words = words[:, 0, :, :][..., [0, 2]]
        head_words = words[:, :, 0, :][..., [1, 3]]
        require(bool((words[..., [0, 2]] == token_words[:, None]).all()) and
                bool((words[..., [1, 3]] == head_words[:, :, None]).all()), "counter",
                "layout must put the token in words 0/2 and the head in words 1/3 (witcert.tier_b.counters)")
        device = store.payload.device
        store = dataclasses.replace(store, payload=store.payload.contiguous(), scales=store.scales.contiguous(),
                                    outliers=store.outliers.contiguous())  # unit channel stride for the kernel
        token_div, group = {"token-group": (1, lay.group), "token": (1, head_dim),
                            "block-channel": (lay.block, 1)}[lay.granularity]
        slots, channels = _outlier_slots(store)
        return cls(store=store, scales=store.scales, token_div=token_div, group=group,
                   token_words=token_words.to(device).contiguous(), head_words=head_words.to(device).contiguous(),
                   key=_key_of(counter.seed).to(device), outlier_slot=slots.to(device),
                   outlier_channels=channels.to(device))

    @property
    def outlier_slack(self) -> bool:
        """Whether fp16 outlier storage rounded a non-fp16 input (``o_t > 0``)."""
        return self.store.layout.outlier_pairs > 0 and self.store.source_dtype != torch.float16


def _outlier_slots(store: PackedStore) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch * Hkv, d) int32 index of each channel in the outlier list (-1 elsewhere), and the
    (batch * Hkv, 2m) int32 channel of each list position."""
    batch, heads, _, head_dim = store.shape
    slots = torch.full((batch * heads, head_dim), -1, dtype=torch.int32)
    m = store.layout.outlier_pairs
    if m == 0:
        return slots, torch.zeros((batch * heads, 0), dtype=torch.int32)
    pairs = store.fixed_pairs.to(torch.int64).expand(batch, heads, m).reshape(batch * heads, m)
    chans = pair_channels(pairs, head_dim, store.layout.rope)  # (B*H, 2m)
    order = torch.arange(2 * m, dtype=torch.int32).expand(batch * heads, 2 * m)
    return slots.scatter(-1, chans, order), chans.to(torch.int32).contiguous()


def log_term(n_union: int, delta_loc: float) -> float:
    """``log(2 S / delta_loc)`` rounded up (for ``u_t``; the kernel reads it as an exact fp64).

    ``2 S / delta_loc`` and the log round once each (the log within 2 ulps): ``1 + 2^-50`` covers them.
    """
    require(0 < delta_loc < 1, "delta_loc", f"must be a probability in (0, 1), got {delta_loc!r}")
    return math.log(2 * n_union / delta_loc) * (1 + 2.0**-50)


@triton.jit
def load_packed_keys(payload_rows, scale_rows, outlier_rows, slot, c0, c2, c1_base, c3, k0, k1,
                     offs_d, mask_nd, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     DITHERED: tl.constexpr = True):
    """fp64 keys (BLOCK_N, BLOCK_D): ``s (n - xi)`` on INT8 channels, the stored fp16 value on outliers.

    ``payload_rows``/``scale_rows``/``outlier_rows`` are (BLOCK_N, 1) row pointers (the scale
    row already at the token's scale row), ``slot`` (BLOCK_D,) the channel's outlier slot or -1,
    ``c0``/``c2`` (BLOCK_N, 1) the tokens' counter words, ``c1_base``/``c3`` the head's.
    ``DITHERED=False`` reads a plain round-to-nearest INT8 store (the benchmark's RTN baseline).
    """
    code = tl.load(payload_rows + offs_d[None, :], mask=mask_nd, other=0).to(tl.float64)
    scale16 = tl.load(scale_rows + (offs_d // GROUP)[None, :], mask=mask_nd, other=0.0)
    is_outlier = (slot >= 0)[None, :] & mask_nd
    scale = tl.where(is_outlier, 0.0, scale16.to(tl.float64))
    if DITHERED:
        xi = dither_block(c0, c1_base, c2, c3, k0, k1, BLOCK_N, BLOCK_D)  # the write-time dither, bit for bit
    else:
        xi = tl.zeros_like(code)
    kept = tl.load(outlier_rows + tl.maximum(slot, 0)[None, :], mask=is_outlier, other=0.0).to(tl.float64)
    return tl.where(is_outlier, kept, scale * (code - xi))  # exact in fp64


@triton.jit
def query_group_sums(q64, slot, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr):
    """``sum_{c in g} |q_c|`` and ``sum_{c in g} q_c^2`` over the INT8 channels of every scale group.

    ``q64`` (BLOCK_H, BLOCK_D) is the query in fp64, ``slot`` (BLOCK_D,) each channel's outlier
    slot (``-1``: INT8); groups are ``GROUP`` consecutive channels (``d`` for per-token scales,
    1 for per-channel ones). Returns two (BLOCK_H, BLOCK_D // GROUP) fp64 tensors.
    """
    q_int8 = tl.where((slot >= 0)[None, :], 0.0, q64)
    groups = tl.reshape(q_int8, [BLOCK_H, BLOCK_D // GROUP, GROUP])
    return tl.sum(tl.abs(groups), axis=2), tl.sum(groups * groups, axis=2)


@triton.jit
def dither_radius(q_l1, q_sq, scale_rows, mask_n, q_rows, mask_h, outlier_rows, outlier_chans, sm_scale, log_term,
                  MODE: tl.constexpr, NUM_GROUPS: tl.constexpr, NUM_OUTLIERS: tl.constexpr,
                  OUTLIER_SLACK: tl.constexpr):
    """Tier B per-token bound (BLOCK_H, BLOCK_N) in fp64 (``witcert.tier_b.certificate``), before the round-up.

    ``q_l1``/``q_sq`` are :func:`query_group_sums`; ``scale_rows`` (BLOCK_N,) points at each
    token's row of fp16 group scales; ``q_rows`` (BLOCK_H,) at the query rows and
    ``outlier_rows`` (BLOCK_N,) at the tokens' fp16 outlier values, whose channels
    ``outlier_chans`` lists. Groups and outlier channels are summed in index order.
    """
    l1 = tl.zeros([q_l1.shape[0], scale_rows.shape[0]], tl.float64)  # sum_c |q_c| s_c
    sq = tl.zeros([q_l1.shape[0], scale_rows.shape[0]], tl.float64)  # sum_c q_c^2 s_c^2
    for g in range(NUM_GROUPS):
        s = tl.load(scale_rows + g, mask=mask_n, other=0.0).to(tl.float64)
        l1 += column(q_l1, g)[:, None] * s[None, :]
        sq += column(q_sq, g)[:, None] * (s * s)[None, :]
    l1 = l1 * sm_scale
    delta = l1 * 0.5  # Delta_t: |err| <= s/2 exactly, every query
    c = delta
    if MODE != RADIUS_DELTA:
        # u_t = sqrt(2 v log_term), v = sm^2 sum q^2 s^2 / 12; plus beta_t = l1 g/2
        u = tl.sqrt(sq * (log_term / 6.0)) * sm_scale + l1 * HALF_GRID
        c = u if MODE == RADIUS_U else tl.minimum(u, delta)
    c = c + l1 * DEQUANT  # rho_t: fp32 dequantization slack (parity with the torch reference)
    if OUTLIER_SLACK:  # o_t: fp16 storage of non-fp16 outlier inputs
        o = tl.zeros([q_l1.shape[0], scale_rows.shape[0]], tl.float64)
        for j in range(NUM_OUTLIERS):
            q_j = tl.abs(tl.load(q_rows + tl.load(outlier_chans + j), mask=mask_h, other=0.0).to(tl.float64))
            x16 = tl.abs(tl.load(outlier_rows + j, mask=mask_n, other=0.0).to(tl.float64))
            o += q_j[:, None] * (x16 * OUTLIER_REL + OUTLIER_ABS)[None, :]
        c = c + o * sm_scale
    return c


@triton.jit
def _dequantize_kernel(payload_ptr, kscale_ptr, outlier_ptr, slot_ptr, token_words_ptr, head_words_ptr, key_ptr,
                       out_ptr, tokens,
                       stride_p_b, stride_p_h, stride_p_s, stride_ks_b, stride_ks_h, stride_ks_s,
                       stride_o_b, stride_o_h, stride_o_s, stride_tw_b, stride_tw_s, stride_hw_b, stride_hw_h,
                       stride_out_b, stride_out_h, stride_out_s,
                       HEAD_DIM: tl.constexpr, SCALE_GROUP: tl.constexpr, SCALE_TOKEN_DIV: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < tokens
    offs_d = tl.arange(0, HEAD_DIM)
    mask_nd = mask_n[:, None] & (offs_d[None, :] < HEAD_DIM)
    head_row = pid_b * stride_hw_b + pid_h * stride_hw_h
    words = token_words_ptr + pid_b * stride_tw_b + offs_n[:, None] * stride_tw_s
    slot = tl.load(slot_ptr + (pid_b * tl.num_programs(1) + pid_h) * HEAD_DIM + offs_d)
    keys = load_packed_keys(
        payload_ptr + pid_b * stride_p_b + pid_h * stride_p_h + offs_n[:, None] * stride_p_s,
        kscale_ptr + pid_b * stride_ks_b + pid_h * stride_ks_h + (offs_n // SCALE_TOKEN_DIV)[:, None] * stride_ks_s,
        outlier_ptr + pid_b * stride_o_b + pid_h * stride_o_h + offs_n[:, None] * stride_o_s, slot,
        tl.load(words, mask=mask_n[:, None], other=0), tl.load(words + 1, mask=mask_n[:, None], other=0),
        tl.load(head_words_ptr + head_row), tl.load(head_words_ptr + head_row + 1),
        tl.load(key_ptr), tl.load(key_ptr + 1), offs_d, mask_nd, SCALE_GROUP, BLOCK_N, HEAD_DIM)
    tl.store(out_ptr + pid_b * stride_out_b + pid_h * stride_out_h + offs_n[:, None] * stride_out_s + offs_d[None, :],
             keys, mask=mask_nd)


def dequantize_packed(keys: PackedKeys, *, block_n: int = 32) -> torch.Tensor:
    """The fp64 keys (batch, Hkv, S, d) exactly as the decode kernel reconstructs them.

    Uses :func:`load_packed_keys`, the decode kernel's own loader, so the read-side dither and
    dequantization can be checked bit for bit against ``DitheredInt8.dequantize(..., float64)``.
    """
    require(isinstance(keys, PackedKeys), "keys", f"must be a PackedKeys, got {type(keys).__name__}")
    payload = keys.store.payload
    batch, heads, tokens, head_dim = payload.shape
    require(triton.next_power_of_2(head_dim) == head_dim, "keys", f"head_dim {head_dim} must be a power of two")
    out = torch.empty(payload.shape, dtype=torch.float64, device=payload.device)
    outliers = keys.store.outliers
    if outliers.shape[-1] == 0:
        outliers = torch.zeros((1, 1, 1, 1), dtype=torch.float16, device=payload.device)
    require_backend(_dequantize_kernel)
    _dequantize_kernel[(batch, heads, triton.cdiv(tokens, block_n))](
        payload, keys.scales, outliers, keys.outlier_slot, keys.token_words, keys.head_words, keys.key,
        out, tokens,
        payload.stride(0), payload.stride(1), payload.stride(2),
        keys.scales.stride(0), keys.scales.stride(1), keys.scales.stride(2),
        outliers.stride(0), outliers.stride(1), outliers.stride(2),
        keys.token_words.stride(0), keys.token_words.stride(1), keys.head_words.stride(0), keys.head_words.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=head_dim, SCALE_GROUP=keys.group, SCALE_TOKEN_DIV=keys.token_div, BLOCK_N=block_n,
    )
    return out

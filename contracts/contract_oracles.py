"""Oracle machinery for the contract suite (no tests here), after SciPy's mpmath tests.

The contracts tie the Triton kernels (``kernels/``) to the theorems' hypotheses. Everything a
test compares against lives here:

* ``AttentionCase``: one decode problem (batch x query heads cells): exact keys ``k``, the
  compressed keys the kernel sees, values, valid lengths and the certificate inputs (Tier A
  witness and/or Tier B packed store). ``CASES`` names the domain: GQA 9/3, d = 64, both RoPE
  pair conventions, masked rows (``S = 1``), ties (``q = 0``), peaked attention, residuals that
  make Theorem 2 tight (logit errors at the box's vertices), logits ~1e4
  (one-hot attention, where the kernel's own logit rounding ``delta_t`` dominates), tiny and huge
  radii, fixed outliers, standalone and paged counters.
* fp64 truths: ``compressed_scores`` / ``exact_scores`` (GQA-expanded logits, ``-inf`` beyond
  ``seq_len``), ``true_tv`` (exact keys vs compressed keys, the quantity the meter bounds),
  ``reference_radius`` (torch ``c_t``: ``witcert.logit_bound`` / ``witcert.tier_b_logit_bound``),
  ``reference_meter`` (``witcert.meter``) and ``reference_moments`` (``witcert.core.bounds.moments``).
* ``kernel_run``: the kernel's ``DecodeAttention`` for a case, cached -- the interpreter is slow
  and several contracts read the same run.

Shapes are small on purpose (S <= 128, d = 64): the interpreter runs every program in Python.
"""
import functools
import math
from dataclasses import dataclass

import torch

import witcert
from witcert.core import bounds
from witcert.tier_a.bands import BandLayout
from witcert.tier_b.counters import PagedCounter, StandaloneCounter
from witcert.tier_b.quantizer import DitheredInt8
from witcert.kernels.decode_attention import DecodeAttention, decode_attention, decode_attention_packed
from witcert.kernels.dither_write import dither_write
from witcert.kernels.packed_keys import PackedKeys
from witcert.kernels.witness_write import witness_write
from witcert.tier_b.certificate import tier_b_logit_bound

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 9, 3, 64
GROUP = Q_HEADS // KV_HEADS
DELTA_LOC = 1e-6
DEFAULT_SPLITS = 3


@dataclass(frozen=True)
class AttentionCase:
    """One decode problem; every (batch, query head) is a cell with its own certificate."""

    name: str
    q: torch.Tensor  # (B, Hq, d)
    k: torch.Tensor  # (B, Hkv, S, d) exact keys
    k_hat: torch.Tensor  # (B, Hkv, S, d) what attention uses (fp64 for the packed store)
    v: torch.Tensor  # (B, Hkv, S, d)
    seq_lens: torch.Tensor  # (B,) int32
    layout: BandLayout
    witness: torch.Tensor | None = None  # (B, Hkv, S, B) fp16, Tier A
    packed: PackedKeys | None = None  # Tier B
    mode: str = "min"  # Tier B branch

    @property
    def tier(self) -> str:
        return "A" if self.packed is None else ("B+A" if self.witness is not None else "B")

    @property
    def adaptive_safe(self) -> bool:
        """Whether the radius holds for every query (Tier A, Tier B Delta) or only on the dither event."""
        return self.packed is None or self.mode == "delta"


def _keys(generator, seq, key_scale=1.0):
    channel_scale = torch.logspace(-1, 0.5, HEAD_DIM)  # uneven channels, as real keys
    k = torch.randn(BATCH, KV_HEADS, seq, HEAD_DIM, generator=generator) * channel_scale * key_scale
    v = torch.randn(BATCH, KV_HEADS, seq, HEAD_DIM, generator=generator)
    return k.half(), v.half()


def tier_a_case(name, scheme, *, seed, seq=96, rope="rotate_half", q_scale=1.0, seq_lens=None,
                noise=None) -> AttentionCase:
    """Tier A: keys through a registered scheme (or fp32 noise of size ``noise``), kernel witness."""
    generator = torch.Generator().manual_seed(seed)
    k, v = _keys(generator, seq)
    q = (torch.randn(BATCH, Q_HEADS, HEAD_DIM, generator=generator) * q_scale).half()
    if noise is not None:
        k_hat = (k.float() + noise * torch.randn(k.shape, generator=generator)).float()
        k = k.float()
    else:
        k_hat = witcert.get_scheme(scheme)(k, role="key")
    layout = BandLayout(HEAD_DIM, 16, rope)
    lens = torch.full((BATCH,), seq, dtype=torch.int32) if seq_lens is None else torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionCase(name, q, k, k_hat, v, lens, layout, witness=witness_write(k, k_hat, layout))


def saturated_case(name, *, seed, seq=48, radius=0.3) -> AttentionCase:
    """Tier A at the edge of Theorem 2: residuals aligned with the first query head of each group.

    ``r_{t,b} = sign_t rho_t q_b / ||q_b||`` makes Cauchy-Schwarz tight per band, so that head's
    logit errors sit at the vertices ``eps_t = +-c_t`` of the box (up to the fp16 round-up of the
    witness): the true TV is then as large as the radii allow for that sign pattern.
    """
    generator = torch.Generator().manual_seed(seed)
    k, v = _keys(generator, seq)
    k = k.float()
    q = torch.randn(BATCH, Q_HEADS, HEAD_DIM, generator=generator).half()
    layout = BandLayout(HEAD_DIM, 16, "rotate_half")
    lead = q[:, ::GROUP].float()  # (B, Hkv, d): the first query head of each kv head
    banded = layout.split(lead)  # (B, Hkv, 16, 4)
    direction = banded / banded.norm(dim=-1, keepdim=True).clamp(min=1e-30)
    sign = torch.where(torch.rand(BATCH, KV_HEADS, seq, 1, 1, generator=generator) < 0.5, -1.0, 1.0)
    rho = radius * torch.rand(BATCH, KV_HEADS, seq, 1, 1, generator=generator)
    residual_banded = sign * rho * direction[:, :, None]  # (B, Hkv, S, 16, 4)
    residual = torch.zeros(BATCH, KV_HEADS, seq, HEAD_DIM)
    residual[..., layout.index.reshape(-1)] = residual_banded.reshape(BATCH, KV_HEADS, seq, -1)
    k_hat = k + residual
    lens = torch.full((BATCH,), seq, dtype=torch.int32)
    return AttentionCase(name, q, k, k_hat, v, lens, layout, witness=witness_write(k, k_hat, layout))


def tier_b_case(name, *, seed, seq=96, quantizer=None, mode="min", paged=False, key_dtype=torch.float16,
                with_witness=False) -> AttentionCase:
    """Tier B: keys written by the ``dither_write`` kernel (streaming configurations; others by the
    torch quantizer), read back by the decode kernel."""
    generator = torch.Generator().manual_seed(seed)
    k, v = _keys(generator, seq)
    k = k.to(key_dtype)
    q = torch.randn(BATCH, Q_HEADS, HEAD_DIM, generator=generator).half()
    if paged:
        slots = torch.randperm(1 << 12, generator=generator)[: BATCH * seq].view(BATCH, seq).to(torch.int64)
        counter = PagedCounter(layer=7, slots=slots, seed=seed)
    else:
        counter = StandaloneCounter(request=torch.tensor([11, 12]), layer=7, seed=seed)
    quantizer = quantizer or DitheredInt8()
    if quantizer.outlier_pairs:
        quantizer = quantizer.calibrate(k[..., :16, :])
    streaming = quantizer.granularity != "block-channel"
    store = dither_write(k, quantizer, counter) if streaming else quantizer.quantize(k, counter)
    k_hat = quantizer.dequantize(store, counter, torch.float64)
    layout = BandLayout(HEAD_DIM, 16, "rotate_half")
    witness = witness_write(k.float(), k_hat.float(), layout) if with_witness else None
    if witness is not None:  # the fp32 cast of k_hat is not k_hat: bound the fp64 residual instead
        witness = witcert.witness_of(k, k_hat, layout)
    lens = torch.full((BATCH,), seq, dtype=torch.int32)
    return AttentionCase(name, q, k, k_hat, v, lens, layout, witness=witness,
                         packed=PackedKeys.from_store(store, counter), mode=mode)


CASE_BUILDERS = {
    "A-rtn-int4": lambda: tier_a_case("A-rtn-int4", "rtn-int4", seed=1),
    "A-kivi-2bit-interleaved": lambda: tier_a_case("A-kivi-2bit-interleaved", "kivi-2bit", seed=2, rope="interleaved"),
    "A-fp8-masked": lambda: tier_a_case("A-fp8-masked", "fp8-e4m3", seed=3, seq_lens=[1, 70]),
    "A-sign-1bit-huge-c": lambda: tier_a_case("A-sign-1bit-huge-c", "sign-1bit", seed=4, seq=48),
    "A-capped-radius": lambda: tier_a_case("A-capped-radius", "sign-1bit", seed=8, seq=32, q_scale=40.0),
    "A-peaked": lambda: tier_a_case("A-peaked", "rtn-int8", seed=5, q_scale=8.0),
    "A-ties": lambda: tier_a_case("A-ties", "rtn-int4", seed=6, q_scale=0.0, seq=40),
    "A-saturated-witness": lambda: saturated_case("A-saturated-witness", seed=9),
    "A-huge-logits": lambda: tier_a_case("A-huge-logits", None, seed=40, noise=1e-9, q_scale=3000.0, seq=32),
    "A-tiny-c": lambda: tier_a_case("A-tiny-c", None, seed=7, noise=1e-5, seq=64),
    "B-min-standalone": lambda: tier_b_case("B-min-standalone", seed=21),
    "B-delta-paged-outliers-fp32": lambda: tier_b_case(
        "B-delta-paged-outliers-fp32", seed=22, quantizer=DitheredInt8(outlier_pairs=2), mode="delta",
        paged=True, key_dtype=torch.float32),
    "B-min-block-channel": lambda: tier_b_case(
        "B-min-block-channel", seed=24, seq=80, quantizer=DitheredInt8(granularity="block-channel", block=32)),
    "B-min-with-witness": lambda: tier_b_case("B-min-with-witness", seed=23, seq=64, with_witness=True),
}
CASES = tuple(CASE_BUILDERS)


@functools.lru_cache(maxsize=None)
def case(name: str) -> AttentionCase:
    """The named case (built once)."""
    return CASE_BUILDERS[name]()


@functools.lru_cache(maxsize=None)
def kernel_run(name: str, num_splits: int = DEFAULT_SPLITS, certify: bool = True, block_n: int = 32) -> DecodeAttention:
    """The decode kernel on a case (cached: several contracts read one run)."""
    c = case(name)
    if c.packed is None:
        return decode_attention(c.q, c.k_hat, c.v, c.witness, c.layout, seq_lens=c.seq_lens,
                                num_splits=num_splits, block_n=block_n, certify=certify)
    return decode_attention_packed(c.q, c.packed, c.v, delta_loc=DELTA_LOC, mode=c.mode, witness=c.witness,
                                   layout=c.layout if c.witness is not None else None, seq_lens=c.seq_lens,
                                   num_splits=num_splits, block_n=block_n, certify=certify)


def _expand(x: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, ...) -> (B, Hq, ...): query head h reads kv head h // G (HF GQA order)."""
    return x.repeat_interleave(GROUP, dim=1)


def _mask(c: AttentionCase, scores: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(scores.shape[-1])
    live = positions[None, None, :] < c.seq_lens[:, None, None].long()
    return torch.where(live, scores, torch.full_like(scores, -math.inf))


def _scores(c: AttentionCase, keys: torch.Tensor) -> torch.Tensor:
    logits = torch.einsum("bhd,bhsd->bhs", c.q.double(), _expand(keys.double())) / math.sqrt(HEAD_DIM)
    return _mask(c, logits)


def compressed_scores(c: AttentionCase) -> torch.Tensor:
    """fp64 logits over the compressed keys (B, Hq, S); ``-inf`` beyond ``seq_len``."""
    return _scores(c, c.k_hat)


def exact_scores(c: AttentionCase) -> torch.Tensor:
    """fp64 logits over the exact keys (B, Hq, S)."""
    return _scores(c, c.k)


def true_tv(c: AttentionCase) -> torch.Tensor:
    """``TV(softmax(exact logits), softmax(compressed logits))`` per cell, fp64 (B, Hq)."""
    return 0.5 * (torch.softmax(exact_scores(c), -1) - torch.softmax(compressed_scores(c), -1)).abs().sum(-1)


def reference_attention(c: AttentionCase) -> torch.Tensor:
    """fp64 attention output over the compressed keys (B, Hq, d)."""
    return torch.einsum("bhs,bhsd->bhd", torch.softmax(compressed_scores(c), -1), _expand(c.v.double()))


def reference_radius(c: AttentionCase) -> torch.Tensor:
    """The torch reference's per-token ``c_t`` (B, Hq, S), fp64 values; ``0`` on masked tokens."""
    radius = None
    if c.witness is not None:
        q = c.q.double()[:, :, None]  # (B, Hq, Tq=1, d) against the witness (B, Hkv, S, B): GQA inside
        radius = witcert.logit_bound(q, c.witness, c.layout).reshape(BATCH, Q_HEADS, -1).double()
    if c.packed is not None:
        q = c.q[:, :, None]  # (B, Hq, Tq=1, d) against the store (B, Hkv, S, d)
        tier_b = tier_b_logit_bound(q, c.packed.store, DELTA_LOC, mode=c.mode).reshape(BATCH, Q_HEADS, -1).double()
        radius = tier_b if radius is None else torch.minimum(radius, tier_b)
    live = compressed_scores(c) > -math.inf
    return torch.where(live, radius, torch.zeros_like(radius))


def reference_meter(c: AttentionCase) -> torch.Tensor:
    """``witcert.meter`` (fp64) on the fp64 compressed logits and the reference radius (B, Hq)."""
    return witcert.meter(compressed_scores(c), reference_radius(c))


def reference_unsplit_meter(c: AttentionCase) -> torch.Tensor:
    """The torch enclosure's ``min(1, T1, P1, MN, CS)`` (no MS): what the kernel's meter reports (B, Hq)."""
    m = reference_moments(c)
    return bounds.Enclosure(m.k_hi, m.j_hi, m.a_minus_lo, m.max_c, m.second_hi).meter()


def reference_base_meter(c: AttentionCase) -> torch.Tensor:
    """The torch enclosure's ``min(1, T1, P1, MN)`` (no CS, MS): the kernel's meter without CS (B, Hq)."""
    m = reference_moments(c)
    return bounds.Enclosure(m.k_hi, m.j_hi, m.a_minus_lo, m.max_c).meter()


def reference_moments(c: AttentionCase) -> bounds.Moments:
    """``witcert.core.bounds.moments``: fp64 enclosures of ``A - 1`` (``k_hi``) and ``1 - A-`` (``j_hi``)."""
    return bounds.moments(compressed_scores(c), reference_radius(c))


def exact_a_minus_one(scores: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """``A - 1 = sum p~ (e^{c} - 1)`` in fp64, without inflation (the value the enclosures bracket)."""
    p = torch.softmax(scores, -1)
    return torch.where(p > 0, p * torch.expm1(radius), torch.zeros_like(p)).sum(-1)


def relative_excess(upper: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``(upper - value) / |value|`` (0 where both are 0)."""
    denom = value.abs().clamp(min=1e-300)
    return torch.where((upper == value), torch.zeros_like(value), (upper - value) / denom)


def delta_max(name: str, num_splits: int = DEFAULT_SPLITS) -> torch.Tensor:
    """The kernel's bound on its own fp64 logit rounding, per cell (B, Hq): an absolute slack of ``A``."""
    from witcert.kernels.merge import STAT_DELTA_MAX, stat_column

    return stat_column(kernel_run(name, num_splits).stats, STAT_DELTA_MAX)


def kernel_relative_budget(name: str, num_splits: int = DEFAULT_SPLITS) -> float:
    """:func:`relative_budget` of a named case's run."""
    c = case(name)
    d_max = float(kernel_run(name, num_splits).certificate.c_max.max())
    return relative_budget(c.k.shape[2], num_splits, d_max, bands=c.layout.bands)


def relative_budget(seq: int, num_splits: int, d_max: float, *, block_n: int = 32, bands: int = 16) -> float:
    """Stated relative slack of the kernel's ``A - 1`` over the exact value (``kernels/certificate.py``).

    Twice the sum of the enclosure's relative terms (per-term errors of ``l`` and ``k``, exponent
    arguments) plus the radius round-up ``kappa`` (``RADIUS_EXCESS`` and the ``2^-22`` of
    ``c' = (c + delta)(1 + 2^-22)``) amplified by ``(1 + D)`` (``d(e^c - 1)/(e^c - 1)
    <= (1 + c) dc/c`` for ``c <= 1``; beyond, ``e^c`` grows the same way), and the reference's own
    fp32 round-up of ``c`` (one ulp).
    """
    from witcert.kernels.certificate import ARG_ERROR, RADIUS_EXCESS, Y_NORMAL, KernelRounding

    shape = KernelRounding(max_seq_len=seq, block_n=block_n, num_splits=num_splits, head_dim=HEAD_DIM, bands=bands)
    kappa = RADIUS_EXCESS + 2.0**-22 + 2.0**-23
    arguments = math.expm1(ARG_ERROR * Y_NORMAL) + ARG_ERROR * math.log(seq)
    return 2 * (shape.mass_error() + shape.moment_error() + arguments) + 2 * kappa * (1 + d_max)

"""Attack class: a Tier A witness stored before RoPE, the rotation computed in the cache dtype (``L1fp``).

Each batch fixes a cache dtype (fp16, bf16, fp32), a pair convention, the rotation's arithmetic
(HF Llama's, in the cache dtype, or :func:`witcert.apply_rope`'s default, fp32 then one cast), a
scheme and a band layout. Keys carry massive channels (up to 2e4 in fp16, 1e6 otherwise) and
positions reach ``2^17``; queries are random, aligned with a massive channel, or aligned with the
rotated residual of one token. The witness is stored from the keys *before* RoPE with
``rope_dtype`` = the cache dtype; attention reads the keys as rotated. Checked per cell against
fp64 over the keys as actually rotated (near misses re-decided exactly, in rationals or mpmath):

* every (token, band): the band norm of the rotated residual ``<=`` the stored witness;
* every (query, token): the logit error ``<= c_t`` (Theorem 2 plus the score rounding);
* every query: the exact TV ``<=`` the meter.
"""
import contextlib
import math
from fractions import Fraction

import torch

from witcert.verification.attacks import AttackTally
from witcert.tier_a.bands import BandLayout
from witcert.core.metering import meter
from witcert.tier_a.score_rounding import score_rounding_bound
from witcert.tier_a.rotary import apply_rope
from witcert.schemes.registry import apply_scheme
from witcert.spec import golden
from witcert.tier_a.witness import logit_bound, witness_of

NAME = "rope frame (L1fp)"
SHARE = 0.015
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROPES = ("rotate_half", "interleaved")
SCHEMES = ("kvquant-4bit", "rtn-int4", "rtn-int8", "fp8-e4m3", "kivi-2bit", "sign-1bit")
LAYOUTS = ((64, 32), (64, 8), (128, 64), (128, 16))  # (head_dim, bands): one pair per band, and wider
THETAS = (10000.0, 500000.0)
BATCH, TOKENS, QUERIES = 32, 40, 4  # 40 tokens: KIVI keeps 8 exact (a zero residual)
NEAR = 1e-9  # relative margin under which a cell is re-decided exactly


def run(n: int, g: torch.Generator) -> AttackTally:
    """``n`` trials (one trial = one kv head: 40 tokens, 4 queries), in batches of one configuration."""
    tally = AttackTally(NAME)
    done = 0
    with one_thread():
        while done < n:
            size = min(BATCH, n - done)
            _batch(size, g, tally)
            done += size
    return tally


@contextlib.contextmanager
def one_thread():
    """Run torch on one intra-op thread inside the block: these tensors are tiny, and on a small
    shared machine more threads oversubscribe (several times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _pick(options, g):
    return options[int(torch.randint(len(options), (1,), generator=g))]


def _loguniform(shape, low, high, g):
    return torch.exp(torch.empty(shape, dtype=torch.float64).uniform_(math.log(low), math.log(high), generator=g))


def _batch(b: int, g: torch.Generator, tally: AttackTally) -> None:
    dtype, rope, scheme, theta = _pick(DTYPES, g), _pick(ROPES, g), _pick(SCHEMES, g), _pick(THETAS, g)
    (d, bands), compute = _pick(LAYOUTS, g), _pick((dtype, None), g)  # HF arithmetic or fp32 + cast
    layout = BandLayout(d, bands, rope)
    k, positions = _keys(b, d, dtype, g)
    k_hat = apply_scheme(scheme, k, role="key")
    w = witness_of(k, k_hat, layout, rope_dtype=dtype)  # stored before RoPE: (b, S, B)
    k_rot = apply_rope(k, positions, rope, theta, compute).double()  # what attention reads
    k_hat_rot = apply_rope(k_hat, positions, rope, theta, compute).double()
    residual = k_hat_rot - k_rot  # fp64 (exact unless the exponents are far apart)
    _check_witness(layout.band_norms(residual), w.double(), layout.split(k_rot), layout.split(k_hat_rot), tally)

    q = _queries(b, d, k_rot, residual, g)  # (b, Tq, d) fp64
    scale = d**-0.5
    c = logit_bound(q[:, None], w[:, None], layout, scale)[:, 0]  # one head per problem: (b, Tq, S)
    c = c + score_rounding_bound(q[:, None], k_hat_rot[:, None], scale, score_dtype=torch.float64,
                                 accumulate_dtype=torch.float64)[:, 0]
    scores = (q @ k_hat_rot.transpose(-1, -2)) * scale  # (b, Tq, S), what the meter sees
    exact = (q @ k_rot.transpose(-1, -2)) * scale  # fp64 image of the exact logits
    _check_logits(exact, scores, c, q, k_rot, scale, tally)
    count_meter(tally, meter(scores, c), scores, q, k_rot, scale)


def _keys(b: int, d: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (b, S, d) in ``dtype`` with 1-2 massive channels, and increasing positions (b, S) up to ~2^17."""
    k = torch.randn(b, TOKENS, d, generator=g, dtype=torch.float64) * _loguniform((b, 1, 1), 0.05, 5, g)
    top = 2e4 if dtype == torch.float16 else 1e6
    for _ in range(int(torch.randint(1, 3, (1,), generator=g))):
        channel = torch.randint(d, (b,), generator=g)
        size = _loguniform((b, 1), 10, top, g) * torch.where(torch.rand(b, 1, generator=g) < 0.5, -1.0, 1.0)
        jitter = 1 + 0.01 * torch.randn(b, TOKENS, generator=g, dtype=torch.float64)
        k[torch.arange(b), :, channel] += size * jitter
    start = _loguniform((b, 1), 1, 2e5, g).floor()
    steps = torch.randint(1, 64, (b, TOKENS), generator=g).double().cumsum(-1)
    return k.to(dtype), (start + steps).long()


def _queries(b, d, k_rot, residual, g) -> torch.Tensor:
    """Random, massive-channel-aligned and residual-aligned queries (b, Tq, d), fp64, logit spread ~0.1..50."""
    random = torch.randn(b, QUERIES, d, generator=g, dtype=torch.float64)
    channel = k_rot.abs().amax(-2).argmax(-1)  # the largest channel of each trial
    aligned = torch.zeros(b, QUERIES, d, dtype=torch.float64)
    aligned[torch.arange(b), :, channel] = 1.0
    token = torch.randint(TOKENS, (b,), generator=g)
    along = residual[torch.arange(b), token][:, None].expand(b, QUERIES, d)  # maximises one token's error
    kind = torch.randint(3, (b, QUERIES, 1), generator=g)
    q = torch.where(kind == 0, random, torch.where(kind == 1, aligned, along))
    q = q + 1e-3 * random  # never exactly zero
    q = q / torch.linalg.vector_norm(q, dim=-1, keepdim=True)
    key_size = torch.linalg.vector_norm(k_rot, dim=-1).amax(-1)[:, None, None]  # (b, 1, 1)
    return q * (_loguniform((b, QUERIES, 1), 0.1, 50, g) * math.sqrt(d) / key_size)


def _check_witness(norms, w, bands, bands_hat, tally) -> None:
    """Band norms (b, S, B) of the rotated residual against the witness; near misses in rationals
    (from the rotated keys' own values, ``bands``/``bands_hat`` (b, S, B, 2P))."""
    near = norms * (1 + NEAR) >= w
    bad = norms > w
    for index in near.nonzero().tolist():
        at = tuple(index)
        pairs = zip(bands[at].tolist(), bands_hat[at].tolist())
        exact = sum((Fraction(y) - Fraction(x)) ** 2 for x, y in pairs)
        bad[at] = exact > Fraction(float(w[at])) ** 2
    _add(tally, norms, w, bad)


def _check_logits(exact, scores, c, q, k_rot, scale, tally) -> None:
    """|logit error| (b, Tq, S) against ``c``; near misses with exact rational logits."""
    err = (exact - scores).abs()
    near = err * (1 + NEAR) >= c
    bad = err > c
    for i, j, t in near.nonzero().tolist():
        truth = _exact_logit(q[i, j], k_rot[i, t], scale)
        bad[i, j, t] = abs(truth - Fraction(float(scores[i, j, t]))) > Fraction(float(c[i, j, t]))
    _add(tally, err, c, bad)


def count_meter(tally: AttackTally, m, scores, q, k, scale: float) -> None:
    """Count ``m`` (b, Tq) against the exact TV between ``softmax(scale q k^T)`` and ``softmax(scores)``.

    ``q`` (b, Tq, d) and ``k`` (b, S, d) fp64 (the exact keys attention reads), ``scores``
    (b, Tq, S) the compressed logits the meter was given. fp64 TV; near misses re-decided by
    the 50-digit golden on exact rational logits.
    """
    exact = scale * q @ k.transpose(-1, -2)
    tv = 0.5 * (torch.softmax(exact, -1) - torch.softmax(scores, -1)).abs().sum(-1)
    near = (tv * (1 + NEAR) >= m) & (m < 1)
    bad = (tv > m) & (m < 1)
    for i, j in near.nonzero().tolist():
        logits = [_exact_logit(q[i, j], k[i, t], scale) for t in range(k.shape[1])]
        eps = [_mpf(Fraction(s) - x) for s, x in zip(scores[i, j].tolist(), logits)]
        bad[i, j] = golden.tv_from_scores(scores[i, j].tolist(), eps) > golden.mpf(float(m[i, j]))
    _add(tally, tv, m, bad)


def _exact_logit(q, k, scale) -> Fraction:
    return Fraction(scale) * sum(Fraction(a) * Fraction(b) for a, b in zip(q.tolist(), k.tolist()))


def _mpf(x: Fraction):
    with golden.mp.workdps(golden.GOLDEN_DPS + golden.GUARD_DPS):
        return golden.mpf(x.numerator) / x.denominator


def _add(tally: AttackTally, exact, bound, bad) -> None:
    """Count cells; ``bad`` (decided exactly) overrides the fp64 comparison."""
    decided = torch.where(bad, torch.maximum(exact, bound * (1 + 2 * NEAR) + 1e-300), torch.minimum(exact, bound))
    tally.add(decided, bound)

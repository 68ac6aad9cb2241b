"""Attack class: the Triton decode kernel over the whole fp32 range of the query (T2, TB, T1, P1, MN).

The kernel forms every radius from the query (band norms, sums of ``|q|`` and ``q^2``); an fp32
square underflows below ``|q| ~ 1e-19`` and overflows above ``1e19``, so each trial draws one
magnitude regime for the queries of a decode problem:

* ``tiny`` / ``huge``: every channel at ``10^e``, ``e`` uniform in ``[-38, -19]`` / ``[19, 38]``
  (fp32 subnormal entries included);
* ``band-mixed``: one exponent per band (or scale group), ``e`` in ``[-37, 37]``;
* ``channel-mixed``: one exponent per channel, so one band holds ``1e-30`` beside ``1e30``;
* ``normal``: ``e`` in ``[-2, 2]``;

with some bands (or the whole query) set to zero. Tier A problems are *scale-free*: keys are
``K0 10^-e`` and residuals ``R0 10^-e`` per channel, so the logits, radii and TV are those of an
O(1) problem whatever ``e`` (up to fp32 rounding, and clipping at fp32's max): attention is
peaked by a massive key channel and the residuals are aligned with the query band by band, so
the logit errors sit at the vertices of Theorem 2's box and the true TV is close to the meter.
Witnesses are fp16 (``witcert.witness_of``) or fp32 (rounded up). Tier B problems quantize
O(1) keys (a massive channel, fixed outliers, each scale granularity) with ``DitheredInt8`` and
run the packed path in each mode, optionally with a witness.

Per (batch row, query head) cell, against oracles computed here in fp64:

* the kernel meter is never below the exact TV between attention over the exact keys and over
  the keys the kernel read (``exact_tv``: stable from the exact logit errors
  ``eps_t = sm q . (k^_t - k_t)``, so TVs of ``1e-24`` are resolved);
* the kernel ``D = max_t c_t`` is never below ``max_t |eps_t|`` (the radius hypothesis);
* ``D`` is never below the torch reference radius (``witcert.logit_bound`` /
  ``witcert.tier_b.certificate.tier_b_terms`` on the fp64 query), less ``2^-40`` relative for the
  reference's own fp64 rounding;
* the meter lies in ``[0, 1]`` and ``D`` is never NaN (an overflowed radius is ``inf``, meter 1).

The Tier B ``u`` branch holds on the dither event (``DELTA_LOC = 1e-9`` per cell). Under the
Triton interpreter (no CUDA) one trial, a single kernel program for 16 query heads, costs about
half a second, hence the small ``SHARE``.
"""
import math
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel modules are first imported

from witcert.verification.attacks import AttackTally  # noqa: E402

NAME = "kernel fp32 range"
SHARE = 1e-4  # 50 trials (800 cells x 3 checks, ~40 s) at --trials 500000
HEAD_DIM, BANDS, HEADS = 64, 16, 16  # one kv head, 16 query heads: one interpreted program per split
SM_SCALE = 0.125  # 1/sqrt(64), exact: the kernel's default and the oracles' multiplier
DELTA_LOC = 1e-9
FP32_MAX = torch.finfo(torch.float32).max
REGIMES = ("tiny", "huge", "band-mixed", "channel-mixed", "normal")
REFERENCE_FP64 = 2.0**-40  # the torch reference radius is an fp64 value rounded up by ~(B + 8) 2^-52


def _uniform(g, low, high, *shape):
    return torch.empty(*shape, dtype=torch.float64).uniform_(low, high, generator=g)


def _pick(g, options):
    return options[int(torch.randint(len(options), (1,), generator=g))]


def query_exponents(regime, groups: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Per-channel decimal exponents (d,) of the query for a regime; ``groups`` maps channel -> band.

    ``regime`` is one of ``REGIMES`` or a number: that exponent for every channel.
    """
    if not isinstance(regime, str):
        return torch.full((HEAD_DIM,), float(regime), dtype=torch.float64)
    if regime == "tiny":
        return _uniform(g, -38, -19, 1).expand(HEAD_DIM).clone()
    if regime == "huge":
        return _uniform(g, 19, 38, 1).expand(HEAD_DIM).clone()
    if regime == "band-mixed":
        return _uniform(g, -37, 37, int(groups.max()) + 1)[groups]
    if regime == "channel-mixed":
        return _uniform(g, -37, 37, HEAD_DIM)
    return _uniform(g, -2, 2, 1).expand(HEAD_DIM).clone()


def queries(exponents: torch.Tensor, groups: torch.Tensor, g: torch.Generator, lead=None) -> torch.Tensor:
    """(HEADS, d) fp32 queries ``q0 10^e`` (``|q0| <= 3``), some bands or whole queries zero.

    ``lead``: a channel set to ``q0 = 3`` in every head (the massive key channel's partner).
    """
    q0 = torch.randn(HEADS, HEAD_DIM, generator=g, dtype=torch.float64).clamp(-3, 3)
    zero_band = torch.rand(HEADS, int(groups.max()) + 1, generator=g) < 0.15
    q0 = torch.where(zero_band[:, groups], 0.0, q0)
    if lead is not None:
        q0[:, lead] = 3.0
    q0[1:][torch.rand(HEADS - 1, generator=g) < 0.05] = 0.0  # zero queries; head 0 leads the residuals
    q = q0 * torch.pow(10.0, exponents)
    return q.clamp(-FP32_MAX, FP32_MAX).float()


def _band_of_channel(layout) -> torch.Tensor:
    groups = torch.empty(HEAD_DIM, dtype=torch.long)
    groups[layout.index.reshape(-1)] = torch.arange(layout.bands).repeat_interleave(layout.index.shape[1])
    return groups


def tier_a_problem(g: torch.Generator, regime, seq: int, scale_free=None, witness_dtype=None,
                   peak=(20.0, 80.0)) -> dict:
    """A Tier A problem (one row, one kv head, ``HEADS`` query heads, ``seq`` tokens).

    ``regime``: see :func:`query_exponents`. ``scale_free`` (default: drawn, mostly True): keys
    and residuals at ``10^-e`` per channel; otherwise O(1), so the radius itself spans the range.
    ``witness_dtype``: fp16 or fp32 (default: drawn). ``peak``: range of the top token's massive
    key channel (its logit lead over the others is about ``0.375 peak``).
    """
    from witcert.tier_a.bands import BandLayout
    from witcert.tier_a.witness import witness_of
    from witcert.core.rounding import round_up_to

    layout = BandLayout(HEAD_DIM, BANDS, _pick(g, ("rotate_half", "interleaved")))
    groups = _band_of_channel(layout)
    e = query_exponents(regime, groups, g)
    massive = int(torch.randint(HEAD_DIM, (1,), generator=g))
    q = queries(e, groups, g, lead=massive)
    if scale_free is None:
        scale_free = bool(torch.rand(1, generator=g) < 0.7)
    # keys and residuals at 10^-e (within 1e+-36, so that O(1) keys and residuals fit in fp32)
    inverse = torch.pow(10.0, (-e).clamp(-36, 36)) if scale_free else torch.ones(HEAD_DIM, dtype=torch.float64)
    # O(1) keys with a massive channel: one token takes almost all the attention
    k0 = torch.randn(seq, HEAD_DIM, generator=g, dtype=torch.float64)
    top = int(torch.randint(seq, (1,), generator=g))
    k0[:, massive] = _uniform(g, 0, 4, seq)
    k0[top, massive] = _uniform(g, *peak, 1)
    k = (k0 * inverse).clamp(-FP32_MAX, FP32_MAX).float()
    # residuals against the first head, band by band (Theorem 2 tight: eps_t = -c_t for it) on the
    # low-mass tokens: p~ = p e^{-c} / Z and A = sum p~ e^{c} = 1/Z, so its exact TV
    # (~ p_top (1 - Z)) is nearly the meter (~ A - 1 = 1/Z - 1)
    banded = layout.split(q[0].double() / inverse)  # (B, 2P): the O(1) query the keys see
    direction = banded / banded.norm(dim=-1, keepdim=True).clamp(min=1e-300)
    rho = torch.exp(_uniform(g, math.log(1e-7), math.log(0.3), seq, 1, 1))
    r0 = torch.zeros(seq, HEAD_DIM, dtype=torch.float64)
    r0[:, layout.index.reshape(-1)] = (-rho * direction).reshape(seq, -1)
    r0[:, layout.index[groups[massive]]] = 0.0  # the massive channel's band stays exact (huge fp32 ulp)
    r0[top] = 0.0
    k_hat = (k.double() + r0 * inverse).clamp(-FP32_MAX, FP32_MAX).float()
    fp16 = bool(torch.rand(1, generator=g) < 0.5) if witness_dtype is None else witness_dtype == torch.float16
    if fp16:
        witness = witness_of(k, k_hat, layout)  # fp16, rounded up (inf past fp16's range)
    else:
        residual = layout.split(k_hat.double() - k.double())
        witness = round_up_to(residual.norm(dim=-1) * (1 + 2.0**-40), torch.float32)
    v = torch.randn(seq, HEAD_DIM, generator=g).half()
    return dict(tier="A", q=q, k=k, k_hat=k_hat.double(), kernel_keys=k_hat, v=v, witness=witness, layout=layout)


def tier_b_problem(g: torch.Generator, regime, seq: int, mode=None, outlier_pairs=None, key_dtype=None) -> dict:
    """A Tier B problem: O(1) keys through ``DitheredInt8``, the packed kernel path, one mode.

    ``regime``: see :func:`query_exponents`; ``mode``, ``outlier_pairs`` and ``key_dtype``
    (fp16 or fp32) are drawn unless given.
    """
    from witcert.tier_a.bands import BandLayout
    from witcert.tier_a.witness import witness_of
    from witcert.tier_b.counters import StandaloneCounter
    from witcert.tier_b.quantizer import DitheredInt8
    from witcert.kernels.packed_keys import PackedKeys

    key_dtype = _pick(g, (torch.float16, torch.float32)) if key_dtype is None else key_dtype
    k = torch.randn(1, 1, seq, HEAD_DIM, generator=g, dtype=torch.float64) * torch.logspace(-1, 0.5, HEAD_DIM)
    k[..., int(torch.randint(HEAD_DIM, (1,), generator=g))] *= float(_uniform(g, 1, 2000, 1))  # massive channel
    k = k.to(key_dtype)
    granularity = _pick(g, ("token-group", "token", "block-channel"))
    pairs = _pick(g, (0, 0, 2)) if outlier_pairs is None else outlier_pairs
    quantizer = DitheredInt8(granularity=granularity, block=16, outlier_pairs=pairs)
    if quantizer.outlier_pairs:
        quantizer = quantizer.calibrate(k)
    counter = StandaloneCounter(request=torch.tensor([int(torch.randint(1 << 20, (1,), generator=g))]), layer=3,
                                seed=int(torch.randint(1 << 30, (1,), generator=g)))
    store = quantizer.quantize(k, counter)
    k_hat = quantizer.dequantize(store, counter, torch.float64)[0, 0]
    group = {"token-group": quantizer.group, "token": HEAD_DIM, "block-channel": 1}[granularity]
    groups = torch.arange(HEAD_DIM) // group
    q = queries(query_exponents(regime, groups, g), groups, g)
    layout = BandLayout(HEAD_DIM, BANDS)
    witness = witness_of(k[0, 0], k_hat, layout) if bool(torch.rand(1, generator=g) < 0.25) else None
    v = torch.randn(seq, HEAD_DIM, generator=g).half()
    return dict(tier="B", q=q, k=k[0, 0], k_hat=k_hat, v=v, witness=witness, layout=layout, store=store,
                plan=PackedKeys.from_store(store, counter), counter=counter,
                mode=_pick(g, ("min", "delta", "u")) if mode is None else mode)


def exact_eps(problem: dict) -> torch.Tensor:
    """``eps_t = sm q . (k^_t - k_t)`` per head and token (HEADS, S), fp64 from the exact residual."""
    residual = problem["k_hat"] - problem["k"].double()
    return SM_SCALE * problem["q"].double() @ residual.T


def exact_tv(scores: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``TV(softmax(s), softmax(s + eps))`` per row, fp64, accurate for tiny and huge ``eps``.

    ``p~_t = p_t e^{eps_t - L}`` with ``L = log sum p e^{eps}`` (``log1p(sum p expm1(eps))`` when
    every ``|eps| < 1``, where ``s + eps`` would lose ``eps`` to rounding); the TV is the mass
    that leaves: ``sum_t p_t max(0, -expm1(eps_t - L))``, every term in ``[0, p_t]``.
    """
    log_p = torch.log_softmax(scores, -1)
    p = torch.exp(log_p)
    small = eps.abs().amax(-1, keepdim=True) < 1
    log_z = torch.where(small, torch.log1p((p * torch.expm1(eps.clamp(max=1.0))).sum(-1, keepdim=True)),
                        torch.logsumexp(log_p + eps, -1, keepdim=True))
    return (p * torch.clamp(-torch.expm1(eps - log_z), min=0.0)).sum(-1)


def reference_radius(problem: dict) -> torch.Tensor:
    """The torch reference's per-token radius on the fp64 query (HEADS, S), fp64."""
    from witcert.tier_a.witness import logit_bound
    from witcert.tier_b.certificate import tier_b_terms

    q64 = problem["q"].double()
    radius = torch.full((HEADS, problem["k"].shape[0]), math.inf, dtype=torch.float64)
    if problem["witness"] is not None:
        # the HEADS queries read one kv head: (Hq=1, Tq=HEADS, d) against (Hkv=1, S, B)
        radius = logit_bound(q64[None], problem["witness"][None], problem["layout"], sm_scale=SM_SCALE)[0].double()
    if problem["tier"] == "B":
        terms = tier_b_terms(q64.view(1, 1, HEADS, HEAD_DIM), problem["store"], DELTA_LOC, sm_scale=SM_SCALE)
        radius = torch.minimum(radius, terms.combined(problem["mode"])[0, 0])
    return radius


def kernel_attention(problem: dict, splits: int = 1, block_n: int = 32):
    """The kernel's ``DecodeAttention`` for the problem (one batch row, one kv head)."""
    from witcert.kernels.decode_attention import decode_attention, decode_attention_packed

    q, v = problem["q"][None], problem["v"][None, None]
    witness = None if problem["witness"] is None else problem["witness"][None, None]
    if problem["tier"] == "A":
        return decode_attention(q, problem["kernel_keys"][None, None], v, witness, problem["layout"],
                                num_splits=splits, block_n=block_n)
    layout = problem["layout"] if witness is not None else None
    return decode_attention_packed(q, problem["plan"], v, delta_loc=DELTA_LOC, mode=problem["mode"], witness=witness,
                                   layout=layout, num_splits=splits, block_n=block_n)


def check(problem: dict, certificate, tally: AttackTally) -> None:
    """Count the cells of one problem against the exact oracles (see the module docstring)."""
    scores = SM_SCALE * problem["q"].double() @ problem["k"].double().T  # exact keys (HEADS, S)
    eps = exact_eps(problem)
    meter, d_max = certificate.meter[0].double(), certificate.c_max[0]
    if bool(torch.isnan(meter).any() | torch.isnan(d_max).any()) or not bool(((meter >= 0) & (meter <= 1)).all()):
        tally.violations += 1
        tally.notes.append(f"{problem['tier']}: NaN or meter outside [0, 1]")
    tally.add(exact_tv(scores, eps), meter)
    tally.add(eps.abs().amax(-1), d_max)
    # consistency with the reference radius: counted, but kept out of worst_ratio (not an exact value)
    reference = AttackTally(NAME)
    reference.add(reference_radius(problem).amax(-1) * (1 - REFERENCE_FP64), d_max)
    tally.cells += reference.cells
    tally.violations += reference.violations
    tally.notes += [f"reference radius: {note}" for note in reference.notes]


def run(n: int, g: torch.Generator) -> AttackTally:
    """``n`` trials, each one kernel launch over 16 query heads in one magnitude regime."""
    tally = AttackTally(NAME)
    for _ in range(n):
        regime = _pick(g, REGIMES)
        seq = int(torch.randint(1, 49, (1,), generator=g))
        build = tier_a_problem if bool(torch.rand(1, generator=g) < 0.5) else tier_b_problem
        problem = build(g, regime, seq)
        splits, block_n = _pick(g, (1, 2)), _pick(g, (16, 32))
        before = tally.violations
        check(problem, kernel_attention(problem, splits, block_n).certificate, tally)
        if tally.violations > before:
            tally.notes.append(f"  ^ tier {problem['tier']}, regime {regime}, S = {seq}, splits {splits}")
    return tally

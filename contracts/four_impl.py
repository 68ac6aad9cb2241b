"""The four-implementation table (docs/design.md "Verification chain"): kernel, torch, mpmath golden, independent.

For a few small cells (one batch row, 9 query heads over 3 kv heads, ``S = 6`` tokens, d = 64;
Tier A keys through ``rtn-int4`` (large radii) or ``fp8-e4m3`` (small radii)) each certificate
quantity is computed four ways:

==========  ======================================  ======================================
quantity    golden (mpmath, 50 digits)               independent (``decimal``, 60 digits)
==========  ======================================  ======================================
c_t         ``spec.bands.bound_band_witness`` (T2)   Cauchy-Schwarz per band, from T2's text
u-branch    ``spec.dither.logit_bound(mode="u")``    ``u + beta + rho`` from TB's definitions
A           ``spec.golden.a_plus_from_scores``       ``spec.independent.quantities``
meter       ``spec.golden.meter_from_scores``        ``spec.independent.quantities``
unsplit     ``min(1, T1, P1, MN, CS)`` of the golden  the same of ``spec.independent.quantities``
CS, MS      ``spec.golden.chi_square_from_scores``,   ``spec.independent.quantities``
            ``mass_split_from_scores``
==========  ======================================  ======================================

The kernel's per-token radii come from single-token rows (``D = max_t c_t = c_t`` when ``S = 1``);
``A`` and the meter from the full rows. torch: ``witcert.logit_bound``, ``tier_b_logit_bound``,
``witcert.core.bounds.moments``, ``witcert.meter``, ``chi_square_bound``, ``mass_split_bound`` (fp64).
Golden and independent see the exact logits (``q . k^`` of the stored values, at full precision)
and their own exact radii. The kernel reports the unsplit meter ``min(1, T1, P1, MN, CS)`` (MS is
not in its accumulators, ``kernels/certificate.py``): it has values in the ``meter`` row (never below
the golden, which holds MS too) and the ``unsplit meter`` row (within its stated budget), none for
CS and MS alone.

Used by ``contracts/test_four_implementations.py`` (assertions) and
``scripts/four_impl_table.py`` (the printed table).
"""
import dataclasses
import functools
import math
from dataclasses import dataclass
from decimal import Decimal, localcontext

import mpmath
import torch

import witcert
from witcert.core import bounds
from witcert.tier_a.bands import BandLayout
from witcert.tier_b.counters import StandaloneCounter
from witcert.tier_b.quantizer import DitheredInt8
from witcert.kernels.certificate import RADIUS_EXCESS
from witcert.kernels.decode_attention import decode_attention, decode_attention_packed
from witcert.kernels.dither_write import dither_write
from witcert.kernels.packed_keys import PackedKeys
from witcert.kernels.witness_write import witness_write
from witcert.tier_b.packed_store import PackedStore
from witcert.spec import bands as spec_bands
from witcert.spec import dither as spec_dither
from witcert.spec import golden, independent
from witcert.tier_b.certificate import tier_b_logit_bound

Q_HEADS, KV_HEADS, TOKENS, HEAD_DIM, BANDS = 9, 3, 6, 64, 16
GROUP = Q_HEADS // KV_HEADS
DELTA_LOC = 1e-6
GOLDEN_DPS = 70
DECIMAL_DIGITS = 60
IMPLEMENTATIONS = ("kernel", "torch", "golden", "independent")


@dataclass(frozen=True)
class Quantity:
    """One row of the table: values (cells,) per implementation, as mpf/Decimal-convertible
    (an implementation that does not compute the quantity has no key)."""

    name: str
    theorem: str
    values: dict  # implementation -> list of values (one per cell)

    def relative(self, implementation: str, against: str = "golden") -> list[mpmath.mpf]:
        """``(impl - golden) / |golden|`` per cell (0 where both are 0), at ``GOLDEN_DPS`` digits."""
        out = []
        with mpmath.workdps(GOLDEN_DPS):
            for a, b in zip(self.values[implementation], self.values[against]):
                a, b = mpmath.mpf(str(a)), mpmath.mpf(str(b))
                out.append(mpmath.mpf(0) if a == b else (a - b) / abs(b) if b != 0 else mpmath.inf)
        return out


@dataclass(frozen=True)
class Problem:
    """The tensors of the table's cells (one batch row)."""

    q: torch.Tensor  # (1, Hq, d) fp16
    k: torch.Tensor  # (1, Hkv, S, d) fp16 exact keys
    k_hat_a: torch.Tensor  # Tier A reconstruction (fp16, rtn-int4)
    witness: torch.Tensor  # (1, Hkv, S, B) fp16
    v: torch.Tensor
    layout: BandLayout
    store: PackedStore  # Tier B
    counter: StandaloneCounter


SCHEMES = ("rtn-int4", "fp8-e4m3")  # large radii (A ~ 3.5) and small ones (A ~ 1.05)


@functools.lru_cache(maxsize=None)
def problem(seed: int = 31, scheme: str = "rtn-int4") -> Problem:
    generator = torch.Generator().manual_seed(seed)
    k = (torch.randn(1, KV_HEADS, TOKENS, HEAD_DIM, generator=generator) * torch.logspace(-1, 0.5, HEAD_DIM)).half()
    v = torch.randn(1, KV_HEADS, TOKENS, HEAD_DIM, generator=generator).half()
    q = torch.randn(1, Q_HEADS, HEAD_DIM, generator=generator).half()
    layout = BandLayout(HEAD_DIM, BANDS, "rotate_half")
    k_hat = witcert.get_scheme(scheme)(k, role="key")
    counter = StandaloneCounter(request=torch.tensor([3]), layer=1, seed=seed)
    store = dither_write(k, DitheredInt8(), counter)
    return Problem(q, k, k_hat, witness_write(k, k_hat, layout), v, layout, store, counter)


# ----------------------------------------------------------------------------- kernel side


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """(1, H, S, ...) -> (S, H, 1, ...): every token becomes its own single-token row."""
    return x.transpose(0, 2).contiguous()


def _token_row_plan(p: Problem) -> PackedKeys:
    """The packed plan with every token as its own batch row (same counter words, same dither)."""
    plan = PackedKeys.from_store(p.store, p.counter)
    store = dataclasses.replace(p.store, payload=_token_rows(p.store.payload), scales=_token_rows(p.store.scales),
                                outliers=_token_rows(p.store.outliers))
    return dataclasses.replace(plan, store=store, scales=store.scales,
                               token_words=plan.token_words.transpose(0, 1).contiguous(),
                               head_words=plan.head_words.expand(TOKENS, -1, -1).contiguous(),
                               outlier_slot=plan.outlier_slot.repeat(TOKENS, 1),
                               outlier_channels=plan.outlier_channels.repeat(TOKENS, 1))


def kernel_radii(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel ``c_t`` (Tier A) and u-branch radius (Tier B), each (Hq, S) fp64, from single-token rows."""
    q_rows = p.q.expand(TOKENS, -1, -1).contiguous()
    v_rows = _token_rows(p.v)
    tier_a = decode_attention(q_rows, _token_rows(p.k_hat_a), v_rows, _token_rows(p.witness), p.layout, num_splits=1)
    tier_b = decode_attention_packed(q_rows, _token_row_plan(p), v_rows, delta_loc=DELTA_LOC, mode="u",
                                     n_union=TOKENS, num_splits=1)
    return tier_a.certificate.c_max.T, tier_b.certificate.c_max.T  # (Hq, S)


def kernel_certificate(p: Problem):
    """Kernel certificate of the full Tier A rows: (A upper bound, meter), each (Hq,)."""
    cert = decode_attention(p.q, p.k_hat_a, p.v, p.witness, p.layout, num_splits=2).certificate
    return 1 + cert.a_minus_one[0], cert.meter[0].double()


def kernel_budget() -> dict:
    """The kernel's stated round-ups: its fp32 radii are at most ``(1 + 2 kappa)`` x the exact ones.

    Both radii are computed in fp64 and rounded up to fp32 (``kernels/radius.py``): ``2 kappa``
    is ``RADIUS_EXCESS`` for either tier.
    """
    return {"kappa_c": RADIUS_EXCESS / 2, "kappa_b": RADIUS_EXCESS / 2}


# ----------------------------------------------------------------------------- torch side


def torch_radii(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    q = p.q.double().view(Q_HEADS, 1, HEAD_DIM)  # (Hq, Tq=1, d) against (Hkv, S, B): GQA inside
    tier_a = witcert.logit_bound(q, p.witness[0], p.layout).reshape(Q_HEADS, TOKENS)
    tier_b = tier_b_logit_bound(p.q.view(1, Q_HEADS, 1, HEAD_DIM), p.store, DELTA_LOC, mode="u")
    return tier_a.double(), tier_b.reshape(Q_HEADS, TOKENS).double()


def torch_scores(p: Problem) -> torch.Tensor:
    keys = p.k_hat_a[0].double().repeat_interleave(GROUP, 0)  # (Hq, S, d)
    return torch.einsum("hd,hsd->hs", p.q[0].double(), keys) / math.sqrt(HEAD_DIM)


def torch_certificate(p: Problem) -> dict:
    """A, the meter, the unsplit meter (the enclosure without MS, as the kernel's), CS and MS, each (Hq,)."""
    scores, radius = torch_scores(p), torch_radii(p)[0]
    m = bounds.moments(scores, radius)
    unsplit = bounds.Enclosure(m.k_hi, m.j_hi, m.a_minus_lo, m.max_c, m.second_hi).meter()
    return {"A": 1 + m.k_hi, "meter": witcert.meter(scores, radius), "unsplit meter": unsplit,
            "CS": bounds.chi_square_bound(scores, radius), "MS": bounds.mass_split_bound(scores, radius)}


# ----------------------------------------------------------------------------- golden side


def _head_inputs(p: Problem, h: int):
    kv = h // GROUP
    q = [float(x) for x in p.q[0, h].double()]
    k_hat = [[float(x) for x in row] for row in p.k_hat_a[0, kv].double()]
    w = [[float(x) for x in row] for row in p.witness[0, kv].double()]
    return q, k_hat, w


def golden_radii_and_scores(p: Problem):
    """Golden ``c_t`` (T2), u-branch radius (TB) and logits per head: lists (Hq) of lists (S)."""
    scale_elem = p.store.scale_per_element()[0]  # (Hkv, S, d) fp64
    radii, u_branch, scores = [], [], []
    with mpmath.workdps(GOLDEN_DPS):
        for h in range(Q_HEADS):
            q, k_hat, w = _head_inputs(p, h)
            radii.append([spec_bands.bound_band_witness(q, w[t], BANDS, "rotate_half") for t in range(TOKENS)])
            scores.append([mpmath.fsum(mpmath.mpf(a) * mpmath.mpf(b) for a, b in zip(q, k_hat[t]))
                           / mpmath.sqrt(HEAD_DIM) for t in range(TOKENS)])
            s_rows = scale_elem[h // GROUP]
            u_branch.append([spec_dither.logit_bound(q, [float(x) for x in s_rows[t]], 1 / mpmath.sqrt(HEAD_DIM),
                                                     TOKENS, DELTA_LOC, mode="u") for t in range(TOKENS)])
    return radii, u_branch, scores


def golden_certificate(scores, radii) -> dict:
    def per_cell(fn):
        return [fn(s, c) for s, c in zip(scores, radii)]

    def unsplit(s, c):
        return min(mpmath.mpf(1), golden.eform_from_scores(s, c), golden.two_sided_from_scores(s, c),
                   golden.maxnorm_from_scores(s, c), golden.chi_square_from_scores(s, c))

    return {"A": per_cell(golden.a_plus_from_scores), "meter": per_cell(golden.meter_from_scores),
            "unsplit meter": per_cell(unsplit), "CS": per_cell(golden.chi_square_from_scores),
            "MS": per_cell(golden.mass_split_from_scores)}


# ----------------------------------------------------------------------------- independent side


def _dec(x) -> Decimal:
    return Decimal(float(x)) if not isinstance(x, Decimal) else x


def independent_radii_and_scores(p: Problem):
    """c_t from T2's statement, ``u + beta + rho`` from TB's definitions, logits: all in decimal."""
    scale_elem = p.store.scale_per_element()[0]
    radii, u_branch, scores = [], [], []
    with localcontext() as ctx:
        ctx.prec = DECIMAL_DIGITS
        inv_sqrt_d = 1 / Decimal(HEAD_DIM).sqrt()
        half, per_band = HEAD_DIM // 2, HEAD_DIM // (2 * BANDS)
        for h in range(Q_HEADS):
            q, k_hat, w = _head_inputs(p, h)
            qd = [_dec(x) for x in q]
            # band b holds RoPE pairs j in [b P, (b+1) P), pair j = (j, j + d/2) (rotate_half)
            q_band = [sum(qd[j] ** 2 + qd[j + half] ** 2 for j in range(b * per_band, (b + 1) * per_band)).sqrt()
                      for b in range(BANDS)]
            radii.append([inv_sqrt_d * sum(q_band[b] * _dec(w[t][b]) for b in range(BANDS)) for t in range(TOKENS)])
            scores.append([inv_sqrt_d * sum(a * _dec(b) for a, b in zip(qd, k_hat[t])) for t in range(TOKENS)])
            s_rows = scale_elem[h // GROUP]
            u_row = []
            for t in range(TOKENS):
                s = [_dec(x) for x in s_rows[t]]
                variance = inv_sqrt_d**2 * sum(qc**2 * sc**2 for qc, sc in zip(qd, s)) / 12
                u = (2 * variance * (2 * Decimal(TOKENS) / _dec(DELTA_LOC)).ln()).sqrt()
                l1 = inv_sqrt_d * sum(abs(qc) * sc for qc, sc in zip(qd, s))
                unit = Decimal(2) ** -24
                u_row.append(u + l1 * Decimal(2) ** -25 + l1 * Decimal("127.5") * (2 * unit + unit**2))
            u_branch.append(u_row)
    return radii, u_branch, scores


def independent_certificate(scores, radii) -> dict:
    found = [independent.quantities(s, c=c) for s, c in zip(scores, radii)]
    return {"A": [f["a_plus"] for f in found], "meter": [f["meter"] for f in found],
            "unsplit meter": [min(Decimal(1), f["eform"], f["two_sided"], f["maxnorm"], f["chi_square"]) for f in found],
            "CS": [f["chi_square"] for f in found], "MS": [f["mass_split"] for f in found]}


# ----------------------------------------------------------------------------- the table


@functools.lru_cache(maxsize=None)
def table(seed: int = 31, scheme: str = "rtn-int4") -> tuple[Quantity, ...]:
    """The four implementations of c_t, the u-branch radius, A and the meter, per cell."""
    p = problem(seed, scheme)
    k_radii, k_u = kernel_radii(p)
    t_radii, t_u = torch_radii(p)
    g_radii, g_u, g_scores = golden_radii_and_scores(p)
    i_radii, i_u, i_scores = independent_radii_and_scores(p)
    k_a, k_meter = kernel_certificate(p)
    t = torch_certificate(p)
    g = golden_certificate(g_scores, g_radii)
    i = independent_certificate(i_scores, i_radii)

    def flat(x):
        return [v for row in x for v in row] if isinstance(x, list) else [float(v) for v in x.reshape(-1)]

    return (
        Quantity("c_t (Tier A)", "T2", {"kernel": flat(k_radii), "torch": flat(t_radii), "golden": flat(g_radii),
                                         "independent": flat(i_radii)}),
        Quantity("u_t + beta_t + rho_t (Tier B)", "TB", {"kernel": flat(k_u), "torch": flat(t_u), "golden": flat(g_u),
                                                         "independent": flat(i_u)}),
        Quantity("A", "T1", {"kernel": flat(k_a), "torch": flat(t["A"]), "golden": g["A"], "independent": i["A"]}),
        Quantity("meter", "T1/P1/MN/CS/MS", {"kernel": flat(k_meter), "torch": flat(t["meter"]), "golden": g["meter"],
                                             "independent": i["meter"]}),
        Quantity("unsplit meter", "T1/P1/MN/CS", {"kernel": flat(k_meter), "torch": flat(t["unsplit meter"]),
                                                  "golden": g["unsplit meter"], "independent": i["unsplit meter"]}),
        Quantity("chi-square", "CS", {"torch": flat(t["CS"]), "golden": g["CS"], "independent": i["CS"]}),
        Quantity("mass-split", "MS", {"torch": flat(t["MS"]), "golden": g["MS"], "independent": i["MS"]}),
    )


def markdown(quantities) -> str:
    """The table as markdown: one row per quantity, the worst cell per implementation pair."""
    lines = ["| quantity | theorem | cells | golden (cell 0) | kernel - golden (max rel) | torch - golden (max rel) "
             "| independent - golden (max rel) | kernel >= golden |",
             "|---|---|---|---|---|---|---|---|"]
    for quantity in quantities:
        rel = {impl: quantity.relative(impl) for impl in ("kernel", "torch", "independent") if impl in quantity.values}
        worst = {impl: mpmath.nstr(max(abs(r) for r in values), 3) for impl, values in rel.items()}
        never_below = "—" if "kernel" not in rel else "yes" if all(r >= 0 for r in rel["kernel"]) else "NO"
        golden0 = mpmath.nstr(mpmath.mpf(str(quantity.values["golden"][0])), 20)
        lines.append(f"| {quantity.name} | {quantity.theorem} | {len(quantity.values['golden'])} | {golden0} "
                     f"| {worst.get('kernel', '— (not in the kernel)')} | {worst['torch']} "
                     f"| {worst['independent']} | {never_below} |")
    return "\n".join(lines)


def kernel_a_budget(d_max: float) -> float:
    """Stated relative slack of the kernel's ``A - 1`` for this problem (``contract_oracles.relative_budget``)."""
    from contract_oracles import relative_budget

    return relative_budget(TOKENS, 2, d_max, bands=BANDS)

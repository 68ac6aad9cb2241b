"""Synthetic Tier A workloads (no tests here): key families and query adversaries.

Shared by ``tests/test_schemes.py`` (per-query soundness) and ``scripts/tier_a_table.py``
(the closing table). Everything is generated from an explicit ``torch.Generator``.

Key families (``(Hkv, S, d)``, RoPE pairs under the layout's convention):

- ``gaussian``: i.i.d. N(0, 1).
- ``massive``: Gaussian, plus ``MASSIVE_PAIRS`` RoPE pairs per kv head (fixed across tokens, as
  massive activations are) whose energy is 50-100x that of a typical pair.

Query kinds (``(Hq, Tq, d)``, ``Hq = G Hkv``, query head ``h`` reads kv head ``h // G``):

- ``random``: N(0, 1) times a per-query temperature in [0.5, 3] (flat to peaked attention).
- ``aligned``: the adversary for Theorem 2: per band, ``q_b`` is parallel to the residual
  ``r_{t*,b}`` of one target token, so ``|eps_{t*}| = c_{t*}`` exactly (Cauchy-Schwarz is an
  equality); the radius ``c_{t*}`` is drawn in [0.05, 4] and the sign at random.
"""
from dataclasses import dataclass

import torch

import witcert

MASSIVE_PAIRS = 3
KEY_FAMILIES = ("gaussian", "massive")
QUERY_KINDS = ("random", "aligned")


@dataclass(frozen=True)
class Workload:
    """One synthetic layer: queries, exact keys and values, the scheme's reconstructions."""

    q: torch.Tensor  # (Hq, Tq, d)
    k: torch.Tensor  # (Hkv, S, d)
    v: torch.Tensor  # (Hkv, S, d)
    k_hat: torch.Tensor
    v_hat: torch.Tensor
    target: torch.Tensor | None  # (Hq, Tq) target token of the aligned adversary


def synthetic_keys(family: str, hkv: int, s: int, layout: witcert.BandLayout, gen: torch.Generator) -> torch.Tensor:
    """Keys of the named family, fp32 (Hkv, S, d)."""
    k = torch.randn(hkv, s, layout.head_dim, generator=gen)
    if family == "gaussian":
        return k
    if family != "massive":
        raise ValueError(f"unknown key family {family!r}")
    for h in range(hkv):
        pairs = torch.randperm(layout.head_dim // 2, generator=gen)[:MASSIVE_PAIRS]
        for j in pairs.tolist():
            energy = 50 + 50 * torch.rand((), generator=gen).item()  # x typical pair energy
            k[h, :, layout.pairs[j]] *= energy**0.5
    return k


def random_queries(hq: int, tq: int, d: int, gen: torch.Generator) -> torch.Tensor:
    temperature = 0.5 + 2.5 * torch.rand(hq, tq, 1, generator=gen)
    return torch.randn(hq, tq, d, generator=gen) * temperature


def aligned_queries(
    k: torch.Tensor, k_hat: torch.Tensor, groups: int, tq: int, layout: witcert.BandLayout, sm_scale: float,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries aligned band by band with one target token's residual: (Hq, Tq, d) fp64, targets (Hq, Tq)."""
    hkv, s, d = k.shape
    residual = (k_hat.double() - k.double())  # (Hkv, S, d)
    target = torch.randint(0, s, (hkv, groups, tq), generator=gen)
    r = torch.gather(residual[:, None].expand(hkv, groups, s, d), 2, target[..., None].expand(hkv, groups, tq, d))
    bands = layout.split(r)  # (Hkv, G, Tq, B, 2P)
    norms = layout.band_norms(r)  # (Hkv, G, Tq, B)
    fallback = torch.randn(bands.shape, generator=gen, dtype=torch.float64)
    unit = torch.where(norms[..., None] > 0, bands / norms.clamp_min(1e-300)[..., None], fallback / fallback.norm(dim=-1, keepdim=True))
    alpha = torch.rand(norms.shape, generator=gen, dtype=torch.float64) + 0.05  # (Hkv, G, Tq, B)
    radius = 0.05 + 3.95 * torch.rand(hkv, groups, tq, 1, generator=gen, dtype=torch.float64)
    reach = sm_scale * (alpha * norms).sum(-1, keepdim=True)  # c_{t*} before scaling
    alpha = torch.where(reach > 0, alpha * radius / reach.clamp_min(1e-300), alpha)
    sign = torch.where(torch.rand(hkv, groups, tq, 1, 1, generator=gen) < 0.5, -1.0, 1.0).double()
    q_banded = sign * alpha[..., None] * unit  # (Hkv, G, Tq, B, 2P)
    q = torch.empty(hkv, groups, tq, d, dtype=torch.float64)
    q[..., layout.index.flatten()] = q_banded.flatten(-2)
    return q.reshape(hkv * groups, tq, d), target.reshape(hkv * groups, tq)


def workload(
    scheme: str, family: str, kind: str, layout: witcert.BandLayout, hkv: int, groups: int, tq: int, s: int,
    seed: int, sm_scale: float,
) -> Workload:
    """Build one synthetic layer for ``scheme`` (keys, values, reconstructions, queries)."""
    gen = torch.Generator().manual_seed(seed)
    k = synthetic_keys(family, hkv, s, layout, gen)
    v = torch.randn(hkv, s, layout.head_dim, generator=gen)
    fn = witcert.get_scheme(scheme)
    k_hat, v_hat = fn(k, role="key"), fn(v, role="value")
    if kind == "random":
        return Workload(random_queries(hkv * groups, tq, layout.head_dim, gen), k, v, k_hat, v_hat, None)
    q, target = aligned_queries(k, k_hat, groups, tq, layout, sm_scale, gen)
    return Workload(q, k, v, k_hat, v_hat, target)

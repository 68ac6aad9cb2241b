"""fp64 queries with components far below fp32's range: the per-token bounds stay upper bounds.

Implementation: ``witcert.logit_bound`` (T2) and ``witcert.tier_b_logit_bound`` (TB). Oracle: the
same quantities in mpmath at 60 digits from the exact inputs. Domain: query components of 1e-200
(their squares underflow fp64) and 1e-310 (fp64 subnormals). Tolerance: never below the exact value.
"""
import mpmath
import pytest
import torch

from witcert import BandLayout, DitheredInt8, logit_bound, tier_b_logit_bound, witness_of
from witcert.tier_b.counters import StandaloneCounter
from tests.test_tier_b import spec_bound_of_token

TINY = 1e-200


def _tiny_queries(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * TINY


@pytest.mark.parametrize("tiny", [TINY, 1e-310])
def test_tier_a_bound_covers_tiny_fp64_queries(tiny):
    layout = BandLayout(64, bands=16)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 8, 64, generator=g)
    w = witness_of(k, k + 1e-3 * torch.randn(1, 8, 64, generator=g), layout)  # (1, 8, B)
    q = _tiny_queries((1, 1, 64), seed=1)[0] / TINY * tiny  # one head, one query: (1, 64) as (Hq=1, Tq=1, d)
    c = logit_bound(q[None], w, layout, sm_scale=0.125)[:, 0]  # (1, S)
    with mpmath.workdps(60):
        for t in range(8):
            exact = 0
            for b in range(layout.bands):
                coords = layout.index[b].tolist()
                norm = mpmath.sqrt(mpmath.fsum(mpmath.mpf(q[0, i].item()) ** 2 for i in coords))
                exact += norm * mpmath.mpf(w[0, t, b].item())
            assert mpmath.mpf(c[0, t].item()) >= exact * mpmath.mpf(0.125) > 0


@pytest.mark.parametrize("mode", ["min", "u", "delta"])
def test_tier_b_bound_covers_tiny_fp64_queries(mode):
    g = torch.Generator().manual_seed(2)
    store = DitheredInt8().quantize(torch.randn(2, 16, 64, generator=g), StandaloneCounter(request=0, layer=0))
    q = _tiny_queries((2, 3, 64), seed=3)
    c = tier_b_logit_bound(q, store, 1e-4, mode=mode)
    with mpmath.workdps(60):
        for h, i, t in [(0, 0, 0), (1, 2, 15), (0, 1, 7)]:
            exact = spec_bound_of_token(q, store, h, i, t, 0.125, 1e-4, mode)
            assert c[h, i, t].item() >= exact > 0


def test_kernel_range_attack_finds_no_violation():
    """``witcert fuzz``'s kernel attack class (``witcert.verification.attacks.kernel_range``): two trials.

    Implementation: the Triton decode kernel (interpreter without CUDA) on fp32 queries drawn over
    the whole fp32 range. Oracle: exact TV and logit errors (fp64), the torch reference radius.
    Domain: two seeded trials (32 cells x 3 checks). Tolerance: 0 violations.
    """
    from witcert.verification.attacks import ATTACKS, kernel_range

    assert "kernel_range" in ATTACKS
    tally = kernel_range.run(2, torch.Generator().manual_seed(3))
    assert tally.cells > 0
    assert tally.violations == 0, tally.notes


def test_kernel_range_oracle_resolves_tiny_tv():
    """The attack's exact TV keeps a logit error of 1e-25 that ``s + eps`` would lose in fp64.

    Oracle: first order, ``TV = 1/2 sum_t p_t |eps_t - E_p eps|`` (exact to ``O(eps^2)``).
    """
    from witcert.verification.attacks.kernel_range import exact_tv

    scores = torch.tensor([[0.0, 1.0, -2.0]], dtype=torch.float64)
    eps = torch.tensor([[1e-25, -3e-25, 2e-25]], dtype=torch.float64)
    p = torch.softmax(scores, -1)
    first_order = 0.5 * (p * (eps - (p * eps).sum(-1, keepdim=True)).abs()).sum(-1)
    assert torch.allclose(exact_tv(scores, eps), first_order, rtol=1e-12, atol=0)
    assert float(first_order) > 0

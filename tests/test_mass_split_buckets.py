"""The torch chi-square (CS) and mass-split (MS) bounds beyond the golden cells of ``test_meter``.

Implementation: ``witcert.core.bounds.split_buckets``, ``chi_square_bound``, ``mass_split_bound``,
``witcert.meter`` and the ``Enclosure`` the kernel builds (fp32 and fp64).
Oracles: ``witcert.spec.bounds.mass_split_thresholds`` (the exact default grid, mpmath) for the
buckets; the 50-digit golden (``witcert.spec.golden``) for the bounds.
Domain: radii on, just below and just above grid values, subnormal and huge ``D``, zeros, ``inf``;
rows of S = 512 with the large radii on low-mass tokens. Tolerance: buckets exact; bounds never
below the golden (fp32), within 1e-12 relative (fp64, moderate rows).
"""
import math

import mpmath
import pytest
import torch

import witcert
from witcert.core import bounds
from witcert.spec import bounds as spec
from witcert.spec import golden
from tests.oracles import to_mpf


def _grid(d: float) -> list[float]:
    with mpmath.workdps(40):
        return [float(g) for g in spec.mass_split_thresholds((1.0,), (d,))]


def _edge_radii(d: float, dtype: torch.dtype) -> torch.Tensor:
    """Radii on every threshold, one float below and above it, and 0 (as ``dtype`` values)."""
    out = [0.0, d]
    for g in _grid(d)[1:]:
        out += [g, math.nextafter(g, 0.0), math.nextafter(g, math.inf)]
    values = torch.tensor(out, dtype=torch.float64).to(dtype)
    return values.clamp(max=values[1])  # D stays the maximum (rounding to fp32 may move it)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d", [1.0, 0.75, 0.7, 0.3, 3.0, 700.0, 2.0**-40, 1e-30, 2.0**-130, 2.0**-1060])
def test_buckets_are_the_spec_low_sets(dtype, d):
    """r_t >= k exactly when c_t <= g_k, the spec's k-th threshold (exact comparisons in mpmath)."""
    c = _edge_radii(d, dtype)
    d_value = float(c.max())
    if d_value == 0.0:
        pytest.skip("D underflowed in this dtype")
    r = bounds.split_buckets(c, c.max())
    with mpmath.workdps(60):
        grid = spec.mass_split_thresholds((1.0,) * len(c), c.double().tolist())
    assert to_mpf(d_value) == grid[0]
    for k, g in enumerate(grid[1:], start=1):
        for t, ct in enumerate(c.double().tolist()):
            if ct > 0:  # a zero radius may sit in any bucket: it adds nothing anywhere
                assert bool(r[t] >= k) == (mpmath.mpf(ct) <= g), (k, ct, float(g))


def test_infinite_radius_lands_in_no_low_set():
    c = torch.tensor([0.5, math.inf, 0.1])
    r = bounds.split_buckets(c, c.max())
    assert r[1] == 0 and not torch.isnan(bounds.mass_split_bound(torch.zeros(3), c))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(2))
def test_large_rows_never_below_golden(dtype, seed):
    """S = 512, a peaked p~ with the large radii on low-mass tokens (where CS and MS bind)."""
    g = torch.Generator().manual_seed(seed)
    s = 512
    scores = torch.randn(1, s, generator=g, dtype=torch.float64) * 3
    scores[0, :8] += 12.0  # a few heavy tokens
    c = torch.rand(1, s, generator=g, dtype=torch.float64) * 0.02
    c[0, 8:] += torch.rand(s - 8, generator=g, dtype=torch.float64) * (0.5 + seed)  # large c on light tokens
    scores, c = scores.to(dtype), c.to(dtype)
    sl, cl = scores[0].double().tolist(), c[0].double().tolist()
    for implementation, oracle in ((bounds.chi_square_bound, golden.chi_square_from_scores),
                                   (bounds.mass_split_bound, golden.mass_split_from_scores)):  # MS <= every other
        value, exact = to_mpf(implementation(scores, c).item()), oracle(sl, cl)
        assert value >= exact
        if dtype == torch.float64:
            assert value <= exact * (1 + mpmath.mpf("1e-12"))


def test_meter_binds_on_cs_and_ms_where_the_max_radius_has_little_mass():
    """One token of mass ~1e-4 with c = 5, the rest c = 0.01 (issue 12): tanh(D/2) = 0.987, the
    meter is far below it (MS splits the large radius off) and still above the exact sup over the box."""
    scores = torch.tensor([[0.0, math.log(1e-4)]], dtype=torch.float64)
    c = torch.tensor([[0.01, 5.0]], dtype=torch.float64)
    meter = witcert.meter(scores, c).item()
    assert meter < bounds.maxnorm_bound(scores, c).item() / 20
    assert to_mpf(meter) >= golden.sup_box_tv_exhaustive([0.0, math.log(1e-4)], [0.01, 5.0])


def test_chi_square_is_exactly_zero_at_zero_radii():
    """sqrt would magnify an underflow slack (~1e-307 -> 1e-154): s <= max(expm1 c) k keeps CS = 0."""
    for dtype in (torch.float32, torch.float64):
        assert bounds.chi_square_bound(torch.zeros(1, 5, dtype=dtype), torch.zeros(1, 5, dtype=dtype)).item() == 0.0


def test_enclosure_without_cs_and_ms_is_the_previous_meter():
    """The kernel builds ``Enclosure(k, j, A-, D)``: without ``second_hi`` and ``split`` the meter is
    min(1, T1, P1, MN), and CS is ``inf``."""
    m = bounds.moments(torch.tensor([[0.0, 1.0, -1.0]]), torch.tensor([[0.1, 0.3, 0.2]]))
    bare = bounds.Enclosure(m.k_hi, m.j_hi, m.a_minus_lo, m.max_c)
    expected = torch.minimum(torch.minimum(m.eform(), m.two_sided()), m.maxnorm()).clamp(max=1.0)
    assert torch.equal(bare.meter(), expected)
    assert bare.chi_square().item() == math.inf
    assert m.meter().item() <= bare.meter().item()

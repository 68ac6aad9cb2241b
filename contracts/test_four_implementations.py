"""Contract: four implementations of c_t, the Tier B radius, A, the meter, CS and MS agree (docs/design.md "Verification chain").

Implementations: the Triton kernel, the torch reference, the 50-digit mpmath golden (``spec``)
and an independent ``decimal`` implementation written from the theorem statements
(``contract_oracles``-style machinery in ``contracts/four_impl.py``).
Domain: 9 cells per scheme (one row, GQA 9/3, S = 6, d = 64): Tier A over rtn-int4 keys (A ~ 3.5)
and fp8-e4m3 keys (A ~ 1.05), Tier B packed keys (u-branch radius ``u_t + beta_t + rho_t``).
Tolerances:

* golden vs independent: 40 significant digits (docs/design.md "Verification chain");
* torch (fp64) vs golden: 1e-12 relative, never below (each rounds up); the Tier B radius is
  rounded up to fp32 by the reference: up to ``2^-22`` above;
* kernel (fp64 radii rounded up to fp32) vs golden: never below; above by at most its stated
  round-up -- ``2 kappa = RADIUS_EXCESS`` for ``c_t`` and the Tier B radius
  (``kernels/certificate.py``), the ``A - 1`` budget ``kernel_a_budget`` for ``A`` (relative to
  ``A - 1``) and twice that for the unsplit meter ``min(1, T1, P1, MN, CS)``, which is what the
  kernel reports; against the full meter (MS included) only never below. The kernel has no MS
  values (registry row MS: ``kernel=None``).
"""
import mpmath
import pytest

from four_impl import SCHEMES, kernel_a_budget, kernel_budget, table

DIGITS = mpmath.mpf("1e-40")
TORCH_FP64 = mpmath.mpf("1e-12")
GOLDEN_ROUNDING = mpmath.mpf("1e-45")  # the golden is rounded to 50 digits


def _quantity(name, scheme):
    return {q.name: q for q in table(31, scheme)}[name]


NAMES = ("c_t (Tier A)", "u_t + beta_t + rho_t (Tier B)", "A", "meter", "unsplit meter", "chi-square", "mass-split")
KERNEL_BUDGETED = ("c_t (Tier A)", "u_t + beta_t + rho_t (Tier B)", "A", "unsplit meter")


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", NAMES)
def test_golden_and_independent_agree_to_40_digits(name, scheme):
    assert max(abs(r) for r in _quantity(name, scheme).relative("independent")) <= DIGITS


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", NAMES)
def test_torch_is_an_upper_bound_within_fp64_or_its_fp32_round_up(name, scheme):
    rel = _quantity(name, scheme).relative("torch")
    ceiling = mpmath.mpf(2) ** -22 if name.startswith("u_t") else TORCH_FP64
    assert all(-GOLDEN_ROUNDING <= r <= ceiling for r in rel)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_kernel_meter_never_below_the_full_golden_meter(scheme):
    """The kernel's meter is sound against the meter with MS (it is never below min(1, T1, P1, MN, CS))."""
    rel = _quantity("meter", scheme).relative("kernel")
    assert rel and all(r >= 0 for r in rel)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", KERNEL_BUDGETED)
def test_kernel_never_below_golden_and_within_its_stated_bound(name, scheme):
    quantity = _quantity(name, scheme)
    rel = quantity.relative("kernel")
    assert all(r >= 0 for r in rel), f"{name}: kernel below the golden value"
    budget = kernel_budget()
    d_max = max(float(v) for v in _quantity("c_t (Tier A)", scheme).values["kernel"])
    if name == "c_t (Tier A)":
        ceiling = [2 * budget["kappa_c"]] * len(rel)
    elif name.startswith("u_t"):
        ceiling = [2 * budget["kappa_b"]] * len(rel)
    else:
        # relative to A - 1 (A) or to the meter itself; A's excess is (A - 1) times the budget
        factor = 1 if name == "A" else 2
        goldens = [mpmath.mpf(str(v)) for v in quantity.values["golden"]]
        scale = [(g - 1) / g if name == "A" else 1 for g in goldens]
        ceiling = [factor * kernel_a_budget(d_max) * s for s in scale]
    assert all(r <= c for r, c in zip(rel, ceiling)), f"{name}: kernel above its stated rounding bound"

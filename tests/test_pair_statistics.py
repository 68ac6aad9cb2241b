"""The written tokens' statistics in one pass over stacked keys and values (witcert.fastpath.pair_statistics, ``L1``).

Oracle: exact rational arithmetic (``fractions.Fraction`` of every fp64 input and output): each returned band norm,
value residual norm and value norm, squared, is at least the exact sum of squares of the exact differences; and
it is tight: within one fp16 step (witness), 2^-40 relative (fp64 norms) of the general statistics
(:func:`witcert.tier_a.observation.stored_statistics`, the store's former path). Domain: fp32, bf16 and fp16 inputs
spread over their whole range (fp32 subnormals down to 2^-149 and values up to 3e38, so differences up to 2^129),
exact zeros and equal pairs, 1, 2, 3 and 17 tokens, eager and compiled (a fallback to eager fails: RuntimeWarning
is an error). Adversary: NaN or inf in either input clears ``finite`` and a store refuses the write as before.
Tolerance: none on the upper-bound property.
"""
from fractions import Fraction

import pytest
import torch

from witcert.core.rounding import round_up_to
from witcert.fastpath.pair_statistics import pair_norms, pair_statistics
from witcert.integrations.hf.codecs import IntCodes
from witcert.integrations.hf.compressed_cache import CompressedLayer
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.observation import stored_statistics

LAYOUT = BandLayout(64, 16)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _pair(dtype, tokens, seed=0):
    """Exact and decoded stacks (2, 1, 2, tokens, 64) over the dtype's range, with zeros and equal entries."""
    gen = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    low, high = (-149, 127) if dtype == torch.float32 else ((-24, 15) if dtype == torch.float16 else (-133, 127))
    exponent = torch.randint(low, high, (2, 1, 2, tokens, 64), generator=gen).double()
    exact = (torch.randn(2, 1, 2, tokens, 64, generator=gen, dtype=torch.float64) * 2.0**exponent)
    exact = exact.clamp(-info.max, info.max).to(dtype)
    far = torch.randint(low, high, exact.shape, generator=gen).double()
    decoded = (exact.double() + torch.randn(exact.shape, generator=gen, dtype=torch.float64) * 2.0**far)
    decoded = decoded.clamp(-info.max, info.max).to(dtype)
    exact[..., 0, :8] = 0  # zeros, an exact band and a value row that reconstructs exactly
    decoded[..., 0, :8] = 0
    decoded[1, ..., -1, :] = exact[1, ..., -1, :]
    return exact, decoded


def _sum_squares(rows) -> list:
    return [sum((Fraction(float(x)) ** 2 for x in row), Fraction(0)) for row in rows]


def _covers(norms: torch.Tensor, exact_squares: list) -> bool:
    """Each norm squared >= its exact sum of squares (``inf``, the fp16 witness's overflow, covers anything)."""
    return all(n == float("inf") or Fraction(n) ** 2 >= s for n, s in zip(norms.double().flatten().tolist(), exact_squares))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("tokens", [1, 2, 3, 17])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_norm_is_an_upper_bound_and_tight(dtype, tokens, compiled, recwarn):
    exact, decoded = _pair(dtype, tokens, seed=tokens)
    with torch.no_grad():
        witness, rho, v_norm, finite = pair_statistics(exact, decoded, LAYOUT, compiled=compiled)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], "fell back to eager"
    assert bool(finite) and witness.dtype == torch.float16 and rho.dtype == torch.float32
    # the exact differences, as rationals of the inputs
    keys = [[Fraction(float(a)) - Fraction(float(b)) for a, b in zip(band_d, band_x)]
            for band_d, band_x in zip(LAYOUT.split(decoded[0].double()).reshape(-1, 4).tolist(),
                                      LAYOUT.split(exact[0].double()).reshape(-1, 4).tolist())]
    assert _covers(witness, [sum(r * r for r in row) for row in keys])
    values = [[Fraction(float(a)) - Fraction(float(b)) for a, b in zip(row_d, row_x)]
              for row_d, row_x in zip(decoded[1].double().reshape(-1, 64).tolist(),
                                      exact[1].double().reshape(-1, 64).tolist())]
    assert _covers(rho, [sum(x * x for x in row) for row in values])
    assert _covers(v_norm, _sum_squares(exact[1].double().reshape(-1, 64).tolist()))
    # tight: the general statistics' values, within one fp16 step (witness) and a few fp64 ulps (norms)
    general = stored_statistics(*(t.contiguous() for t in (exact[0], decoded[0], exact[1], decoded[1])), LAYOUT)
    step_up = round_up_to(general[0].double() * (1 + 2.0**-10), torch.float16)
    assert bool((witness <= step_up).all())
    assert bool((rho.double() <= general[1].double() * (1 + 2.0**-20) + 2.0**-149).all())
    assert bool((v_norm <= general[2] * (1 + 2.0**-40)).all())


@pytest.mark.parametrize("compiled", [False, True])
def test_the_fp64_norms_are_those_the_statistics_round(compiled):
    exact, decoded = _pair(torch.float32, 5)
    keys, rho, v_norm, _ = pair_norms(exact, decoded, LAYOUT, compiled=compiled)
    witness, rho32, v_norm2, _ = pair_statistics(exact, decoded, LAYOUT, compiled=compiled)
    assert torch.equal(round_up_to(keys, torch.float16), witness) and torch.equal(round_up_to(rho, torch.float32), rho32)
    assert keys.shape == (1, 2, 5, 16) and rho.shape == v_norm.shape == (1, 2, 5)
    assert bool((v_norm2 >= v_norm * (1 - 2.0**-50)).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", [0, 1])
def test_a_non_finite_entry_clears_the_flag_and_a_store_refuses_it(bad, where):
    exact, decoded = _pair(torch.float32, 3)
    (exact, decoded)[where][1, 0, 1, 2, 7] = bad
    assert not bool(pair_statistics(exact, decoded, LAYOUT)[3])
    store = CompressedLayer(IntCodes(4), LAYOUT, keep_exact=False)
    key = torch.zeros(1, 2, 3, 64)
    value = key.clone()
    value[0, 1, 2, 7] = bad
    store.append(key, value)
    with pytest.raises(ValueError, match="NaN or Inf"):
        store.memory()


def test_bad_input_is_refused_naming_it():
    exact, decoded = _pair(torch.float32, 2)
    with pytest.raises(ValueError, match="exact"):
        pair_statistics(exact.double(), decoded, LAYOUT)
    with pytest.raises(ValueError, match="decoded"):
        pair_statistics(exact, decoded[:1], LAYOUT)
    with pytest.raises(ValueError, match="one shape"):
        pair_statistics(exact, decoded[..., :1, :], LAYOUT)
    with pytest.raises(ValueError, match="head dim"):
        pair_statistics(exact, decoded, BandLayout(32, 8))
    with pytest.raises(ValueError, match="layout"):
        pair_statistics(exact, decoded, None)

"""A witness derived from the codec's elementwise error bound, nothing stored per band (``DW``, then ``T2``).

Implementations: :mod:`witcert.tier_a.derived_witness` (``derived_witness``, ``check_error_bound``), the
codecs' ``error_bound`` (:mod:`witcert.integrations.hf.codecs`), :class:`CompressedLayer` with
``WitnessCode(0)`` and ``witcert.monitor(..., witness_bits=0)``. Oracles: the mpmath spec mirror
(:mod:`witcert.spec.derived`, 60 digits), exact fp64 residuals (inputs are at most fp32, so their differences
are exact) and the monitor's fp64 true TV against the exact keys, per cell. Domain: keys from subnormal to
beyond E4M3's range, exact zeros, one outlier per group, bf16/fp16/fp32 models; tiny Llama under generate with
left padding. Adversaries: a codec that understates its bound, one whose bound changes between calls, one
whose join changes its bound. Tolerance: none (a derived witness below a band norm, a cell above its meter or
a lying codec accepted fails).
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import mp, mpf

import witcert
from tiny_models import prompts, tiny
from witcert.integrations.hf.codecs import codec_for
from witcert.integrations.hf.compressed_cache import CompressedLayer
from witcert.integrations.hf.footprint import footprint
from witcert.spec.bands import band_norms
from witcert.spec.derived import bound_derived_witness, hypotheses_derived_witness
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.derived_witness import (
    RELATIVE_MARGIN, check_error_bound, derived_residual, derived_witness, group_band_norms, group_counts,
    pack_nibbles, relative_codes, relative_witness, unpack_nibbles)
from witcert.tier_a.witness_code import DEFAULT_WITNESS_BITS, WitnessCode

SCHEMES = ["rtn-int8", "rtn-int4", "rtn-int2", "kivi-2bit", "fp8-e4m3", "fp8-e4m3-scaled"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# ----------------------------------------------------------------------------- the reduction against mpmath
@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1e4, allow_subnormal=True), min_size=16, max_size=16), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from(["rotate_half", "interleaved"]))
def test_derived_witness_is_at_or_above_the_band_norms_of_the_bounds(e, bands, rope):
    layout = BandLayout(16, bands, rope)
    got = derived_witness(torch.tensor(e, dtype=torch.float64), layout)
    want = bound_derived_witness(e, bands, rope)
    assert all(mpf(float(g)) >= w for g, w in zip(got.tolist(), want))
    assert all(float(g) <= float(w) * (1 + 2.0**-9) + 2.0**-24 for g, w in zip(got.tolist(), want))  # rounded up once
    rho = derived_residual(torch.tensor(e, dtype=torch.float64))
    assert mpf(float(rho)) >= mp.sqrt(mp.fsum(mpf(x) ** 2 for x in e))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(0.0, 1e300, allow_subnormal=True) | st.sampled_from([0.0, 5e-324, 1e-300, float("inf")]),
                min_size=4, max_size=4), st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from(["rotate_half", "interleaved"]))
def test_group_bounds_reduce_to_at_least_the_band_norms(groups, bands, rope):
    """The scales-only reduction (rtn codecs) against mpmath, from subnormal to overflowing bounds."""
    layout = BandLayout(32, bands, rope)
    group_bound = torch.tensor(groups, dtype=torch.float64)
    got = group_band_norms(group_bound[None], group_counts(layout, 4))[0]
    e = [groups[i // 8] for i in range(32)]
    if any(x == float("inf") for x in groups):
        return  # inf: a band touching that group is inf (checked by the elementwise comparison below elsewhere)
    want = bound_derived_witness(e, bands, rope)
    assert all(mpf(float(g)) >= w for g, w in zip(got.tolist(), want))
    assert all(float(g) <= float(w) * (1 + 2.0**-40) + 2.0**-390 * max(groups) for g, w in zip(got.tolist(), want))


def test_the_spec_mirror_bounds_every_residual_within_the_bounds():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(32, generator=gen, dtype=torch.float64)
    e = torch.rand(32, generator=gen, dtype=torch.float64)
    x_hat = x + e * (2 * torch.rand(32, generator=gen, dtype=torch.float64) - 1)
    assert hypotheses_derived_witness(x.tolist(), x_hat.tolist(), e.tolist())
    residual = band_norms([a - b for a, b in zip(x_hat.tolist(), x.tolist())], 8)
    assert all(r <= w for r, w in zip(residual, bound_derived_witness(e.tolist(), 8)))


# ----------------------------------------------------------------------------- every built-in codec's bound
def _hard_keys(dtype, tokens=70, d=64, seed=0):
    """Keys over many magnitudes: a scale per token, exact zeros, subnormals, one outlier per token, E4M3's edge."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, tokens, d, generator=gen, dtype=torch.float64)
    x = x * torch.logspace(-6, 2.5, tokens, dtype=torch.float64)[:, None]
    if tokens >= 4:
        x[..., 0, :] = 0.0  # an all-zero token
        x[..., 1, ::3] = torch.finfo(dtype).smallest_normal / 4 if dtype != torch.float32 else 1e-40  # subnormals
        x[..., 2, 5] = 447.9  # near E4M3's largest value
        x[..., 3, 7] = 1000.0  # beyond it: the raw cast clamps (bound inf there)
    return x.to(dtype)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits, bands", [(0, 16), (4, 16), (4, 5)])  # 5 bands: an odd count of nibbles
def test_every_builtin_codec_keeps_its_declared_bound_and_the_witness_covers_the_residual(scheme, dtype, bits, bands):
    layout = BandLayout(64, bands) if bands == 16 else BandLayout(160, bands)
    store = CompressedLayer(codec_for(scheme, packed=True), layout, keep_exact=False, witness_code=WitnessCode(bits))
    keys, values = [], []
    for i, tokens in enumerate((70, 1, 1, 33)):  # a prefill, decode steps, a chunk (KIVI's exact tails)
        k, v = (_hard_keys(dtype, tokens, d=layout.head_dim, seed=i),
                _hard_keys(dtype, tokens, d=layout.head_dim, seed=10 + i).flip(-2))
        store.append(k, v)
        keys.append(k)
        values.append(v)
        stored = store.stored()  # checks |x - x^| <= error_bound for the new tokens; refuses otherwise
    k_hat, v_hat = store.read()
    residual = k_hat.double() - torch.cat(keys, -2).double()  # exact: both at most fp32
    assert (stored.witness.double() >= layout.band_norms(residual)).all()
    assert (stored.value_residual.double() >= (v_hat.double() - torch.cat(values, -2).double()).norm(dim=-1)).all()
    if scheme != "fp8-e4m3":  # the raw cast's bound is inf where it may have clamped (|x^| = 448): trivial, sound
        assert torch.isfinite(stored.witness).all()


def test_the_derived_witness_is_at_most_a_small_factor_above_the_stored_one():
    """Tightness: RTN's half step against a uniform rounding error is ``sqrt(3)`` in the band norm, give or take."""
    layout = BandLayout(64, 16)
    x = torch.randn(1, 2, 256, 64, generator=torch.Generator().manual_seed(1))
    store = CompressedLayer(codec_for("rtn-int4", packed=True), layout, keep_exact=False, witness_code=WitnessCode(0))
    store.append(x, x)
    ratio = store.stored().witness.double() / layout.band_norms(store.read()[0].double() - x.double())
    assert 1.0 <= float(ratio.median()) < 2.2


# ----------------------------------------------------------------------------- the 4-bit fraction of the derived witness
@settings(max_examples=200, deadline=None)
@given(st.floats(0.0, 1e30, allow_subnormal=True), st.floats(0.0, 1.0), st.sampled_from([16, 256]),
       st.floats(-2.0**-20, 2.0**-20))
def test_a_relative_code_read_back_is_at_or_above_the_norm(derived, fraction, levels, drift):
    """Whatever the residual's share of the derived bound, and a read whose fp64 derived norm moved by far more than
    a reduction order can move it, the code read back is at or above the norm (or is the derived bound itself)."""
    d = torch.tensor([derived], dtype=torch.float64)
    norm = d * fraction
    code = relative_codes(norm, d, levels)
    read = relative_witness(code, d * (1 + drift), levels, torch.float64 if levels == 256 else torch.float16)
    assert int(code) == levels - 1 or float(read) >= float(norm)
    if int(code) < levels - 1:  # the smallest such fraction: one level less would not do
        assert int(code) == 0 or float(d * RELATIVE_MARGIN * int(code) / levels) < float(norm)


def test_nibbles_round_trip():
    codes = torch.randint(0, 16, (2, 3, 6, 7), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


# ----------------------------------------------------------------------------- codecs that lie are caught
class UserInt4:
    """A user's int4 codec (one scale per token) with an honest or a dishonest error bound."""

    def __init__(self, understate: float = 1.0, drift: bool = False):
        self.understate, self.drift, self.calls = understate, drift, 0

    def encode(self, x, role, start):
        scale = (x.abs().amax(-1, keepdim=True).float() / 7).clamp(min=1e-12)
        return torch.round(x.float() / scale).clamp(-7, 7).to(torch.int8), scale

    def decode(self, packed, dtype):
        return (packed[0].float() * packed[1]).to(dtype)

    def nbytes(self, packed):
        return sum(t.numel() * t.element_size() for t in packed)

    def error_bound(self, packed, decoded):
        self.calls += 1
        half = packed[1].double() * (0.5 + 2.0**-20) / self.understate
        shrink = 2.0 ** -(self.calls % 2) if self.drift else 1.0
        return half * shrink + 2.0**-8 * decoded.double().abs() + 1e-38


def _generate(scheme, **kwargs):
    model = tiny("llama")
    ids, mask = prompts(2, length=40)
    with torch.no_grad(), witcert.monitor(model, scheme, **kwargs) as mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                       pad_token_id=0)
    return mon


def test_an_honest_user_codec_is_metered_soundly_with_no_stored_witness():
    table = _generate(UserInt4(), witness_bits=0).table()
    assert len(table) and not (table["true_tv"] > table["meter"]).any() and np.nanmax(table["true_tv"]) > 0


def test_a_codec_that_understates_its_bound_is_refused_naming_it():
    with pytest.raises(ValueError, match="codec UserInt4: the reconstruction error exceeds"):
        _generate(UserInt4(understate=4.0), witness_bits=0, keep_exact=False)


def test_a_codec_whose_bound_changes_between_calls_is_refused():
    with pytest.raises(ValueError, match="error_bound.*different values"):
        _generate(UserInt4(drift=True), witness_bits=0)


def test_a_bound_of_another_dtype_or_shape_is_refused():
    x, x_hat = torch.zeros(2, 4), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="float64"):
        check_error_bound(x, x_hat, torch.zeros(2, 4), "C")
    with pytest.raises(ValueError, match="broadcast"):
        check_error_bound(x, x_hat, torch.zeros(3, dtype=torch.float64), "C")
    with pytest.raises(ValueError, match="exceeds"):
        check_error_bound(x, x_hat + 1, torch.full((2, 4), 0.5, dtype=torch.float64), "C")
    with pytest.raises(ValueError, match="exceeds"):
        check_error_bound(x, x_hat, torch.full((2, 4), float("nan"), dtype=torch.float64), "C")


@pytest.mark.parametrize("scheme", ["dithered-int8", "sign-1bit", lambda x: x.half().to(x.dtype)])
def test_a_scheme_without_an_error_bound_is_refused_up_front(scheme):
    with pytest.raises(ValueError, match="witness_bits=0"):
        witcert.monitor(tiny("llama"), scheme, witness_bits=0)


# ----------------------------------------------------------------------------- through the public API, per query
@pytest.mark.parametrize("scheme", ["rtn-int8", "rtn-int4", "kivi-2bit", "fp8-e4m3", "fp8-e4m3-scaled"])
@pytest.mark.parametrize("bits", [0, 4])
def test_every_cell_of_a_derived_witness_is_at_or_above_its_true_tv(scheme, bits):
    table = _generate(scheme, witness_bits=bits, bands=4).table()
    assert len(table) and not np.isnan(table["true_tv"]).any()
    assert not (table["true_tv"] > table["meter"]).any()
    assert np.nanmax(table["true_tv"]) > 0


def test_the_relative_meter_lies_between_the_stored_and_the_derived_ones():
    """The meter is monotone in the witness (MW): fp16 norm <= 4-bit fraction of the derived bound <= derived bound."""
    fine, relative, derived = (_generate("rtn-int8", witness_bits=bits).table() for bits in (16, 4, 0))
    assert (fine["meter"] <= relative["meter"]).all() and (relative["meter"] <= derived["meter"]).all()
    assert (relative["meter"] < derived["meter"]).any()


def test_production_meters_what_validation_meters():
    """keep_exact=False holds the same codes and derives the same witness: the same meter, cell by cell."""
    kept = _generate("rtn-int4", witness_bits=0).table()
    production = _generate("rtn-int4", witness_bits=0, keep_exact=False).table()
    assert np.array_equal(kept["meter"], production["meter"])


def test_a_derived_witness_costs_two_bytes_per_token_and_kv_head_and_the_relative_one_eleven():
    fp = footprint("rtn-int8", 128, witness_bits=0)
    assert fp.witness == WitnessCode(0).bytes_per_token(16) == 2
    assert fp.capacity() > 1.8
    assert footprint("rtn-int8", 128, witness_bits=4).witness == WitnessCode(4).bytes_per_token(16) == 11
    assert footprint("rtn-int8", 160, witness_bits=4, bands=5).witness == WitnessCode(4).bytes_per_token(5) == 6


def test_spot_checks_default_to_the_stored_byte_where_the_meter_saturates():
    """rtn-int4's default is the derived witness, but a spot check (``certificate="spot"``, an audit with ``keys``)
    reads the meter's per-key radii, so there the default is the stored byte; an explicit ``witness_bits`` always
    wins."""
    model = tiny("llama")
    assert witcert.monitor(model, "rtn-int4").witness_code.bits == 0
    assert witcert.monitor(model, "rtn-int4", certificate="spot").witness_code.bits == DEFAULT_WITNESS_BITS
    audited = witcert.monitor(model, "rtn-int4", audit=witcert.Audit(rate=0.5, tau=0.2, delta=1e-3, keys=64))
    assert audited.witness_code.bits == DEFAULT_WITNESS_BITS
    exact = witcert.monitor(model, "rtn-int4", audit=witcert.Audit(rate=0.5, tau=0.2, delta=1e-3))
    assert exact.witness_code.bits == 0  # the exact audit reads exact keys, no radii
    assert witcert.monitor(model, "rtn-int4", certificate="spot", witness_bits=0).witness_code.bits == 0
    assert witcert.monitor(model, "rtn-int8", certificate="spot").witness_code.bits == 4

"""A smaller witness: the one-byte e5m3 code and fewer bands, rounded up everywhere (T2 premise, MW).

Implementations: :mod:`witcert.tier_a.witness_code` (``encode_e5m3``, ``decode_e5m3``, ``WitnessCode``),
the stores that hold it (:class:`~witcert.integrations.hf.compressed_cache.CompressedLayer`,
:class:`~witcert.integrations.hf.quantized_store.QuantizedLayerStore`) and ``witcert.monitor(...,
witness_bits=, bands=)``. Oracles: every non-negative fp16 bit pattern (exhaustive), exact fp64
comparisons of decoded codes (fp16 values are exact in fp64), mpmath band norms at 60 digits
(``maintenance_oracles``) and the monitor's fp64 true TV against the exact keys the model wrote, per
cell. Domain: fp16 0 ... inf, fp64 values from subnormal to beyond the fp16 range, tiny Llama models
(head dim 32, GQA) under generate with left padding. Tolerance: none (a stored value below its norm, or
a cell's true TV above its meter, fails).
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import witcert
from maintenance_oracles import value_shortfalls, witness_shortfalls
from tiny_models import prompts, tiny
from witcert.core.rounding import round_up_to
from witcert.tier_a.witness_code import E5M3_INF, E5M3_MAX, WitnessCode, decode_e5m3, encode_e5m3

ALL_FP16 = torch.arange(0, 0x7C01, dtype=torch.int32).to(torch.int16).view(torch.float16)  # +0 ... +inf


# ----------------------------------------------------------------------------- the code itself


def test_every_fp16_value_is_coded_at_or_above_itself_and_by_the_smallest_code():
    codes = encode_e5m3(ALL_FP16)
    decoded = decode_e5m3(codes).double()
    assert (decoded >= ALL_FP16.double()).all()
    below = decode_e5m3((codes.to(torch.int16) - 1).clamp(min=0).to(torch.uint8)).double()
    assert ((codes == 0) | (below < ALL_FP16.double())).all()  # no smaller code would do
    assert int(codes.max()) == E5M3_INF and torch.isinf(decoded[-1])


def test_code_points_decode_exactly_and_values_just_above_move_up_one_code():
    codes = torch.arange(0, E5M3_INF + 1, dtype=torch.uint8)
    points = decode_e5m3(codes)
    assert torch.equal(encode_e5m3(points), codes)  # a code point is its own code
    finite = points[:-1]
    above = torch.nextafter(finite, torch.tensor(math.inf, dtype=torch.float16))
    assert torch.equal(encode_e5m3(above), codes[1:])
    assert float(points[-2]) == E5M3_MAX


@pytest.mark.parametrize("value, code", [(0.0, 0), (-0.0, 0), (2.0**-24, 1), (2.0**-17, 1), (2.0**-17 + 2.0**-24, 2),
                                         (1.0, 0x3C00 >> 7), (E5M3_MAX, 247), (61472.0, 248), (65504.0, 248),
                                         (math.inf, 248)])
def test_edge_values(value, code):
    assert int(encode_e5m3(torch.tensor([value], dtype=torch.float16))) == code


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="w16"):
        encode_e5m3(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="w16"):
        encode_e5m3(torch.tensor([-1.0], dtype=torch.float16))
    with pytest.raises(ValueError, match="w16"):
        encode_e5m3(torch.tensor([math.nan], dtype=torch.float16))
    with pytest.raises(ValueError, match="codes"):
        decode_e5m3(torch.tensor([1], dtype=torch.int8))
    with pytest.raises(ValueError, match="witness_bits"):
        WitnessCode(12)


@given(st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False, allow_subnormal=True))
@example(0.0)
@example(5e-324)  # the smallest fp64 subnormal: below every nonzero code
@example(2.0**-17 * (1 + 2.0**-40))  # just above a code point
@example(61440.0 * (1 + 2.0**-50))  # just above the largest finite code: inf
def test_stored_values_are_never_below_the_fp64_value(x):
    for bits in (16, 8):
        code = WitnessCode(bits)
        stored = code.witness(round_up_to(torch.tensor([x], dtype=torch.float64), torch.float16))
        assert float(code.decoded(stored)[0]) >= x
        rho, norm = code.residual(torch.tensor([x])), code.norm(torch.tensor([x], dtype=torch.float64))
        witness, rho, norm = code.readable(stored, rho, norm)
        assert float(rho[0]) >= float(torch.tensor([x]).float()) and float(norm[0]) >= x


@pytest.mark.parametrize("bands", [1, 2, 4, 8, 16])
def test_coded_witness_covers_every_band_norm(bands):
    """witness_of, then the e5m3 code, decodes at or above the exact (60-digit) band norm of every residual."""
    gen = torch.Generator().manual_seed(bands)
    layout = witcert.BandLayout(64, bands)
    k = torch.randn(2, 3, 50, 64, generator=gen) * torch.logspace(-6, 3, 50)[:, None]  # tiny to large tokens
    for scheme in ("rtn-int8", "rtn-int4", "fp8-e4m3"):
        k_hat = witcert.get_scheme(scheme)(k)
        code = WitnessCode(8)
        decoded = code.decoded(code.witness(witcert.witness_of(k, k_hat, layout)))
        assert witness_shortfalls(decoded, k_hat, k, layout) == 0


def test_an_overflowing_band_gives_the_trivial_bound_never_nan():
    layout = witcert.BandLayout(8, 2)
    k = torch.zeros(1, 2, 8)
    k_hat = k.clone()
    k_hat[0, 0, 0] = 7e4  # a band norm above the largest finite code
    code = WitnessCode(8)
    w = code.decoded(code.witness(witcert.witness_of(k, k_hat, layout)))
    assert torch.isinf(w[0, 0, 0]) and w[0, 1].eq(0).all()
    q = torch.ones(1, 1, 8)
    c = witcert.logit_bound(q, w, layout)
    meter = witcert.meter(torch.zeros(1, 1, 2, dtype=torch.float64), c.double())
    assert torch.equal(meter, torch.ones(1, 1, dtype=torch.float64))


# ----------------------------------------------------------------------------- through the monitor


def _generate(scheme, **kwargs):
    model = tiny("llama")
    ids, mask = prompts(2, length=40)  # a full 32-token group: KIVI quantizes keys too
    with torch.no_grad(), witcert.monitor(model, scheme, **kwargs) as mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                       pad_token_id=0)
    return mon


@pytest.mark.parametrize("scheme", ["rtn-int8", "rtn-int4", "fp8-e4m3", "kivi-2bit"])
@pytest.mark.parametrize("bands", [2, 4, 16])
def test_every_cell_of_an_8_bit_witness_is_at_or_above_its_true_tv(scheme, bands):
    table = _generate(scheme, witness_bits=8, bands=bands).table()
    assert len(table) and not np.isnan(table["true_tv"]).any()
    assert not (table["true_tv"] > table["meter"]).any()
    assert np.nanmax(table["true_tv"]) > 0


@pytest.mark.parametrize("meter", ["fused", "full"])
def test_the_8_bit_meter_is_never_below_the_fp16_meter(meter):
    """The meter is monotone in the witness (MW): a coded witness at or above the fp16 one meters at or above it."""
    fine = _generate("rtn-int4", witness_bits=16, meter=meter).table()
    coarse = _generate("rtn-int4", witness_bits=8, meter=meter).table()
    assert np.array_equal(fine["pos"], coarse["pos"])
    assert (coarse["meter"] >= fine["meter"]).all()
    assert (coarse["meter"] > fine["meter"]).any()


@pytest.mark.parametrize("bits, per_token", [(16, 2 * 4 + 8), (8, 4 + 3)])
def test_the_witness_bytes_are_what_the_code_says(bits, per_token):
    mon = _generate("rtn-int4", witness_bits=bits, bands=4, keep_exact=False)
    memory = mon.memory().total
    tokens_times_heads = memory.exact_cache // (2 * 32 * 4)  # fp32 keys and values of head dim 32
    assert memory.witness == tokens_times_heads * per_token == tokens_times_heads * WitnessCode(bits).bytes_per_token(4)


def test_the_store_hands_the_meter_decoded_values_in_its_layout():
    store = witcert.integrations.hf.compressed_cache.CompressedLayer(
        witcert.integrations.hf.codecs.IntCodes(4), witcert.BandLayout(32, 4), keep_exact=False,
        witness_code=WitnessCode(8))
    k = torch.randn(1, 2, 9, 32, generator=torch.Generator().manual_seed(3))
    v = torch.randn(1, 2, 9, 32, generator=torch.Generator().manual_seed(4))
    store.append(k, v)
    stored = store.stored()
    assert stored.witness.dtype == torch.float16 and stored.witness.transpose(-1, -2).is_contiguous()
    assert witness_shortfalls(stored.witness, stored.k_hat, k, witcert.BandLayout(32, 4)) == 0
    assert value_shortfalls(stored.value_residual, store.read()[1], v) == 0
    assert (stored.value_norm.double() >= v.double().norm(dim=-1)).all()


def test_8_bit_witness_over_a_quantized_cache_is_sound_per_cell():
    pytest.importorskip("optimum.quanto", reason="the 'quant' extra is not installed")
    spec = witcert.integrations.hf.quantized_cache.QuantizedCacheSpec("quanto", 2, q_group_size=32,
                                                                    residual_length=4)
    table = _generate(spec, witness_bits=8, bands=4).table()
    assert not (table["true_tv"] > table["meter"]).any() and np.nanmax(table["true_tv"]) > 0

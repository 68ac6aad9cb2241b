"""The engine KV formats, code for code: hand-worked small tensors, edge cases, packing and byte counts.

Implementations: :mod:`witcert.schemes.per_token_head`, :mod:`witcert.schemes.fp4_blocks`,
:mod:`witcert.schemes.turboquant` (with :mod:`witcert.schemes.e2m1`, :mod:`witcert.schemes.hadamard`,
:mod:`witcert.schemes.lloyd_max`), registered by :mod:`witcert.schemes.engine_formats`. Oracles: codes and scales
worked by hand in each test from the engine's arithmetic (vLLM's and SGLang's sources named in the modules), the
fp32 constants they start from (``numpy.float32``), and the formats' own byte formulas. Domain: heads of 4 to 64
channels, fp32/bf16/fp16/fp64, zeros, ties, saturation, subnormals, negative zero. Tolerance: none (bit for bit).
"""
import math

import numpy as np
import pytest
import torch

import witcert
from witcert.integrations.hf import codecs
from witcert.schemes import e2m1
from witcert.schemes.engine_formats import ENGINE_NAMES, FORMATS, engine_name_note, format_of
from witcert.schemes.fp4_blocks import Mxfp4Block16, Nvfp4
from witcert.schemes.hadamard import inverse_rht, rht, rht_signs
from witcert.schemes.kv_format import pack_bits, unpack_bits
from witcert.schemes.lloyd_max import centroids
from witcert.schemes.per_token_head import Fp8PerTokenHead, Int4PerTokenHead, Int8PerTokenHead
from witcert.schemes.turboquant import TurboQuant
from witcert.tier_a.witness_code import DEFAULT_WITNESS_BITS, WitnessCode

f32 = np.float32
ROTATED = ("int4-per-token-head", "turboquant-4bit-nc", "turboquant-k3v4-nc", "turboquant-3bit-nc")


def _head(*values, dtype=torch.float32):
    return torch.tensor([values], dtype=dtype)  # one token, one head: (1, d)


# ----------------------------------------------------------------------------- vLLM per-token-head


def test_int8_per_token_head_codes_by_hand():
    scale = f32(1) / f32(127)  # amax 1: fl32(1/127), whose fl32 reciprocal is exactly 127
    assert f32(1) / scale == 127
    codes, stored = Int8PerTokenHead().encode(_head(1.0, -0.5, 0.25, 0.0))
    # 1 -> 127 + 0.5 = 127.5 -> truncated 127; -0.5 -> -63.5 - 0.5 = -64; 0.25 -> 31.75 + 0.5 -> 32; 0 -> 0
    assert codes.tolist() == [[127, -64, 32, 0]] and stored.item() == scale


def test_int8_rounds_half_away_from_zero_with_an_fp32_addition():
    below_half = float(np.nextafter(f32(0.5), f32(0)))  # 0.49999997: + 0.5 rounds to 1.0 in fp32, so code 1
    codes, stored = Int8PerTokenHead().encode(_head(127.0, 2.5, -2.5, below_half))
    assert stored.item() == 1.0 and codes.tolist() == [[127, 3, -3, 1]]


def test_fp8_per_token_head_codes_by_hand():
    inverse = f32(1) / (f32(1) / f32(448))  # 447.99997: x * inverse rounds to E4M3
    codes, _ = Fp8PerTokenHead().encode(_head(1.0, 0.5, 0.3, -1.0))
    # 447.99997 -> 448; 223.99998 -> 224; 134.39999 -> 128 (E4M3 spacing 16 above 128); -448
    assert float(inverse) == pytest.approx(447.99997, abs=1e-4)
    assert codes.float().tolist() == [[448.0, 224.0, 128.0, -448.0]]


def test_int4_per_token_head_codes_by_hand():
    # a head whose rotation is (-1, 0, 0.5, 2): exact, so the kernel sees these values
    y = torch.tensor([[-1.0, 0.0, 0.5, 2.0]], dtype=torch.float64)
    x = inverse_rht(y).to(torch.float32)
    assert torch.equal(rht(x), y)
    payload, hidden = Int4PerTokenHead().encode(x)
    scale = f32(3) / f32(15)  # (max - min) / 15 = fl32(0.2)
    # zp = round(1 / 0.2) = 5; fma(y, 5, 5) = 0, 5, 7.5, 15 -> half away: 0, 5, 8, 15 (low nibble first)
    assert unpack_bits(payload, 4, 4).tolist() == [[0, 5, 8, 15]] and payload.tolist() == [[0x50, 0xF8]]
    bits = hidden.view(torch.int32).item()
    assert bits & 0xF == 5 and bits & -16 == int(np.array(scale).view(np.int32)) & -16
    cleared = float(np.array(int(np.array(scale).view(np.int32)) & -16, dtype=np.int32).view(np.float32))
    expected = inverse_rht(torch.tensor([[-5.0, 0.0, 3.0, 10.0]], dtype=torch.float64) * cleared)
    assert torch.equal(Int4PerTokenHead().decode((payload, hidden), torch.float64), expected)


def test_rht_uses_vllms_signs_and_inverts_exactly():
    assert rht_signs(4).tolist() == [1.0, -1.0, 1.0, 1.0]  # torch.bernoulli under vLLM's seed 0x9E3779B9
    x = torch.randn(3, 64, dtype=torch.float64)
    assert torch.allclose(inverse_rht(rht(x)), x, rtol=0, atol=1e-13)


# ----------------------------------------------------------------------------- FP4


def test_e2m1_rounding_ties():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, -0.0])
    nearest_even = e2m1.values(e2m1.round_nearest_even(ties)).tolist()
    half_up = e2m1.values(e2m1.round_half_up(ties)).tolist()
    assert nearest_even == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -0.0]
    assert half_up == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0, -0.0, 0.0]
    assert torch.signbit(e2m1.values(e2m1.round_nearest_even(ties))[-1])  # cvt keeps -0's sign
    assert not torch.signbit(e2m1.values(e2m1.round_half_up(ties))[-1])  # SGLang's x < 0 does not


def _block(*head, fill=0.0):
    return _head(*head, *([fill] * (16 - len(head))))


def test_nvfp4_codes_by_hand():
    assert f32(6) * (f32(1) / f32(6)) == 1  # sf = 1 * (6 rcp(6)) = 1.0, exactly an E4M3 value
    payload, sf, tensor_scale = Nvfp4().encode(_block(6, 3, 1.5, 0.75, 0.25, -5, 0.1, -0.0))
    codes = unpack_bits(payload, 4, 16)[0, :8].tolist()
    assert sf.float().tolist() == [[1.0]] and tensor_scale == 1.0
    # ties to even: 0.75 -> 1, 0.25 -> 0, -5 -> -4; 0.1 -> 0; -0 keeps its sign bit
    assert codes == [7, 5, 3, 2, 0, 8 + 6, 0, 8]


def test_nvfp4_scale_rounding_saturation_and_tensor_scale():
    payload, sf, _ = Nvfp4().encode(_block(100, 40, 1))
    # sf = 100/6 = 16.67 -> E4M3 16 (spacing 2); out = 1/16: 6.25 -> saturates to 6, 2.5 -> 2 (tie to even)
    assert sf.float().item() == 16.0
    assert unpack_bits(payload, 4, 16)[0, :3].tolist() == [7, 4, 0]  # 1/16 = 0.0625 -> 0
    assert Nvfp4()(_block(100, 40, 1))[0, :3].tolist() == [96.0, 32.0, 0.0]
    scaled = Nvfp4(k_scale=2.0)
    payload, sf, tensor_scale = scaled.encode(_block(6, 3))
    assert tensor_scale == 2.0 and sf.float().item() == 0.5  # g = 1/2: sf = 0.5 (6 rcp(6))
    assert scaled(_block(6, 3))[0, :2].tolist() == [6.0, 3.0]  # e2m1 x sf x k_scale


def test_mxfp4_codes_by_hand():
    payload, biased = Mxfp4Block16().encode(_block(6, 3, 1.5, 0.75, 0.25, -5, 0.1, -0.0))
    # max 6: ceil(log2(6 / 6)) = 0, stored 127; half away from zero: 0.75 -> 1, 0.25 -> 0.5, -5 -> -6
    assert biased.tolist() == [[127]]
    assert unpack_bits(payload, 4, 16)[0, :8].tolist() == [7, 5, 3, 2, 1, 8 + 7, 0, 0]
    payload, biased = Mxfp4Block16().encode(_block(7, 1))
    # max 7: ceil(log2(7/6)) = 1: scale 2, so nothing clips; 7 / 2 = 3.5 -> 4 (half up): reconstructs 8
    assert biased.tolist() == [[128]] and Mxfp4Block16()(_block(7, 1))[0, :2].tolist() == [8.0, 1.0]
    _, biased = Mxfp4Block16().encode(_block(0.0))
    assert biased.tolist() == [[127 - 33]]  # all zero: ceil(log2(1e-10)) = -33


def test_block_formats_refuse_heads_that_do_not_split_into_blocks():
    for fmt in (Nvfp4(), Mxfp4Block16()):
        with pytest.raises(ValueError, match="head_dim 24 is not a multiple of 16"):
            fmt(torch.ones(2, 24))


# ----------------------------------------------------------------------------- TurboQuant


def test_turboquant_key_codes_by_hand():
    # k = (1, ..., 1): u = k / ||k|| rotated by H / sqrt(8) is (1, 0, ..., 0): the top centroid, then the
    # centroid just above the midpoint 0 (the binary search sends ties up); the norm stored as fp16
    codes, norm = TurboQuant().encode(torch.ones(1, 8), "key")
    assert unpack_bits(codes, 4, 8).tolist() == [[15, 8, 8, 8, 8, 8, 8, 8]]
    assert norm.dtype == torch.float16 and norm.item() == float(np.float16(f32(8**0.5)))
    c = torch.tensor(centroids(8, 4), dtype=torch.float64)[[15] + [8] * 7]
    c8, c15 = centroids(8, 4)[8], centroids(8, 4)[15]
    corrected = c / math.sqrt(7 * (c8 * c8) + c15 * c15 + 1e-16)  # sum c^2 by level (8 seven times, then 15)
    rotated = norm.double() * corrected  # then back to the model's frame (H / sqrt(8))
    from witcert.schemes.hadamard import orthonormal_hadamard
    assert torch.equal(TurboQuant().decode((codes, norm), torch.float64), orthonormal_hadamard(rotated))


def test_turboquant_value_codes_by_hand():
    v = torch.tensor([[0.0, 0.5, 1.5, 2.0, *range(4, 15), 15.0]])
    codes, side = TurboQuant().encode(v, "value")
    # lo 0, scale (15 - 0) / 15 = 1: trunc(v + 0.5): 0.5 -> 1, 1.5 -> 2 (half up)
    assert unpack_bits(codes, 4, 16)[0, :4].tolist() == [0, 1, 2, 2] and side.tolist() == [[1.0, 0.0]]
    three = TurboQuant(3, 3).encode(torch.arange(8.0)[None], "value")[0]
    assert three.shape[-1] == 3 and unpack_bits(three, 3, 8).tolist() == [list(range(8))]  # 8 codes, 3 bytes


def test_turboquant_refuses_what_fp16_cannot_hold():
    with pytest.raises(ValueError, match="turboquant: a key norm of .* exceeds fp16"):
        TurboQuant()(torch.full((1, 8), 1e5), "key")
    with pytest.raises(ValueError, match="turboquant: a value minimum"):
        TurboQuant()(torch.full((1, 8), -7e4), "value")


# ----------------------------------------------------------------------------- every format


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("case", ["zeros", "negative zero", "subnormal", "ties", "large"])
def test_edge_cases_reconstruct_finite_and_close(name, case):
    x = torch.zeros(2, 3, 64)
    if case == "negative zero":
        x = -x
    elif case == "subnormal":
        x[..., ::3] = 1e-40
    elif case == "ties":
        x[..., :2] = 3.0  # two channels at the head's amax
        x[..., 2:4] = -3.0
    elif case == "large":
        x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0)) * 3e3
    for role in ("key", "value"):
        x_hat = witcert.get_scheme(name)(x, role=role)
        assert torch.isfinite(x_hat).all()
        if case in ("zeros", "negative zero", "subnormal"):
            assert x_hat.abs().max() <= 1e-39  # zeros stay zero; subnormals go to zero or stay
        if case == "ties" and name not in ROTATED:  # a rotated head has other maxima
            assert torch.equal(x_hat[..., :4].abs(), x[..., :4].abs())


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_codec_is_the_registered_scheme_bit_for_bit_and_chunking_free(name, dtype):
    x = (torch.randn(2, 3, 9, 64, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    codec = codecs.codec_for(name, packed=True)
    assert format_of(codec) is FORMATS[name] and codecs.owned_codec(codec) is codec
    for role in ("key", "value"):
        whole = witcert.get_scheme(name)(x, role=role)
        assert whole.dtype == dtype and torch.equal(codec.decode(codec.encode(x, role), dtype), whole)
        per_token = torch.cat([codec.decode(codec.encode(x[..., t:t + 1, :], role), dtype) for t in range(9)], -2)
        assert torch.equal(per_token, whole)  # per-token formats: the same bytes however the writes are chunked


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_bytes_stored_match_the_formats_formula(name):
    fmt, d = FORMATS[name], 64
    x = torch.randn(2, 3, 5, d)
    for role in ("key", "value"):
        assert fmt.nbytes(fmt.encode(x, role)) == fmt.code_bytes(d, role) * 2 * 3 * 5
    account = fmt.bytes_per_token(d, bands=16)
    assert account["bf16"] == 256 and account["witness"] == WitnessCode(DEFAULT_WITNESS_BITS).bytes_per_token(16) and 0 < account["codes"] < account["bf16"]


def test_expected_bytes_per_token():
    per_token = {name: fmt.bytes_per_token(64, 16)["codes"] for name, fmt in FORMATS.items()}
    assert per_token == {"int8-per-token-head": 136, "fp8-per-token-head": 136, "int4-per-token-head": 72,
                         "nvfp4": 72, "mxfp4": 72, "turboquant-4bit-nc": 70, "turboquant-k3v4-nc": 62,
                         "turboquant-3bit-nc": 54}


def test_pack_bits_layouts():
    assert pack_bits(torch.tensor([[1, 2, 3, 4]]), 4).tolist() == [[0x21, 0x43]]  # even code in the low nibble
    packed = pack_bits(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]]), 3)  # code i at bit 3i, little-endian
    word = sum(int(b) << (8 * i) for i, b in enumerate(packed[0]))
    assert [(word >> (3 * i)) & 7 for i in range(8)] == [1, 2, 3, 4, 5, 6, 7, 0]


def test_engine_names_name_the_scheme_or_refuse():
    for engine_name, (scheme, _, _) in ENGINE_NAMES.items():
        note = engine_name_note(engine_name)
        assert (scheme is None and "refused" in note) or (scheme in witcert.list_schemes() and scheme in note)
    with pytest.raises(ValueError, match="'turboquant_k8v4' is refused"):
        witcert.get_scheme("turboquant_k8v4")
    with pytest.raises(ValueError, match="'int8_per_token_head' is vLLM's name for WitCert's 'int8-per-token-head'"):
        witcert.get_scheme("int8_per_token_head")
    for fmt in (Int4PerTokenHead(), TurboQuant()):
        with pytest.raises(ValueError, match="not a power of two"):
            fmt(torch.ones(2, 48))


def test_witcert_schemes_lists_each_format_with_its_bytes_per_token(capsys):
    from witcert.cli import main

    assert main(["schemes"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    for name, fmt in FORMATS.items():
        cost = fmt.bytes_per_token(64, 16)
        assert f"[{cost['codes']} B + witness {cost['witness']} B per token per kv head at d=64" in lines[name]
    assert "4-bit Lloyd-Max keys" in lines["turboquant-4bit-nc"] and "3-bit uniform values" in lines["turboquant-3bit-nc"]


def test_a_reconstruction_beyond_the_model_dtype_is_refused_by_name():
    x = torch.zeros(1, 64, dtype=torch.float16)
    x[0, 0] = 65000.0  # MXFP4: 65000 / 2^14 = 3.97 -> 4 -> 65536, beyond fp16
    for use in (lambda fmt: fmt(x), lambda fmt: fmt.encode(x, "key")):  # the scheme and the codec's write
        with pytest.raises(ValueError, match="mxfp4: a reconstructed value overflows torch.float16"):
            use(FORMATS["mxfp4"])
    spread = torch.full((1, 64), 30000.0, dtype=torch.float16)  # H (s x) grows a coordinate up to 64 x 30000
    with pytest.raises(ValueError, match="int4-per-token-head: the rotated head overflows torch.float16"):
        FORMATS["int4-per-token-head"].encode(spread, "key")

"""What a monitored cache holds: codecs, the layer store's memory account, the file-backed backing store.

Implementations: :mod:`witcert.integrations.hf.codecs`, :class:`witcert.integrations.hf.compressed_cache.CompressedLayer`,
:class:`witcert.gate.backing_store.BackingStore` with ``directory``. Oracles: the registered
schemes' own outputs (bitwise), the tensors' byte counts, the bytes written to the store.
Domain: fp32/bf16/fp16 caches (B, Hkv, T, d), d in {32, 64, 80}. Tolerance: none.
"""
import pytest
import torch

import witcert
from witcert.gate.backing_store import BackingStore, ChecksumMismatchError
from witcert.integrations.hf import codecs
from witcert.integrations.hf.compressed_cache import CompressedLayer


def _cache(dtype, d=64, seed=0, tokens=7):
    x = torch.randn(2, 3, tokens, d, generator=torch.Generator().manual_seed(seed)) * 4
    x[0, 0, 0, :] = 0.0  # an all-zero group
    return x.to(dtype)


@pytest.mark.parametrize("name", ["rtn-int8", "rtn-int4", "rtn-int2", "fp8-e4m3-scaled", "kivi-2bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 80, 30])
@pytest.mark.parametrize("tokens", [7, 70])
def test_packed_codecs_decode_to_the_registered_scheme_bit_for_bit(name, dtype, d, tokens):
    codec = codecs.codec_for(name, packed=True)
    assert not isinstance(codec, codecs.Reconstruction)
    x = _cache(dtype, d, tokens=tokens)
    for role in ("key", "value"):
        decoded = codec.decode(codec.encode(x, role), dtype)
        assert decoded.dtype == dtype and torch.equal(decoded, witcert.get_scheme(name)(x, role=role))


@pytest.mark.parametrize("name, per_token", [("rtn-int8", 64 + 2 * 2), ("rtn-int4", 32 + 2 * 2), ("rtn-int2", 16 + 2 * 2),
                                             ("kivi-2bit", 16 + 2 * 2 * 2)])
def test_bf16_group_statistics_take_two_bytes(name, per_token):
    """A group's maximum (and KIVI's minimum) is one of the group's values: the model's dtype holds it exactly.
    Bytes per token and head of one side at d = 64: codes plus 2 bytes per statistic of each 32-value group
    (KIVI keys: two per channel over 32 tokens, i.e. 2 * 2 * 64 / 32 per token, as its values)."""
    codec = codecs.codec_for(name, packed=True)
    x = _cache(torch.bfloat16, 64, tokens=64)
    for role in ("key", "value"):
        assert codec.nbytes(codec.encode(x, role)) == x.numel() // 64 * per_token


@pytest.mark.parametrize("role", ["key", "value"])
def test_kivi_chunks_join_as_they_decode(role):
    """Decode steps (one token each) join the prefill's chunk: exact key tails and value rows merge, and the joined
    chunk decodes as the chunks did, bit for bit."""
    codec = codecs.KiviCodes()
    x = _cache(torch.bfloat16, 64, tokens=70)
    parts = [x[:, :, :40], x[:, :, 40:41], x[:, :, 41:42], x[:, :, 42:]]
    encoded = [codec.encode(part, role) for part in parts]
    joined = encoded[0]
    for chunk in encoded[1:]:
        joined = codec.join(joined, chunk)
    expected = torch.cat([codec.decode(chunk, x.dtype) for chunk in encoded], dim=-2)
    assert torch.equal(codec.decode(joined, x.dtype), expected)
    kinds = [segment[0] for segment in joined]
    assert kinds == (["rows"] if role == "value" else ["groups", "exact"])


def test_a_plain_function_in_production_warns_once_naming_its_memory():
    """A callable's reconstruction cannot be packed: the first chunk it holds in the model's dtype says so (bytes per
    token, the codec alternative); a registered name with a codec and a lossless fp8 cast never warn."""
    import warnings

    def int6(x):
        scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 31
        return (x / scale).round().clamp(-31, 31) * scale

    layout = witcert.BandLayout(64)
    with pytest.warns(codecs.HeldReconstructionWarning, match=r"512 bytes per token .*codec") as caught:
        store = CompressedLayer(codecs.codec_for(int6, packed=True), layout, keep_exact=False)
        for start in range(4):  # the prefill and decode steps of every layer say it once
            store.append(_cache(torch.float32)[:, :, start:start + 1], _cache(torch.float32)[:, :, start:start + 1])
    assert len([w for w in caught if issubclass(w.category, codecs.HeldReconstructionWarning)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", codecs.HeldReconstructionWarning)
        for name in ("rtn-int4", "kivi-2bit", "fp8-e4m3"):
            CompressedLayer(codecs.codec_for(name, packed=True), layout, keep_exact=False).append(
                _cache(torch.float32), _cache(torch.float32))
        CompressedLayer(codecs.codec_for(int6, packed=False), layout).append(_cache(torch.float32), _cache(torch.float32))


@pytest.mark.parametrize("bits, per_value", [(8, 1.0), (4, 0.5), (2, 0.25)])
def test_int_codes_are_packed(bits, per_value):
    codec = codecs.IntCodes(bits)
    x = _cache(torch.float32)
    payload, scale, _ = codec.encode(x, "key")
    assert payload.numel() * payload.element_size() == x.numel() * per_value
    assert scale.dtype == torch.float32 and scale.numel() == x.numel() // 32


def test_a_replaced_builtin_name_gets_no_builtin_codec():
    """A name re-registered to another function must not be packed by the built-in's codec."""
    from witcert.schemes.registry import _REGISTRY

    original = _REGISTRY["rtn-int4"]
    witcert.register_scheme("rtn-int4", replace=True)(lambda x: x * 0.5)
    try:
        assert isinstance(codecs.codec_for("rtn-int4", packed=True), codecs.Reconstruction)
    finally:
        witcert.register_scheme("rtn-int4", replace=True)(original)
    assert isinstance(codecs.codec_for("rtn-int4", packed=True), codecs.IntCodes)


@pytest.mark.parametrize("scheme, dtype, held", [
    ("fp8-e4m3", torch.float32, torch.float8_e4m3fn),  # a raw fp8 cast: one byte per value
    ("fp8-e5m2", torch.bfloat16, torch.float8_e5m2),
    (lambda x: x.half().to(x.dtype), torch.float32, torch.float16),
    (lambda x: x * 1.000001, torch.float32, torch.float32),  # nothing narrower holds it
])
def test_reconstructions_are_narrowed_only_when_lossless(scheme, dtype, held):
    codec = codecs.codec_for(scheme, packed=True)
    x = _cache(dtype)
    packed = codec.encode(x, "key")
    assert packed.dtype == held
    assert torch.equal(codec.decode(packed, dtype), witcert.schemes.registry.apply_scheme(scheme, x))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_joined_int_chunks_decode_as_the_chunks_did(bits):
    """A decode-on-read store holds one joined chunk (one decode per read, not one per step), same values."""
    layout = witcert.BandLayout(64)
    store = CompressedLayer(codecs.IntCodes(bits), layout, keep_exact=False)
    x = _cache(torch.float32)
    parts = [x[:, :, :4], x[:, :, 4:5], x[:, :, 5:]]
    for part in parts:
        store.append(part, part)
    assert len(store.key_chunks) == len(store.value_chunks) == 1
    expected = torch.cat([store.codec.decode(store.codec.encode(part, "key"), x.dtype) for part in parts], dim=-2)
    keys, values = store.read()
    assert torch.equal(keys, expected) and torch.equal(values, expected)


def test_layer_memory_account():
    """Production store of rtn-int4 keys and values, d = 64, fp32: int4 codes (32 B) + fp32 scales
    (8 B) per token per head and side, the witness (16 bands fp16 = 32 B) + value statistics (8 B)."""
    layout = witcert.BandLayout(64)
    store = CompressedLayer(codecs.IntCodes(4), layout, keep_exact=False)
    x = _cache(torch.float32)
    store.append(x, x)
    store.append(x[:, :, :1], x[:, :, :1])
    tokens = 2 * 3 * 8  # rows x kv heads x tokens
    account = store.memory()
    assert account.compressed == tokens * 2 * (32 + 8)
    assert account.witness == tokens * (32 + 4 + 4)
    assert account.exact_cache == tokens * 2 * 64 * 4 and account.exact_shadow == account.decoded == 0
    assert account.saved == account.exact_cache - account.held > 0
    kept = CompressedLayer(codecs.Reconstruction("rtn-int4"), layout)
    kept.append(x, x)
    assert kept.memory().exact_shadow == kept.memory().decoded == 2 * x.numel() * 4


def test_file_backed_store_checks_the_content_on_disk(tmp_path):
    """The exact copy lives in memory-mapped files; a byte flipped on disk is caught at page-in."""
    store = BackingStore(block_size=4, directory=tmp_path)
    k = torch.randn(2, 10, 8, dtype=torch.bfloat16)
    for start in range(0, 10, 3):  # appends that grow the files (doubling)
        store.write("layer", k[:, start:start + 3], k[:, start:start + 3] * 2)
    assert torch.equal(store.page_in("layer", (1, ), 2).k, k[1, 8:10])
    files = sorted(tmp_path.glob("backing-*-k.bin"))
    assert len(files) == 1 and store.nbytes() > 0
    raw = bytearray(files[0].read_bytes())
    raw[0] ^= 0x40  # row 0, token 0 lives at the start of the keys file
    files[0].write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError):
        store.page_in("layer", (0,), 0)
    store.clear()
    assert not list(tmp_path.glob("backing-*"))

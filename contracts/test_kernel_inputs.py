"""Contract: the kernels run only on inputs that meet their hypotheses; anything else is a ValueError.

Implementation: the public functions of ``kernels/`` (``decode_attention``,
``decode_attention_packed``, ``witness_write``, ``dither_write``, ``philox4x32_10``).
Oracle: the rule of the project -- bad input raises ``ValueError`` naming the argument (NaN or
Inf values, negative witnesses, wrong shapes or dtypes, GQA head counts that do not divide,
out-of-range lengths, non-streaming quantizer configurations, words outside [0, 2^32)).
Domain: one valid call per kernel, perturbed one argument at a time. Tolerance: exact (the
error type and the argument named in its message).
"""
import pytest
import torch

from witcert import BandLayout, DitheredInt8
from witcert.tier_b.counters import StandaloneCounter
from witcert.kernels.decode_attention import decode_attention, decode_attention_packed
from witcert.kernels.dither_write import dither_write
from witcert.kernels.packed_keys import PackedKeys
from witcert.kernels.philox import philox4x32_10
from witcert.kernels.witness_write import witness_write

LAYOUT = BandLayout(64, 16)


def _valid():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 64, generator=generator).half()
    k = torch.randn(1, 2, 8, 64, generator=generator).half()
    v = torch.randn(1, 2, 8, 64, generator=generator).half()
    return q, k, v, witness_write(k, k, LAYOUT)


def _with(tensor, index, value):
    out = tensor.clone()
    out.view(-1)[index] = value
    return out


def _dense_cases():
    q, k, v, w = _valid()
    return {
        "q": dict(q=_with(q, 3, float("nan"))),
        "k_hat": dict(k_hat=_with(k, 5, float("inf"))),
        "v": dict(v=v[..., :32]),
        "witness": dict(witness=_with(w, 0, -1.0)),
        "layout": dict(layout=BandLayout(32, 16)),
        "seq_lens": dict(seq_lens=torch.tensor([9], dtype=torch.int32)),
        "num_splits": dict(num_splits=0),
        "block_n": dict(block_n=24),
        "sm_scale": dict(sm_scale=float("nan")),
    }


@pytest.mark.parametrize("argument", sorted(_dense_cases()))
def test_decode_attention_rejects_bad_input(argument):
    q, k, v, w = _valid()
    call = dict(q=q, k_hat=k, v=v, witness=w, layout=LAYOUT)
    call.update(_dense_cases()[argument])
    with pytest.raises(ValueError, match=argument):
        decode_attention(call.pop("q"), call.pop("k_hat"), call.pop("v"), call.pop("witness"), call.pop("layout"),
                         **call)


def test_decode_attention_rejects_gqa_mismatch():
    q, k, v, w = _valid()
    with pytest.raises(ValueError, match="q"):
        decode_attention(q[:, :3], k, v, w, LAYOUT)


def test_packed_decode_needs_delta_loc_and_a_known_mode():
    q, k, v, _ = _valid()
    counter = StandaloneCounter(request=0, layer=0)
    plan = PackedKeys.from_store(dither_write(k, DitheredInt8(), counter), counter)
    with pytest.raises(ValueError, match="delta_loc"):
        decode_attention_packed(q, plan, v, mode="min")
    with pytest.raises(ValueError, match="mode"):
        decode_attention_packed(q, plan, v, mode="median", delta_loc=1e-3)
    with pytest.raises(ValueError, match="delta_loc"):
        decode_attention_packed(q, plan, v, mode="u", delta_loc=1.5)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's fp16 cast of the inf scale
def test_write_kernels_reject_bad_input():
    _, k, _, _ = _valid()
    counter = StandaloneCounter(request=0, layer=0)
    with pytest.raises(ValueError, match="k_hat"):
        witness_write(k, k[..., :4, :], LAYOUT)
    with pytest.raises(ValueError, match="x"):
        dither_write(_with(k, 0, float("nan")), DitheredInt8(), counter)
    with pytest.raises(ValueError, match="quantizer"):
        dither_write(k, DitheredInt8(granularity="block-channel"), counter)
    with pytest.raises(ValueError, match="quantizer"):
        dither_write(k, DitheredInt8(outlier_pairs=1), counter)  # energy mode: per-block selection
    with pytest.raises(ValueError, match="x"):
        dither_write(_with(k.float(), 0, 1e7), DitheredInt8(), counter)  # amax beyond the fp16 scale range


def test_philox_rejects_words_outside_32_bits():
    with pytest.raises(ValueError, match="counter"):
        philox4x32_10(torch.tensor([[1 << 32, 0, 0, 0]]), torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="key"):
        philox4x32_10(torch.zeros(1, 4, dtype=torch.int64), torch.tensor([[-1, 0]]))


def test_strided_inputs_give_the_same_result():
    """Channel-strided q, keys and values (e.g. a transposed cache) are read correctly."""
    q, k, v, w = _valid()

    def strided(x):
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)

    reference = decode_attention(q, k, v, w, LAYOUT, num_splits=2)
    result = decode_attention(strided(q), strided(k), strided(v), strided(w), LAYOUT, num_splits=2)
    assert strided(k).stride(-1) != 1
    assert torch.equal(result.out, reference.out)
    assert torch.equal(result.certificate.meter, reference.certificate.meter)


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_overflowing_magnitudes_give_the_trivial_bound_never_nan():
    """|q| ~ 1e25 overflows fp32 band norms; with zero witness bands that would be inf * 0."""
    q, k, v, w = _valid()
    q = q.float() * 1e25
    w = w.clone()
    w[..., ::2] = 0.0
    cert = decode_attention(q, k, v, w, LAYOUT, num_splits=2).certificate
    assert not bool(torch.isnan(cert.meter).any())
    assert bool((cert.meter == 1).all())

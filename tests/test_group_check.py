"""The write-time check of a per-group error bound in one pass (witcert.fastpath.group_check, ``DW``'s hypothesis).

Oracle: the elementwise check :func:`witcert.tier_a.derived_witness.check_error_bound` over the bounds repeated to
every channel of their group (the check the store ran before). Domain: the built-in rtn codecs' own bounds on
keys over 30 decades (fp32, bf16, fp16), exact zeros, a bound lowered by one fp64 step below one group's largest
error, NaN and inf in the decode or the bound, eager and compiled. Adversary: a store whose rtn codec declares a
bound of 0 for one group of one token is refused, naming the codec. Tolerance: none (one verdict differing from the
oracle fails).
"""
import pytest
import torch

from witcert.fastpath.group_check import group_bound_holds
from witcert.integrations.hf.codecs import IntCodes
from witcert.integrations.hf.compressed_cache import CompressedLayer
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.derived_witness import check_error_bound
from witcert.tier_a.witness_code import WitnessCode

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _elementwise_holds(x, x_hat, groups) -> bool:
    try:
        check_error_bound(x, x_hat, groups.repeat_interleave(x.shape[-1] // groups.shape[-1], dim=-1), "C")
    except ValueError:
        return False
    return True


def _coded(dtype, bits=4, tokens=40):
    gen = torch.Generator().manual_seed(bits)
    magnitude = torch.logspace(-12 if dtype == torch.float16 else -30, 3, tokens, dtype=torch.float64)
    x = (torch.randn(2, 1, 3, tokens, 64, generator=gen, dtype=torch.float64) * magnitude[:, None]).to(dtype)
    x[..., 5, :32] = 0
    codec = IntCodes(bits)
    packed = codec.encode(x, "key")
    return x, codec.decode(packed, dtype), codec.group_error_bound(packed, dtype)


def _tight(x, x_hat):
    """Each group's largest fp64 error: the tightest bound that holds."""
    error = (x_hat.double() - x.double()).abs()
    return error.unflatten(-1, (2, -1)).amax(-1)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_group_check_agrees_with_the_elementwise_check(dtype, compiled):
    x, x_hat, bound = _coded(dtype)
    tight = _tight(x, x_hat)
    lowered = tight.clone()
    lowered[1, 0, 2, 17, 1] = torch.nextafter(tight[1, 0, 2, 17, 1], torch.tensor(0.0, dtype=torch.float64))
    nan_decode = x_hat.clone()
    nan_decode[0, 0, 1, 3, 40] = float("nan")
    nan_bound = bound.clone()
    nan_bound[0, 0, 0, 9, 0] = float("nan")
    cases = [(x_hat, bound, True), (x_hat, tight, True), (x_hat, lowered, False), (nan_decode, bound, False),
             (x_hat, nan_bound, False), (x_hat, torch.full_like(bound, float("inf")), True)]
    for decoded, groups, holds in cases:
        assert _elementwise_holds(x, decoded, groups) is holds
        assert group_bound_holds(x, decoded, groups, compiled=compiled) is holds


def test_bad_shapes_and_dtypes_are_refused():
    x = torch.zeros(1, 3, 4, 64)
    with pytest.raises(ValueError, match="one shape"):
        group_bound_holds(x, torch.zeros(1, 3, 5, 64), torch.zeros(1, 3, 4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="float64"):
        group_bound_holds(x, x, torch.zeros(1, 3, 4, 2))
    with pytest.raises(ValueError, match="divide"):
        group_bound_holds(x, x, torch.zeros(1, 3, 4, 3, dtype=torch.float64))
    assert group_bound_holds(x[..., :0, :], x[..., :0, :], torch.zeros(1, 3, 0, 2, dtype=torch.float64))


def _understated(honest):
    """rtn's ``group_error_bound`` with one group of one token's bound set to 0 (below its error)."""

    def group_error_bound(self, packed, dtype):
        bound = honest(self, packed, dtype)
        if bound.shape[-2] > 7:
            bound[..., 7, 0] = 0.0
        return bound

    return group_error_bound


@pytest.mark.parametrize("compiled", ["0", "1"])
def test_a_store_whose_grouped_bound_fails_is_refused_naming_the_codec(compiled, monkeypatch):
    monkeypatch.setenv("WITCERT_COMPILE", compiled)
    monkeypatch.setattr(IntCodes, "group_error_bound", _understated(IntCodes.group_error_bound))
    store = CompressedLayer(IntCodes(4), BandLayout(64, 16), keep_exact=False, witness_code=WitnessCode(0))
    x = torch.randn(1, 3, 12, 64, generator=torch.Generator().manual_seed(3))
    store.append(x, x.flip(-1))
    with pytest.raises(ValueError, match="codec IntCodes: the reconstruction error exceeds"):
        store.memory()

"""Contract: the witness write kernel stores every band norm at or above itself, in fp16 or one e5m3 byte (T2, MW).

Implementation: ``witcert.kernels.witness_write.witness_write`` (``bits=16`` and ``bits=8``). Oracles: the
torch reference ``witcert.witness_of`` and ``WitnessCode(8).witness`` (bit for bit: both round the same fp64
norm up, the kernel's arithmetic being the reference's), and 60-digit band norms of the residuals
(``tests/maintenance_oracles.py``: every decoded entry at or above its exact norm). Domain: fp16, bf16 and
fp32 keys of head dim 64 in 4 and 16 bands, magnitudes from ``1e-6`` to ``1e4``, an exact token (witness 0)
and a residual beyond the e5m3 range (the trivial ``inf``). Tolerance: none.
"""
import sys
from pathlib import Path

import pytest
import torch

import witcert
from witcert.kernels.witness_write import witness_write
from witcert.tier_a.witness_code import E5M3_INF, WitnessCode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from maintenance_oracles import witness_shortfalls  # noqa: E402  (the exact per-band oracle of tests/)


def _keys(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(2, 3, 24, 64, generator=gen) * torch.logspace(-6, 4, 24)[:, None]).to(dtype)
    k_hat = witcert.get_scheme("rtn-int4")(k)
    k_hat[0, 0, 0] = k[0, 0, 0]  # an exact token: witness 0
    k[0, 0, 1, 0], k_hat[0, 0, 1, 0] = -6e4, 6e4  # a residual beyond the largest finite e5m3 value: inf, never NaN
    return k, k_hat


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's cast of the inf witness
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bands", [4, 16])
@pytest.mark.parametrize("bits", [16, 8])
def test_kernel_witness_is_the_reference_bit_for_bit_and_covers_every_band(dtype, bands, bits):
    layout = witcert.BandLayout(64, bands)
    k, k_hat = _keys(dtype, seed=bands + bits)
    code = WitnessCode(bits)
    stored = witness_write(k, k_hat, layout, bits=bits)
    assert stored.dtype == code.dtype
    assert torch.equal(stored, code.witness(witcert.witness_of(k, k_hat, layout)))
    decoded = code.decoded(stored)
    assert witness_shortfalls(decoded, k_hat, k, layout) == 0
    assert decoded[0, 0, 0].eq(0).all() and torch.isinf(decoded[0, 0, 1, 0])
    if bits == 8:
        assert int(stored.max()) == E5M3_INF


def test_kernel_refuses_other_widths():
    layout = witcert.BandLayout(64, 4)
    k, k_hat = _keys(torch.float32, 0)
    with pytest.raises(ValueError, match="bits"):
        witness_write(k, k_hat, layout, bits=4)

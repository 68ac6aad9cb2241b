"""Witness maintenance under re-quantization (``WM``) and the witnessed store of one cache side.

Implementations: ``witcert.tier_a.maintenance.maintained_witness`` and ``WitnessedTensor``.
Oracles: the spec mirror ``witcert.spec.maintenance`` (mpmath, 50 digits) and the exact
per-(token, band) check of ``tests/maintenance_oracles.py``. Domain: fp32/fp16/bf16 keys, chains
of up to 12 re-quantizations by several quantizers (including HQQ-like re-grouping that moves
keys by whole steps). Tolerance: none (every witness must be >= its exact residual); agreement
with the spec: the fp16 result is the spec value rounded up (at most 2 fp16 ulps above it).
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import mpf

from maintenance_oracles import witness_shortfalls
from witcert.spec import maintenance as spec
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.maintenance import WitnessedTensor, maintained_witness
from witcert.integrations.hf import codecs
from witcert.integrations.hf.compressed_cache import CompressedLayer
from witcert.tier_a.witness import band_major, cat_tokens, witness_of

LAYOUT = BandLayout(16, 4)


def _rtn(x: torch.Tensor, step: float, shift: float = 0.0) -> torch.Tensor:
    """Round to a grid of ``step`` offset by ``shift`` (a stand-in for one quantization), same dtype."""
    xw = x.double()
    return (torch.round((xw - shift) / step) * step + shift).to(x.dtype)


def _regroup(x: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Asymmetric min-max quantization over token groups of ``group`` (groups change as the cache grows)."""
    xw = x.double()
    s = xw.shape[-2] // group * group
    head = xw[..., :s, :].unflatten(-2, (-1, group))
    lo, hi = head.amin(-2, keepdim=True), head.amax(-2, keepdim=True)
    scale = torch.where(hi > lo, (hi - lo) / (2**bits - 1), torch.ones_like(hi))
    q = (torch.round((head - lo) / scale) * scale + lo).flatten(-3, -2)
    return torch.cat([q, xw[..., s:, :]], dim=-2).to(x.dtype)


# ----------------------------------------------------------------------------- maintained_witness


@settings(max_examples=60)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 1.0, 30.0, 3e3]), rope=st.sampled_from(["rotate_half", "interleaved"]))
def test_maintained_witness_is_the_spec_value_rounded_up(seed, scale, rope):
    """Per token: the fp16 witness is >= the spec's w + ||x^_new - x^_old||_b and at most 2 fp16 ulps above it."""
    layout = BandLayout(16, 4, rope)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 16, generator=gen) * scale
    old, new = _rtn(x, 0.1 * scale), _rtn(x, 0.37 * scale, 0.05 * scale)
    w = witness_of(x, old, layout)
    got = maintained_witness(w, old, new, layout)
    assert got.dtype == torch.float16
    for t in range(3):
        expected = spec.bound_maintained_witness(w[t].double().tolist(), old[t].tolist(), new[t].tolist(), 4, rope)
        for b in range(4):
            value = mpf(got[t, b].item())
            assert value >= expected[b]
            assert value <= expected[b] * (1 + 2 * 2.0**-10) + 2.0**-23, (t, b, value, expected[b])
        assert spec.hypotheses_maintained_witness(x[t].tolist(), old[t].tolist(), w[t].double().tolist(), 4, rope)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_chain_of_requantizations_keeps_every_witness_sound(dtype):
    """12 re-quantizations by different grids and re-groupings: w >= ||(x^_n - x)_b|| after every one (exact check).

    A witness frozen at the first quantization falls below the residual on many bands (the
    failure the maintenance repairs), so the check has teeth.
    """
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(2, 3, 40, 16, generator=gen) * 2).to(dtype)
    x_hat = _regroup(x, 8, 2)
    w = witness_of(x, x_hat, LAYOUT)
    first = w.clone()
    stale = 0
    for step in range(12):
        new = _regroup(x_hat, 8 + 4 * (step % 3), 2 + step % 3) if step % 2 else _rtn(x_hat, 0.3, 0.1 * step)
        w = maintained_witness(w, x_hat, new, LAYOUT)
        x_hat = new
        assert witness_shortfalls(w, x_hat, x, LAYOUT) == 0, step
        stale = max(stale, witness_shortfalls(first, x_hat, x, LAYOUT))
    assert stale > 0.1 * first.numel()


def test_exact_token_gets_its_exact_witness_and_unmoved_tokens_keep_theirs():
    """w = 0 and x^_old = x gives witness_of(x, x^_new) bit for bit; x^_new = x^_old leaves w unchanged (no creep)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=gen)
    new = _rtn(x, 0.25)
    zero = torch.zeros(5, 4, dtype=torch.float16)
    assert torch.equal(maintained_witness(zero, x, new, LAYOUT), witness_of(x, new, LAYOUT))
    w = witness_of(x, new, LAYOUT)
    again = w
    for _ in range(50):
        again = maintained_witness(again, new, new.clone(), LAYOUT)
    assert torch.equal(again, w)


def test_infinite_witness_stays_infinite_and_bad_witness_raises():
    x = torch.randn(2, 16)
    w = torch.full((2, 4), float("inf"), dtype=torch.float16)
    assert torch.isinf(maintained_witness(w, x, x + 1, LAYOUT)).all()
    with pytest.raises(ValueError, match="shape"):
        maintained_witness(w[:, :2], x, x, LAYOUT)
    with pytest.raises(ValueError, match=">= 0"):
        maintained_witness(-w, x, x, LAYOUT)
    with pytest.raises(ValueError, match="NaN|>= 0"):
        maintained_witness(torch.full_like(w, float("nan")), x, x, LAYOUT)


# ----------------------------------------------------------------------------- WitnessedTensor


def test_witnessed_tensor_appends_moves_and_keeps_snapshots():
    gen = torch.Generator().manual_seed(11)
    store = WitnessedTensor(LAYOUT)
    exact = torch.randn(1, 2, 6, 16, generator=gen)
    store.append_exact(exact)
    snapshot, snapshot_w = store.recon, store.witness
    assert torch.equal(snapshot_w, torch.zeros(1, 2, 6, 4, dtype=torch.float16))
    moved = _rtn(exact[..., 1:4, :], 0.5)
    store.move(moved, start=1)
    assert torch.equal(snapshot, exact) and not snapshot_w.any()  # the earlier read is untouched
    assert torch.equal(store.recon[..., 1:4, :], moved) and torch.equal(store.recon[..., 4:, :], exact[..., 4:, :])
    assert not store.witness[..., [0, 4, 5], :].any()
    assert witness_shortfalls(store.witness, store.recon, exact, LAYOUT) == 0
    again = _regroup(store.recon, 3, 1)
    store.move(again)
    assert store.recon is again  # a whole move holds the caller's tensor, no copy
    assert witness_shortfalls(store.witness, store.recon, exact, LAYOUT) == 0


def test_keep_exact_recomputes_from_the_shadow_and_is_never_looser():
    gen = torch.Generator().manual_seed(5)
    exact = torch.randn(1, 1, 32, 16, generator=gen)
    shadowed, maintained = WitnessedTensor(LAYOUT, keep_exact=True), WitnessedTensor(LAYOUT)
    for store in (shadowed, maintained):
        store.append_exact(exact)
        for step in range(4):
            store.move(_regroup(store.recon, 4 + 4 * step, 2))
    assert torch.equal(shadowed.recon, maintained.recon)
    assert torch.equal(shadowed.witness, witness_of(exact, shadowed.recon, LAYOUT))
    assert (shadowed.witness <= maintained.witness).all()
    assert (shadowed.witness < maintained.witness).any()
    assert torch.equal(shadowed.exact, exact)


def test_reorder_and_reset():
    store = WitnessedTensor(LAYOUT, keep_exact=True)
    exact = torch.randn(3, 1, 4, 16)
    store.append_exact(exact)
    store.move(_rtn(exact, 0.5))
    w = store.witness
    store.reorder(torch.tensor([2, 0, 1]))
    assert torch.equal(store.witness, w[[2, 0, 1]]) and torch.equal(store.exact, exact[[2, 0, 1]])
    store.reset()
    assert store.length == 0 and store.recon is None and store.exact is None


def test_witnessed_tensor_rejects_what_it_cannot_describe():
    store = WitnessedTensor(LAYOUT)
    with pytest.raises(ValueError, match="no tokens"):
        store.move(torch.zeros(1, 1, 1, 16))
    store.append_exact(torch.zeros(1, 1, 4, 16))
    with pytest.raises(ValueError, match="dtype"):
        store.append_exact(torch.zeros(1, 1, 1, 16, dtype=torch.float16))  # a cast would change the exact keys
    with pytest.raises(ValueError, match="does not match"):
        store.move(torch.zeros(1, 1, 4, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[2, 6\)"):
        store.move(torch.zeros(1, 1, 4, 16), start=2)
    with pytest.raises(ValueError, match="finite"):
        store.append_exact(torch.full((1, 1, 1, 16), float("nan")))
    with pytest.raises(ValueError, match="d=16"):
        store.append_exact(torch.zeros(1, 1, 1, 8))

    class Packed(torch.Tensor):  # a backend's quantized tensor subclass is not what attention reads
        pass

    with pytest.raises(ValueError, match="plain torch.Tensor"):
        store.move(torch.zeros(1, 1, 4, 16).as_subclass(Packed))
    with pytest.raises(ValueError, match="BandLayout"):
        WitnessedTensor("bands")


def _band_major(w: torch.Tensor) -> bool:
    return w.transpose(-1, -2).is_contiguous()


def test_stores_keep_the_witness_band_major():
    """The fast band dot reads each band contiguously: appends, partial moves and reorders keep that layout
    (values as the token-major joins would give)."""
    gen = torch.Generator().manual_seed(23)
    store = WitnessedTensor(LAYOUT)
    exact = torch.randn(2, 2, 6, 16, generator=gen)
    store.append_exact(exact[..., :4, :])
    store.append_exact(exact[..., 4:, :])
    assert _band_major(store.witness) and store.witness.shape == (2, 2, 6, 4)
    store.move(_rtn(exact[..., 1:3, :], 0.5), start=1)
    assert _band_major(store.witness) and witness_shortfalls(store.witness, store.recon, exact, LAYOUT) == 0
    w = store.witness.clone()
    store.reorder(torch.tensor([1, 0]))
    assert _band_major(store.witness) and torch.equal(store.witness, w[[1, 0]])
    layer = CompressedLayer(codecs.IntCodes(8), LAYOUT, keep_exact=False)
    for part in (exact[..., :4, :], exact[..., 4:5, :], exact[..., 5:, :]):
        layer.append(part, part)
    stored = layer.stored()
    assert stored.witness.stride(-2) == 1  # each band's tokens contiguous (a view of the store's growing buffer)
    assert torch.equal(stored.witness, witness_of(exact, layer.read()[0], LAYOUT))
    assert torch.equal(cat_tokens(w[..., :2, :], w[..., 2:, :]), w) and _band_major(cat_tokens(w[..., :2, :].contiguous(), w))
    one_token = w[0, 0, 0]
    assert band_major(w) is w and band_major(one_token) is one_token  # no copy where nothing moves

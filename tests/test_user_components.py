"""The components a user hands the monitor (issue 28 cases 1 and 3): the store owns what it holds.

Implementation: :func:`witcert.schemes.registry.apply_scheme` (every scheme output copied),
:class:`witcert.integrations.hf.codecs.OwnedCodec` (a user codec's inputs private, outputs copied,
``decode`` deterministic, ``join`` lossless), the HF quantized-cache witness and
:class:`witcert.tier_a.maintenance.WitnessedTensor` (no tensor held by reference from the model).
Oracle: the fuzz class :mod:`witcert.verification.attacks.user_components` (fp64 TV over the exact
keys the model wrote and the keys attention read, per cell, both ``keep_exact`` modes) and, for the
stores, bitwise comparisons with what was read before another layer wrote. Tolerance: none.
"""
import pytest
import torch

from witcert.integrations.hf.codecs import OwnedCodec, Reconstruction, owned_codec
from witcert.integrations.hf.compressed_cache import CompressedLayer
from witcert.integrations.hf.quantized_cache import _owned
from witcert.schemes.registry import apply_scheme, shares_memory
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.maintenance import WitnessedTensor
from witcert.tier_a.witness import witness_of
from witcert.verification.attacks import AttackTally
from witcert.verification.attacks import user_components as uc

LAYOUT = BandLayout(32, 4)


def _cache(seed: int, tokens: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, tokens, 32, generator=g), torch.randn(2, 2, tokens, 32, generator=g)


def test_apply_scheme_returns_a_copy_of_a_reused_workspace():
    scheme = uc.WorkspaceScheme(3.0, shared_roles=True)
    first = apply_scheme(scheme, _cache(0)[0])
    kept = first.clone()
    second = apply_scheme(scheme, _cache(1)[0])
    assert torch.equal(first, kept) and not torch.equal(first, second)
    assert not any(shares_memory(first, buffer) for buffer in scheme.buffers.values())


@pytest.mark.parametrize("keep_exact", [True, False])
@pytest.mark.parametrize("make", [lambda: Reconstruction(uc.WorkspaceScheme(3.0, shared_roles=False)),
                                  lambda: uc.WorkspaceCodec(3.0)], ids=["workspace scheme", "workspace codec"])
def test_a_store_keeps_its_keys_when_the_next_layer_writes(make, keep_exact):
    """One component serves two layers (as one scheme instance serves a model): layer 0's read keys and
    witness stay what they were, and the witness describes the keys read, against the model's exact keys."""
    component = make()
    layers = [CompressedLayer(component, LAYOUT, keep_exact=keep_exact) for _ in range(2)]
    key, value = _cache(2)
    key0 = key.clone()
    layers[0].append(key, value)
    read0 = [t.clone() for t in layers[0].read()]
    layers[1].append(*_cache(3))
    assert torch.equal(key, key0)  # the codec quantized its private copy, not the model's keys
    assert all(torch.equal(now, before) for now, before in zip(layers[0].read(), read0))
    stored = layers[0].stored()
    assert torch.equal(stored.witness.float(), witness_of(key0, read0[0], LAYOUT).float())


@pytest.mark.parametrize("keep_exact", [True, False])
def test_a_requantizing_join_is_refused_and_a_lossless_one_kept(keep_exact):
    key, value = _cache(4, tokens=6)
    refused = CompressedLayer(uc.ChannelCodec(3.0, requantize=True), LAYOUT, keep_exact=keep_exact)
    refused.append(key[..., :4, :], value[..., :4, :])
    with pytest.raises(ValueError, match="join must only concatenate"):
        refused.append(key[..., 4:, :], value[..., 4:, :])
    kept = CompressedLayer(uc.ChannelCodec(3.0, requantize=False), LAYOUT, keep_exact=keep_exact)
    kept.append(key[..., :4, :], value[..., :4, :])
    kept.append(key[..., 4:, :], value[..., 4:, :])
    assert len(kept.key_chunks) == 1 and kept.length == 6


class _NoisyDecode:
    """A codec whose decode adds fresh noise: the keys read are never the ones witnessed."""

    def encode(self, x, role, start=0):
        return x.clone()

    def decode(self, packed, dtype):
        return packed + 1e-3 * torch.randn(packed.shape, dtype=dtype)

    def nbytes(self, packed):
        return packed.numel() * packed.element_size()


def test_a_non_deterministic_decode_is_refused():
    layer = CompressedLayer(_NoisyDecode(), LAYOUT, keep_exact=False)
    with pytest.raises(ValueError, match="deterministic"):
        layer.append(*_cache(5))


def test_builtin_codecs_are_held_as_they_are_and_user_codecs_wrapped_once():
    builtin = Reconstruction("rtn-int8")
    assert owned_codec(builtin) is builtin
    wrapped = owned_codec(uc.WorkspaceCodec(3.0))
    assert isinstance(wrapped, OwnedCodec) and owned_codec(wrapped) is wrapped
    assert not hasattr(wrapped, "join") and hasattr(owned_codec(uc.ChannelCodec(3.0, False)), "join")


def test_the_quantized_cache_witness_copies_a_read_it_does_not_own():
    """transformers returns the model's in-flight keys themselves on a layer's first write."""
    key = torch.randn(1, 2, 3, 32)
    assert _owned(key, (key,)) is not key and torch.equal(_owned(key, (key,)), key)
    fresh = torch.cat([key, key], dim=-2)
    assert _owned(fresh, (key, torch.empty(0))) is fresh


def test_witnessed_tensor_copies_the_first_write():
    store = WitnessedTensor(LAYOUT)
    key = torch.randn(1, 2, 3, 32)
    store.append_exact(key)
    key.mul_(2)
    assert not torch.equal(store.recon, key)


@pytest.mark.parametrize("keep_exact", [True, False])
@pytest.mark.parametrize("case", uc.CASES, ids=lambda case: case.__name__.strip("_"))
def test_every_user_component_case_through_the_monitor(case, keep_exact):
    """Each fuzz case once through ``witcert.monitor`` on the tiny Llama: every cell's meter at least the
    fp64 TV against the exact keys the model wrote, or the component refused with a clear error."""
    tally = AttackTally(uc.NAME)
    uc.run_case(case, keep_exact, torch.Generator().manual_seed(28), tally)
    assert tally.violations == 0, tally.notes
    assert tally.cells > 0 or tally.rejected == 1
    assert tally.rejected == (1 if case is uc._requantizing_join_codec else 0)

"""A scheme must return a plain tensor: subclasses and non-dense outputs are rejected with what to return.

Implementation under test: ``witcert.schemes.registry.apply_scheme`` (and ``get_scheme``, which
runs through it). Oracle: the expected ``ValueError`` message, which names the scheme and says
what to return. Domain: a wrapper subclass that packs int8 codes and reports the float shape and
dtype (as optimum-quanto's ``QTensor`` does), with and without its own ``dequantize``; a plain
``as_subclass``; torch's own quantized, sparse and meta tensors; non-tensors. Tolerance: none.
"""
import pytest
import torch

import witcert
from witcert.schemes.registry import _REGISTRY, apply_scheme, shares_memory

X = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))


class PackedTensor(torch.Tensor):
    """Stand-in for optimum-quanto's QTensor: int8 codes and a scale behind the float shape and dtype."""

    @staticmethod
    def __new__(cls, codes, scale, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=dtype, device=codes.device)

    def __init__(self, codes, scale, dtype):
        self._codes, self._scale = codes, scale

    def dequantize(self):
        return self._codes.to(self.dtype) * self._scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} is not supported on a packed tensor")


def pack_int8(x):
    """Per-tensor int8 packing that returns the packed tensor itself (the mistake under test)."""
    scale = x.abs().amax() / 127
    return PackedTensor(torch.round(x / scale).to(torch.int8), scale, x.dtype)


class Opaque(torch.Tensor):
    """A subclass with no dequantize of its own."""


@pytest.mark.parametrize("scheme,message", [
    (pack_int8, r"tensor subclass \(.*PackedTensor\).*plain torch.Tensor of the input's shape \(2, 6, 8\) "
                r"and dtype torch.float32: call \.dequantize\(\) on it and return that"),
    (lambda x: x.as_subclass(Opaque), r"tensor subclass .*Opaque.*return the reconstructed values as a plain tensor"),
    (lambda x: torch.quantize_per_tensor(x, 0.1, 0, torch.qint8), r"quantized tensor.*call \.dequantize\(\)"),
    (lambda x: x.to_sparse(), r"sparse_coo tensor.*plain torch.Tensor.*\(dense\)"),
    (lambda x: x.to("meta"), r"moved the tensor from cpu to meta"),
    (lambda x: x.numpy(), r"returned numpy.ndarray; it must return a plain torch.Tensor"),
    (lambda x: None, r"returned NoneType; it must return a plain torch.Tensor"),
], ids=["packed-with-dequantize", "subclass", "qint8", "sparse", "meta", "numpy", "none"])
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_non_plain_outputs_are_rejected_with_what_to_return(scheme, message):
    with pytest.raises(ValueError, match=message):
        apply_scheme(scheme, X)


def test_the_registered_path_rejects_a_packed_output_too():
    _REGISTRY.pop("test-packed", None)
    witcert.register_scheme("test-packed")(pack_int8)
    try:
        with pytest.raises(ValueError, match=r"scheme 'test-packed' returned a tensor subclass.*dequantize"):
            witcert.get_scheme("test-packed")(X)
    finally:
        _REGISTRY.pop("test-packed", None)


def test_the_hint_works_calling_dequantize_gives_an_accepted_scheme():
    x_hat = apply_scheme(lambda x: pack_int8(x).dequantize(), X)
    assert type(x_hat) is torch.Tensor and x_hat.shape == X.shape and x_hat.dtype == X.dtype
    assert (x_hat - X).abs().max() <= X.abs().max() / 127 / 2 * (1 + 1e-6)  # half a step of the per-tensor grid
    assert not shares_memory(x_hat, X)


def test_plain_outputs_still_pass_and_never_alias_the_input():
    for scheme in (lambda x: x, lambda x: x.mul_(0.5), lambda x: x.detach().clone().requires_grad_(False)):
        x0 = X.clone()
        x_hat = apply_scheme(scheme, X)
        assert torch.equal(X, x0) and type(x_hat) is torch.Tensor and not shares_memory(x_hat, X)

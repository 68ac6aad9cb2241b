"""The memory account is the bytes a store holds, to the byte (issue 44: exact byte accounts, asserted).

Implementations: ``CompressedLayer.memory`` and ``QuantizedLayerStore.memory``
(:class:`witcert.integrations.hf.memory.MemoryAccount`), summed by ``witcert.monitor(...).memory()``.
Oracle: every tensor reachable from the store (its buffers, packed chunks, witnesses, transformers'
quantized states, tensor subclasses flattened), each storage counted once by address: their bytes must
equal ``held + reserved`` exactly. Domain: every built-in codec and a user codec, validation and production
mode, fp32 and bf16 caches, 16- and 8-bit witnesses, prefill then one-token steps; quanto int4. Tolerance: none.
"""
import weakref

import pytest
import torch

import witcert
from benchmarks.capacity import UserInt4
from tiny_models import prompts, tiny
from witcert.integrations.hf.codecs import codec_for
from witcert.integrations.hf.compressed_cache import CompressedLayer
from witcert.integrations.hf.token_buffer import TokenBuffer
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness_code import WitnessCode

WALKED = ("witcert.integrations.hf", "transformers.cache_utils")  # objects whose attributes hold the store's data


def storage_bytes(root) -> int:
    """Bytes of every distinct tensor storage reachable from ``root`` (shared geometry such as a BandLayout excluded)."""
    storages: dict[int, int] = {}
    seen: set[int] = set()

    def walk(x):
        if id(x) in seen or x is None or isinstance(x, (BandLayout, weakref.ref, str, int, float, bool, torch.dtype)):
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if type(x) is not torch.Tensor and hasattr(x, "__tensor_flatten__"):  # quanto's QTensor and its parts
                for name in x.__tensor_flatten__()[0]:
                    walk(getattr(x, name))
                return
            storage = x.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(x, (list, tuple, set)):
            for item in x:
                walk(item)
        elif isinstance(x, dict):
            for item in x.values():
                walk(item)
        elif isinstance(x, TokenBuffer) or type(x).__module__.startswith(WALKED):
            for item in vars(x).values():
                walk(item)

    walk(root)
    return sum(storages.values())


SCHEMES = ["rtn-int8", "rtn-int4", "kivi-2bit", "fp8-e4m3", "fp8-e4m3-scaled", "sign-1bit", UserInt4()]


@pytest.mark.filterwarnings("ignore::witcert.integrations.hf.codecs.HeldReconstructionWarning")  # sign-1bit
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s if isinstance(s, str) else type(s).__name__)
@pytest.mark.parametrize("keep_exact", [False, True])
@pytest.mark.parametrize("dtype, bits", [(torch.float32, 16), (torch.bfloat16, 8)])
def test_the_account_is_every_byte_the_store_holds(scheme, keep_exact, dtype, bits):
    store = CompressedLayer(codec_for(scheme, packed=not keep_exact), BandLayout(64, 4), keep_exact=keep_exact,
                            witness_code=WitnessCode(bits))
    gen = torch.Generator().manual_seed(0)
    for n in [45] + [1] * 20:  # a prefill (a full KIVI group and a tail), then decode steps that grow the buffers
        k, v = (torch.randn(2, 3, n, 64, generator=gen).to(dtype) for _ in range(2))
        store.append(k, v)
    account = store.memory()
    assert storage_bytes(store) == account.held + account.reserved
    assert account.reserved <= account.held // 4 + 64 * 1024  # growth keeps at most a quarter ahead (and its first 16)
    if not keep_exact:
        assert account.decoded == account.exact_shadow == 0
        assert account.witness == 2 * 3 * 65 * WitnessCode(bits).bytes_per_token(4)


def test_a_quantized_cache_store_holds_its_packed_history_and_nothing_decoded():
    pytest.importorskip("optimum.quanto", reason="the 'quant' extra is not installed")
    from witcert.integrations.hf.quantized_cache import QuantizedCacheSpec
    from witcert.integrations.hf.quantized_store import QuantizedLayerStore

    store = QuantizedLayerStore(QuantizedCacheSpec("quanto", 4, residual_length=8), BandLayout(64, 8),
                                keep_exact=False, witness_code=WitnessCode(8))
    gen = torch.Generator().manual_seed(1)
    for n in [40] + [1] * 11:  # the prefill, a flush, and a window of three exact tokens
        k, v = (torch.randn(1, 2, n, 64, generator=gen) for _ in range(2))
        store.append(k, v)
        store.read()  # what the forward call attends; released with it
    account = store.memory()
    assert account.decoded == 0 and storage_bytes(store) == account.held + account.reserved
    assert account.held < 0.5 * account.exact_cache


def test_a_monitored_request_reports_the_stores_sum_and_the_backing_store_apart():
    from transformers import DynamicCache

    model = tiny("llama")
    ids, mask = prompts(1, length=40)
    cache = DynamicCache()
    with torch.no_grad(), witcert.monitor(model, "rtn-int4", keep_exact=False, certificate="spot", witness_bits=8,
                                          bands=4) as mon:
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
        total = mon.memory().total
        assert total.held + total.reserved == sum(storage_bytes(layer.store) for layer in cache.layers)
        assert total.backing_host == sum(layer.store.backing.stream_nbytes(i) for i, layer in enumerate(cache.layers))
        assert total.backing_files == 0 and total.held < 0.3 * total.exact_cache
        assert "in host memory, not on the device" in str(mon.memory()) and "backing store" in str(mon.summary())

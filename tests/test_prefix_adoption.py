"""``witcert.monitor`` adopting a cache that already holds an exact prefix (one prefill shared by several runs).

Implementation: :func:`witcert.integrations.hf.cache_layer.adopt` (the prefix becomes each
store's first write). Oracle: the same request whose prefix is prefilled under the monitor
(the stores' first write is then the prefill itself); the fp64 true TV of every cell. Domain: a
tiny 2-layer Llama (GQA), schemes rtn-int4 and fp8-e4m3, a 12-token prefix, a 3-token probe.
Tolerance: none on the metered cells and logits (the prefill writes the same exact keys either way).
"""
import copy

import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

import witcert
from tests.tiny_models import VOCAB, tiny


def _ids(length, seed):
    return torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scheme", ["rtn-int4", "fp8-e4m3"])
def test_an_exact_prefix_is_metered_like_a_monitored_prefill(scheme):
    model = tiny("llama")
    prefix, probe = _ids(12, 1), _ids(3, 2)
    with torch.no_grad():
        with witcert.monitor(model, scheme) as inside:
            cache = DynamicCache(config=model.config)
            model(prefix, past_key_values=cache)
            expected = model(probe, past_key_values=cache).logits
        exact = DynamicCache(config=model.config)
        model(prefix, past_key_values=exact)
        with witcert.monitor(model, scheme) as adopted:
            got = model(probe, past_key_values=copy.deepcopy(exact)).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    a, b = inside.table(), adopted.table()
    assert len(b) == 2 * 2 * 4 * 3  # rows x layers x query heads x probe queries
    for name in ("meter", "true_tv", "pos", "layer", "head"):
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.any(b["true_tv"] > b["meter"])
    assert np.all(b["true_tv"] > 0)  # the probe really read the compressed prefix


def test_a_ragged_or_windowed_prefix_is_refused():
    model = tiny("llama")
    exact = DynamicCache(config=model.config)
    with torch.no_grad():
        model(_ids(5, 3), past_key_values=exact)
    exact.layers[1].keys, exact.layers[1].values = exact.layers[1].keys[..., :4, :], exact.layers[1].values[..., :4, :]
    with witcert.monitor(model, "rtn-int4"), pytest.raises(ValueError, match="different lengths per layer"):
        model(_ids(1, 4), past_key_values=exact)
    windowed = DynamicCache(config=model.config)
    with torch.no_grad():
        model(_ids(5, 3), past_key_values=windowed)
    layer = DynamicSlidingWindowLayer(sliding_window=8)
    layer.lazy_initialization(windowed.layers[0].keys, windowed.layers[0].values)
    layer.keys, layer.values = windowed.layers[0].keys, windowed.layers[0].values
    windowed.layers[0] = layer
    with witcert.monitor(model, "rtn-int4"), pytest.raises(ValueError, match="DynamicSlidingWindowLayer holding tokens"):
        model(_ids(1, 4), past_key_values=windowed)

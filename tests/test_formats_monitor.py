"""The engine KV formats through the integrations: ``witcert.monitor`` (both ``keep_exact`` modes, the gate), the
observatory and the memory account.

Implementations: ``witcert.monitor`` with each format of :mod:`witcert.schemes.engine_formats` (held as its own
packed codec in production), :func:`witcert.observatory.runner.run_observe` on SmolLM2. Oracles: per cell, the
fp64 true TV against the exact shadow (never in aggregate); the bytes the format's formula gives
(``KVFormat.code_bytes``); the reconstruction the validation mode reads. Domain: a tiny Llama (head dim 32,
GQA 4/2), fp32 and bf16; SmolLM2-135M on a short needle task. Tolerance: none.
"""
import copy

import numpy as np
import pytest
import torch

import witcert
from tests.tiny_models import prompts, tiny
from witcert.integrations.hf import default_model as models
from witcert.observatory import runner as observatory
from witcert.schemes.engine_formats import FORMATS


def _generate(model, scheme, **monitor):
    ids, mask = prompts()
    with torch.no_grad(), witcert.monitor(model, scheme, **monitor) as mon:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    return mon, out


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_cell_is_sound_and_production_holds_the_engine_bytes(name, dtype):
    model = copy.deepcopy(tiny("llama")).to(dtype)  # the cached model is shared: never cast it in place
    validation, out = _generate(model, name)
    production, out_production = _generate(model, name, keep_exact=False)
    table = validation.table()
    assert len(table) and not np.isnan(table["true_tv"]).any() and (table["true_tv"] <= table["meter"]).all()
    assert torch.equal(out, out_production)  # production decodes the packed codes to the same keys
    assert np.array_equal(table["meter"], production.table()["meter"])
    memory = production.memory().total
    tokens = out.shape[1] - 1  # the last token is generated, never written
    rows, kv_heads, layers, head_dim = 2, 2, 2, 32
    fmt = FORMATS[name]
    expected = sum(fmt.code_bytes(head_dim, role) for role in ("key", "value")) * rows * kv_heads * layers * tokens
    assert memory.compressed == expected and memory.exact_shadow == 0 and memory.saved > 0


@pytest.mark.parametrize("name", ["int4-per-token-head", "mxfp4"])
def test_the_gate_repairs_engine_formats(name):
    mon, _ = _generate(tiny("llama"), name, gate=witcert.Gate(0.001))
    table = mon.table()
    assert table["repaired"].any() and (table["meter_after"] <= 0.001).all()
    assert (table["true_tv_after"] <= table["meter_after"]).all()


@pytest.mark.model
def test_observatory_runs_engine_formats_on_smollm2():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loaded = models.load_model()
    except models.ModelUnavailable as err:  # pragma: no cover - the package is a pinned dependency
        pytest.skip(str(err))
    try:
        config = observatory.ObserveConfig(schemes=("nvfp4", "turboquant-4bit-nc"), task="needle", context_tokens=160,
                                           probe_tokens=8, new_tokens=2, cases=1)
        results, _ = observatory.run_observe(loaded, config)
    finally:
        torch.set_num_threads(threads)
    for result in results:
        tv, meter = result.raw["true_tv"], result.raw["meter"]
        assert len(tv) and not np.isnan(tv).any() and (tv <= meter).all()

"""``witcert.monitor`` around ``generate`` and forward calls of tiny random transformers decoders.

Implementation: :mod:`witcert.integrations.hf.monitoring` (with the ``"witcert"`` attention, the
monitored cache layers, the stores and codecs). Oracles: the fp64 true TV of every cell against
the exact keys the model wrote (per cell, never in aggregate); stock transformers logits; runs
of the same request in a fresh monitor; the registered schemes' own outputs (codecs); the
independent fp64 TV of :func:`witcert.verification.attacks.model_dtypes.oracle_tv`. Domain:
2-layer models with GQA (4 query heads over 2 kv heads), Llama/Qwen2/Mistral (``rotate_half``)
and Cohere/GLM/Helium (interleaved pairs), head dims 32, 80 and 112, left-padded batches.
Tolerance: none unless stated.
"""
import json

import numpy as np
import pytest
import torch

import witcert
from witcert.integrations.hf import geometry
from tests.tiny_models import INTERLEAVED, ROTATE_HALF, VOCAB, prompts, tiny


pytestmark = pytest.mark.usefixtures("one_thread")


def generate(model, scheme, new_tokens=4, rows=2, **kwargs):
    ids, mask = prompts(rows)
    with torch.no_grad(), witcert.monitor(model, scheme, **kwargs) as mon:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return mon, out


def assert_sound(table):
    """Every cell: true TV <= meter (no tolerance), and the exact cache was consulted."""
    tv, meter = table["true_tv"], table["meter"]
    assert len(table) > 0 and not np.isnan(tv).any() and not np.isnan(meter).any()
    bad = np.flatnonzero(tv > meter)
    assert bad.size == 0, f"{bad.size} cells with true TV above the meter, e.g. {tv[bad[:3]]} > {meter[bad[:3]]}"


# ---------------------------------------------------------------- geometry


@pytest.mark.parametrize("head_dim, bands", [(64, 16), (80, 10), (112, 14), (128, 16), (32, 16), (6, 3), (2, 1)])
def test_auto_bands_is_the_largest_divisor_of_half_the_head_dim_up_to_16(head_dim, bands):
    assert geometry.auto_bands(head_dim) == bands


@pytest.mark.parametrize("family", ROTATE_HALF + INTERLEAVED)
def test_rope_convention_and_heads_come_from_the_model(family):
    geo = geometry.geometry_of(tiny(family))
    assert geo == geometry.AttentionGeometry(layers=2, query_heads=4, kv_heads=2, head_dim=32,
                                             rope="interleaved" if family in INTERLEAVED else "rotate_half")


@pytest.mark.parametrize("family", ["llama", "cohere", "glm"])
def test_generate_left_padded_batch_every_cell_sound(family):
    """Batched, left-padded ``generate``: one cell per (row, layer, query head, decode step), each sound."""
    mon, out = generate(tiny(family), "rtn-int4")
    table = mon.table()
    assert len(table) == 2 * 2 * 4 * 3  # rows x layers x heads x measured decode steps (4 new tokens)
    assert_sound(table)
    assert set(table["tier"]) == {"A"} and mon.tensor().shape == (2, 2, 4, 3)
    assert (mon.positions() == torch.tensor([[10, 11, 12]] * 2)).all()


@pytest.mark.parametrize("head_dim", [80, 112])
def test_head_dims_80_and_112(head_dim):
    model = tiny("llama", hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim)
    mon, _ = generate(model, "fp8-e4m3")
    assert mon.layout.bands == {80: 10, 112: 14}[head_dim]
    assert_sound(mon.table())


def test_forward_calls_pipeline_style_and_stock_path():
    """A forward without a cache is one prefill (nothing compressed is read: no cell); a cache passed
    by the caller is one request across calls; leaving the block restores the stock path exactly."""
    model = tiny("qwen2")
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        stock = model(ids).logits
        with witcert.monitor(model, "kivi-2bit") as mon:
            alone = model(ids).logits
            from transformers import DynamicCache
            cache = DynamicCache(config=model.config)
            model(ids[:, :8], past_key_values=cache)
            model(ids[:, 8:], past_key_values=cache)
        assert torch.equal(model(ids).logits, stock) and model.config._attn_implementation == "sdpa"
    assert torch.equal(alone, stock)  # a prefill attends its exact in-flight keys
    assert len(mon.requests) == 2 and len(mon.table()) == 2 * 4 * 4  # the probe's 4 queries, both layers
    assert_sound(mon.table())


# ---------------------------------------------------------------- defect: a reused monitor served request 1's cache


@pytest.mark.parametrize("scheme", ["rtn-int4", "dithered-int8"])
def test_each_generate_call_is_a_fresh_request(scheme):
    """Two ``generate`` calls in one monitor, the second prompt at least as long as the first: the
    second request must run on its own compressed cache. Oracle: the same second request after a
    *different* first request (fixed dither seed) gives bit-identical logits and meters; before the
    fix the second request ran on the first one's compressed keys (logits off by up to 29.8)."""
    model = tiny("llama")
    first_a = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    first_b = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    second = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(6))
    runs = []
    for first in (first_a, first_b):
        with torch.no_grad(), witcert.monitor(model, scheme, seed=1234) as mon:
            model.generate(first, max_new_tokens=3, do_sample=False, pad_token_id=0)
            out = model.generate(second, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
        table = mon.table()
        runs.append((torch.stack(out.logits), table.where(table["request"] == 1)))
        assert [r.rows for r in mon.requests] == [1, 1]
        assert_sound(table)
    (logits_a, cells_a), (logits_b, cells_b) = runs
    assert torch.equal(logits_a, logits_b)
    assert np.array_equal(cells_a["meter"], cells_b["meter"]) and np.array_equal(cells_a["pos"], cells_b["pos"])
    assert cells_a["pos"].min() == 12  # the second request's own positions, not the first one's continuation


# ---------------------------------------------------------------- defect: Tier B under generate


def test_tier_b_is_deterministic_inside_generate_and_probabilistic_only_where_declared():
    """Before the fix a user's generation loop used Tier B's probabilistic branch by default
    (``Session.adaptive=False``) while its queries depend on the dither. Now every cell inside
    ``generate`` uses the deterministic branch, even within ``non_adaptive()``; forward calls use
    the probabilistic branch only inside ``non_adaptive()``. Every cell is sound."""
    model = tiny("llama")
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))
    from transformers import DynamicCache

    with torch.no_grad(), witcert.monitor(model, "dithered-int8") as mon:
        with mon.non_adaptive():
            model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)  # request 0-1: adaptive anyway
            cache = DynamicCache(config=model.config)
            model(ids[:, :5], past_key_values=cache)
            model(ids[:, 5:], past_key_values=cache)  # requests 2-3: declared teacher-forced
        model(ids[:, :1], past_key_values=cache)  # not declared: adaptive
    table = mon.table()
    assert set(table["tier"]) == {"B"} and mon.tier == "B"
    assert table["adaptive"][table["request"] < 2].all()
    probe = (table["request"] >= 2) & (table["pos"] < 8)
    assert not table["adaptive"][probe].any() and table["adaptive"][~probe & (table["request"] >= 2)].all()
    assert_sound(table)
    assert len(set(table["seed"].tolist())) == 2  # a fresh secret seed per request (cache)


# ---------------------------------------------------------------- production mode


@pytest.mark.parametrize("scheme, saves", [("rtn-int4", True), ("rtn-int8", True), ("fp8-e4m3", True),
                                            ("dithered-int8", True), ("kivi-2bit", True)])
def test_production_mode_holds_less_and_meters_the_same(scheme, saves):
    """``keep_exact=False``: the same meters as with the exact cache kept (the packed codecs decode
    bit for bit to the scheme's reconstruction), no true TV, and the memory report says what is held."""
    model = tiny("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    kept, out_kept = generate(model, scheme, seed=99)
    lean, out_lean = generate(model, scheme, seed=99, keep_exact=False)
    assert torch.equal(out_kept, out_lean)
    assert np.array_equal(kept.table()["meter"], lean.table()["meter"], equal_nan=True)
    assert np.isnan(lean.table()["true_tv"]).all()
    report = lean.memory().total
    assert report.exact_shadow == 0 and report.decoded == 0 and report.exact_cache > 0
    assert (report.saved > 0) == saves
    assert kept.memory().total.held > report.held
    if scheme == "rtn-int4":  # int4 codes + fp32 group maxima per 32 channels + witness: about 0.34 of fp32 keys
        assert report.held < 0.4 * report.exact_cache
    assert "saved" in str(lean.memory())


def test_production_gate_pages_from_a_verified_file_backed_store(tmp_path):
    """Gate at tau = 0.05 on rtn-int2 without the exact cache: fired cells are repaired from the
    backing store (memory-mapped files), bytes are paged, and the run matches the in-memory gate."""
    model = tiny("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    gate = witcert.Gate(tau=0.05)
    kept, out_kept = generate(model, "rtn-int2", gate=gate)
    lean, out_lean = generate(model, "rtn-int2", gate=gate, keep_exact=False, backing_dir=tmp_path)
    table = lean.table()
    assert table["repaired"].any() and np.nansum(table["bytes_paged"]) > 0
    assert np.array_equal(table["repaired"], kept.table()["repaired"])
    assert torch.equal(out_kept, out_lean)
    assert lean.memory().total.backing_files > 0 and lean.memory().total.backing_host == 0  # it lived in files
    assert not list(tmp_path.iterdir())  # removed with the request (tests/test_backing_store.py)


def test_a_plain_callable_scheme_reports_its_memory_honestly():
    """A callable returns a reconstruction: held as is (or narrowed when lossless), so a scheme whose
    output needs the model's dtype saves nothing, and the report says so (negative saving)."""
    model = tiny("llama")

    def fine_grid(x):
        return (x * 2**16).round() / 2**16  # 16+ significant bits: no narrower float holds it, kept in fp32

    def to_fp16(x):
        return x.half().to(x.dtype)  # exactly fp16 values: held in fp16

    wide, _ = generate(model, fine_grid, keep_exact=False)
    narrow, _ = generate(model, to_fp16, keep_exact=False)
    assert wide.memory().total.saved < 0 < narrow.memory().total.saved


# ---------------------------------------------------------------- guard: a cache that is not exact


def _quantized_cache(model):
    from transformers import DynamicCache
    from transformers.cache_utils import QuantizedLayer

    class RoundingLayer(QuantizedLayer):  # an HF-quantized layer: what it hands back is not the exact keys
        def _quantize(self, tensor, axis):
            return tensor.half()

        def _dequantize(self, q_tensor):
            return q_tensor.float()

    cache = DynamicCache(config=model.config)
    cache.layers = [RoundingLayer(residual_length=2) for _ in cache.layers]
    return cache


def test_a_quantized_cache_is_refused():
    """Running WitCert attention over an HF-quantized cache used to report 0 violations against its
    non-exact "shadow" (1,005 of 2,160 cells were above the meter against the truly exact keys);
    now it raises before any cell is reported, for forward calls and for ``generate``."""
    model = tiny("llama")
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(8))
    with torch.no_grad(), witcert.monitor(model, "rtn-int4") as mon:
        with pytest.raises(ValueError, match="RoundingLayer.*not the exact keys"):
            model(ids, past_key_values=_quantized_cache(model))
        with pytest.raises(ValueError, match="not the exact keys"):
            model.generate(ids, past_key_values=_quantized_cache(model), max_new_tokens=2, pad_token_id=0)
    assert len(mon.batches) == 0


def test_a_layer_swapped_mid_request_is_refused():
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    model = tiny("llama")
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), witcert.monitor(model, "rtn-int4"):
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache)
        cache.layers[1] = DynamicLayer()
        with pytest.raises(ValueError, match="not the monitored layer"):
            model(ids[:, :1], past_key_values=cache)


def test_bad_configuration_is_rejected():
    model = tiny("llama")
    with pytest.raises(ValueError, match="tier B"):
        witcert.monitor(model, "rtn-int4", tier="B")
    with pytest.raises(ValueError, match="unknown scheme"):
        witcert.monitor(model, "no-such-scheme")
    with pytest.raises(ValueError, match="tier must be"):
        witcert.monitor(model, "rtn-int4", tier="C")
    with pytest.raises(ValueError, match="backing_dir"):
        witcert.monitor(model, "rtn-int4", backing_dir="/tmp/x")
    with pytest.raises(ValueError, match="seed"):
        witcert.monitor(model, "dithered-int8", seed=-1)
    with pytest.raises(ValueError, match="bands"):
        witcert.monitor(model, "rtn-int4", bands=3)
    with pytest.raises(ValueError, match="meter must be"):
        witcert.monitor(model, "rtn-int4", meter="fast")


@pytest.mark.parametrize("family", ["llama", "cohere"])
def test_full_and_fused_meters_are_sound_and_close(family):
    """``meter="full"`` (eager, MS over twelve thresholds) and the fused pass (fp32 budget, MS on four sets of
    its own): each sound per cell; they differ only by the budget and the split sets, so they stay close."""
    fused, _ = generate(tiny(family), "rtn-int4")
    full, _ = generate(tiny(family), "rtn-int4", meter="full")
    assert_sound(fused.table())
    assert_sound(full.table())
    a, b = fused.table()["meter"], full.table()["meter"]
    assert a.shape == b.shape and np.all(a > 0)
    ratio = a / b
    assert np.median(ratio) <= 1 + 1e-4 and np.all(ratio <= 2.0) and np.all(ratio >= 0.5), ratio


# ---------------------------------------------------------------- results


def test_results_table_jsonl_and_pandas(tmp_path):
    mon, _ = generate(tiny("mistral"), "dithered-int8", seed=5)
    path = tmp_path / "cells.jsonl"
    assert mon.write_jsonl(path, {"run": "t"}) == len(mon.table())
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["tier"] for r in rows} == {"B"} and all(r["adaptive"] is True for r in rows)
    assert all(r["seed"] == 5 and r["run"] == "t" and r["scheme"] == "dithered-int8" for r in rows)
    summary = mon.summary()
    assert [r["layer"] for r in summary.rows] == [0, 1] and all(r["violations"] == 0 for r in summary.rows)
    assert "tier B" in str(summary) and "violations" in str(summary)
    pandas = pytest.importorskip("pandas")
    frame = mon.to_pandas()
    assert isinstance(frame, pandas.DataFrame) and len(frame) == len(rows)


def test_sliding_window_model_attends_as_stock():
    """Mistral with a 4-token window: an identity scheme under the monitor gives the stock logits
    (the model's sliding mask over the monitored layer's full cache), every cell sound."""
    from transformers import DynamicCache

    model = tiny("mistral", sliding_window=4)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        stock = model(ids).logits
        with witcert.monitor(model, lambda x: x.clone()) as mon:
            cache = DynamicCache(config=model.config)
            model(ids[:, :8], past_key_values=cache)
            probe = model(ids[:, 8:], past_key_values=cache).logits
    torch.testing.assert_close(probe, stock[:, 8:], rtol=1e-5, atol=1e-5)
    assert_sound(mon.table())
    assert (mon.table()["meter"] < 1e-9).all()

"""transformers' own quantized KV caches (quanto, HQQ, fp8) with maintained witnesses (``WM``, ``T2`` premise).

Implementation: ``witcert.integrations.hf.quantized_cache`` around transformers 5.23's
``QuantizedCache`` layers. Oracle: the truly exact post-RoPE keys and values (every tensor the
model or the test wrote, kept by the test itself, never by the code under test) and the exact
per-(token, band) check of ``tests/maintenance_oracles.py``. Domain: quanto key axes 0/-1 at 2/4
bits, HQQ axes 0/1 at 2/4/8 bits, fp8; residual windows 8-16 in the synthetic caches, 16 in a
tiny random Llama (2 layers, GQA) under ``generate``, transformers' defaults (group 64, window
128) in the HQQ re-quantization test. Tolerance: none -- every witness >= its residual, at every step.

``witcert.monitor`` over transformers' own quantized layers (``QuantizedCacheSpec``,
``QuantizedLayerStore``): implementation ``witcert.integrations.hf.monitoring`` with the ``"witcert"``
attention; oracles: the fp64 true TV of every cell against the exact keys the model wrote (per cell,
no tolerance), the exact witness oracle above on the final state of every layer, and stock
transformers ``generate`` over the same ``QuantizedCache`` configuration (same tokens, bit for bit).
Domain: the named schemes (transformers' defaults: window 128, group 64) and small windows (8, 16)
that flush and re-quantize several times, both key axes, 2/4/8 bits, a tiny random Llama (GQA,
head dim 32) with left-padded batches, and one short SmolLM2 run per backend (``model`` mark).

The quanto and HQQ tests need the optional extra ``quant`` and skip with the reason otherwise;
the fp8 backend needs nothing more and always runs.
"""
import importlib.util

import numpy as np
import pytest
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer, Fp8QuantizedLayer, QuantizedCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from maintenance_oracles import value_shortfalls, witness_shortfalls
from witcert.integrations.hf import quantized_cache as qc
from witcert.integrations.hf import quantized_store as qs
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness import witness_of


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


NEEDS = {
    "quanto": pytest.mark.skipif(not _installed("optimum.quanto"), reason="optional extra 'quant' (optimum-quanto) not installed: make install"),
    "hqq": pytest.mark.skipif(not _installed("hqq"), reason="optional extra 'quant' (hqq) not installed: make install"),
    "fp8": pytest.mark.skipif(False, reason=""),
}
CONFIGS = [  # (backend, key axis, bits)
    *[pytest.param("quanto", axis, bits, marks=NEEDS["quanto"]) for axis in (0, -1) for bits in (2, 4)],
    *[pytest.param("hqq", axis, bits, marks=NEEDS["hqq"]) for axis in (0, 1) for bits in (2, 4, 8)],
]
LAYOUT = BandLayout(32, 4)


def _layer(backend: str, axis: int, bits: int, group: int, residual: int):
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    cls = {"quanto": QuantoQuantizedLayer, "hqq": HQQQuantizedLayer}[backend]
    return cls(nbits=bits, axis_key=axis, axis_value=axis, q_group_size=group, residual_length=residual)


def _keys(n: int, gen: torch.Generator, d: int = 32) -> torch.Tensor:
    k = torch.randn(1, 2, n, d, generator=gen) * 3
    k[..., 5] *= 40  # a massive channel, as real post-RoPE keys have
    return k


class _Exact:
    """The test's own record of every key/value written: the truly exact cache."""

    def __init__(self):
        self.keys = self.values = None

    def add(self, k, v):
        self.keys = k.clone() if self.keys is None else torch.cat([self.keys, k], dim=-2)
        self.values = v.clone() if self.values is None else torch.cat([self.values, v], dim=-2)


# ----------------------------------------------------------------------------- synthetic caches


@pytest.mark.parametrize("backend, axis, bits", CONFIGS)
def test_every_witness_covers_its_residual_at_every_step(backend, axis, bits):
    """Prefill 16, a 4-token chunk, then one-token steps over five flushes (window 8, group 8)."""
    gen = torch.Generator().manual_seed(bits * 10 + axis)
    layer = _layer(backend, axis, bits, group=8, residual=8)
    witness = qc.QuantizedCacheWitness(layer, LAYOUT).attach()
    exact = _Exact()
    for n in [16, 4] + [1] * 28:
        k, v = _keys(n, gen), torch.randn(1, 2, n, 32, generator=gen)
        exact.add(k, v)
        keys, values = layer.update(k, v)
        assert keys is witness.keys and values is witness.values  # the witness describes what attention reads
        assert witness_shortfalls(witness.key_witness, keys, exact.keys, LAYOUT) == 0
        assert value_shortfalls(witness.value_witness, values, exact.values) == 0
    assert witness.key_witness.any()  # something was quantized: the check had something to check


@pytest.mark.parametrize("backend, axis, bits", CONFIGS[:1] + CONFIGS[6:7])
def test_keep_exact_recomputes_witnesses_from_the_shadow(backend, axis, bits):
    gen = torch.Generator().manual_seed(1)
    layer = _layer(backend, axis, bits, group=8, residual=8)
    witness = qc.QuantizedCacheWitness(layer, LAYOUT, keep_exact=True).attach()
    exact = _Exact()
    for n in [16] + [1] * 20:
        k, v = _keys(n, gen), torch.randn(1, 2, n, 32, generator=gen)
        exact.add(k, v)
        keys, _ = layer.update(k, v)
        assert torch.equal(witness.exact_keys, exact.keys) and torch.equal(witness.exact_values, exact.values)
        assert torch.equal(witness.key_witness, witness_of(exact.keys, keys, LAYOUT))


@NEEDS["hqq"]
def test_hqq_requantization_stale_witness_fails_maintained_witness_holds():
    """HQQ 4-bit with transformers' defaults (group 64, window 128): flushes re-quantize and re-group the
    history and move keys; a witness frozen at each token's first quantization falls below its
    residual on many bands, the maintained one on none, at any step."""
    from transformers.cache_utils import HQQQuantizedLayer

    gen = torch.Generator().manual_seed(0)
    layout = BandLayout(64, 16)
    layer = HQQQuantizedLayer(nbits=4, axis_key=0, axis_value=0)
    witness = qc.QuantizedCacheWitness(layer, layout).attach()
    exact = _Exact()
    first = torch.zeros(1, 2, 0, layout.bands, dtype=torch.float16)  # each token's witness at its first quantized read
    first_read = torch.zeros(1, 2, 0, 64)
    moved = 0.0
    for n in [100] + [1] * 260:
        k, v = _keys(n, gen, 64), torch.randn(1, 2, n, 64, generator=gen)
        exact.add(k, v)
        previous = witness.keys
        keys, _ = layer.update(k, v)
        if previous is not None:
            moved = max(moved, (keys[..., : previous.shape[-2], :] - previous).abs().max().item())
        w = witness.key_witness
        first = torch.cat([first, w[..., first.shape[-2] :, :]], dim=-2)
        first_read = torch.cat([first_read, keys[..., first_read.shape[-2] :, :]], dim=-2)
        quantized_now = (first == 0).all(-1, keepdim=True) & (w != 0).any(-1, keepdim=True)
        first, first_read = torch.where(quantized_now, w, first), torch.where(quantized_now, keys, first_read)
        assert witness_shortfalls(w, keys, exact.keys, layout) == 0
    stale = witness_shortfalls(first, keys, exact.keys, layout)
    requantized = (first != 0).any(-1) & (keys != first_read).any(-1)  # tokens whose read moved since
    bands = int(requantized.sum()) * layout.bands
    assert moved > 0.1 and bands > 0
    assert stale > 0.2 * bands, (stale, bands)


# ----------------------------------------------------------------------------- a tiny Llama under generate

_CAPTURED: list = []


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    _CAPTURED.append((module.layer_idx, key))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("witcert-test-capture", _capture_attention)


def _tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attn_implementation="witcert-test-capture",
    )
    return LlamaForCausalLM(config).eval(), config


@pytest.mark.parametrize(
    "backend, axis, bits",
    [
        pytest.param("quanto", 0, 4, marks=NEEDS["quanto"]),
        pytest.param("quanto", -1, 2, marks=NEEDS["quanto"]),
        pytest.param("hqq", 1, 4, marks=NEEDS["hqq"]),
        pytest.param("hqq", 0, 8, marks=NEEDS["hqq"]),
        pytest.param("fp8", None, None),
    ],
)
def test_tiny_llama_generate_every_witness_covers_the_keys_attention_reads(backend, axis, bits):
    """``generate`` over a witnessed QuantizedCache: at every step of every layer, attention reads
    exactly the witnessed keys and every witness covers the residual against the exact post-RoPE keys."""
    model, config = _tiny_llama()
    layout = BandLayout(16, 4)
    kwargs = {} if backend == "fp8" else dict(nbits=bits, axis_key=axis, axis_value=axis, q_group_size=16, residual_length=16)
    cache = QuantizedCache(backend, config, **kwargs)
    witnesses = qc.witness_quantized_cache(cache, layout)
    exact = [_Exact() for _ in witnesses]
    checked = []

    for index, (layer, witness) in enumerate(zip(cache.layers, witnesses)):
        wrapped = layer.update

        def spy(k, v, *args, _index=index, _wrapped=wrapped, _witness=witness, **kwargs):
            exact[_index].add(k, v)  # the truly exact post-RoPE keys, recorded by the test
            keys, values = _wrapped(k, v, *args, **kwargs)
            shortfalls = witness_shortfalls(_witness.key_witness, keys, exact[_index].keys, layout)
            checked.append(shortfalls + value_shortfalls(_witness.value_witness, values, exact[_index].values))
            return keys, values

        layer.update = spy
    _CAPTURED.clear()
    prompt = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    model.generate(prompt, past_key_values=cache, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    assert len(checked) == 2 * 40 and sum(checked) == 0
    reads = {}
    for layer_idx, key in _CAPTURED:
        reads[layer_idx] = key
    for index, witness in enumerate(witnesses):
        assert torch.equal(reads[index], witness.keys)  # the last read is the witnessed tensor
        assert witness.key_witness.any()


# ----------------------------------------------------------------------------- misuse raises


def test_wrapper_refuses_what_it_cannot_witness():
    with pytest.raises(ValueError, match="BaseQuantizedLayer"):
        qc.QuantizedCacheWitness(DynamicLayer(), LAYOUT)
    layer = Fp8QuantizedLayer()
    layer.update(torch.randn(1, 2, 4, 32), torch.randn(1, 2, 4, 32))
    with pytest.raises(ValueError, match="already holds tokens"):
        qc.QuantizedCacheWitness(layer, LAYOUT)
    layer = Fp8QuantizedLayer()
    witness = qc.QuantizedCacheWitness(layer, LAYOUT).attach()
    assert qc.is_witnessed(layer)
    with pytest.raises(ValueError, match="already has a witness"):
        qc.QuantizedCacheWitness(layer, LAYOUT).attach()
    layer.update(torch.randn(1, 2, 4, 32), torch.randn(1, 2, 4, 32))
    witness._keys.reset()  # the witness lost track of the cache (as after a crop or reindex behind its back)
    with pytest.raises(RuntimeError, match="cannot be attributed"):
        layer.update(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32))
    witness.detach()
    assert not qc.is_witnessed(layer) and "update" not in vars(layer)
    with pytest.raises(ValueError, match="layers"):
        qc.witness_quantized_cache(object(), LAYOUT)


def test_reset_and_beam_reorder_follow_the_cache():
    gen = torch.Generator().manual_seed(2)
    layer = Fp8QuantizedLayer()
    witness = qc.QuantizedCacheWitness(layer, LAYOUT).attach()
    exact = _Exact()
    k, v = _keys(6, gen).expand(3, -1, -1, -1).contiguous(), torch.randn(3, 2, 6, 32, generator=gen)
    exact.add(k, v)
    layer.update(k, v)
    beams = torch.tensor([2, 2, 0])
    layer.reorder_cache(beams)
    exact.keys, exact.values = exact.keys[beams], exact.values[beams]
    k1, v1 = _keys(1, gen).expand(3, -1, -1, -1).contiguous(), torch.randn(3, 2, 1, 32, generator=gen)
    exact.add(k1, v1)
    keys, values = layer.update(k1, v1)
    assert witness_shortfalls(witness.key_witness, keys, exact.keys, LAYOUT) == 0
    assert value_shortfalls(witness.value_witness, values, exact.values) == 0
    layer.reset()
    assert witness.keys is None
    keys, _ = layer.update(k1, v1)  # a new request starts from scratch
    assert keys.shape[-2] == 1 and witness.keys.shape[-2] == 1


def test_named_hf_cache_schemes_and_missing_backend(monkeypatch):
    _, config = _tiny_llama()
    with pytest.raises(ValueError, match="unknown HF cache scheme"):
        qc.quantized_cache("hf-nope", config, BandLayout(16, 4))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("optimum") else real(name, *a))
    with pytest.raises(ImportError, match="optional extra 'quant'"):
        qc.quantized_cache("hf-quanto-int4", config, BandLayout(16, 4))


@NEEDS["hqq"]
def test_named_hf_cache_scheme_builds_a_witnessed_cache():
    _, config = _tiny_llama()
    cache, witnesses = qc.quantized_cache("hf-hqq-int8", config, BandLayout(16, 4), residual_length=16)
    assert len(witnesses) == config.num_hidden_layers
    assert all(qc.is_witnessed(layer) and layer.nbits == 8 and layer.residual_length == 16 for layer in cache.layers)


# ----------------------------------------------------------------------------- witcert.monitor over HF's QuantizedCache

MONITORED = [  # named schemes (transformers' defaults) and small windows that flush and re-quantize
    pytest.param("hf-quanto-int4", marks=NEEDS["quanto"]),
    pytest.param("hf-quanto-int2", marks=NEEDS["quanto"]),
    pytest.param("hf-hqq-int4", marks=NEEDS["hqq"]),
    pytest.param("hf-hqq-int8", marks=NEEDS["hqq"]),
    pytest.param(qc.QuantizedCacheSpec("quanto", 2, axis_key=-1, axis_value=-1, q_group_size=16, residual_length=8),
                 marks=NEEDS["quanto"]),
    pytest.param(qc.QuantizedCacheSpec("hqq", 4, axis_key=1, axis_value=1, q_group_size=16, residual_length=8),
                 marks=NEEDS["hqq"]),
]


def _monitored_generate(scheme, new_tokens=12, **kwargs):
    import witcert
    from tests.tiny_models import prompts, tiny

    model = tiny("llama")
    ids, mask = prompts(2, length=12)
    with torch.no_grad(), witcert.monitor(model, scheme, **kwargs) as mon:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return model, ids, mask, mon, out


@pytest.mark.parametrize("scheme", MONITORED)
def test_monitor_meters_the_quantized_cache_that_generates(scheme):
    """Every cell's true TV (against the exact keys the model wrote) is below its meter, and the tokens
    are stock transformers' over the same QuantizedCache configuration."""
    from transformers.cache_utils import QuantizedCache

    spec = qc.cache_spec_of(scheme)
    model, ids, mask, mon, out = _monitored_generate(scheme)
    table = mon.table()
    assert len(table) == 2 * 2 * 4 * 11  # rows x layers x query heads x decode steps after the prefill
    assert not np.isnan(table["true_tv"]).any()
    bad = np.flatnonzero(table["true_tv"] > table["meter"])
    assert bad.size == 0, f"{bad.size} cells with true TV above the meter"
    assert np.nanmax(table["true_tv"]) > 0  # the cache really is lossy: the check had something to check

    stock_cache = QuantizedCache(spec.backend, model.config, nbits=spec.nbits, axis_key=spec.axis_key,
                                 axis_value=spec.axis_value, q_group_size=spec.q_group_size,
                                 residual_length=spec.residual_length)
    with torch.no_grad():
        stock = model.generate(input_ids=ids, attention_mask=mask, past_key_values=stock_cache, max_new_tokens=12,
                               min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(out, stock)


@pytest.mark.parametrize("scheme", [MONITORED[4], MONITORED[5]])
def test_monitored_store_keeps_maintained_witnesses_that_cover_the_exact_keys(scheme):
    """The store's witness is the maintained one (never below the exact witness, looser after a flush),
    and it covers ``read - exact`` per (token, band); the store's exact shadow is what the model wrote."""
    stores = []
    real = qs.QuantizedLayerStore.__post_init__

    def spy(store):
        real(store)
        stores.append(store)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(qs.QuantizedLayerStore, "__post_init__", spy)
        _monitored_generate(scheme, new_tokens=20)
    layout = BandLayout(32, 16)
    assert len(stores) == 2
    for store in stores:
        keys, values = store.read()  # the forward calls are over: decoded afresh from the packed history
        stored = store.stored()
        exact_k, exact_v = store.exact()
        assert torch.equal(stored.k_hat, keys) and not torch.equal(keys, exact_k)
        assert witness_shortfalls(stored.witness, keys, exact_k, layout) == 0
        assert value_shortfalls(stored.value_residual, values, exact_v) == 0
        exact_witness = witness_of(exact_k, keys, layout)
        assert (stored.witness >= exact_witness).all()
        assert (stored.witness > exact_witness).any()  # re-quantized tokens: the triangle bound
        memory = store.memory()
        assert memory.exact_cache == 2 * keys.numel() * keys.element_size() and memory.decoded == 0


@NEEDS["hqq"]
def test_monitor_production_mode_and_gate_over_the_quantized_cache():
    """keep_exact=False: no true TV, the gate pages exact blocks from the host backing store; with the
    exact shadow the same gate repairs from memory and every cell stays sound."""
    import witcert

    spec = qc.QuantizedCacheSpec("hqq", 2, q_group_size=16, residual_length=8)
    _, _, _, mon, _ = _monitored_generate(spec, new_tokens=12, keep_exact=False, gate=witcert.Gate(tau=0.05))
    table = mon.table()
    assert np.isnan(table["true_tv"]).all() and table["repaired"].any()
    assert mon.memory().total.exact_shadow == 0 and mon.memory().total.backing_host > 0
    _, _, _, mon, _ = _monitored_generate(spec, new_tokens=12, gate=witcert.Gate(tau=0.05))
    table = mon.table()
    assert table["repaired"].any() and not (table["true_tv"] > table["meter"]).any()


def test_quantized_cache_spec_checks_and_names():
    assert qc.cache_spec_of("hf-hqq-int8") == qc.QuantizedCacheSpec("hqq", 8)
    assert qc.cache_spec_of("rtn-int4") is None and qc.cache_spec_of(len) is None
    assert qc.QuantizedCacheSpec("quanto", 4).name == "hf-quanto-int4"
    assert qc.QuantizedCacheSpec("hqq", 4, residual_length=16).name == "hf-hqq-int4(residual_length=16)"
    with pytest.raises(ValueError, match="backend must be one of"):
        qc.QuantizedCacheSpec("fp8", 8)
    with pytest.raises(ValueError, match="residual_length must be a positive int"):
        qc.QuantizedCacheSpec("hqq", 4, residual_length=0)


def test_monitor_names_the_missing_extra_before_any_forward_call(monkeypatch):
    import witcert
    from tests.tiny_models import tiny

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("hqq") else real(name, *a))
    with pytest.raises(ImportError, match="optional extra 'quant'"):
        witcert.monitor(tiny("llama"), "hf-hqq-int4")


@NEEDS["quanto"]
def test_metering_an_already_quantized_cache_as_exact_raises():
    """The misuse of the issue: WitCert attention over transformers' QuantizedCache built outside the
    monitor (its "exact" keys are the quantized ones) raises before any cell is reported, and names the
    scheme that meters it (scheme="hf-quanto-int4")."""
    import witcert
    from tests.tiny_models import prompts, tiny

    model = tiny("llama")
    ids, mask = prompts(1, length=8)
    with torch.no_grad(), witcert.monitor(model, "rtn-int4") as mon:
        with pytest.raises(ValueError, match='QuantoQuantizedLayer.*not the exact keys.*scheme="hf-quanto-int4"'):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0,
                           cache_implementation="quantized", cache_config={"backend": "quanto", "nbits": 4})
    assert len(mon.batches) == 0


# ----------------------------------------------------------------------------- SmolLM2 (one short run per backend)


@pytest.mark.model
@pytest.mark.parametrize("scheme", [pytest.param("hf-quanto-int4", marks=NEEDS["quanto"]),
                                    pytest.param("hf-hqq-int8", marks=NEEDS["hqq"])])
def test_observe_meters_the_quantized_cache_of_the_real_model(scheme, tmp_path):
    """``witcert observe --scheme hf-...`` (transformers' defaults) on SmolLM2: every cell sound against the
    exact keys, from the run's own telemetry (no tolerance)."""
    import json

    from witcert.cli import main

    threads = torch.get_num_threads()
    try:
        status = main(["observe", "--scheme", scheme, "--task", "text", "--cases", "1", "--context", "160",
                       "--probe", "8", "--out", str(tmp_path / "report")])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    rows = [json.loads(line) for line in (tmp_path / "report" / "telemetry.jsonl").read_text().splitlines()]
    assert rows and {r["scheme"] for r in rows} == {scheme} and {r["tier"] for r in rows} == {"A"}
    tv, meter = np.array([r["true_tv"] for r in rows]), np.array([r["meter"] for r in rows])
    assert not np.isnan(tv).any() and (tv <= meter).all() and tv.max() > 0


@pytest.mark.model
@NEEDS["hqq"]
def test_real_model_generate_through_flushes_is_sound_per_cell():
    """SmolLM2 generating over HQQ 4-bit with an 8-token window: reads of re-quantized history, every cell sound."""
    import witcert
    from witcert.integrations.hf.default_model import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loaded = load_model()
        ids = loaded.tokenizer("The history of the printing press begins", return_tensors="pt").input_ids
        spec = qc.QuantizedCacheSpec("hqq", 4, residual_length=8)
        with torch.no_grad(), witcert.monitor(loaded.model, spec) as mon:
            loaded.model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                  pad_token_id=loaded.tokenizer.eos_token_id)
    finally:
        torch.set_num_threads(threads)
    table = mon.table()
    assert len(table) == 19 * loaded.model.config.num_hidden_layers * loaded.model.config.num_attention_heads
    assert not np.isnan(table["true_tv"]).any() and not (table["true_tv"] > table["meter"]).any()


def test_observe_checks_hf_cache_schemes_before_the_model_loads(monkeypatch, capsys):
    """``witcert observe --scheme hf-...``: listed by ``witcert schemes``; tier B and a missing backend are
    refused with exit status 2 before the model loads."""
    from witcert.cli import main
    from witcert.integrations.hf import default_model

    def refuse(*args, **kwargs):
        raise AssertionError("the model loader ran before the arguments were rejected")

    monkeypatch.setattr(default_model, "load_model", refuse)
    assert main(["schemes", "--names"]) == 0
    assert set(qc.HF_CACHE_SCHEMES) <= set(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as exc:
        main(["observe", "--tier", "B", "--scheme", "hf-hqq-int8"])
    assert exc.value.code == 2 and "--tier B certifies the dithered-int8 cache only" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("hqq") else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        main(["observe", "--scheme", "hf-hqq-int4"])
    assert exc.value.code == 2 and "--scheme hf-hqq-int4: the 'hqq' KV-cache backend needs the optional extra" \
        in capsys.readouterr().err

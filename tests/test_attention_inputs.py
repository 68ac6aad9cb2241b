"""Attention inputs metered as the model uses them: additive float masks, soft biases, ``position_bias``.

Implementation: :func:`witcert.integrations.hf.cells.mask_terms` (what a mask hides and what it adds),
the ``bias`` of :func:`witcert.tier_a.observation.observe_stored` (added to both logits, its fp64
rounding to ``c``: :func:`witcert.tier_a.score_rounding.bias_rounding_bound`) and the ``"witcert"``
attention's reading of sdpa's inputs (:mod:`witcert.integrations.hf.attention`). Oracle: every
cell's true TV recomputed here in fp64 from the query, the exact and the compressed keys and the
mask sdpa applied, outside the monitor (per cell, never in aggregate); exact rationals for the
rounding bound. Domain: tiny random Llama decoders (GQA) through ``witcert.monitor`` in both
``keep_exact`` modes, masks with ``-1e9`` entries, soft biases up to 30, transformers' minimum;
random fp64 logits and biases across 600 binades. Tolerance: none for bounds; ``1e-9`` relative
for the monitor's own true TV against the one recomputed here.
"""
from fractions import Fraction

import numpy as np
import pytest
import torch

import witcert
from witcert.integrations.hf import attention, cells
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.observation import observe_stored, stored_keys
from witcert.tier_a.score_rounding import bias_rounding_bound
from tests.tiny_models import VOCAB, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX, LENGTH = 60, 66  # prefill tokens, then one decode step per token (many exact tokens: a diluting prefix)


def damaging_decodes(x, role="key"):
    """Exact on the prefill write, 3% off on every decode write: exact tokens a mask may hide dilute a
    meter that does not see the mask."""
    return x.clone() if x.shape[-2] > 1 else x * 1.03


def float_masks(kind: str, rows: int = 2) -> torch.Tensor:
    """(rows, 1, LENGTH, LENGTH) additive fp32 masks: causal by ``-1e9``, plus ``kind``'s hiding or bias."""
    causal = torch.ones(LENGTH, LENGTH).tril().bool()
    mask = torch.zeros(rows, 1, LENGTH, LENGTH).masked_fill(~causal, -1e9)
    decode_keys = torch.arange(LENGTH) >= PREFIX
    if kind == "hide-1e9":  # later queries see only the (damaged) decoded tokens and themselves
        mask[:, :, PREFIX + 2:, :PREFIX] = -1e9
    elif kind == "hide-min":
        mask[:, :, PREFIX + 2:, :PREFIX] = torch.finfo(torch.float32).min
    elif kind == "soft":  # decoded tokens favoured by a bias of 30, the rest by random soft values
        soft = torch.randn(rows, 1, LENGTH, LENGTH, generator=torch.Generator().manual_seed(3))
        mask = mask + torch.where(causal, soft + 30.0 * decode_keys, torch.zeros(()))
    return mask


def spy_on_attend(monkeypatch) -> list:
    """Record, for every metered call, the query, the exact and read keys, the mask sdpa applied, the scale and
    the cell batch (the exact keys only when the store keeps them)."""
    calls, original = [], attention.attend

    def spy(scope, layer, query, read, attention_mask, scale, output, **kwargs):
        output, batch = original(scope, layer, query, read, attention_mask, scale, output, **kwargs)
        exact = layer.store.exact()[0].clone() if scope.truth else None
        read = layer.store.read() if read is None else read  # a deferred flush passes None: attend reads the store
        calls.append(dict(query=query.clone(), exact=exact, read=read[0].clone(), mask=attention_mask.clone(),
                          scale=scale, batch=batch))
        return output, batch

    monkeypatch.setattr(attention, "attend", spy)
    return calls


def oracle_tv(query, exact, read, mask, scale) -> torch.Tensor:
    """fp64 TV (B, Hq, Tq) between attention over ``exact`` and over ``read`` keys under sdpa's ``mask``."""
    groups = query.shape[1] // exact.shape[1]
    q = query.double()
    k, k_hat = (x.double().repeat_interleave(groups, dim=1) for x in (exact, read))
    mask = mask[..., :k.shape[-2]]
    hidden = ~mask if mask.dtype == torch.bool else mask <= torch.finfo(mask.dtype).min / 2
    additive = torch.zeros(()) if mask.dtype == torch.bool else mask.double()
    logits = [(q @ x.transpose(-1, -2) * scale + additive).masked_fill(hidden, -torch.inf) for x in (k, k_hat)]
    return 0.5 * (torch.softmax(logits[0], -1) - torch.softmax(logits[1], -1)).abs().sum(-1)


def run_with_mask(model, mask, keep_exact: bool, ids, **monitor_kwargs):
    """Prefill then one forward call per token, each with its slice of the 4D mask, as a user writes it."""
    with torch.no_grad(), witcert.monitor(model, damaging_decodes, keep_exact=keep_exact, **monitor_kwargs) as mon:
        out = model(input_ids=ids[:, :PREFIX], attention_mask=mask[:, :, :PREFIX, :PREFIX])
        for i in range(PREFIX, LENGTH):
            out = model(input_ids=ids[:, i:i + 1], attention_mask=mask[:, :, i:i + 1, :i + 1],
                        past_key_values=out.past_key_values)
    return mon


def tokens(rows: int = 2) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, LENGTH), generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("kind", ["hide-1e9", "hide-min", "soft"])
def test_a_4d_float_mask_is_metered_as_the_model_applies_it_in_both_modes(monkeypatch, kind):
    """Before the fix a ``-1e9`` mask hid tokens from the model but not from the meter, and a soft bias was
    ignored: the meter (and the monitor's own true TV) described attention the model did not run (7 and
    6 cells above their meter here in the -1e9 and soft cases). Now every
    cell's meter bounds the TV recomputed here under the mask sdpa applied, in validation and production
    mode, and the monitor's true TV is that TV."""
    model, ids, mask = tiny("llama"), tokens(), float_masks(kind)
    calls = spy_on_attend(monkeypatch)
    run_with_mask(model, mask, True, ids)
    validation, calls[:] = list(calls), []
    run_with_mask(model, mask, False, ids)
    worst, meters = 0.0, {}
    for mode, metered in (("validation", validation), ("production", calls)):
        # calls metered in their step (a soft bias) or later, several steps at once (deferred): each metered
        # call's cells, at their own positions, bound the TV recomputed from what it was handed
        cells = set()
        for seen in metered:
            batch = seen["batch"]
            exact = seen["exact"] if mode == "validation" else validation_exact(validation, batch.layer)
            truth = oracle_tv(seen["query"], exact[:, :, :seen["read"].shape[-2]], seen["read"], seen["mask"],
                              seen["scale"])
            if mode == "validation":
                torch.testing.assert_close(batch.true_tv, truth, rtol=1e-9, atol=1e-15)
                worst = max(worst, float((truth / batch.meter).max()))
            bad = truth > batch.meter
            assert not bad.any(), f"{int(bad.sum())} cells above their meter: {truth[bad][:3]} > {batch.meter[bad][:3]}"
            cells |= {(batch.layer, int(p)) for p in batch.positions}
            for i, p in enumerate(batch.positions.tolist()):
                meters.setdefault((mode, batch.layer, p), batch.meter[..., i])
        assert cells == {(layer, p) for layer in range(2) for p in range(PREFIX, LENGTH)}  # every step, once
    for (mode, layer, p), meter in meters.items():  # production meters the same cells as validation
        if mode == "production":
            torch.testing.assert_close(meter, meters[("validation", layer, p)], rtol=1e-4, atol=1e-12)
    assert worst > 0.05  # the masks matter: the truth is not trivially far below every meter


def validation_exact(validation: list, layer: int) -> torch.Tensor:
    """The exact keys of ``layer`` the validation run kept (all of them: the production run did not keep them)."""
    return max((seen["exact"] for seen in validation if seen["batch"].layer == layer), key=lambda k: k.shape[-2])


def test_a_soft_mask_under_tier_b_both_branches_bounds_every_cell(monkeypatch):
    """The dithered cache with a soft mask: the Tier B tightening adds the bias addition's rounding too; the
    deterministic branch (undeclared) and the probabilistic one (``non_adaptive``) bound every cell's oracle TV
    (the dither seed fixed: a replay, so the probabilistic branch is judged on this one draw)."""
    model, ids, mask = tiny("llama"), tokens(), float_masks("soft")
    calls = spy_on_attend(monkeypatch)
    for declared in (False, True):
        with torch.no_grad(), witcert.monitor(model, "dithered-int8", seed=7) as mon:
            with mon.non_adaptive() if declared else torch.no_grad():
                out = model(input_ids=ids[:, :PREFIX], attention_mask=mask[:, :, :PREFIX, :PREFIX])
                for i in range(PREFIX, LENGTH):
                    out = model(input_ids=ids[:, i:i + 1], attention_mask=mask[:, :, i:i + 1, :i + 1],
                                past_key_values=out.past_key_values)
    assert len(calls) == 4 * (LENGTH - PREFIX)
    assert [bool(c["batch"].adaptive) for c in calls] == [True] * (len(calls) // 2) + [False] * (len(calls) // 2)
    for call in calls:
        truth = oracle_tv(call["query"], call["exact"], call["read"], call["mask"], call["scale"])
        assert (truth <= call["batch"].meter).all()


def test_a_soft_mask_with_a_gate_repairs_over_the_biased_logits(monkeypatch):
    """With the exact cache kept the gate's exact logits carry the bias (its true TV after repair is measured
    under the mask); a production gate cannot add it to its page-ins and is refused, naming the mask."""
    model, ids, mask = tiny("llama"), tokens(), float_masks("soft")
    calls = spy_on_attend(monkeypatch)
    run_with_mask(model, mask, True, ids, gate=witcert.Gate(tau=1e-4))
    fired = 0
    for call in calls:
        batch = call["batch"]
        truth = oracle_tv(call["query"], call["exact"], call["read"], call["mask"], call["scale"])
        assert (truth <= batch.meter).all()
        assert (batch.extra["true_tv_after"] <= batch.extra["meter_after"]).all()
        fired += int(batch.repaired.sum())
    assert fired > 0
    with pytest.raises(ValueError, match="attention_mask"):
        run_with_mask(model, mask, False, ids, gate=witcert.Gate(tau=1e-4))


@pytest.mark.parametrize("keep_exact", [True, False])
def test_a_soft_mask_under_the_spot_check_bounds_every_cell(monkeypatch, keep_exact):
    """The spot check's exact logits carry the bias the compressed ones hold (its reader once returned
    ``q . k`` alone: ``W`` then compared logits of two different masks); every checked cell's reported
    meter bounds the oracle TV under the mask, from the exact cache and from the backing store."""
    model, ids, mask = tiny("llama"), tokens(), float_masks("soft")
    calls = spy_on_attend(monkeypatch)
    run_with_mask(model, mask, True, ids, certificate="spot", spot_keys=8, tau=1e-3)
    checked = 0
    exact_of = [c["exact"] for c in calls]
    if not keep_exact:
        calls[:] = []
        run_with_mask(model, mask, False, ids, certificate="spot", spot_keys=8, tau=1e-3)
    for call, exact in zip(calls, exact_of):
        batch = call["batch"]
        truth = oracle_tv(call["query"], exact, call["read"], call["mask"], call["scale"])
        spot = batch.extra["spot_bound"]
        assert (truth <= batch.meter).all() and (truth[~spot.isnan()] <= spot[~spot.isnan()]).all()
        checked += int((~spot.isnan()).sum())
    assert checked > 0


def test_a_minimum_value_mask_meters_as_the_bool_mask_of_the_same_keys():
    """transformers' minimum-value masks hide keys exactly as a bool mask does: the same cells, bit for bit
    (no bias is formed from them)."""
    model, ids = tiny("llama"), tokens()
    causal = torch.ones(LENGTH, LENGTH).tril().bool()[None, None].expand(2, 1, LENGTH, LENGTH)
    minimum = torch.zeros(2, 1, LENGTH, LENGTH).masked_fill(~causal, torch.finfo(torch.float32).min)
    meters = [run_with_mask(model, m, True, ids).tensor("meter") for m in (causal, minimum)]
    assert torch.equal(*meters)


def test_mask_terms_read_what_sdpa_adds_and_refuse_what_it_cannot():
    """Bool and minimum-value entries hide keys (no bias); ``-inf`` too; ``-1e9`` and soft values are a bias on
    the visible keys; NaN, ``+inf`` and a mask of the wrong query length raise naming ``attention_mask``."""
    low = torch.finfo(torch.float16).min
    mask = torch.tensor([[[[0.0, low, -torch.inf, -1e4, 2.5]]]], dtype=torch.float16)
    visible, bias = cells.mask_terms(mask, 1, 5, "cpu")
    assert visible.tolist() == [[[[True, False, False, True, True]]]]
    assert bias.dtype == torch.float64 and bias.tolist() == [[[[0.0, 0.0, 0.0, -10000.0, 2.5]]]]
    assert cells.mask_terms(torch.zeros(1, 1, 1, 5, dtype=torch.float16).masked_fill(~visible, low), 1, 5, "cpu")[1] is None
    same, none = cells.mask_terms(visible, 1, 5, "cpu")
    assert torch.equal(same, visible) and none is None
    for bad in (torch.tensor([[[[0.0, torch.nan]]]]), torch.tensor([[[[0.0, torch.inf]]]])):
        with pytest.raises(ValueError, match="attention_mask"):
            cells.mask_terms(bad, 1, 2, "cpu")
    with pytest.raises(ValueError, match="attention_mask"):
        cells.mask_terms(torch.zeros(1, 1, 3, 5), 2, 5, "cpu")


def _exact_sum_error(s: float, b: float) -> Fraction:
    return abs(Fraction(s + b) - (Fraction(s) + Fraction(b)))


def test_bias_rounding_bound_covers_every_fp64_addition():
    """``|fl(s + b) - (s + b)| <= bias_rounding_bound(fl(s + b))`` in exact rationals, per entry, over logits and
    biases from ``2^-1074`` to ``2^600``, cancelling pairs and ties; ``-inf`` (masked) entries get 0."""
    gen = torch.Generator().manual_seed(5)
    exponent = torch.randint(-1074, 600, (4000,), generator=gen).double()
    s = torch.randn(4000, generator=gen, dtype=torch.float64) * torch.exp2(exponent)
    b = torch.where(torch.rand(4000, generator=gen) < 0.5, -s * (1 + torch.randn(4000, generator=gen,
                    dtype=torch.float64) * 2.0**-30), torch.randn(4000, generator=gen, dtype=torch.float64) * 1e3)
    s = torch.cat([s, torch.tensor([1.0, 2.0**-1074, 1e300, 3.0], dtype=torch.float64)])
    b = torch.cat([b, torch.tensor([2.0**-53, 2.0**-1074, 1e300, 2.0**-52], dtype=torch.float64)])  # ties, subnormal
    total = s + b
    bound = bias_rounding_bound(total)
    for si, bi, ti in zip(s.tolist(), b.tolist(), bound.tolist()):
        assert _exact_sum_error(si, bi) <= Fraction(ti)
    assert bias_rounding_bound(torch.tensor([-torch.inf])).item() == 0.0


@pytest.mark.parametrize("fused", [True, False])
def test_observe_stored_with_a_bias_bounds_every_query(fused):
    """Per query, adversarially: keys damaged where a bias puts the mass, exact where the bias hides it; the
    meter with the bias bounds the fp64 TV of the biased logits, and without it (the old reading) it does not."""
    gen = torch.Generator().manual_seed(9)
    d, s, layout = 16, 24, BandLayout(16, 4)
    q = torch.randn(1, 4, 3, d, generator=gen, dtype=torch.float64) * 4
    k = torch.randn(1, 2, s, d, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, s, d, generator=gen, dtype=torch.float64)
    damaged = torch.arange(s) >= 20
    k_hat = torch.where(damaged[:, None], k + 0.05 * torch.randn(k.shape, generator=gen, dtype=torch.float64), k)
    bias = torch.where(damaged, 25.0, torch.randn(s, generator=gen, dtype=torch.float64))  # (S,), every query
    stored = stored_keys(k, k_hat, v, v, layout)
    with_bias = observe_stored(q, stored, layout, truth=(k, v, v), fused=fused, bias=bias)
    truth = oracle_tv(q, k, k_hat, bias.expand(1, 1, 3, s), d**-0.5)
    torch.testing.assert_close(with_bias.true_tv, truth, rtol=1e-9, atol=1e-15)
    assert (truth <= with_bias.meter).all()
    ignored = observe_stored(q, stored, layout, fused=fused)
    assert (truth > ignored.meter).any()  # the old reading: the bias ignored, the meter below the truth


@pytest.mark.parametrize("far", [-1e9, -1e30, -1.6e38, -1e300])
@pytest.mark.parametrize("fused", [True, False])
def test_a_far_negative_soft_value_is_sound_never_nan(far, fused):
    """A soft value far below the logits (``-1e30``: the fp64 sum keeps nothing of the logit, its rounding is
    about ``2e14``) is visible, not hidden: every meter bounds the truth and is finite; the fused pass, whose
    ``e^c`` overflows fp32 beyond about ``-4e17``, gives the trivial bound 1 with risk ``inf`` there, the
    eager meter stays informative."""
    gen, layout = torch.Generator().manual_seed(0), BandLayout(16, 4)
    q = torch.randn(1, 2, 1, 16, generator=gen, dtype=torch.float64) * 3
    k = torch.randn(1, 2, 6, 16, generator=gen, dtype=torch.float64)
    k_hat = k + 0.2 * torch.randn(k.shape, generator=gen, dtype=torch.float64)
    bias = torch.tensor([0.0, far, 0.0, far, 5.0, far], dtype=torch.float64)
    obs = observe_stored(q, stored_keys(k, k_hat, k, k, layout), layout, truth=(k, k, k), fused=fused, bias=bias)
    assert not obs.meter.isnan().any() and (obs.true_tv <= obs.meter).all()
    if not fused or far > -4e17:
        assert (obs.meter < 1).all()
    else:
        assert (obs.meter == 1).all() and torch.isinf(obs.risk).all()


def test_observe_stored_refuses_an_infinite_bias():
    layout = BandLayout(8, 2)
    k = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    stored = stored_keys(k, k, k, k, layout)
    with pytest.raises(ValueError, match="bias"):
        observe_stored(torch.ones(1, 1, 1, 8), stored, layout, bias=torch.tensor([0.0, 1.0, torch.inf, 0.0]))


# ---------------------------------------------------------------- other score terms a model passes


def test_a_position_bias_is_metered_like_an_additive_mask(monkeypatch):
    """A ``position_bias`` a model passes to its attention is added to the scores by sdpa: it enters both logits
    of every cell, as the oracle here adds it (independently of the mask the attention formed)."""
    model, ids = tiny("llama"), tokens(1)
    gen = torch.Generator().manual_seed(4)
    calls = spy_on_attend(monkeypatch)
    biases = []
    with torch.no_grad(), witcert.monitor(model, damaging_decodes) as mon:
        out = model(input_ids=ids[:, :PREFIX])
        for i in range(PREFIX, LENGTH):
            bias = torch.where(torch.arange(i + 1) >= PREFIX, 30.0, 0.0) + torch.randn(1, 4, 1, i + 1, generator=gen)
            biases.append(bias)
            out = model(input_ids=ids[:, i:i + 1], past_key_values=out.past_key_values, position_bias=bias)
    assert len(calls) == 2 * len(biases)
    for call, bias in zip(calls, [b for b in biases for _ in range(2)]):
        truth = oracle_tv(call["query"], call["exact"], call["read"], bias, call["scale"])
        torch.testing.assert_close(call["batch"].true_tv, truth, rtol=1e-9, atol=1e-15)
        assert (truth <= call["batch"].meter).all()
    assert mon.summary().rows[0]["violations"] == 0


@pytest.mark.parametrize("name", ["s_aux", "sinks", "softcap"])
def test_a_score_term_sdpa_would_drop_raises_naming_it(name):
    model, ids = tiny("llama"), tokens(1)
    with torch.no_grad(), witcert.monitor(model, "rtn-int4"):
        out = model(input_ids=ids[:, :4])
        with pytest.raises(ValueError, match=name):
            model(input_ids=ids[:, 4:5], past_key_values=out.past_key_values, **{name: torch.ones(4)})


def test_attention_dropout_raises():
    """A model in training mode with attention dropout attends at random: refused, naming ``dropout``."""
    model, ids = tiny("llama", attention_dropout=0.5), tokens(1)
    try:
        model.train()
        with torch.no_grad(), witcert.monitor(model, "rtn-int4"):
            out = model(input_ids=ids[:, :4])
            with pytest.raises(ValueError, match="dropout"):
                model(input_ids=ids[:, 4:5], past_key_values=out.past_key_values)
    finally:
        model.eval()


# ---------------------------------------------------------------- fp32 matmul precision, compilation


@pytest.fixture
def restore_matmul_precision():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.mkldnn.matmul.fp32_precision)
        yield
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.backends.mkldnn.matmul.fp32_precision = "ieee"
        torch.backends.mkldnn.matmul.fp32_precision = saved[1]
        torch.set_float32_matmul_precision("highest")


@pytest.mark.parametrize("setting", ["allow_tf32", "high", "medium", "mkldnn-bf16"])
def test_tf32_or_bf16_matmul_settings_lift_the_fast_radius(restore_matmul_precision, setting):
    """Under a reduced fp32-matmul setting the fast radius's sgemm may round its inputs to TF32 / bf16 (``2^-11``
    to ``2^-8`` relative each): the setting is detected and the radius lifted by ``REDUCED_PRECISION_LIFT``,
    which covers bf16 inputs (emulated here: both inputs rounded toward zero to 8 significant bits, the dot
    exact, the lift applied to it and the fp32 summation's error taken off)."""
    from witcert.core.matmul_precision import REDUCED_PRECISION_LIFT, reduced_fp32_matmul
    from witcert.fastpath.radius import radius_kernel
    from witcert.tier_a.witness import band_major

    gen = torch.Generator().manual_seed(2)
    norms = torch.rand(1, 4, 8, generator=gen) * 3 + 2.0**-100
    witness = band_major((torch.rand(1, 64, 8, generator=gen) * 2).half())
    plain = radius_kernel(norms, witness)
    assert reduced_fp32_matmul() is None
    if setting == "allow_tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
    elif setting == "mkldnn-bf16":
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    else:
        torch.set_float32_matmul_precision(setting)
    assert reduced_fp32_matmul() is not None
    lifted = radius_kernel(norms, witness)
    assert torch.equal(lifted, plain * REDUCED_PRECISION_LIFT)
    def to_bf16_down(x):  # an input rounded toward zero to bf16 (8 significant bits): the worst rounding
        return x.float().view(torch.int32).bitwise_and(~0xFFFF).view(torch.float32).double()

    w = witness.float()  # (1, S, B)
    exact = norms.double() @ w.double().transpose(-1, -2)
    rounded = to_bf16_down(norms) @ to_bf16_down(w).transpose(-1, -2)  # what such a GEMM multiplies, exactly
    assert (rounded * REDUCED_PRECISION_LIFT * (1 - 2.0**-20) >= exact).all()  # fp32 sums of 8 terms: < 2^-20
    assert (lifted.double() >= exact).all()


def test_a_monitored_run_under_tf32_settings_stays_sound(restore_matmul_precision):
    model, ids = tiny("llama"), tokens(1)
    torch.set_float32_matmul_precision("high")
    with torch.no_grad(), witcert.monitor(model, "rtn-int4") as mon:
        model.generate(input_ids=ids[:, :8], max_new_tokens=3, do_sample=False, pad_token_id=0)
    table = mon.table()
    assert len(table) > 0 and (table["true_tv"] <= table["meter"]).all()


def test_a_compiled_model_is_refused(monkeypatch):
    """``torch.compile(model)`` or ``model.compile()``: refused by ``witcert.monitor`` naming ``model``; a compiled
    trace reaching the attention of a monitored call raises too."""
    model, ids = tiny("llama"), tokens(1)
    with pytest.raises(ValueError, match="model"):
        witcert.monitor(model=torch.compile(model), scheme="rtn-int4")
    try:
        model.compile()
        with pytest.raises(ValueError, match="model"):
            witcert.monitor(model, "rtn-int4")
    finally:
        model._compiled_call_impl = None
    with torch.no_grad(), witcert.monitor(model, "rtn-int4"):
        out = model(input_ids=ids[:, :4])
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        with pytest.raises(RuntimeError, match="compiled"):
            model(input_ids=ids[:, 4:5], past_key_values=out.past_key_values)
    # torch skips always_call hooks when a compiled trace raises: the block's exit drops the open scope
    assert len(attention._ACTIVE) == 0
    assert torch.equal(model(input_ids=ids[:, :4]).logits, model(input_ids=ids[:, :4]).logits)

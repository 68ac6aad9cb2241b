"""The query-side radius (registry ``QR``): kernels that quantize the query.

Implementations: :func:`witcert.tier_a.query_radius.query_radius` and ``read_scores`` (the hook of
:func:`witcert.tier_a.observation.observe_stored`), :class:`~witcert.tier_a.query_radius.Fp8Query`, and
``witcert.monitor(..., query_format=)`` through the deterministic meter (fused and full), the gate (in memory and
paged), the spot check and deferred metering. Oracles: the spec mirror :mod:`witcert.spec.query_radius` (50
digits) for the statement and the term; per cell, the fp64 TV between softmax over the exact query and keys and
softmax over the read query and stored keys (``true_tv``, and an independent recomputation); E4M3 values worked
by hand. Domain: random and large queries (fp32, bf16), GQA, tiny Llama models. Tolerance: none.
"""
import pytest
import torch
from mpmath import mp, mpf

import witcert
import witcert.tier_a.observation as observation
from tests.tiny_models import prompts, tiny
from witcert.spec import query_radius as spec
from witcert.spec.bands import band_norms
from witcert.tier_a.query_radius import Fp8Query, query_format_of, query_radius, read_scores


def _identity(x):
    """No compression: every cell's key-side radius is 0, so only the query term can cover the TV."""
    return x


def test_fp8_query_values_by_hand():
    q = torch.tensor([1.0, 0.3, -500.0, 1e-5, -0.0])
    # E4M3: 0.3 lies between 0.28125 and 0.3125 (step 2^-5) -> 0.3125; -500 saturates to -448; 1e-5 is below
    # half the smallest subnormal 2^-9 -> 0
    assert Fp8Query().read(q).tolist() == [1.0, 0.3125, -448.0, 0.0, -0.0]
    # scale 2: codes 0.5, 0.15625 and -256 (-250 between 240 and 256, step 16), times 2
    assert Fp8Query(scale=2.0).read(q).tolist() == [1.0, 0.3125, -512.0, 0.0, -0.0]


def test_fp8_query_scale_is_applied_as_the_kernel_descales():
    read = Fp8Query(scale=0.5).read(torch.tensor([3.0]))  # 3 / 0.5 = 6 -> code 6 -> 6 * 0.5
    assert read.dtype == torch.float64 and read.item() == 3.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gain", [1.0, 60.0])
def test_query_radius_bounds_the_exact_term_per_token(dtype, gain):
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(1, 4, 3, 32, generator=g) * gain).to(dtype)
    k_hat = (torch.randn(1, 2, 9, 32, generator=g) * 3).to(dtype)
    q_read = Fp8Query().read(q)
    r = query_radius(q, q_read, k_hat, 32**-0.5)
    for h in range(4):
        for t in range(3):
            # the rounding bounds are per row: at most ~1e-14 of the row's largest sm sum |q k^|
            row = 32**-0.5 * max(q_read[0, h, t].abs().max(), q[0, h, t].double().abs().max()) * k_hat[0, h // 2].double().abs().sum(-1).max()
            for s in range(9):
                e_term = spec.bound_query_key(q[0, h, t].double().tolist(), q_read[0, h, t].tolist(),
                                              k_hat[0, h // 2, s].double().tolist(), [0.0] * 4, 32**-0.5, 4)
                assert r[0, h, t, s].item() >= e_term  # the key side is 0 here: the term alone
                assert r[0, h, t, s].item() <= e_term + 1e-12 * float(row)  # and no looser than the logits' rounding


def test_spec_statement_identity_and_cauchy_schwarz_form():
    g = torch.Generator().manual_seed(4)
    for _ in range(20):
        q, k = torch.randn(16, generator=g) * 5, torch.randn(16, generator=g)
        q_read, k_hat = Fp8Query().read(q), k + torch.randn(16, generator=g) * 0.1
        args = (q.tolist(), q_read.tolist(), k.tolist(), k_hat.tolist(), 0.25)
        key_part, query_part = spec.logit_error_split(*args)
        with mp.workdps(spec.SPEC_DPS):
            assert abs(key_part + query_part - spec.logit_error(*args)) < mpf(10) ** -45
        witness = band_norms((k_hat - k).tolist(), 4)
        bound = spec.bound_query_key(q.tolist(), q_read.tolist(), k_hat.tolist(), witness, 0.25, 4)
        assert abs(spec.logit_error(*args)) <= bound
        assert abs(query_part) <= spec.bound_query_cauchy_schwarz(q.tolist(), q_read.tolist(), k_hat.tolist(), 0.25, 4)


def test_read_scores_masks_and_rounds_up():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 5, 8)
    scores = (q.double().reshape(1, 1, 6, 8) @ k.double().transpose(-1, -2)) * 0.5
    scores[..., -1] = -torch.inf
    read, radius = read_scores(scores, Fp8Query().read(q).reshape(1, 1, 6, 8), k, 0.5)
    assert torch.isneginf(read[..., -1]).all() and (radius[..., -1] == 0).all()
    assert (radius[..., :-1] >= (read - scores)[..., :-1].abs()).all()


def _generate(model, scheme="nvfp4", **monitor):
    ids, mask = prompts()
    with torch.no_grad(), witcert.monitor(model, scheme, **monitor) as mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    return mon


def _loud(dtype=torch.float32):
    """A tiny Llama whose query projections are scaled up: logits of tens, where an fp8 query moves attention."""
    import copy

    model = copy.deepcopy(tiny("llama")).to(dtype)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= 40
    return model


@pytest.mark.parametrize("meter", ["fused", "full"])
def test_a_cell_exceeds_the_key_only_bound_and_the_term_covers_it(meter, monkeypatch):
    model = _loud()
    covered = _generate(model, _identity, query_format="fp8-e4m3", meter=meter)
    assert covered.summary().total["violations"] == 0
    assert float(covered.tensor("true_tv").nan_to_num(0).max()) > 0.01  # the quantized query moved attention
    real, left_out = observation.read_scores, []

    def without_term(scores, q_read, k_hat, sm_scale):
        read, radius = real(scores, q_read, k_hat, sm_scale)
        left_out.append(1)
        return read, torch.zeros_like(radius)

    monkeypatch.setattr(observation, "read_scores", without_term)
    key_only = _generate(model, _identity, query_format="fp8-e4m3", meter=meter)
    assert left_out and key_only.summary().total["violations"] > 0  # the key-only bound is exceeded


def test_true_tv_compares_the_exact_query_with_the_read_one():
    model = _loud()
    mon = _generate(model, _identity, query_format="fp8-e4m3")
    plain = _generate(model, _identity)
    assert float(plain.tensor("true_tv").nan_to_num(0).max()) == 0.0  # same query, same keys
    assert float(mon.tensor("true_tv").nan_to_num(0).max()) > 0.01


@pytest.mark.parametrize("scheme", ["nvfp4", "int4-per-token-head", "rtn-int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_formats_with_a_quantized_query_have_no_violations(scheme, dtype):
    mon = _generate(_loud(dtype), scheme, query_format="fp8-e4m3")
    assert mon.summary().total["violations"] == 0


def test_gate_and_spot_check_use_the_term():
    model = _loud()
    spot = _generate(model, "nvfp4", query_format="fp8-e4m3", certificate="spot", tau=0.01)
    table = spot.table()
    assert spot.summary().total["violations"] == 0 and (table["spot_keys"] > 0).any()
    for keep_exact in (True, False):
        gated = _generate(model, "nvfp4", query_format="fp8-e4m3", gate=witcert.Gate(0.01), keep_exact=keep_exact)
        table = gated.table()
        assert (table["repaired"]).any() and (table["meter_after"] <= 0.01).all()
        if keep_exact:
            assert (table["true_tv_after"] <= table["meter_after"]).all()


def test_deferred_metering_meters_what_the_step_would():
    model = _loud()
    deferred = _generate(model, "nvfp4", query_format="fp8-e4m3")
    in_step = _generate(model, "nvfp4", query_format="fp8-e4m3", certificate="spot", tau=0.999,
                        spot_delta=witcert.spot.RequestBudget(1e-3))  # a request budget: checked in each step
    assert deferred.defer and not in_step.defer
    assert torch.allclose(deferred.tensor("meter"), in_step.tensor("meter"), rtol=1e-6, equal_nan=True)


def test_a_call_wide_query_format_is_metered_in_its_step():
    def dynamic_scale(q):  # a per-call scale: q' depends on the whole call, so a fold of calls would differ
        scale = q.abs().amax().clamp(min=1e-12) / 448
        return (q / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float64) * scale

    model = _loud()
    mon = _generate(model, "nvfp4", query_format=dynamic_scale)
    assert not mon.defer and mon.summary().total["violations"] == 0


def test_bad_query_formats_are_refused():
    model = tiny("llama")
    with pytest.raises(ValueError, match="query_format 'fp4' is unknown; known: fp8-e4m3"):
        witcert.monitor(model, "nvfp4", query_format="fp4")
    with pytest.raises(ValueError, match="Tier B certificate of 'dithered-int8' does not carry the query term"):
        witcert.monitor(model, "dithered-int8", query_format="fp8-e4m3")
    with pytest.raises(ValueError, match="fp8 query scale must be a positive finite float"):
        Fp8Query(scale=0.0)
    with pytest.raises(ValueError, match="must return a tensor of the query's shape"):
        query_format_of(lambda q: q[..., :2]).read(torch.ones(1, 1, 1, 4))
    with pytest.raises(ValueError, match="q_read must have q's shape"):
        query_radius(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 2, 4), torch.ones(1, 1, 3, 4), 0.5)

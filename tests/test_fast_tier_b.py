"""The fast path's fp32 Tier B bound (:func:`witcert.fastpath.tier_b_radius.fast_tier_b_logit_bound`; TB, L2, L3, DB under FP).

Implementation: two fp32 group dots per token over the fp16 scales, eager and ``torch.compile``d.
Oracles: ``witcert.spec.dither.logit_bound`` (40 digits, the store's exact fp16 data) and
:func:`witcert.tier_b_logit_bound` (fp64). Domain: token-group (groups 8, 16, 32) and token layouts,
fp32 and fp64 queries from ``1e-30`` to ``1e20``, softmax scales down to ``2^-140``, all-zero key
groups (scale 0), both modes, GQA shapes; fallbacks for the other layouts and key dtypes.
Tolerance: none below the spec bound; above it at most ``(n_g + 14) 2^-23`` relative plus the
lifted floors; NaN never (an fp64 query beyond fp32 against a zero scale gives ``inf``).
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import mp, mpf

import witcert
from spec import dither as spec
from witcert.fastpath import budgeted_pass
from witcert.fastpath import compiled as compiled_mod
from witcert.fastpath import tier_b_radius
from witcert.fastpath.fused import lean_cells, tier_b_cells
from witcert.fastpath.tier_b_radius import fast_tier_b_logit_bound
from witcert.spec import golden
from witcert.tier_b.counters import StandaloneCounter

LAYOUTS = [dict(group=8), dict(group=16), dict(group=32), dict(granularity="token")]


def _store(keys: torch.Tensor, **config):
    return witcert.DitheredInt8(**config).quantize(keys, StandaloneCounter(request=0, layer=0))


@st.composite
def _case(draw):
    config = draw(st.sampled_from(LAYOUTS))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    keys = torch.randn(1, 6, 32, generator=g) * draw(st.sampled_from([1.0, 1e-3, 300.0]))
    keys[0, 2] = 0.0  # every scale 0: c = 0 exactly
    keys[0, 4, :8] = 0.0  # one zero group where the group is 8
    q = torch.randn(1, 2, 32, generator=g, dtype=torch.float64) * draw(st.sampled_from([1.0, 1e-30, 1e20]))
    q[0, 1, :16] = 0.0
    return config, keys, q


@settings(max_examples=40, deadline=None)  # each example runs 24 spec evaluations at 40 digits
@given(_case(), st.sampled_from([None, 1.0, 2.0**-140]), st.sampled_from(["min", "delta"]),
       st.sampled_from([torch.float32, torch.float64]))
def test_fast_tier_b_never_below_the_spec_bound(case, sm_scale, mode, dtype):
    config, keys, q64 = case
    store = _store(keys, **config)
    q = q64.to(dtype)
    c = fast_tier_b_logit_bound(q, store, 1e-6, sm_scale, mode)
    assert c.dtype == torch.float32 and c.shape == (1, 2, 6)
    sm = 32**-0.5 if sm_scale is None else sm_scale
    n_groups = store.scales.shape[-1]
    with mp.workdps(40):
        for i in range(2):
            for t in range(6):
                exact = spec.logit_bound(q[0, i].double().tolist(), store.scale_per_element()[0, t].tolist(), sm,
                                         store.n_tokens, 1e-6, mode=mode)
                got = mpf(c[0, i, t].item())
                assert got >= exact
                scales = [mpf(x) for x in store.scales[0, t].double().tolist()]  # the lifted a_g, b_g add at most
                floors = sum(scales) * mpf(2) ** -100 + mp.sqrt(sum(x * x for x in scales)) * mpf(2) ** -39
                if q.abs().max() > 1e18:  # b_g beyond fp32: u = inf, the Delta branch (sound, looser)
                    exact = spec.logit_bound(q[0, i].double().tolist(), store.scale_per_element()[0, t].tolist(),
                                             sm, store.n_tokens, 1e-6, mode="delta")
                assert got <= exact * (1 + (n_groups + 14) * mpf(2) ** -23) + mpf(2) ** -125 + floors
                if keys[0, t].abs().max() == 0:
                    assert got == 0


def test_fast_tier_b_close_to_the_library_on_gqa_shapes():
    g = torch.Generator().manual_seed(0)
    store = _store(torch.randn(2, 3, 500, 64, generator=g))
    q = torch.randn(2, 9, 2, 64, generator=g)
    for mode in ("min", "delta"):
        fast, library = fast_tier_b_logit_bound(q, store, 1e-6, mode=mode), witcert.tier_b_logit_bound(q, store, 1e-6, mode=mode)
        assert fast.shape == library.shape == (2, 9, 2, 500)
        assert torch.all(fast.double() >= library.double() * (1 - 2.0**-40))  # both above the exact value
        assert torch.all(fast.double() <= library.double() * (1 + 2.0**-17))


def test_query_beyond_fp32_gives_inf_never_nan():
    keys = torch.randn(1, 3, 32)
    keys[0, 1] = 0.0  # a zero-scale token
    c = fast_tier_b_logit_bound(torch.full((1, 1, 32), 1e300, dtype=torch.float64), _store(keys), 1e-6)[0, 0]
    assert not torch.isnan(c).any() and torch.isinf(c).all()  # token 1: exact 0, trivial inf (sound)


@pytest.mark.parametrize("config, key_dtype, mode", [
    (dict(granularity="block-channel", block=16), torch.float32, "min"),
    (dict(outlier_pairs=2), torch.float32, "min"),
    (dict(), torch.float16, "min"),
    (dict(), torch.bfloat16, "delta"),
    (dict(), torch.float32, "u"),
])
def test_other_layouts_dtypes_and_modes_take_the_library(config, key_dtype, mode):
    store = _store(torch.randn(1, 2, 40, 64), **config)
    q = torch.randn(1, 4, 1, 64)
    expected = witcert.tier_b_logit_bound(q, store, 1e-6, mode=mode, key_dtype=key_dtype)
    assert torch.equal(fast_tier_b_logit_bound(q, store, 1e-6, mode=mode, key_dtype=key_dtype), expected)


def test_bad_input_names_the_argument():
    store = _store(torch.randn(1, 2, 10, 64))
    q = torch.randn(1, 2, 1, 64)
    with pytest.raises(ValueError, match="delta_loc"):
        fast_tier_b_logit_bound(q, store, 0.0)
    with pytest.raises(ValueError, match="n_tokens"):
        fast_tier_b_logit_bound(q, store, 1e-6, n_tokens=5)  # fewer than the store's 10 tokens
    with pytest.raises(ValueError, match="q: contains NaN"):
        fast_tier_b_logit_bound(torch.full((1, 2, 1, 64), math.nan), store, 1e-6)
    with pytest.raises(ValueError, match="sm_scale"):
        fast_tier_b_logit_bound(q, store, 1e-6, sm_scale=-1.0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        fast_tier_b_logit_bound(torch.randn(1, 3, 1, 64), store, 1e-6)


def test_compiled_tier_b_matches_eager_and_stays_above(monkeypatch):
    if compiled_mod.compiled_of(tier_b_radius.tier_b_kernel, tier_b_radius.probe) is None:
        pytest.skip("torch.compile unavailable on this machine")
    g = torch.Generator().manual_seed(3)
    store = _store(torch.randn(1, 3, 2048, 64, generator=g))
    q = torch.randn(1, 9, 1, 64, generator=g) * 30
    for mode in ("min", "delta"):
        library = witcert.tier_b_logit_bound(q, store, 1e-7, mode=mode).double()
        monkeypatch.setenv("WITCERT_COMPILE", "0")
        eager = fast_tier_b_logit_bound(q, store, 1e-7, mode=mode)
        monkeypatch.setenv("WITCERT_COMPILE", "1")
        compiled = fast_tier_b_logit_bound(q, store, 1e-7, mode=mode)
        assert torch.all(compiled.double() >= library * (1 - 2.0**-40))
        assert torch.allclose(compiled, eager, rtol=2.0**-20, atol=0.0)


def test_fast_radii_attack_class_finds_nothing_and_catches_a_short_lift(monkeypatch):
    """The fuzz class of both fast per-token bounds: clean on the library, and it catches a bound lowered by
    ``2^-17`` relative (the lifts' margin is about ``1e-6``: the class measures it, worst ratio ~0.999999)."""
    from witcert.fastpath import radius
    from witcert.verification.attacks import fast_radii

    tally = fast_radii.run(30, torch.Generator().manual_seed(0))
    assert tally.cells == 30 * 28 and tally.violations == 0, tally.notes  # 24 radii and 4 cell meters per trial
    for module, name in ((tier_b_radius, "tier_b_kernel"), (radius, "band_dot")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, f=original: f(*args) * (1 - 2.0**-17))
    assert fast_radii.run(30, torch.Generator().manual_seed(0)).violations > 0


def test_chunks_of_one_cache_in_one_pass():
    """The monitor's form: the chunks written step by step, their union over every token (``n_tokens``)."""
    from witcert.fastpath.tier_b_radius import fast_tier_b_of_chunks

    g = torch.Generator().manual_seed(5)
    keys = torch.randn(1, 3, 40, 64, generator=g)
    chunks = [_store(keys[..., a:b, :]) for a, b in ((0, 30), (30, 31), (31, 40))]
    q = torch.randn(1, 9, 1, 64, generator=g)
    for mode in ("min", "delta"):
        joined = fast_tier_b_of_chunks(q, chunks, 1e-6, mode=mode)
        library = torch.cat([witcert.tier_b_logit_bound(q, chunk, 1e-6, mode=mode, n_tokens=40) for chunk in chunks], -1)
        assert joined.shape == (1, 9, 1, 40)
        assert torch.all(joined.double() >= library.double() * (1 - 2.0**-40))
        assert torch.all(joined.double() <= library.double() * (1 + 2.0**-17))
    with pytest.raises(ValueError, match="stores"):
        fast_tier_b_of_chunks(q, [], 1e-6)
    with pytest.raises(ValueError, match="one cache"):
        fast_tier_b_of_chunks(q, [chunks[0], _store(keys[..., :5, :], group=16)], 1e-6)


@pytest.mark.parametrize("compiled", [False, True])
def test_tier_b_cells_is_the_two_calls_and_never_below_golden(compiled, monkeypatch):
    """``tier_b_cells`` is ``lean_cells(scores, fast_tier_b_logit_bound(...))`` bit for bit (eager and compiled),
    and per row never below the 50-digit meter at the exact Tier B bound (40-digit spec per token), MS on the
    pass's own sets."""
    if compiled and compiled_mod.compiled_of(tier_b_radius.tier_b_kernel, tier_b_radius.probe) is None:
        pytest.skip("torch.compile unavailable on this machine")
    monkeypatch.setenv("WITCERT_COMPILE", "1" if compiled else "0")
    g = torch.Generator().manual_seed(41)
    store = _store(torch.randn(1, 2, 20, 32, generator=g) * 3, group=8)
    q = torch.randn(1, 4, 1, 32, generator=g)
    scores = torch.randn(1, 4, 1, 20, generator=g, dtype=torch.float64) * 2
    scores[..., 3] = -math.inf
    for mode in ("min", "delta"):
        cells = tier_b_cells(scores, q, store, 1e-6, mode=mode)
        c = fast_tier_b_logit_bound(q, store, 1e-6, mode=mode)
        two_calls = lean_cells(scores, c, checked=True)  # c kept fp32
        assert torch.equal(cells.meter, two_calls.meter) and torch.equal(cells.risk, two_calls.risk)
        sets = budgeted_pass.split_low_sets(scores, c)
        scale = store.scale_per_element()
        for h in range(4):
            with mp.workdps(40):
                exact_c = [spec.logit_bound(q[0, h, 0].double().tolist(), scale[0, h // 2, t].tolist(), 32**-0.5,
                                            store.n_tokens, 1e-6, mode=mode) for t in range(20)]
            exact = golden.meter_on_sets_from_scores(scores[0, h, 0].tolist(), exact_c, sets[0, h, 0].tolist())
            assert mpf(cells.meter[0, h, 0].item()) >= exact, (mode, h)


def test_tier_b_cells_takes_the_two_calls_where_one_pass_does_not_apply_and_checks_shapes():
    g = torch.Generator().manual_seed(43)
    keys = torch.randn(1, 2, 9, 32, generator=g)
    q = torch.randn(1, 4, 1, 32, generator=g)
    scores = torch.randn(1, 4, 1, 9, generator=g)
    for store, mode, key_dtype in [(_store(keys, granularity="block-channel"), "min", torch.float32),
                                   (_store(keys), "u", torch.float32), (_store(keys), "min", torch.float16)]:
        expected = lean_cells(scores, fast_tier_b_logit_bound(q, store, 1e-6, mode=mode, key_dtype=key_dtype)).meter
        assert torch.equal(tier_b_cells(scores, q, store, 1e-6, mode=mode, key_dtype=key_dtype).meter, expected)
    with pytest.raises(ValueError, match="scores must be"):
        tier_b_cells(scores[..., :8], q, _store(keys), 1e-6)

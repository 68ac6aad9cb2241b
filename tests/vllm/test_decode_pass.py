"""The plugin's one-pass decode meter against an fp64 oracle, per query row (no vLLM needed).

Implementation: ``witcert.integrations.vllm.decode_pass.meter_rows`` (fp32 GEMM logits, Tier A radius, Tier B
deterministic branch, score rounding, the fused meter; the zero-witness short cut), eager and compiled.
Oracle: the fp64 TV between softmax over the exact keys and over the stored keys, per (row, kv head, query
row), with no padding. Domain: SmolLM2-like heads (d = 64, 3 kv heads, 3 query heads each), several query
rows per kv head with their own causal lengths (a speculative verification step), keys cast to fp8 and to
rtn-int4, a massive channel, large query norms, exactly stored keys, a stored key whose compressed logit lies
~1000 below the row's maximum while its exact logit is the largest (its compressed weight underflows to 0 in
fp64). Tolerance: none (meter >= true TV); the zero-witness short cut against the reference's rounding term.
"""
import math
import warnings

import pytest
import torch

import witcert
from witcert.integrations.vllm.decode_pass import (cell_terms, exact_cells, meter_cells, meter_pairs, meter_rows,
                                                   pass_constants)
from witcert.integrations.vllm.written import key_norms_of, written

D, HKV, G = 64, 3, 3
LAYOUT = witcert.BandLayout(D, 16)
SCALE = D**-0.5


def _rows(g, rows, tokens, q_scale=1.0, cast=None):
    """Exact keys (R, Hkv, S, d), stored keys, witnesses (band-major view) and norms as the state keeps them."""
    k = torch.randn(rows, HKV, tokens, D, generator=g) * 2
    k[..., 5] *= 20  # a massive channel
    stored = k if cast is None else cast(k)
    kept = written(k.reshape(-1, HKV, D), stored.float().reshape(-1, HKV, D), LAYOUT)
    keys = kept.keys.reshape(rows, HKV, tokens, D)
    witness = kept.witness.reshape(rows, HKV, tokens, -1).transpose(-1, -2).contiguous()  # (R, Hkv, B, S)
    norms = kept.key_norms.reshape(rows, HKV, tokens)
    q = torch.randn(rows, HKV, G * 2, D, generator=g) * q_scale  # two query tokens per row, G heads each
    return k, keys, witness, norms, q


def _lengths(rows, tokens):
    """Causal lengths: query token j of row r attends ``tokens - r - 1 + j`` tokens (heads folded: m = g Q + j)."""
    per_token = torch.tensor([[tokens - r - 1, tokens - r] for r in range(rows)])  # (R, Q)
    return per_token[:, None, None, :].expand(rows, 1, G, 2).reshape(rows, 1, G * 2)


def _true_tv(q, k_exact, keys, lengths):
    """fp64 TV per (row, kv head, query row), each over its own tokens (no mask, no padding)."""
    rows, hkv, m, _ = q.shape
    out = torch.empty(rows, hkv, m, dtype=torch.float64)
    for r in range(rows):
        for h in range(hkv):
            for i in range(m):
                n = int(lengths[r, 0, i])
                qi = q[r, h, i].double()
                exact = torch.softmax(SCALE * (k_exact[r, h, :n].double() @ qi), -1)
                comp = torch.softmax(SCALE * (keys[r, h, :n].double() @ qi), -1)
                out[r, h, i] = 0.5 * (exact - comp).abs().sum()
    return out


def _fp8(k):
    return k.to(torch.float8_e4m3fn).to(torch.float32)


def _int4(k):
    return witcert.get_scheme("rtn-int4")(k.clone())


def _meter(q, keys, witness, norms, lengths, compiled, scales=None, own=None):
    lossy = witness.flatten(2).amax(-1) > 0
    norm_max = norms.double().amax(-1)
    return meter_rows(q, keys, witness, norms, lengths, lossy, norm_max, LAYOUT, SCALE, scales, own, compiled=compiled)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("cast", [_fp8, _int4], ids=["fp8", "rtn-int4"])
@pytest.mark.parametrize("q_scale", [1.0, 8.0])
def test_meter_bounds_true_tv_per_query_row(compiled, cast, q_scale):
    g = torch.Generator().manual_seed(3)
    k, keys, witness, norms, q = _rows(g, 3, 40, q_scale, cast)
    lengths = _lengths(3, 40)
    meter, risk = _meter(q, keys, witness, norms, lengths, compiled)
    tv = _true_tv(q, k, keys, lengths)
    assert (meter >= tv).all(), float((tv - meter).max())
    assert (tv > 0).any()  # lossy: the check is not vacuous
    if cast is _fp8 and q_scale == 1.0:
        assert (meter < 0.5).any()  # and informative where the keys are close
    assert (risk >= 0).all() and not torch.isnan(meter).any()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("wanted", [[[0, 1, 0], [0, 0, 0], [1, 0, 1]], [[0, 0, 0], [0, 0, 1], [0, 0, 0]],
                                    [[1, 1, 1], [1, 1, 1], [1, 1, 1]], [[0, 0, 0], [0, 0, 0], [0, 0, 0]]],
                         ids=["some", "one pair", "every pair", "none"])
def test_metering_some_pairs_meters_them_as_every_pair(compiled, wanted):
    # an audit's flush meters only the (row, kv head) pairs a picked cell reads (meter_pairs): each such pair's
    # cells must be a bound on its own (oracle: the true TV), agree with the pass over every pair up to the
    # GEMM's summation order, and every other pair's cells be NaN (unmetered), never a number; a single pair
    # (one row of one kv head) and the rtn-int4 keys with the exactly stored ones of a short cut pair
    g = torch.Generator().manual_seed(11)
    k, keys, witness, norms, q = _rows(g, 3, 40, 1.0, _int4)
    witness[1, 2] = 0  # row 1, kv head 2 stored exactly: its cells take the short cut
    keys[1, 2], norms[1, 2] = k[1, 2], key_norms_of(k[1, 2])
    lengths = _lengths(3, 40)
    wanted = torch.tensor(wanted, dtype=torch.bool)
    lossy = witness.flatten(2).amax(-1) > 0
    norm_max = norms.double().amax(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        meter, risk = meter_pairs(wanted, q, keys, witness, norms, lengths, lossy, norm_max, LAYOUT, SCALE,
                                  compiled=compiled)
    every, every_risk = meter_rows(q, keys, witness, norms, lengths, lossy, norm_max, LAYOUT, SCALE,
                                   compiled=compiled)
    _wanted_rows_as_every_row(wanted, (meter, risk), (every, every_risk), _true_tv(q, k, keys, lengths))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("picked", [[(0, 1, 4)], [(0, 0, 0), (2, 2, 5), (2, 2, 1), (1, 2, 3)], [(1, 0, 2), (1, 0, 3)],
                                    "every row of a pair", "all", "none"],
                         ids=["one cell", "some", "two of one pair", "every row of a pair", "all", "none"])
def test_metering_some_query_rows_meters_them_as_every_row(compiled, picked):
    # an audit's flush meters only the query rows a picked cell reads (meter_cells): each such row must be a bound
    # on its own (oracle: the true TV), agree with the pass over every row up to the GEMM's summation order, and
    # every other row be NaN (unmetered), never a number; one cell (one pair of one row: padded), rows of one pair,
    # a short cut pair (row 1, kv head 2), every row of a pair beside one cell of another, everything, nothing;
    # deferred rows' own tokens gathered with their rows
    g = torch.Generator().manual_seed(12)
    k, keys, witness, norms, q = _rows(g, 3, 40, 1.0, _int4)
    witness[1, 2] = 0
    keys[1, 2], norms[1, 2] = k[1, 2], key_norms_of(k[1, 2])
    lengths = _lengths(3, 40)
    m = q.shape[2]
    wanted = torch.zeros(3, HKV, m, dtype=torch.bool)
    if picked == "all":
        wanted[:] = True
    elif picked == "every row of a pair":
        wanted[2, 1] = True
        wanted[0, 0, 3] = True
    elif picked != "none":
        for r, h, i in picked:
            wanted[r, h, i] = True
    lossy = witness.flatten(2).amax(-1) > 0
    norm_max = norms.double().amax(-1)
    last = lengths[:, 0] - 1  # (R, M): each query row's own token, as a deferred row carries it
    own = (torch.take_along_dim(keys, last[:, None, :, None], dim=2),
           torch.take_along_dim(witness.transpose(-1, -2), last[:, None, :, None], dim=2),
           torch.take_along_dim(norms, last[:, None, :], dim=2))
    for mine in (None, own):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            meter, risk = meter_cells(wanted, q, keys, witness, norms, lengths, lossy, norm_max, LAYOUT, SCALE,
                                      own=mine, compiled=compiled)
        every, every_risk = meter_rows(q, keys, witness, norms, lengths, lossy, norm_max, LAYOUT, SCALE, own=mine,
                                       compiled=compiled)
        _wanted_rows_as_every_row(wanted, (meter, risk), (every, every_risk), _true_tv(q, k, keys, lengths))


def test_padding_and_other_rows_do_not_change_a_row():
    # a row metered beside a longer one (its keys padded with garbage) meters as alone, up to the sum order
    g = torch.Generator().manual_seed(4)
    k, keys, witness, norms, q = _rows(g, 2, 30, cast=_fp8)
    lengths = _lengths(2, 30)
    both, _ = _meter(q, keys, witness, norms, lengths, False)
    keys2, witness2 = keys.clone(), witness.clone()
    keys2[1, :, 29:] = 1e4
    witness2[1, :, :, 29:] = math.inf
    alone, _ = _meter(q[1:], keys2[1:], witness2[1:], norms[1:], lengths[1:], False)
    torch.testing.assert_close(alone, both[1:], rtol=1e-6, atol=1e-12)


def test_exactly_stored_keys_take_the_short_cut():
    g = torch.Generator().manual_seed(5)
    k, keys, witness, norms, q = _rows(g, 2, 25)
    assert (witness == 0).all()  # stored exactly: every witness is 0, no row is lossy
    lengths = _lengths(2, 25)
    meter, risk = _meter(q, keys, witness, norms, lengths, False)
    assert (meter > 0).all() and (meter < 1e-9).all() and (risk >= meter).all()
    # the short cut is c/2 >= tanh(c/2) at the reference's rounding term for the largest key norm: every token's
    # term (cell_terms rounds each up a few more steps)
    _, c = cell_terms(q, keys, witness, norms, lengths, norms.double().amax(-1), LAYOUT, SCALE, reference=True)
    torch.testing.assert_close(meter, 0.5 * c.amax(-1), rtol=1e-12, atol=0)
    alone, _ = exact_cells(q, norms.double().amax(-1), pass_constants(D, SCALE))
    assert torch.equal(meter, alone)


def test_a_token_whose_compressed_weight_underflows_is_still_bounded():
    # token 7's stored key points far against the query: its compressed logit is ~1000 below the maximum (its
    # fp64 softmax weight is exactly 0), while its exact key makes it the heaviest token
    g = torch.Generator().manual_seed(6)
    rows, tokens = 1, 12
    q = torch.randn(rows, HKV, G * 2, D, generator=g)
    k = torch.randn(rows, HKV, tokens, D, generator=g)
    direction = q[0, :, 0] / q[0, :, 0].norm(dim=-1, keepdim=True)  # (Hkv, d)
    k[0, :, 7] = 30.0 * direction
    stored = k.clone()
    stored[0, :, 7] = -1200.0 * direction
    kept = written(k.reshape(-1, HKV, D), stored.float().reshape(-1, HKV, D), LAYOUT)
    keys = kept.keys.reshape(rows, HKV, tokens, D)
    witness = kept.witness.reshape(rows, HKV, tokens, -1).transpose(-1, -2).contiguous()
    norms = kept.key_norms.reshape(rows, HKV, tokens)
    lengths = torch.full((rows, 1, G * 2), tokens)
    comp = torch.softmax(SCALE * (keys[0, 0].double() @ q[0, 0, 0].double()), -1)
    assert comp[7] == 0.0  # the compressed weight underflows in fp64
    tv = _true_tv(q, k, keys, lengths)
    assert float(tv[0, 0, 0]) > 0.5  # ... while the exact weight is large
    for compiled in (False, True):
        meter, _ = _meter(q, keys, witness, norms, lengths, compiled)
        assert (meter >= tv).all()


def test_tier_b_scales_enter_as_a_per_token_minimum():
    # scales that do not describe the keys are still only a minimum with Tier A: inf scales change nothing
    g = torch.Generator().manual_seed(7)
    k, keys, witness, norms, q = _rows(g, 2, 20, cast=_int4)
    lengths = _lengths(2, 20)
    none, _ = _meter(q, keys, witness, norms, lengths, False)
    infinite = torch.full((2, HKV, D // 32, 20), math.inf, dtype=torch.float16)
    same, _ = _meter(q, keys, witness, norms, lengths, False, infinite)
    assert torch.equal(none, same)


def test_key_norms_are_upper_bounds():
    g = torch.Generator().manual_seed(8)
    keys = torch.randn(50, HKV, D, generator=g) * torch.logspace(-30, 30, 50)[:, None, None]
    norms = key_norms_of(keys)
    exact = [[math.sqrt(math.fsum(x * x for x in keys[i, h].double().tolist())) for h in range(HKV)] for i in range(50)]
    assert (norms.double() >= torch.tensor(exact, dtype=torch.float64)).all()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_deferred_row_is_metered_over_its_own_token_as_attended(compiled):
    # deferred metering: when a row is metered, its own (last) token has since been stored compressed; the
    # row attended the exact one. With ``own`` the pass meters what was attended (oracle: TV against it)
    g = torch.Generator().manual_seed(9)
    k, keys, witness, norms, q = _rows(g, 2, 30, cast=_fp8)
    lengths = _lengths(2, 30)
    own_index = (lengths - 1)[:, 0]  # (R, M): each query row's own position
    exact_kept = written(k.reshape(-1, HKV, D), k.float().reshape(-1, HKV, D), LAYOUT)
    exact_keys = exact_kept.keys.reshape(2, HKV, 30, D)
    rows = torch.arange(2)[:, None, None]
    heads = torch.arange(HKV)[None, :, None]
    own = (exact_keys[rows, heads, own_index[:, None, :]],  # (R, Hkv, M, d): the exact own keys, witness 0
           torch.zeros(2, HKV, own_index.shape[-1], LAYOUT.bands, dtype=torch.float16),
           exact_kept.key_norms.reshape(2, HKV, 30)[rows, heads, own_index[:, None, :]])
    meter, _ = _meter(q, keys, witness, norms, lengths, compiled, own=own)
    attended = keys.clone().unsqueeze(2).expand(-1, -1, q.shape[2], -1, -1).clone()  # per query row
    for r in range(2):
        for h in range(HKV):
            for m in range(q.shape[2]):
                attended[r, h, m, own_index[r, m]] = exact_keys[r, h, own_index[r, m]]
    tv = torch.empty_like(meter)
    for r in range(2):
        for h in range(HKV):
            for m in range(q.shape[2]):
                n = int(lengths[r, 0, m])
                qi = q[r, h, m].double()
                exact = torch.softmax(SCALE * (k[r, h, :n].double() @ qi), -1)
                served = torch.softmax(SCALE * (attended[r, h, m, :n].double() @ qi), -1)
                tv[r, h, m] = 0.5 * (exact - served).abs().sum()
    assert (meter >= tv).all() and (tv > 0).any()
    plain, _ = _meter(q, keys, witness, norms, lengths, compiled)  # own token compressed: another bound
    assert not torch.equal(meter, plain)
    same = (keys[rows, heads, own_index[:, None, :]], witness.transpose(-1, -2)[rows, heads, own_index[:, None, :]],
            norms[rows, heads, own_index[:, None, :]])
    again, _ = _meter(q, keys, witness, norms, lengths, compiled, own=same)  # own = the state's entry
    torch.testing.assert_close(again, plain, rtol=1e-6, atol=1e-9)


def _wanted_rows_as_every_row(wanted, some: tuple, every: tuple, tv) -> None:
    """The wanted rows of a pass over some rows: bounds on their true TV ``tv``, equal to the pass over every row up to
    the GEMM's summation order; every other row NaN (unmetered), never a number."""
    (meter, risk), (all_meter, all_risk) = some, every
    assert meter.shape == all_meter.shape
    assert torch.isnan(meter[~wanted]).all() and torch.isnan(risk[~wanted]).all()
    assert not torch.isnan(meter[wanted]).any() and (meter[wanted] >= tv[wanted]).all()
    torch.testing.assert_close(meter[wanted], all_meter[wanted], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(risk[wanted], all_risk[wanted], rtol=1e-5, atol=1e-9)

"""The exact audit's bound against its spec mirror (registry AE): ``true_tv_bounds`` never below the 50-digit TV.

Implementation: :func:`witcert.audit.exact.true_tv_bounds` (fp64 logits and softmaxes, the TV rounded up) and
:func:`witcert.audit.exact.group_keys`. Oracle: :func:`witcert.spec.audit.true_tv` at 50 digits, from the same
fp64 logits the implementation forms (so the oracle checks the softmaxes, the sum and the rounding up, and the
logits themselves are checked separately against exact fraction arithmetic of the fp64 operands). Domain: random
and adversarial cells (hypothesis): logits spread over +-700 (exp near underflow), keys of 1e30 scale, one token,
identical logits (TV 0), masked tokens, disjoint winners (TV near 1), 4096 tokens; a quantized query (``served``);
an additive bias. Tolerances: bound >= TV exactly, bound <= TV + 1e-8 (the rounding up is a relative 1e-9 plus
1e-12); NaN exactly where a cell sees no token; a non-finite read key yields the trivial bound 1, never NaN.
"""
from fractions import Fraction

import mpmath
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from witcert.audit.exact import group_keys, true_tv_bounds
from witcert.spec.audit import true_tv
from witcert.spot.gather import BackedKeys
from witcert.gate.backing_store import BackingStore

mpmath.mp.dps = 50


def golden(exact_logits: torch.Tensor, read_logits: torch.Tensor, visible: torch.Tensor) -> float:
    on = visible.nonzero().reshape(-1)
    return true_tv(exact_logits[on].tolist(), read_logits[on].tolist())


def logits_of(query, keys, scale, bias=None):
    out = (query.double() @ keys.double().transpose(-1, -2)) * scale
    return out if bias is None else out + bias


def check_cells(query, served, read_keys, exact_keys, visible, bias, scale):
    bound, tv, seen = true_tv_bounds(query, served, read_keys, exact_keys.double(), visible, bias, scale)
    exact_l = logits_of(query, exact_keys, scale, bias)
    read_l = logits_of(query if served is None else served, read_keys, scale, bias)
    for index in np.ndindex(*bound.shape):
        vis = visible[index]
        if not vis.any():
            assert torch.isnan(bound[index]) and torch.isnan(tv[index]) and seen[index] == 0
            continue
        reference = golden(exact_l[index], read_l[index], vis)
        assert float(bound[index]) >= reference, (index, float(bound[index]), reference)
        assert float(bound[index]) <= float(reference) + 1e-8
        assert seen[index] == int(vis.sum())
    return bound


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), s=st.integers(1, 40), spread=st.sampled_from([0.1, 3.0, 30.0, 300.0]),
       noise=st.sampled_from([0.0, 1e-6, 0.05, 1.0, 10.0]), quantized=st.booleans(), biased=st.booleans())
def test_the_bound_is_at_or_above_the_fifty_digit_tv(seed, s, spread, noise, quantized, biased):
    g = torch.Generator().manual_seed(seed)
    b, hkv, n, d = 2, 2, 3, 16
    query = torch.randn(b, hkv, n, d, generator=g) * spread / d ** 0.5
    exact_keys = torch.randn(b, hkv, s, d, generator=g)
    read_keys = exact_keys + noise * torch.randn(b, hkv, s, d, generator=g)
    served = (query * 64).round() / 64 if quantized else None
    visible = torch.rand(b, hkv, n, s, generator=g) < 0.8
    visible[0, 0, 0] = False  # a cell that sees nothing
    bias = torch.randn(b, hkv, n, s, generator=g, dtype=torch.float64) if biased else None
    check_cells(query, served, read_keys, exact_keys, visible, bias, 0.125)


@pytest.mark.parametrize("case", ["underflow", "one token", "identical", "disjoint", "long"])
def test_adversarial_cells(case):
    d = 8
    if case == "underflow":  # logits 700 apart: every weight but one underflows in exp
        query = torch.ones(1, 1, 1, d, dtype=torch.float64)
        exact = torch.zeros(1, 1, 3, d, dtype=torch.float64)
        exact[..., 0, :] = 700 / d
        read = exact.clone()
        read[..., 1, :] = 699.9 / d
        bound = check_cells(query, None, read, exact, torch.ones(1, 1, 1, 3, dtype=torch.bool), None, 1.0)
        assert 0.4 < float(bound) < 0.6
    elif case == "one token":  # softmax over one token is 1 whatever the logit: TV 0
        query, exact = torch.randn(1, 1, 1, d), torch.randn(1, 1, 1, d) * 1e30
        bound = check_cells(query, None, -exact, exact, torch.ones(1, 1, 1, 1, dtype=torch.bool), None, 1.0)
        assert float(bound) <= 1e-11
    elif case == "identical":
        query, exact = torch.randn(1, 1, 2, d), torch.randn(1, 1, 50, d)
        bound = check_cells(query, None, exact, exact, torch.ones(1, 1, 2, 50, dtype=torch.bool), None, 0.3)
        assert float(bound.max()) <= 1e-11
    elif case == "disjoint":  # each attention on another token: TV near 1, never above the trivial 1
        query = torch.ones(1, 1, 1, d, dtype=torch.float64)
        exact = torch.zeros(1, 1, 2, d, dtype=torch.float64)
        exact[..., 0, :] = 100.0
        read = exact.flip(-2)
        bound = check_cells(query, None, read, exact, torch.ones(1, 1, 1, 2, dtype=torch.bool), None, 1.0)
        assert 0.999 < float(bound) <= 1.0
    else:
        g = torch.Generator().manual_seed(3)
        query, exact = torch.randn(1, 1, 2, 64, generator=g), torch.randn(1, 1, 4096, 64, generator=g)
        read = exact + 0.1 * torch.randn(1, 1, 4096, 64, generator=g)
        check_cells(query, None, read, exact, torch.ones(1, 1, 2, 4096, dtype=torch.bool), None, 0.125)


def test_a_non_finite_read_key_yields_the_trivial_bound_never_nan():
    query, exact = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 5, 8)
    read = exact.clone()
    read[..., 2, :] = torch.inf
    bound, _, _ = true_tv_bounds(query, None, read, exact.double(), torch.ones(1, 1, 2, 5, dtype=torch.bool), None,
                                 1.0)
    assert torch.equal(bound, torch.ones_like(bound))


def test_logits_are_the_exact_products_of_the_fp64_operands_up_to_their_rounding():
    g = torch.Generator().manual_seed(1)
    query, keys = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 4, 8, generator=g)
    logits = logits_of(query, keys, 0.125)[0, 0, 0]
    for t in range(4):
        exact = sum(Fraction(float(a)) * Fraction(float(b)) for a, b in zip(query[0, 0, 0], keys[0, 0, t])) / 8
        assert abs(Fraction(float(logits[t])) - exact) <= Fraction(1, 10**12) * (1 + abs(exact))


def test_group_keys_reads_the_wanted_groups_whole_from_the_backing_store():
    store = BackingStore()
    keys = torch.randn(2, 3, 7, 8)
    store.write(0, keys)
    wanted = torch.tensor([[True, False, False], [False, False, True]])
    read = group_keys(BackedKeys(store, 0, 7), wanted, 8)
    assert torch.equal(read[wanted], keys[wanted].double()) and not read[~wanted].any()
    assert torch.equal(group_keys(keys, wanted, 8), keys.double())  # the exact cache: every group as it is

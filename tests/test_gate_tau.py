"""Gates at thresholds the repaired cells cannot reach, and thresholds compared exactly (issue 16, item 6).

Implementations: ``witcert.gate.policy.Gate`` (exact shadow, table pager, ``LayerPager`` over a
``BackingStore``), ``witcert.core.values.joint_pass``; the ``gate-tau`` attack class.
Oracles: termination under a time limit (``witcert.verification.attacks.gate_tau.time_limit``); the 50-digit TV
between softmax of the exact logits (the exact dot products for a ``LayerPager``) and of the
repaired ones; exact comparisons of ``after`` with ``tau`` in Python floats.
Domain: fp32 scores with fp64 exact logits, fp64 scores through a ``LayerPager``; ``tau`` the least
positive double, 1e-9 and the fp32 neighbour of 0.1 (``Gate`` refuses 0). Tolerance: none.
"""
import math

import pytest
import torch
from mpmath import mp, mpf

from witcert.verification.attacks import gate_tau
from witcert.verification.attacks.gate_tau import time_limit
from witcert.gate.backing_store import BackingStore
from witcert.gate.policy import Gate, PageIn
from witcert.core.metering import meter
from witcert.gate.repair import LayerPager, Repairer
from witcert.spec import bounds as spec
from witcert.core.values import joint_pass

LIMIT_S = 60.0


def _golden_tv(exact: list, used: list) -> mpf:
    with mp.workdps(60):
        return spec.tv(spec.softmax(exact), spec.softmax(used))


def _mixed_inputs(seed: int = 0, cells: int = 2, s: int = 40):
    g = torch.Generator().manual_seed(seed)
    exact = torch.randn(cells, s, generator=g, dtype=torch.float64) * 3
    return exact, exact.float(), torch.full((cells, s), 0.05)


def _table_pager(exact: torch.Tensor, block_size: int):
    def pager(cell, block):
        lo = block * block_size
        return PageIn(logits=exact[cell][lo : lo + block_size].clone(), nbytes=0)

    return pager


@pytest.mark.parametrize("tau", [2.0**-1074, 1e-9])
@pytest.mark.parametrize("source", ["exact", "pager"])
def test_gate_returns_and_says_when_tau_is_unreachable(tau, source):
    """fp32 scores, fp64 exact logits: repaired tokens keep c = the cast's rounding, so tau is out of reach."""
    exact, scores, c = _mixed_inputs()
    inputs = {"exact": exact} if source == "exact" else {"pager": _table_pager(exact, 8)}
    with time_limit(LIMIT_S):
        result = Gate(tau, block_size=8)(scores, c, **inputs)
    assert result.fired.all() and result.unreachable.all() and not result.reached.any()
    assert "unreachable in 2 cell(s)" in result.label
    assert len(set(result.pages)) == len(result.pages) == 2 * 5  # every block once, none twice
    for cell in range(2):
        tv = _golden_tv(exact[cell].tolist(), result.scores[cell].double().tolist())
        assert mpf(result.after[cell].item()) >= tv


def test_reached_means_after_at_most_tau_exactly():
    """fp32(0.1) > 0.1: a meter equal to fp32(0.1) is above tau = 0.1 and must fire, not pass as reached."""
    tau = 0.1
    target = torch.tensor(tau, dtype=torch.float32)
    assert target.double().item() > tau
    d = torch.tensor([2 * math.atanh(tau)], dtype=torch.float32)
    scores = torch.zeros(1, 2)
    for _ in range(64):  # walk D until the fp32 meter lands on fp32(tau)
        value = meter(scores, d.expand(1, 2))
        if value.item() == target.item():
            break
        d = torch.nextafter(d, torch.tensor(math.inf if value.item() < target.item() else -math.inf))
    c = d.expand(1, 2).clone()
    assert meter(scores, c).item() == target.item()
    result = Gate(tau, block_size=1)(scores, c, exact=scores.clone())
    assert result.fired.item()
    assert not result.reached.item() or result.after.double().item() <= tau
    assert not joint_pass(meter(scores, c), torch.zeros(1), torch.ones(1), tau_k=tau).pass_k.item()


def test_layer_pager_logits_carry_their_fp64_rounding():
    """fp64 scores: the pager's fp64 dot products are not exact; c = 0 on repaired tokens was false."""
    g = torch.Generator().manual_seed(3)
    s, d = 24, 8
    k = torch.randn(1, s, d, generator=g).half()
    k_hat = (k.float() + 0.05 * torch.randn(1, s, d, generator=g)).half()
    q = torch.randn(1, d, generator=g) * 3
    scale = d**-0.5
    scores = torch.einsum("hsd,hd->hs", k_hat.double(), q.double()) * scale
    spread = scale * torch.einsum("hsd,hd->hs", (k_hat.double() - k.double()).abs(), q.double().abs())
    c = spread * (1 + 1e-9) + 1e-12
    store = BackingStore(block_size=8)
    store.write("L", k)
    with time_limit(LIMIT_S):
        result = Gate(2.0**-1074, block_size=8)(scores, c, pager=LayerPager(Repairer(store), "L", q, scale))
    assert result.unreachable.all() and (result.c > 0).all()
    with mp.workdps(60):
        exact = [mpf(scale) * mp.fsum(mpf(a) * mpf(b) for a, b in zip(row, q[0].tolist())) for row in k[0].double().tolist()]
    assert mpf(result.after.item()) >= _golden_tv(exact, result.scores[0].tolist())


def test_pager_error_must_be_a_bound():
    scores, c = torch.zeros(1, 4), torch.full((1, 4), 0.5)
    bad = lambda cell, block: PageIn(torch.zeros(4, dtype=torch.float64), 0, error=-1.0)  # noqa: E731
    with pytest.raises(ValueError, match="negative or NaN logit error"):
        Gate(0.1, block_size=4)(scores, c, pager=bad)


def test_gate_tau_attack_class_finds_nothing():
    tally = gate_tau.run(6, torch.Generator().manual_seed(0))
    assert tally.cells > 0 and tally.violations == 0, tally.notes


@pytest.mark.parametrize("tau", [0.0, -0.0, -1e-9, math.inf, math.nan, True])
def test_gate_refuses_a_threshold_outside_its_two_regimes(tau):
    """0 < tau < 1 certified, tau >= 1 risk-ranked (both kept); 0, negatives, inf, NaN and bools are refused by name."""
    with pytest.raises(ValueError, match="tau must be"):
        Gate(tau)
    assert Gate(2.0**-1074).mode == "certified" and Gate(0.2).mode == "certified" and Gate(5.0).mode == "risk"

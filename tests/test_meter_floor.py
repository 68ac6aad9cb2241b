"""The meter floor (``witcert.gate.meter_floor``) and the repair loops that skip meters with it.

Implementations under test: :func:`~witcert.gate.meter_floor.meter_floor`, ``Gate.value_unless_over`` and its use in
``Gate``'s greedy and prefix repairs and in the spot-certified gate. Oracles: ``witcert.meter`` (the floor must never
exceed it), the 50-digit TV of the floor's own perturbations (``witcert.spec.bounds``: the floor is below their
largest), ``tanh(c/2)`` for a constant radius (the floor reaches it), and the same gates run with the skip turned
off (every decision, page and reported value bit for bit the same). Domain: ``tests.oracles`` cells (logits in
[-40, 40] with ties and masks, radii 0, 1e-30 to 12, 50 and 700), fp64 and fp32; saturated cells of 64-512 tokens for
the gates; the tiny Llama under kivi-2bit for the monitor's gates.
"""
import math

import mpmath
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import witcert
from tests.oracles import radius_lists, score_lists
from tests.test_gate import TablePager
from tests.test_spot_gate import decode_step_table
from tests.tiny_models import tiny
from witcert.core.metering import meter
from witcert.gate import policy
from witcert.gate.meter_floor import CAP, meter_floor, surely_over
from witcert.gate.policy import Gate
from witcert.spec import bounds as spec


@st.composite
def cells(draw, max_size: int = 24):
    scores = draw(score_lists(min_size=1, max_size=max_size))
    return torch.tensor(scores, dtype=torch.float64), torch.tensor(draw(radius_lists(len(scores))), dtype=torch.float64)


def _perturbation_tvs(scores: torch.Tensor, c: torch.Tensor) -> list:
    """50-digit TV of each perturbation the floor takes (``-c'`` on the k largest ``c' = min(c, CAP)``, ``+c'`` on the
    rest, in the floor's stable order)."""
    visible = [math.isfinite(s) for s in scores.tolist()]
    radius = [min(r, CAP) if v else 0.0 for r, v in zip(c.tolist(), visible)]
    order = sorted(range(len(radius)), key=lambda t: -radius[t])  # stable, as argsort(stable=True)
    with mpmath.workdps(50):
        p = spec.softmax(scores.tolist())
        return [spec.tv_perturbed(p, [-r if t in order[:k] else r for t, r in enumerate(radius)])
                for k in range(1, len(order) + 1)]


@settings(max_examples=300, deadline=None)
@given(cells(), st.sampled_from([torch.float64, torch.float32]))
def test_the_floor_never_exceeds_the_meter_nor_its_own_perturbations(cell, dtype):
    scores, c = cell[0].to(dtype), cell[1].to(dtype)
    floor = meter_floor(scores, c)
    assert floor.dtype == torch.float64 and floor.shape == ()
    assert float(floor) <= float(meter(scores, c))
    assert mpmath.mpf(float(floor)) <= max(_perturbation_tvs(scores.double(), c.double()))


@pytest.mark.parametrize("n_tokens,radius", [(1, 3.0), (600, 0.1), (600, 2.0), (4096, 7.0)])
def test_a_constant_radius_gives_tanh_of_half_of_it(n_tokens, radius):
    """Equal logits and one radius: the best split raises ``1 / (1 + e^c)`` of the mass, where the TV is ``tanh(c/2)``
    (the largest any bound of the radius alone may give); the floor reaches it up to the split's granularity."""
    scores, c = torch.zeros(n_tokens, dtype=torch.float64), torch.full((n_tokens,), radius, dtype=torch.float64)
    floor = float(meter_floor(scores, c))
    if n_tokens == 1:
        assert floor <= 0.0  # one token: every perturbation leaves the distribution as it is
    else:
        assert math.tanh(radius / 2) * (1 - 4 / n_tokens) - 1e-9 <= floor <= math.tanh(radius / 2)


def test_rows_the_meter_refuses_give_nan_and_are_never_surely_over():
    scores = torch.tensor([[0.0, float("nan")], [0.0, float("inf")], [-math.inf, -math.inf], [0.0, 1.0]],
                          dtype=torch.float64)
    c = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [float("nan"), 1.0]], dtype=torch.float64)
    scores, c = torch.cat([scores, torch.tensor([[0.0, 9.0]])]), torch.cat([c, torch.tensor([[-1.0, 40.0]])])
    floor = meter_floor(scores, c)
    assert bool(torch.isnan(floor).all())
    assert not bool(surely_over(scores, c, 0.0).any())
    with pytest.raises(ValueError, match="NaN"):  # the loop then asks the meter, which names the problem
        Gate(tau=0.2).value_unless_over(scores[:1], c[:1])
    with pytest.raises(ValueError, match=">= 0"):
        Gate(tau=0.2).value_unless_over(scores[-1:], c[-1:])


def test_large_radii_and_logits_stay_finite():
    scores = torch.tensor([[700.0, -700.0, 0.0], [1e300, -1e300, 0.0]], dtype=torch.float64)
    c = torch.tensor([[math.inf, 1e300, 0.0], [700.0, 700.0, 700.0]], dtype=torch.float64)
    floor = meter_floor(scores, c)
    assert bool(torch.isfinite(floor).all()) and bool((floor <= meter(scores, c)).all())


def _saturated(n_cells: int, n_tokens: int, seed: int) -> tuple:
    """Exact logits, compressed logits within radii of 0.5-4 of them (a 4-bit cache's meter is near 1), masks."""
    g = torch.Generator().manual_seed(seed)
    exact = torch.randn(n_cells, n_tokens, generator=g, dtype=torch.float64) * 3
    c = torch.rand(n_cells, n_tokens, generator=g, dtype=torch.float64) * 3.5 + 0.5
    scores = exact + (2 * torch.rand(n_cells, n_tokens, generator=g, dtype=torch.float64) - 1) * c
    exact[0, :5] = scores[0, :5] = -math.inf
    return exact, scores, c


def _every_meter(monkeypatch):
    """The skip turned off: every loop computes every meter, as before the floor existed."""
    monkeypatch.setattr(policy, "surely_over", lambda scores, c, tau: torch.zeros(scores.shape[:-1], dtype=torch.bool))


@pytest.mark.parametrize("source", ["pager", "exact"])
@pytest.mark.parametrize("n_tokens,tau", [(64, 0.3), (512, 0.2), (512, 0.05)])
def test_gate_repairs_are_the_same_with_and_without_the_skip(monkeypatch, source, n_tokens, tau):
    """The greedy loop (pager) and the prefix search (exact logits in memory): the same pages, repaired logits,
    bounds and values after repair; fewer meter rows computed with the floor."""
    exact, scores, c = _saturated(6, n_tokens, seed=n_tokens)
    rows_metered = []
    real_meter = policy.meter
    monkeypatch.setattr(policy, "meter", lambda s, r: rows_metered.append(s.shape[0]) or real_meter(s, r))

    def run():
        gate = Gate(tau=tau, block_size=16)
        kwargs = dict(pager=TablePager(exact, 16)) if source == "pager" else dict(exact=exact)
        rows_metered.clear()
        result = gate(scores, c, **kwargs)
        return result, sum(rows_metered)

    skipped, skipped_rows = run()
    _every_meter(monkeypatch)
    full, full_rows = run()
    for name in ("before", "after", "scores", "c", "fired", "reached", "blocks"):
        a, b = getattr(skipped, name), getattr(full, name)
        assert torch.equal(a, b), name
    assert skipped.bytes_paged == full.bytes_paged and bool(skipped.fired.any())
    assert skipped_rows < full_rows


@torch.no_grad()
@pytest.mark.parametrize("keep_exact", [True, False])
@pytest.mark.parametrize("certificate", ["spot", "deterministic"])
def test_monitor_gates_report_the_same_with_and_without_the_skip(monkeypatch, keep_exact, certificate):
    """The monitor's gates (the spot-certified one's repair loop, the deterministic one's greedy loop), validation and
    production: every reported column the same, bit for bit, with the skip and without it."""
    model, gate = tiny("llama"), witcert.Gate(tau=0.03, block_size=8)
    skipped = decode_step_table(model, gate, certificate, keep_exact)
    _every_meter(monkeypatch)
    full = decode_step_table(model, gate, certificate, keep_exact)
    assert list(skipped.columns) == list(full.columns) and skipped["repaired"].astype(bool).any()
    for name in skipped.columns:
        a, b = np.asarray(skipped[name]), np.asarray(full[name])
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), name

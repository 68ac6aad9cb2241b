"""A spot check that carries an earlier check's exact logits (``check_cells(carried=...)``; registry SCR, SCO).

Implementation under test: ``witcert.spot.check_cells`` with ``carried`` (the gate's re-checks of a repaired cell,
``witcert.spot.gate``) and the ``known`` / ``exact`` it returns. Oracles: the true TV of each synthetic cell (30
digits, ``tests/spot_cells.py``) and the binomial ceiling of a level-delta bound's failures. Domain: the adversarial
families of ``tests/spot_cells.py``, S = 400, carried sets drawn by an earlier check (random) or chosen against the
check (the tokens of largest logit error, a fixed set). Tolerances: failures within the binomial ceiling at 1e-4
(delta 0.2); a cell carried whole bounded by its true TV within 1e-8 (``Z_U`` and the bound each rounded up by
1e-9 relative).
"""
import pytest
import torch

from witcert.spot import TableLogits, check_cells, spot_randomness

from tests.spot_cells import binomial_ceiling, stacked_cells, true_tv

TRIALS = 120


def repeated(family: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    scores, c, eps = stacked_cells([family], 400, seed=seed)
    tv = true_tv(scores[0], eps[0])
    return scores.expand(TRIALS, -1), c.expand(TRIALS, -1), eps.expand(TRIALS, -1), tv


@pytest.mark.parametrize("family", ("vertex", "split", "heavy"))
def test_a_check_carrying_an_earlier_checks_reads_fails_within_delta(family):
    """The second check knows what the first read (fixed before its draws): its bound still fails at most as often
    as its delta allows, and it reads at most its own budget of new keys."""
    scores, c, eps, tv = repeated(family, 21)
    source = TableLogits(scores - eps)
    generator = spot_randomness(9).generator
    first = check_cells(scores, c, source, keys=48, delta=0.2, generator=generator, keep_reads=True)
    second = check_cells(scores, c, source, keys=48, delta=0.2, tau=0.01, generator=generator,
                         carried=(first.known, first.exact), keep_reads=True)
    assert int((second.bound < tv).sum()) <= binomial_ceiling(TRIALS, 0.2), family
    assert bool((second.keys_read <= 48).all())
    assert bool((second.known >= first.known).all())  # what was carried stays known
    known = second.known
    assert torch.allclose(second.exact[known], (scores - eps)[known], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", ("vertex", "heavy"))
def test_an_adversarially_chosen_carried_set_keeps_the_failure_rate(family):
    """A fixed carried set chosen against the check (the 24 tokens of largest ``|l - l~|``, the ones a sampler
    would most want to see): the statement holds for any known set fixed before the draws."""
    scores, c, eps, tv = repeated(family, 33)
    top = eps[0].abs().topk(24).indices
    known = torch.zeros_like(scores, dtype=torch.bool)
    known[:, top] = True
    exact = torch.where(known, scores - eps, 0.0)
    result = check_cells(scores, c, TableLogits(scores - eps), keys=32, delta=0.2, tau=0.01,
                         generator=spot_randomness(4).generator, carried=(known, exact))
    assert int((result.bound < tv).sum()) <= binomial_ceiling(TRIALS, 0.2), family


class _NoReads:
    """A source that fails any read: a check of cells carried whole must not call it."""

    def logits(self, cells, tokens):
        raise AssertionError("read a carried cell's exact logits")

    dense_logits = logits


def test_a_cell_carried_whole_is_bounded_by_its_true_tv_without_reads():
    """Every visible exact logit carried: the cell's true TV rounded up, read whole (delta 0, one round), with no read
    and whatever the budget or tau."""
    scores, c, eps = stacked_cells(["vertex", "split"], 400, seed=5)
    visible = torch.isfinite(scores)
    carried = (visible, torch.where(visible, scores - eps, 0.0))
    for tau in (None, 0.01):
        result = check_cells(scores, c, _NoReads(), keys=32, delta=1e-6, tau=tau, carried=carried)
        for i in range(2):
            tv = true_tv(scores[i], eps[i])
            assert tv <= float(result.bound[i]) <= tv + 1e-8  # rounded up by 8u per token, 1e-9 relative, 1e-12
        assert bool(result.whole.all()) and bool((result.delta == 0).all()) and bool((result.rounds == 1).all())
        assert int(result.keys_read.sum()) == 0 and result.known is None  # returned only with keep_reads


def test_carried_logits_are_checked_and_shapes_named():
    scores, c, eps = stacked_cells(["vertex"], 200, seed=6)
    source = TableLogits(scores - eps)
    known = torch.zeros_like(scores, dtype=torch.bool)
    known[0, :5] = True
    wrong = torch.where(known, scores - eps + 10 * c + 1, 0.0)  # outside every radius
    with pytest.raises(ValueError, match="radii"):
        check_cells(scores, c, source, keys=32, delta=1e-3, carried=(known, wrong))
    with pytest.raises(ValueError, match="carried"):
        check_cells(scores, c, source, keys=32, delta=1e-3, carried=(known[:, :10], wrong))

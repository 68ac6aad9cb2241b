"""Attack class ``spot-underflow``: tokens far below the row maximum in the compressed logits, large in the exact ones.

A scheme that reconstructs a token's key with a blown per-token scale (finite, right shape and dtype)
puts its compressed logit hundreds below the row maximum: its fp64 weight ``p~_t`` underflows to 0
while its exact weight can be most of the row (issue 40 item 1). Each trial is one cell:

* exact logits with a spread from 0.1 to 5 (sometimes one peaked token), compressed ones within a
  small error of them, radii ``c >= |eps|`` (at the error, or loose);
* one to three *blown* tokens: compressed logit 700..1100 below the compressed maximum (across the
  fp64 underflow edge at ~745), exact logit from 3 below to 3 above the exact maximum; in a quarter
  of the cells the other way, compressed logit 700..3000 *above* the others and exact logit among
  them (then ``Z = E_p~ W`` itself underflows);
* masked tokens in a fifth of the cells; ``S`` from 2 to 1000, key budgets from 8 to 256 (sampled and
  read-whole paths), ``delta = 1e-6``.

Checked per cell, each form of the spot check (``witcert.spot.spot_check``, ``spot_check_two_sided``, and the
batched ``witcert.spot.check_cells``, with adaptive rounds at a random ``tau``) against the true TV at 30 digits from the exact and
compressed logits. A violation at ``delta = 1e-6`` is a bug, not chance. :func:`probability_visibility`
is the known-false control: the rule before issue 40 (a token whose fp64 ``p~`` is 0 is not visible).
"""
import math

import mpmath
import torch

from witcert.spec import bounds as spec_bounds
from witcert.spot import check_cells, spot_check, spot_check_two_sided
from witcert.spot.randomness import spot_randomness
from witcert.verification.attacks import AttackTally

NAME = "spot-underflow"
SHARE = 0.0004  # a cell costs ~10-60 ms (three forms and a 30-digit TV): 200 cells at --trials 500000
DELTA = 1e-6


class _OneCell:
    """A one-cell reader as :func:`witcert.spot.check_cells`' source."""

    def __init__(self, read_exact):
        self.read_exact = read_exact

    def logits(self, cells, tokens):
        return self.read_exact(tokens)


def _batched(scores, c, read_exact, *, keys: int, delta: float, generator):
    """The batched check of one cell, reading in rounds up to ``keys`` with a threshold drawn from the generator."""
    tau = float(torch.rand(1, generator=generator)) * 0.5
    return check_cells(scores[None], c[None], _OneCell(read_exact), keys=keys, delta=delta, tau=tau,
                       generator=generator)


FORMS = {"one-sided": spot_check, "two-sided": spot_check_two_sided, "batched": _batched}
_SIZES = ((2, 1), (5, 2), (17, 2), (100, 3), (300, 2), (1000, 1))
_KEYS = (8, 16, 32, 64, 256)


def library(form, scores, c, read_exact, keys: int, generator) -> float:
    """The spot check as the library runs it."""
    return float(FORMS[form](scores, c, read_exact, keys=keys, delta=DELTA, generator=generator).bound)


def probability_visibility(form, scores, c, read_exact, keys: int, generator) -> float:
    """Known false: the rule before issue 40, a token whose fp64 ``p~`` rounds to 0 taken as masked."""
    hidden = torch.softmax(scores, dim=0) == 0
    return library(form, scores.masked_fill(hidden, -math.inf), c, read_exact, keys, generator)


def blown_cell(size: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scores, exact, c)`` fp64 of one cell with one to three blown tokens (``-inf`` on masked tokens)."""
    def uniform(low, high, n=1):
        return torch.empty(n, dtype=torch.float64).uniform_(low, high, generator=g)

    spread = math.exp(float(uniform(math.log(0.1), math.log(5.0))))
    exact = torch.randn(size, generator=g, dtype=torch.float64) * spread
    if bool(torch.rand(1, generator=g) < 0.3):
        exact[int(torch.randint(size, (1,), generator=g))] += float(uniform(3.0, 12.0))
    error = math.exp(float(uniform(math.log(1e-4), math.log(0.5))))
    scores = exact + (2 * torch.rand(size, generator=g, dtype=torch.float64) - 1) * error
    blown = torch.randperm(size, generator=g)[:int(torch.randint(1, min(3, size - 1) + 1, (1,), generator=g))]
    others = torch.ones(size, dtype=torch.bool)
    others[blown] = False
    if bool(torch.rand(1, generator=g) < 0.25):  # blown up: the compressed mass leaves every exact weight
        scores[blown] = scores[others].max() + uniform(700.0, 3000.0, blown.numel())
    else:
        scores[blown] = scores[others].max() - uniform(700.0, 1100.0, blown.numel())
        exact[blown] = exact[others].max() + uniform(-3.0, 3.0, blown.numel())
    eps = (scores - exact).abs()
    loose = torch.rand(size, generator=g, dtype=torch.float64) * float(uniform(0.0, 0.5))
    c = eps * (1 + 1e-6 + loose) + 1e-12 * (torch.rand(1, generator=g) < 0.5)
    if size > 4 and bool(torch.rand(1, generator=g) < 0.2):
        masked = (torch.rand(size, generator=g) < 0.3) & others
        scores, exact = scores.masked_fill(masked, -math.inf), exact.masked_fill(masked, -math.inf)
    return scores, exact, c


def true_tv(scores: torch.Tensor, exact: torch.Tensor) -> float:
    """``TV(softmax(exact), softmax(scores))`` at 30 digits (masked tokens carry no weight in either)."""
    with mpmath.workdps(30):
        p = spec_bounds.softmax([float(v) for v in exact])
        q = spec_bounds.softmax([float(v) for v in scores])
        return float(mpmath.fsum(abs(a - b) for a, b in zip(p, q)) / 2)


def run(n: int, g: torch.Generator, check=library) -> AttackTally:
    """``n`` cells, each checked in every form by ``check`` (default: the library)."""
    tally = AttackTally(NAME)
    sizes = torch.tensor([w for _, w in _SIZES], dtype=torch.float64)
    for _ in range(n):
        size = _SIZES[int(torch.multinomial(sizes, 1, generator=g))][0]
        keys = _KEYS[int(torch.randint(len(_KEYS), (1,), generator=g))]
        scores, exact, c = blown_cell(size, g)
        tv = true_tv(scores, exact)
        seed = int(torch.randint(2**31, (1,), generator=g))
        for form in FORMS:
            bound = check(form, scores, c, lambda index: exact[index], keys, spot_randomness(seed).generator)
            tally.add(torch.tensor([tv]), torch.tensor([bound]))
            if tv > bound and len(tally.notes) <= 5:
                tally.notes[-1] += f" ({form}, S={size}, keys={keys})"
    return tally

"""Attack class ``gate-tau``: certified gates at thresholds the repaired cells may not reach (issue 16, item 6).

Each trial is one :class:`witcert.Gate` call on one to three cells. Exact logits are fp64;
the compressed logits (errors in a box, ``c`` covering them) are fp32 or fp64, so a repaired
token keeps ``c`` = the cast's rounding (fp32 scores) or the pager's own fp64 dot-product error
(:class:`witcert.gate.repair.LayerPager`). The exact logits arrive through ``exact=``, a table pager, or the
production ``LayerPager`` over a :class:`witcert.gate.backing_store.BackingStore`. ``tau`` is 1e-9, 1e-300,
``2^-1074``, an fp32 neighbour of a random ``tau`` (where an fp32 comparison would round it),
or the fully repaired floor times ``1 +- 1e-6``; sometimes ``tau >= 1`` (risk-ranked).
Granularities, repair policies and block sizes 1..16 vary. Every call runs under
``TIME_LIMIT_S``. A cell is a violation when

* the call did not return in time (each of its cells);
* ``after`` is below the exact TV between attention over the exact logits and over the
  repaired ones (fp64, re-decided at 50 digits when close);
* ``reached`` with ``after > tau`` (decided exactly), or ``unreachable != fired & ~reached``;
* it stays above ``tau`` with an unpaged block that could still lower its value (the gate gave
  up early), or a block was paged twice in one call.
"""
import math
import signal
import threading
from contextlib import contextmanager

import torch
from mpmath import mp, mpf

from witcert.core import rounding
from witcert.verification.attacks import AttackTally
from witcert.gate.backing_store import BackingStore
from witcert.gate.blocks import log_block_excess
from witcert.verification.fuzz import _true_tv
from witcert.gate.policy import Gate, PageIn
from witcert.gate.repair import LayerPager, Repairer
from witcert.spec import bounds as spec

NAME = "gate-tau"
SHARE = 0.0008  # a gate call costs ~50-150 ms: 400 calls at --trials 500000
TIME_LIMIT_S = 60.0  # generous for a loaded machine: a terminating call takes well under a second
_SIZES = (1, 3, 8, 16, 33, 64)
_BLOCKS = (1, 4, 8, 16)
_HEAD_DIM = 8


@contextmanager
def time_limit(seconds: float):
    """Raise ``TimeoutError`` in the block after ``seconds`` (main thread only: signals reach no other)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"no return within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _TablePager:
    """Pager over known fp64 exact logits (cells, S): a block's slice, 0 bytes."""

    def __init__(self, exact: torch.Tensor, block_size: int):
        self.exact, self.block_size = exact, block_size

    def __call__(self, cell, block):
        lo = block * self.block_size
        return PageIn(logits=self.exact[cell][lo : lo + self.block_size].clone(), nbytes=0)


def _choice(options, g):
    return options[int(torch.randint(len(options), (1,), generator=g))]


def _uniform(low, high, g) -> float:
    return float(torch.empty(1, dtype=torch.float64).uniform_(low, high, generator=g))


def _covering(compressed: torch.Tensor, exact: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """``c >= max(radius, |compressed - exact|)`` in the compressed dtype (the fp64 difference rounds: one step up)."""
    gap = rounding.next_up((compressed.double() - exact).abs())
    c = torch.maximum(radius, gap)
    c = torch.where(torch.isneginf(exact), torch.zeros_like(c), c)
    return rounding.round_up_to(c, compressed.dtype)


def _box_inputs(g, n_cells, s, dtype):
    """Exact fp64 logits, compressed logits in ``dtype`` and covering radii; some tokens masked or exact."""
    exact = torch.randn(n_cells, s, generator=g, dtype=torch.float64) * _uniform(0.1, 6, g)
    radius = torch.rand(n_cells, s, generator=g, dtype=torch.float64) * 10 ** _uniform(-7, 0.5, g)
    radius = torch.where(torch.rand(n_cells, s, generator=g) < 0.2, torch.zeros_like(radius), radius)
    eps = radius * (2 * torch.rand(n_cells, s, generator=g, dtype=torch.float64) - 1)
    masked = (torch.rand(n_cells, s, generator=g) < 0.15) & (torch.arange(s) > 0)
    exact = exact.masked_fill(masked, -math.inf)
    compressed = (exact + eps).to(dtype)
    return exact, compressed, _covering(compressed, exact, radius)


def _store_inputs(g, n_cells, s, dtype, block_size):
    """fp16 exact keys in a backing store, fp16 compressed keys, fp32 queries: scores and a LayerPager."""
    k = torch.randn(n_cells, s, _HEAD_DIM, generator=g).half()
    k_hat = (k.float() + 10 ** _uniform(-4, -0.5, g) * torch.randn(n_cells, s, _HEAD_DIM, generator=g)).half()
    q = torch.randn(n_cells, _HEAD_DIM, generator=g) * _uniform(0.5, 4, g)
    scale = _HEAD_DIM**-0.5
    scores64 = torch.einsum("hsd,hd->hs", k_hat.double(), q.double()) * scale
    exact64 = torch.einsum("hsd,hd->hs", k.double(), q.double()) * scale
    # |scores - exact| <= scale sum |q||k^ - k| + fp64 rounding (1e-12 relative covers it with room)
    spread = scale * torch.einsum("hsd,hd->hs", (k_hat.double() - k.double()).abs(), q.double().abs())
    size = scale * torch.einsum("hsd,hd->hs", k_hat.double().abs() + k.double().abs(), q.double().abs())
    compressed = scores64.to(dtype)
    radius = spread * (1 + 1e-12) + size * 1e-12 + (compressed.double() - scores64).abs() * (1 + 1e-12)
    store = BackingStore(block_size=block_size)
    store.write("L", k)
    pager = LayerPager(Repairer(store), "L", q, scale)
    return exact64, compressed, rounding.round_up_to(radius, dtype), pager, (k, q, scale)


def _tau(g, floor: torch.Tensor | None) -> float:
    kind = int(torch.randint(7, (1,), generator=g))
    if kind == 0:  # the least positive threshold (Gate refuses tau = 0)
        return 2.0**-1074
    if kind == 1:
        return 1e-9
    if kind == 2:
        return _choice((1e-300, 2.0**-1074, 1e-12), g)
    if kind == 3:  # an fp32 comparison rounds these up
        return float(torch.tensor(_uniform(1e-6, 0.5, g), dtype=torch.float32).double()) * (1 - 2.0**-40)
    if kind == 4 and floor is not None and bool((floor > 0).any()):
        top = float(floor.max())
        return min(top * (1 + _choice((-1e-6, 1e-6, 0.0), g)), 0.999)
    if kind == 5:
        return _choice((1.0, 1.0 + 1e-9, 5.0), g)
    return 10 ** _uniform(-8, -0.5, g)


def _exact_tv(exact: torch.Tensor, used: torch.Tensor, exact_source) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 TV(softmax(exact), softmax(used)) per cell and its error scale.

    For a LayerPager the fp64 ``exact`` are dot products off by ~``d u sum |q||k|``; TV moves by
    at most half the largest logit change, so a ``1e-12`` relative share of the logits covers it.
    """
    eps = torch.where(torch.isneginf(exact), torch.zeros_like(exact), used.double() - exact)
    tv, scale = _true_tv(used.double(), eps)
    if exact_source is not None:
        scale = scale + 1e-12 * (1 + exact.abs().amax(-1))
    return tv, scale


def _golden_tv(cell: int, used: torch.Tensor, exact: torch.Tensor, exact_source) -> mpf:
    """50-digit TV for one cell, from the exact logits (the exact dot products for a LayerPager)."""
    with mp.workdps(60):
        if exact_source is None:
            a = [mpf(x) for x in exact[cell].tolist()]
        else:
            k, q, scale = exact_source
            qs = [mpf(x) for x in q[cell].tolist()]
            a = [mpf(scale) * mp.fsum(mpf(ki) * qi for ki, qi in zip(row, qs)) for row in k[cell].double().tolist()]
        b = used[cell].double().tolist()
        return spec.tv(spec.softmax(a), spec.softmax(b))


def _one_call(g, tally: AttackTally) -> None:
    n_cells, s = int(torch.randint(1, 4, (1,), generator=g)), _choice(_SIZES, g)
    block_size = _choice(_BLOCKS, g)
    dtype = _choice((torch.float32, torch.float32, torch.float64), g)
    source_kind = _choice(("exact", "table", "store"), g)
    exact_source = None
    if source_kind == "store":
        exact, scores, c, pager, exact_source = _store_inputs(g, n_cells, s, dtype, block_size)
        source = {"pager": pager}
    else:
        exact, scores, c = _box_inputs(g, n_cells, s, dtype)
        source = {"exact": exact} if source_kind == "exact" else {"pager": _TablePager(exact, block_size)}
    floor = None
    if int(torch.randint(4, (1,), generator=g)) == 0 and source_kind != "store":  # near the repaired floor
        floor = Gate(2.0**-1074, block_size=block_size, repair="whole")(scores, c, **source).after
    tau = _tau(g, floor)
    gate = Gate(tau, granularity=_choice(("head", "request"), g), repair=_choice(("blocks", "whole"), g),
                block_size=block_size)
    try:
        with time_limit(TIME_LIMIT_S):
            result = gate(scores, c, **source)
    except TimeoutError as timeout:
        tally.cells += n_cells
        tally.violations += n_cells
        if len(tally.notes) < 5:
            tally.notes.append(f"tau={tau!r} S={s} block={block_size} {dtype} {source_kind}: {timeout}")
        return
    _check(result, gate, exact, exact_source, tally, f"tau={tau!r} S={s} block={block_size} {dtype} {source_kind}")


def _check(result, gate: Gate, exact, exact_source, tally: AttackTally, label: str) -> None:
    n_cells = result.after.numel()
    after = result.after.double().reshape(-1)
    tv, scale = _exact_tv(exact, result.scores, exact_source)
    tv = tv.reshape(-1)
    bad = torch.zeros(n_cells, dtype=torch.bool)
    reasons = [""] * n_cells
    near = tv + scale.reshape(-1) > after * (1 - 1e-9)
    for i in near.nonzero().flatten().tolist():
        exact_tv = _golden_tv(i, result.scores, exact, exact_source)
        if exact_tv > mpf(float(after[i])):
            bad[i], reasons[i] = True, f"after {float(after[i]):.6g} < exact TV {float(exact_tv):.6g}"
        tally.worst_ratio = _worst(tally.worst_ratio, exact_tv, after[i])
    within = torch.tensor([a <= gate.tau for a in after.tolist()])
    reached, fired = result.reached.reshape(-1), result.fired.reshape(-1)
    unreachable = getattr(result, "unreachable", torch.zeros_like(fired)).reshape(-1)  # a gate must say so
    for i in range(n_cells):
        if bool(reached[i]) != bool(within[i]):
            bad[i], reasons[i] = True, f"reached={bool(reached[i])} but after {float(after[i])!r} vs tau {gate.tau!r}"
        if bool(unreachable[i]) != bool(fired[i] & ~within[i]):
            bad[i], reasons[i] = True, "unreachable flag disagrees with fired and after > tau"
    pages = list(result.pages)
    if len(pages) != len(set(pages)):
        bad[:] = True
        reasons = [r or "a block paged twice in one call" for r in reasons]
    flat_scores, flat_c = result.scores.reshape(n_cells, -1), result.c.reshape(n_cells, -1)
    left = log_block_excess(flat_scores, flat_c, gate.block_size) > -math.inf  # (cells, blocks)
    left &= ~result.paged.reshape(n_cells, -1)
    gave_up = (fired & ~within).reshape(-1) & left.any(-1)
    for i in gave_up.nonzero().flatten().tolist():
        bad[i], reasons[i] = True, "stopped above tau with an unpaged block left to repair"
    tally.cells += n_cells
    tally.violations += int(bad.sum())
    for i in bad.nonzero().flatten().tolist()[: max(0, 5 - len(tally.notes))]:
        tally.notes.append(f"{label} cell {i}: {reasons[i]}")


def _worst(current: float, exact: mpf, bound: torch.Tensor) -> float:
    if float(bound) <= 0:
        return current
    ratio = float(exact / mpf(float(bound)))
    return ratio if math.isnan(current) else max(current, ratio)


def run(n: int, g: torch.Generator) -> AttackTally:
    """``n`` gate calls (one to three cells each), each under ``TIME_LIMIT_S``."""
    tally = AttackTally(NAME)
    for _ in range(n):
        _one_call(g, tally)
    return tally

"""The spot check inside the monitor: every cell whose meter exceeds ``tau``, one batched check per layer-step.

``witcert.monitor(..., certificate="spot", spot_keys=m, spot_delta=delta)`` builds a
:class:`SpotSettings`; the ``"witcert"`` attention calls :meth:`SpotSettings.apply` on each
call's fp64 cells, which checks every cell above ``tau`` at once (:func:`witcert.spot.check_cells`:
adaptive rounds of 32, 128, 512, ... up to ``spot_keys`` exact keys, stopping at a bound ``<= tau``; the checked
cells over one key history, the query heads over a kv head, read it whole where it holds at most ``spot_keys``
tokens per checked cell, :mod:`witcert.spot.groups`: their true TVs rounded up, no failure probability). The
reported meter becomes ``min(meter before the check, spot bound)``, and the output bound and the joint
pass are recomputed from it. Extra columns:

- ``meter_before_spot``: the meter the check started from. Deterministic under Tier A and inside
  ``generate``; under Tier B's probabilistic branch (``mon.non_adaptive()`` on the dithered cache) it
  is Tier B's meter, valid with probability ``1 - delta_loc`` (the check itself relies on deterministic
  radii, so its bound does not);
- ``spot_bound`` (NaN where no check ran), ``spot_keys`` (distinct exact keys the cell read; in a key group read whole,
  its share of the group's reads: :mod:`witcert.spot.groups`),
  ``spot_rounds``, ``spot_bytes`` (bytes the checks read, each key row or verified block charged to the
  first cell of the call that needed it, so the column sums to the traffic), ``spot_delta`` (the failure
  probability the cell's checks spent: at most its ``delta``; 0 where the meter is deterministic and where
  a check read the cell whole, which makes its bound the true TV).

``spot_delta`` is a float (each checked cell's failure probability) or a request budget, a callable
``(step, cells) -> delta`` of the request's metered decode step and the cells that step may check
(:class:`witcert.spot.budget.RequestBudget`). With a gate, half of each cell's ``delta`` goes to this
check and half to the gate's re-checks (:mod:`witcert.spot.gate`), so the cell's statements together
fail with probability at most ``delta``.

Exact keys come from the exact cache the store keeps (validation, ``keep_exact=True``) or, in
production (``keep_exact=False``), from the content-checked host backing store the monitor keeps
for the request (:class:`~witcert.spot.gather.BackedKeys`): only the keys of the tokens read are read, by
token index, each row verified against the checksum of the bytes written.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from witcert.core import values
from witcert.spot.batched import check_cells
from witcert.spot.gather import BackedKeys, KeyGather
from witcert.spot.randomness import SpotRandomness, spot_randomness
from witcert.spot.rounds import DEFAULT_SPLIT, SPLITS

CERTIFICATES = ("deterministic", "spot")
SPOT_BLOCK_SIZE = 16
"""Tokens per backing-store block when the spot check alone keeps the store (a gate's block size otherwise)."""
GATE_SHARE = 0.5
"""Share of a cell's ``delta`` left to the gate's re-checks when a gate repairs after the check."""

__all__ = ["BackedKeys", "CERTIFICATES", "GATE_SHARE", "SPOT_BLOCK_SIZE", "SpotSettings", "spot_settings"]


@dataclass
class SpotSettings:
    """Key budget, failure probability and threshold of the monitor's spot checks."""

    keys: int = 256
    delta: float | Callable[[int, int], float] = 1e-6  # per checked cell, or a request budget (step, cells) -> delta
    tau: float = 0.2  # cells with a meter above tau are checked; a check stops at a bound <= tau
    seed: int | None = None  # replay opt-in; None: the OS's cryptographic source
    adaptive: bool = True  # read in rounds of 32, 128, 512, ... keys (witcert.spot.rounds); False: all keys at once
    split: str = DEFAULT_SPLIT  # how a cell's delta divides over its rounds
    gated: bool = False  # a gate repairs after the check: the check spends 1 - GATE_SHARE of each cell's delta
    randomness: SpotRandomness = field(init=False)

    def __post_init__(self):
        if not isinstance(self.keys, int) or isinstance(self.keys, bool) or self.keys < 1:
            raise ValueError(f"spot_keys must be a positive int, got {self.keys!r}")
        if not callable(self.delta) and not (isinstance(self.delta, (int, float)) and 0 < self.delta < 1):
            raise ValueError(f"spot_delta must lie in (0, 1) or be a request budget (step, cells) -> delta, "
                             f"got {self.delta!r}")
        if self.split not in SPLITS:
            raise ValueError(f"spot split must be one of {SPLITS}, got {self.split!r}")
        self.randomness = spot_randomness(self.seed)

    def cell_delta(self, step: int | None, cells: int) -> float:
        """Each cell's failure probability at the request's metered ``step`` (``cells`` it may check)."""
        if not callable(self.delta):
            return float(self.delta)
        value = self.delta(max(1, step or 1), cells)
        if not (isinstance(value, (int, float)) and 0 < value < 1):
            raise ValueError(f"spot_delta: the request budget returned {value!r} for step {step}, not a probability "
                             "in (0, 1)")
        return float(value)

    def pending(self, tau_k: float, tau_v: float, step: int | None):
        """The :class:`~witcert.spot.deferred.PendingChecks` of one forward call (no gate: checked at its end)."""
        from witcert.spot.deferred import PendingChecks

        return PendingChecks(self, tau_k, tau_v, step)

    def check_share(self) -> float:
        """The share of a cell's ``delta`` this check spends (the rest is the gate's)."""
        return 1 - GATE_SHARE if self.gated else 1.0

    def apply(self, math, query, exact_keys, scale: float, tau_k: float, tau_v: float, radii=None,
              step: int | None = None, layers: int = 1, keep_reads: bool = False):
        """``(math with the spot meter, extra columns)`` for one call (see the module docstring).

        ``math`` a :class:`~witcert.integrations.hf.cells.CallMath`; ``query`` (B, Hq, Tq, d) post-RoPE;
        ``exact_keys`` (B, Hkv, S, d) the exact cache or a :class:`BackedKeys`; ``radii`` (B, Hq, Tq, S) the
        per-token radii the check relies on (default ``math.c``; the monitor passes radii that hold for every
        query, so the check's ``delta`` is its whole failure probability); ``step`` the request's metered
        decode step and ``layers`` the model's, for a request budget. ``keep_reads``: also return the checked
        cells' exact reads ``(at (M, 3), known (M, S), exact (M, S))`` (:class:`~witcert.spot.batched.CellChecks`),
        which the gate's re-checks of those cells carry (:func:`witcert.spot.gate.spot_gated`).
        """
        before = math.cells["meter"]
        checked = (before > self.tau) & ~math.blank  # (B, Hq, Tq)
        shape = before.shape
        bound = torch.full(shape, torch.nan, dtype=torch.float64)
        columns = {name: torch.zeros(shape, dtype=torch.float64) for name in ("spot_keys", "spot_bytes",
                                                                             "spot_rounds", "spot_delta")}
        at = checked.cpu().nonzero()  # (M, 3): row, query head, query
        reads = (at, None, None)
        if at.numel():
            delta = self.cell_delta(step, layers * shape[1] * shape[2]) * self.check_share()
            scores, source = self.cells(math, query, exact_keys, scale, at)
            radii = (math.c if radii is None else radii).detach()[checked].cpu()
            result = check_cells(scores, radii, source, keys=self.keys, delta=delta,
                                 tau=self.tau if self.adaptive else None, generator=self.randomness.generator,
                                 split=self.split, keep_reads=keep_reads, read_groups=True)
            reads = (at, result.known, result.exact)
            where = tuple(at.T)
            bound[where] = result.bound
            for name, value in (("spot_keys", result.keys_read), ("spot_bytes", source.bytes_read),
                                ("spot_rounds", result.rounds), ("spot_delta", result.delta)):
                columns[name][where] = value.to(torch.float64)
        bound = bound.to(before.device)
        meter = torch.where(torch.isnan(bound), before, torch.minimum(before, bound.to(before.dtype)))
        passes = values.joint_pass(meter, math.value_term, math.v_norm_max, tau_k, tau_v)
        cells = dict(math.cells, meter=meter, joint=passes.joint,
                     output_bound=values.output_bound(meter, math.value_term, math.v_norm_max))
        extra = {"meter_before_spot": torch.where(math.blank.cpu(), torch.nan, before.cpu().to(torch.float64)),
                 "spot_bound": bound.cpu(), **columns}
        return (replace(math, cells=cells), extra, reads) if keep_reads else (replace(math, cells=cells), extra)

    @staticmethod
    def cells(math, query, exact_keys, scale: float, at: torch.Tensor, rows=None):
        """``(scores (M, S), source)``: the compressed logits of the cells ``at`` (M, 3) (``rows``: other logits of
        those cells to check, e.g. partly repaired ones) and a :class:`~witcert.spot.gather.KeyGather` of their
        exact logits."""
        b, h, t = at.T
        kv_heads = exact_keys.kv_heads if isinstance(exact_keys, BackedKeys) else exact_keys.shape[1]
        group = query.shape[1] // kv_heads
        rows = (math.scores_hat.detach()[b, h, t] if rows is None else rows).cpu()
        bias = None
        if math.bias is not None:
            full = math.bias.expand(*math.scores_hat.shape)
            bias = full[b, h, t]
        source = KeyGather(query.detach()[b, h, t], b, h // group, exact_keys, scale, bias)
        return rows, source


def spot_settings(certificate: str, keys: int, delta, tau: float, seed: int | None = None,
                  gated: bool = False) -> SpotSettings | None:
    """The monitor's spot settings (``None`` for the deterministic certificate), checked."""
    if certificate not in CERTIFICATES:
        raise ValueError(f"certificate must be one of {CERTIFICATES}, got {certificate!r}")
    if certificate == "deterministic":
        return None
    return SpotSettings(keys=keys, delta=delta, tau=tau, seed=seed, gated=gated)

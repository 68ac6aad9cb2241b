"""The spot-certified gate: repair a cell only until its spot bound (or its meter) is ``<= tau`` (registry SCO, SCD).

The deterministic certified gate (:class:`witcert.Gate`) pages blocks in Lemma 4 order (``L4``:
largest ``X_j = sum_{t in j} p~_t (e^{c_t} - 1)`` first) until the meter recomputed on the
repaired logits is ``<= tau``; on caches where the witness saturates that is most of the context.
The spot-certified gate pages in the same order, and decides with the spot check as well:

- a cell whose spot bound (:class:`~witcert.spot.cells.SpotSettings`, before repair) is ``<= tau``
  is not repaired;
- otherwise the prefixes of 1, 2, 4, ... blocks shorter than the deterministic gate's are checked
  on the repaired logits (paged tokens exact, radius 0), the ``i``-th at
  ``delta_i = delta 6 / (pi^2 i^2)`` (:func:`witcert.spot.delta_at_step`,
  ``WitCert.sum_step_allocation_le``); the repair stops at the first prefix whose bound is
  ``<= tau``, else where the deterministic gate stops (it never pages more).

A repaired cell's ``meter_after`` is the minimum of its recomputed meter and the accepted spot
bound; its statement holds with probability at least ``1 - spot_delta``, reported per cell as
``delta`` plus the ``delta_i`` of the checks it ran (at most ``2 delta``). Validation mode only
(the exact cache in memory): with ``keep_exact=False`` the gate decides on the meter alone.
"""
from __future__ import annotations

import torch

from witcert.gate.blocks import log_block_excess
from witcert.spot.budget import delta_at_step
from witcert.spot.one_sided import spot_check


def prefix_lengths(limit: int) -> list[int]:
    """Block counts checked before the deterministic gate's ``limit``: 1, 2, 4, ... (< limit)."""
    lengths, n = [], 1
    while n < limit:
        lengths.append(n)
        n *= 2
    return lengths


def spot_gated(math, gate, spot, readers, radii, spot_bound, exact_scores):
    """``(fired, scores after, repaired tokens, meter after, added delta, checks, keys read)`` of one call.

    ``math`` the call's :class:`~witcert.integrations.hf.cells.CallMath` (its meter the reported
    one); ``spot`` its :class:`~witcert.spot.cells.SpotSettings`; ``readers`` the
    :class:`~witcert.spot.cells.ExactReaders`; ``radii`` the radii the spot check relies on;
    ``spot_bound`` (B, Hq, Tq) the bound before repair (NaN where unchecked); ``exact_scores`` the
    fp64 exact logits (B, Hq, Tq, S).
    """
    result = gate(math.scores_hat, math.c, exact=exact_scores)  # the deterministic gate's pages and meter after
    scores_after = math.scores_hat.to(result.scores.dtype).clone()  # fired cells are written below
    repaired = torch.zeros_like(math.scores_hat, dtype=torch.bool)
    meter_after = math.cells["meter"].clone()
    extra_delta = torch.zeros(meter_after.shape, dtype=torch.float64)
    checks = torch.zeros(meter_after.shape, dtype=torch.float64)
    keys_read = torch.zeros(meter_after.shape, dtype=torch.float64)
    n_tokens, size = math.scores_hat.shape[-1], gate.block_size
    fired = result.fired & ~(spot_bound.to(result.fired.device) <= gate.tau)  # spot-certified cells need nothing
    for b, h, t in fired.nonzero().tolist():
        scores, c, exact = math.scores_hat[b, h, t], math.c[b, h, t], exact_scores[b, h, t]
        visible = ~torch.isneginf(scores)
        order = log_block_excess(scores[None], c[None], size)[0].sort(descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
        token_rank = rank.repeat_interleave(size)[:n_tokens]  # page order of each token's block
        final, after = int(result.paged[b, h, t].sum()), float(result.after[b, h, t])
        read: set[int] = set()  # distinct exact keys the repair checks read (a key read twice is in memory)
        for i, blocks in enumerate(prefix_lengths(final), start=1):
            page = token_rank < blocks
            cand = torch.where(page & visible, exact, scores)
            cand_radii = torch.where(page, torch.zeros_like(c), radii[b, h, t].to(c.dtype))
            delta_i = delta_at_step(spot.delta, i, 1)
            check = spot_check(cand, cand_radii, readers.cell(b, h, t), keys=spot.keys, delta=delta_i,
                               generator=spot.randomness.generator)
            extra_delta[b, h, t] += delta_i
            checks[b, h, t] += 1
            read |= set(torch.cat([check.exact, check.pilot, check.draws]).tolist())
            if check.bound <= gate.tau:
                meter_cand = float(gate.value(cand[None], torch.where(page, torch.zeros_like(c), c)[None])[0])
                final, after = blocks, min(check.bound, meter_cand)
                break
        page = (token_rank < final) & visible
        scores_after[b, h, t] = torch.where(page, exact, scores)
        repaired[b, h, t] = page
        meter_after[b, h, t] = after
        keys_read[b, h, t] = len(read)
    return fired, scores_after, repaired, meter_after, extra_delta, checks, keys_read

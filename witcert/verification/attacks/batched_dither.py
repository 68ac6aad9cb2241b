"""Attack class: batched requests through the dithered cache of ``witcert.integrations.hf.attention``.

A batch of 2-5 sequences runs through the tiny random Llama of
:mod:`witcert.verification.attacks.model_dtypes` on the dithered INT8 cache (Tier B, adaptive or not), with
per-row request ids (random distinct ids, or the default row numbering) and a seed drawn from
the fuzz generator. Several rows repeat row 0's tokens, so their exact keys are identical. Three
checks per trial:

* **per-row streams**: two rows with identical exact keys must not get identical reconstructions
  (fp32 models, where two different dither values cannot round to the same key); one dither
  stream for the whole batch (issue 16) makes them equal everywhere, so their quantization
  errors are fully correlated. One cell per (row pair, layer, kv head, token);
* **batch order** (a third of the trials): the same batch with its rows permuted, each row
  keeping its request id and the seed, must read every token back from the same stream: the
  reconstruction of each token whose exact key is unchanged is bitwise the permuted original.
  One cell per (row, layer, kv head, token);
* **per-row bounds**: every cell's meter against the fp64 TV over the exact keys
  (:func:`witcert.verification.attacks.model_dtypes.oracle_tv`).
"""
from __future__ import annotations

import torch

from witcert.verification.attacks import AttackTally
from witcert.verification.attacks.model_dtypes import (HEAD_DIM, VOCAB, oracle_tv, recorded_run, spiky_llama,
                                          tiny_llama)

NAME = "batched dither (HF, per-row streams)"
SHARE = 0.0001  # one trial: a batch of 2-5 rows prefilled and probed on a tiny model (~0.3 s on one core)


def _count(tally: AttackTally, cells: int, bad: int, note: str) -> None:
    tally.cells += cells
    tally.violations += bad
    if bad and len(tally.notes) < 5:
        tally.notes.append(note)


def _batch(g: torch.Generator) -> tuple[torch.Tensor, int]:
    """(B, T) ids with B in 2..5; each row after the first repeats row 0 with probability 1/2."""
    rows = int(torch.randint(2, 6, (), generator=g))
    prefill, probe = int(torch.randint(2, 25, (), generator=g)), int(torch.randint(1, 4, (), generator=g))
    ids = torch.randint(0, VOCAB, (rows, prefill + probe), generator=g)
    copies = torch.rand(rows, 1, generator=g) < 0.5
    copies[0] = False
    return torch.where(copies, ids[:1], ids), prefill


def _final_keys(session) -> dict[int, torch.Tensor]:
    return {index: layer.k_hat for index, layer in session.layers.items()}


def _same_rows_differ(tally, calls, ids) -> None:
    """Rows with identical exact keys must not share their reconstruction (fp32)."""
    for call in calls:
        for a in range(ids.shape[0]):
            for b in range(a + 1, ids.shape[0]):
                same_key = (call.key[a] == call.key[b]).all(-1)  # (Hkv, S)
                same_hat = (call.k_hat[a] == call.k_hat[b]).all(-1)
                bad = int((same_key & same_hat).sum())
                _count(tally, int(same_key.sum()), bad, f"rows {a} and {b} share {bad} reconstructed key vectors")


def _order_is_kept(tally, model, make_session, ids, prefill, requests, reference, exact) -> None:
    """Permuted rows, permuted ids: every unchanged exact key reads back the same reconstruction."""
    order = torch.randperm(ids.shape[0])
    session = make_session(tuple(requests[i] for i in order.tolist()))
    calls = recorded_run(model, session, ids[order], prefill)
    moved_exact = {call.layer: call.key for call in calls}
    for layer, k_hat in _final_keys(session).items():
        if layer not in moved_exact or layer not in exact:
            continue
        kept = (moved_exact[layer] == exact[layer][order]).all(-1)  # (B, Hkv, S)
        bad = int((kept & ~(k_hat == reference[layer][order]).all(-1)).sum())
        _count(tally, int(kept.sum()), bad, f"layer {layer}: {bad} tokens changed stream under a batch reorder")


def run(n: int, g: torch.Generator) -> AttackTally:
    from witcert.tier_a.bands import BandLayout
    from witcert.integrations.hf.attention import DITHERED, Session

    tally = AttackTally(NAME)
    layout = BandLayout(head_dim=HEAD_DIM, bands=8, rope="rotate_half")
    for _ in range(n):
        dtype = (torch.float32, torch.float16, torch.bfloat16)[int(torch.multinomial(torch.tensor([0.6, 0.2, 0.2]), 1,
                                                                                      generator=g))]
        model = tiny_llama(dtype) if torch.rand((), generator=g) < 0.5 else spiky_llama(dtype, 15, 10.0, 20.0)
        ids, prefill = _batch(g)
        requests = tuple(torch.randperm(1 << 16, generator=g)[: ids.shape[0]].tolist())
        seed = int(torch.randint(0, 2**62, (), generator=g))
        adaptive = bool(torch.rand((), generator=g) < 0.5)

        def make_session(rows):
            return Session(DITHERED, layout, tier="B", seed=seed, requests=rows)

        session = make_session(requests if torch.rand((), generator=g) < 0.5 else None)
        calls = recorded_run(model, session, ids, prefill, adaptive_probe=adaptive)
        for call in calls:
            tally.add(oracle_tv(call), call.meter)
        if dtype == torch.float32:
            _same_rows_differ(tally, calls, ids)
        if torch.rand((), generator=g) < 1 / 3:
            rows = session.requests or tuple(range(ids.shape[0]))
            exact = {call.layer: call.key for call in calls}
            _order_is_kept(tally, model, make_session, ids, prefill, rows, _final_keys(session), exact)
    return tally

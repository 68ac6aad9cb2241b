"""Attack class: batched requests through the dithered cache of ``witcert.monitor``.

A batch of 2-5 sequences runs through the tiny random Llama of
:mod:`witcert.verification.attacks.model_dtypes` on the dithered INT8 cache (Tier B, adaptive or not), one
request id per row, and a seed drawn from the fuzz generator. Several rows repeat row 0's tokens,
so their exact keys are identical. Three checks per trial:

* **per-row streams**: two rows with identical exact keys must not get identical reconstructions
  (fp32 models, where two different dither values cannot round to the same key); one dither
  stream for the whole batch (issue 16) makes them equal everywhere, so their quantization
  errors are fully correlated. One cell per (row pair, layer, kv head, token);
* **batch order** (a third of the trials): the layer stores of the recorded exact keys, written
  again with the rows permuted and each row keeping its request id (random distinct ids) and
  the seed, must read every token back from the same stream: bitwise the permuted original.
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


def _same_rows_differ(tally, calls, ids) -> None:
    """Rows with identical exact keys must not share their reconstruction (fp32)."""
    for call in calls:
        for a in range(ids.shape[0]):
            for b in range(a + 1, ids.shape[0]):
                same_key = (call.key[a] == call.key[b]).all(-1)  # (Hkv, S)
                same_hat = (call.k_hat[a] == call.k_hat[b]).all(-1)
                bad = int((same_key & same_hat).sum())
                _count(tally, int(same_key.sum()), bad, f"rows {a} and {b} share {bad} reconstructed key vectors")


def _dithered_keys(keys: torch.Tensor, layer: int, seed: int, requests) -> torch.Tensor:
    """The keys a dithered layer store reads back for exact ``keys`` (B, Hkv, S, d), rows keyed by ``requests``."""
    from witcert.integrations.hf.codecs import Dither
    from witcert.integrations.hf.compressed_cache import CompressedLayer
    from witcert.tier_a.bands import BandLayout
    from witcert.tier_b.quantizer import DitheredInt8

    codec = Dither(DitheredInt8(rope="rotate_half"), layer=layer, seed=seed, requests=requests)
    store = CompressedLayer(codec, BandLayout(HEAD_DIM, 8), keep_exact=False)
    store.append(keys, keys)
    return store.read()[0]


def _order_is_kept(tally, calls, seed: int, g: torch.Generator) -> None:
    """Permuted rows with their request ids: every token reads back the same reconstruction."""
    for call in calls:
        rows = call.key.shape[0]
        requests = tuple(torch.randperm(1 << 16, generator=g)[:rows].tolist())
        order = torch.randperm(rows, generator=g)
        reference = _dithered_keys(call.key, call.layer, seed, requests)
        moved = _dithered_keys(call.key[order], call.layer, seed, tuple(requests[i] for i in order.tolist()))
        bad = int((~(moved == reference[order]).all(-1)).sum())
        _count(tally, moved.shape[0] * moved.shape[1] * moved.shape[2], bad,
               f"layer {call.layer}: {bad} tokens changed stream under a batch reorder")


def run(n: int, g: torch.Generator) -> AttackTally:
    from witcert.integrations.hf.monitoring import DITHERED, Monitor

    tally = AttackTally(NAME)
    for _ in range(n):
        dtype = (torch.float32, torch.float16, torch.bfloat16)[int(torch.multinomial(torch.tensor([0.6, 0.2, 0.2]), 1,
                                                                                      generator=g))]
        model = tiny_llama(dtype) if torch.rand((), generator=g) < 0.5 else spiky_llama(dtype, 15, 10.0, 20.0)
        ids, prefill = _batch(g)
        seed = int(torch.randint(0, 2**62, (), generator=g))
        adaptive = bool(torch.rand((), generator=g) < 0.5)
        monitor = Monitor(model, DITHERED, tier="B", bands=8, seed=seed)
        calls = recorded_run(model, monitor, ids, prefill, adaptive_probe=adaptive)
        for call in calls:
            tally.add(oracle_tv(call), call.meter)
        if dtype == torch.float32:
            _same_rows_differ(tally, calls, ids)
        if torch.rand((), generator=g) < 1 / 3:
            _order_is_kept(tally, calls, seed, g)
    return tally

"""What the meter keeps of tokens just written to vLLM's cache: keys as read back, witnesses, key norms (L1, T2, SR).

The keys are read back from the cache at the written slots (:meth:`.layout.CacheLayout.keys_at_slots`, by
index) and decoded (:func:`.layout.decode_kept`); the meter reads them in fp32 (:mod:`.decode_pass`), so the
value it keeps is ``fl32`` of the stored value: exact for every ``auto`` cache (the model dtype is fp32, bf16 or
fp16) and for fp8 codes at a power-of-two scale, one rounding otherwise. The witness
is formed against the kept value, so it bounds exactly the residual the meter's logits see; a key that is not
finite (exact or stored) keeps 0 and the witness ``inf`` (the trivial bound).
"""
import functools
from dataclasses import dataclass

import torch

from witcert.fastpath.compiled import pick
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness import residual_witness

from .decode_pass import norms_up


@dataclass(frozen=True)
class Written:
    """Per written token and kv head: ``keys`` (N, Hkv, d) fp32, ``witness`` (N, Hkv, B) fp16 (rounded up),
    ``key_norms`` (N, Hkv) fp64 (``>= ||key||``)."""

    keys: torch.Tensor
    witness: torch.Tensor
    key_norms: torch.Tensor


def written(exact: torch.Tensor, kept: torch.Tensor, layout: BandLayout, compiled: bool | None = None) -> Written:
    """:class:`Written` of exact keys ``exact`` (N, Hkv, d) (the model's post-RoPE keys) and the values the cache
    holds for them as the meter keeps them, ``kept`` (N, Hkv, d) fp32 (:func:`.layout.decode_kept`); the lossy
    case as one compiled graph (``compiled``, default ``WITCERT_COMPILE``)."""
    if torch.equal(exact.to(kept.dtype), kept) and bool(torch.isfinite(kept).all()):
        witness = torch.zeros(*kept.shape[:-1], layout.bands, dtype=torch.float16)  # stored exactly: residual 0
        return Written(keys=kept, witness=witness, key_norms=key_norms_of(kept))
    return Written(*pick(lossy_written, functools.partial(_probe, layout), compiled)(exact, kept, layout))


def lossy_written(exact: torch.Tensor, kept: torch.Tensor, layout: BandLayout) -> tuple:
    """``(keys, witness, key_norms)`` of :class:`Written` for keys stored with a loss: a (token, head) whose exact or
    kept key is not finite keeps 0 and the witness ``inf`` (the trivial bound)."""
    finite = (torch.isfinite(kept).all(-1) & torch.isfinite(exact).all(-1)).unsqueeze(-1)  # (N, Hkv, 1)
    keys = torch.where(finite, kept, 0.0)
    witness = residual_witness(torch.where(finite, exact, 0.0), keys, layout)
    witness = torch.where(finite, witness, torch.full_like(witness, float("inf")))
    return keys, witness, key_norms_of(keys)


def _probe(layout: BandLayout) -> tuple:
    """Arguments that compile :func:`lossy_written` (two tokens, two kv heads)."""
    return torch.ones(2, 2, layout.head_dim), torch.full((2, 2, layout.head_dim), 2.0), layout


def from_cache(kept: torch.Tensor, witness: torch.Tensor) -> Written:
    """:class:`Written` of tokens already in the cache: ``kept`` (N, Hkv, d) fp32 (:func:`.layout.decode_kept`) and
    the witnesses recorded when they were written (N, Hkv, B) fp16 (formed against the same kept keys)."""
    keys, _ = kept_keys(kept)
    return Written(keys=keys, witness=witness, key_norms=key_norms_of(keys))


def kept_keys(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kept`` with every non-finite (token, head) set to 0, and which (token, head) were finite."""
    finite = torch.isfinite(kept).all(-1)
    if not bool(finite.all()):
        kept = torch.where(finite.unsqueeze(-1), kept, 0.0)
    return kept, finite


def key_norms_of(keys: torch.Tensor) -> torch.Tensor:
    """fp64 ``>= ||key||`` of each (token, head) of fp32 ``keys`` (N, Hkv, d)."""
    return norms_up(keys)

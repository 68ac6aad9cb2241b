"""What the meter keeps of tokens just written to vLLM's cache: keys as read back, witnesses, key norms (L1, T2, SR).

The keys are read back from the cache at the written slots (:meth:`.layout.CacheLayout.keys_at_slots`, by
index) and decoded exactly in fp64 (:func:`.layout.decode`); the meter reads them in fp32
(:mod:`.decode_pass`), so the value it keeps is ``fl32`` of that: exact for every ``auto`` cache (the model
dtype is fp32, bf16 or fp16) and for fp8 codes at a power-of-two scale, one rounding otherwise. The witness
is formed against the kept value, so it bounds exactly the residual the meter's logits see; a key that is not
finite (exact or stored) keeps 0 and the witness ``inf`` (the trivial bound).
"""
from dataclasses import dataclass

import torch

from witcert.fastpath.budgeted_pass import fp32_up
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness import residual_witness

from .decode_pass import norms_up


@dataclass(frozen=True)
class Written:
    """Per written token and kv head: ``keys`` (N, Hkv, d) fp32, ``witness`` (N, Hkv, B) fp16 (rounded up),
    ``key_norms`` (N, Hkv) fp32 (``>= ||key||``)."""

    keys: torch.Tensor
    witness: torch.Tensor
    key_norms: torch.Tensor


def written(exact: torch.Tensor, stored: torch.Tensor, layout: BandLayout) -> Written:
    """:class:`Written` of exact keys ``exact`` (N, Hkv, d) (the model's post-RoPE keys) and the values the cache
    holds for them, ``stored`` (N, Hkv, d) fp64 (decoded exactly)."""
    keys, finite = kept_keys(stored)
    finite &= torch.isfinite(exact).all(-1)
    all_finite = bool(finite.all())
    if all_finite and torch.equal(exact.to(keys.dtype), keys):  # stored exactly: the residual is 0
        witness = torch.zeros(*keys.shape[:-1], layout.bands, dtype=torch.float16)
    else:
        witness = residual_witness(torch.where(finite.unsqueeze(-1), exact, 0.0), keys, layout)
        if not all_finite:
            witness = torch.where(finite.unsqueeze(-1), witness, torch.full_like(witness, float("inf")))
    return Written(keys=keys, witness=witness, key_norms=key_norms_of(keys))


def from_cache(stored: torch.Tensor, witness: torch.Tensor) -> Written:
    """:class:`Written` of tokens already in the cache: ``stored`` (N, Hkv, d) fp64 (decoded exactly) and the
    witnesses recorded when they were written (N, Hkv, B) fp16 (formed against the same kept keys)."""
    keys, _ = kept_keys(stored)
    return Written(keys=keys, witness=witness, key_norms=key_norms_of(keys))


def kept_keys(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 keys the meter keeps of ``stored`` (fp64) and whether each (token, head) is finite (else 0)."""
    keys = stored.float()
    finite = torch.isfinite(keys).all(-1)
    if not bool(finite.all()):
        keys = torch.where(finite.unsqueeze(-1), keys, 0.0)
    return keys, finite


def key_norms_of(keys: torch.Tensor) -> torch.Tensor:
    """fp32 ``>= ||key||`` of each (token, head) of fp32 ``keys`` (N, Hkv, d)."""
    return fp32_up(norms_up(keys))

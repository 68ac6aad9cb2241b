"""Attack class: schemes that mutate or alias their input (in-place ops, views, the input itself).

A common memory-saving idiom quantizes in place (``x.div_(s).round_().mul_(s); return x``). If
the scheme saw the caller's tensor it would overwrite the exact keys: the witness would be 0
and the meter certify a distribution it never compared with. Each trial draws keys, values and
queries (fp16, bf16, fp32, fp64; GQA) and one mutating scheme, and runs it through
:func:`witcert.observe`, :func:`witcert.schemes.registry.apply_scheme` and the HF path's
:class:`witcert.integrations.hf.compressed_cache.CompressedLayer`. Violations:

* any change of the caller's exact keys or values (bitwise), or a reconstruction that shares
  memory with them;
* any reported meter below the exact TV against the *original* keys (fp64, near misses
  re-decided by the 50-digit golden).
"""
import math

import torch

from witcert.verification.attacks import AttackTally
from witcert.verification.attacks.rope_frame import count_meter, one_thread
from witcert.tier_a.bands import BandLayout
from witcert.integrations.hf.codecs import Reconstruction
from witcert.integrations.hf.compressed_cache import CompressedLayer
from witcert.tier_a.observation import observe
from witcert.schemes.registry import apply_scheme, shares_memory

NAME = "mutating scheme"
SHARE = 0.005
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BATCH, GROUPS, TOKENS, QUERIES, HEAD_DIM = 16, 2, 24, 3, 32  # a batch of trials = one layer, one kv head each
LAYOUT = BandLayout(HEAD_DIM, 4)


def _inplace_rtn(x, role="key"):
    """RTN INT2 in place, per token: the idiom of the issue."""
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-3)
    return x.div_(s).round_().mul_(s)


def _inplace_then_view(x):
    """Halve in place and return a view of the input."""
    x.mul_(0.5)
    return x.view(x.shape)


def _round_out(x):
    """``torch.round(x, out=x)`` with a coarse step, returned through a slicing view."""
    torch.round(x.mul_(4), out=x).div_(4)
    return x[..., :, :]


def _zero_input_fresh_output(x):
    """Returns a fresh reconstruction and zeroes its input."""
    x_hat = (x * 8).round() / 8
    x.zero_()
    return x_hat


def _identity_alias(x):
    """Returns its input itself (no copy): aliases the exact tensor."""
    return x


def _values_only(x, role="key"):
    """Mutates values only (role-dependent), keys exact."""
    if role == "value":
        x.mul_(-1.0)
    return x


SCHEMES = (_inplace_rtn, _inplace_then_view, _round_out, _zero_input_fresh_output, _identity_alias, _values_only)


def run(n: int, g: torch.Generator) -> AttackTally:
    """``n`` trials (one kv head each: GQA 2, 24 tokens, 3 queries), batched as the heads of one layer."""
    tally = AttackTally(NAME)
    done = 0
    with one_thread():
        while done < n:
            hkv = min(BATCH, n - done)
            dtype = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=g))]
            scheme = SCHEMES[int(torch.randint(len(SCHEMES), (1,), generator=g))]
            _layer(hkv, dtype, scheme, g, tally)
            done += hkv
    return tally


def _layer(hkv: int, dtype, scheme, g, tally: AttackTally) -> None:
    q = torch.randn(hkv * GROUPS, QUERIES, HEAD_DIM, generator=g, dtype=torch.float64) * 4
    k = (torch.randn(hkv, TOKENS, HEAD_DIM, generator=g, dtype=torch.float64) * 2).to(dtype)
    v = torch.randn(hkv, TOKENS, HEAD_DIM, generator=g, dtype=torch.float64).to(dtype)
    k0, v0 = k.clone(), v.clone()

    obs = observe(q.to(dtype), k, v, scheme, LAYOUT)
    _count_unchanged(tally, (k, k0), (v, v0))
    k_hat = apply_scheme(scheme, k, role="key")  # deterministic: the reconstruction observe used
    _count_unchanged(tally, (k, k0))
    tally.add(float(shares_memory(k_hat, k)), 0.0)

    qg = q.to(dtype).double().reshape(hkv, GROUPS, QUERIES, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    scores = (qg @ k_hat.double()[:, None].transpose(-1, -2)) * scale  # as observe forms them
    k_rep = k0.double()[:, None].expand(hkv, GROUPS, TOKENS, HEAD_DIM)
    count_meter(
        tally, obs.meter.reshape(-1, QUERIES), scores.reshape(-1, QUERIES, TOKENS),
        qg.reshape(-1, QUERIES, HEAD_DIM), k_rep.reshape(-1, TOKENS, HEAD_DIM), scale,
    )

    cache_k, cache_v = k[None].clone(), v[None].clone()  # (1, Hkv, S, d): a model's exact cache
    layer = CompressedLayer(Reconstruction(scheme), LAYOUT)
    layer.append(cache_k, cache_v)
    shadow_k, shadow_v = layer.exact()
    _count_unchanged(tally, (cache_k, k0[None]), (cache_v, v0[None]), (shadow_k, k0[None]), (shadow_v, v0[None]))
    read_k, read_v = layer.read()
    aliased = shares_memory(read_k, cache_k) or shares_memory(read_v, cache_v)
    tally.add(float(aliased), 0.0)


def _count_unchanged(tally: AttackTally, *pairs) -> None:
    """One cell per (tensor, its saved copy): a violation when they differ in any bit."""
    for now, before in pairs:
        same = now.shape == before.shape and bool(torch.equal(now, before))
        if not same and len(tally.notes) < 5:
            tally.notes.append(f"exact tensor changed by the scheme (max diff {_max_diff(now, before):.3g})")
        tally.add(0.0 if same else 1.0, 0.0)


def _max_diff(a, b) -> float:
    diff = (a.double() - b.double()).abs()
    return float(diff.max()) if diff.numel() else math.nan

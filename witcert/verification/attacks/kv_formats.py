"""Attack class: the KV formats serving engines ship (:mod:`witcert.schemes.engine_formats`), end to end through
the Tier A path, and the kernels that quantize the query (``QR``).

Each batch is one layer (GQA 2, 32 channels in 4 bands) in fp16, bf16 or fp32 with one format: vLLM's
per-token-head INT8/FP8/INT4 (with its Hadamard rotation), NVFP4 (with a per-tensor scale), TurboQuant, or
SGLang's FP4 E2M1 blocks. Keys are Gaussian, carry a massive channel, sit at the edge of a block's scale
(several channels at the block maximum, the rest at E2M1 ties) or are tiny (subnormal in fp16); queries are
random, large, or aligned with one token's residual. With probability one half the kernel reads a quantized
query: vLLM's static FP8 E4M3 query at a scale that leaves it inside or saturates it, or the query rounded to
bf16. The witness and meter come from :func:`witcert.tier_a.observation.stored_keys` and ``observe_stored``
(the fused pass or the full meter, ``q_read=`` for the read query). Per cell, the exact TV between
``softmax(sm q . k)`` (the exact query and keys) and ``softmax`` of the logits the meter certified (the read
query against the format's reconstruction) must not exceed the meter; near misses are re-decided at 50 digits
(:func:`~witcert.verification.attacks.rope_frame.count_meter`). A format that cannot hold a tensor (TurboQuant
beyond fp16's range) raises a ``ValueError``: counted as rejected, never metered.
"""
import torch

from witcert.schemes.engine_formats import FORMATS
from witcert.schemes.fp4_blocks import Nvfp4
from witcert.schemes.registry import apply_scheme
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.observation import observe_stored, stored_keys
from witcert.tier_a.query_radius import CallableQuery, Fp8Query
from witcert.verification.attacks import AttackTally
from witcert.verification.attacks.rope_frame import count_meter, one_thread

NAME = "engine KV formats"
SHARE = 0.0004  # a layer of 8 kv heads costs ~0.1 s: 200 layers at --trials 500000
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCHEMES = (*FORMATS.values(), Nvfp4(k_scale=0.05), Nvfp4(k_scale=4.0))
QUERIES = (None, Fp8Query(), Fp8Query(scale=0.02), Fp8Query(scale=3.0), CallableQuery(lambda q: q.bfloat16()))
BATCH, GROUPS, TOKENS, STEPS, HEAD_DIM = 8, 2, 24, 3, 32
LAYOUT = BandLayout(HEAD_DIM, 4)
SCALE = HEAD_DIM**-0.5


def _pick(options, g):
    return options[int(torch.randint(len(options), (1,), generator=g))]


def _keys(family: str, hkv: int, dtype, g) -> torch.Tensor:
    k = torch.randn(hkv, TOKENS, HEAD_DIM, generator=g, dtype=torch.float64)
    if family == "massive":
        k[..., int(torch.randint(HEAD_DIM, (1,), generator=g))] *= 300.0 if dtype == torch.float16 else 3e3
    elif family == "block edge":  # a block's maximum on several channels, the rest on E2M1 midpoints of it
        k = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], dtype=torch.float64).repeat(4)
        k = (k * torch.where(torch.rand(hkv, TOKENS, HEAD_DIM, generator=g) < 0.5, -1.0, 1.0)).to(torch.float64)
    elif family == "tiny":
        k = k * 1e-6
    return (k * torch.exp(torch.empty(hkv, TOKENS, 1, dtype=torch.float64).uniform_(-3, 3, generator=g))).to(dtype)


def _queries(kind: str, k: torch.Tensor, k_hat: torch.Tensor, g) -> torch.Tensor:
    hkv = k.shape[0]
    q = torch.randn(hkv, GROUPS, STEPS, HEAD_DIM, generator=g, dtype=torch.float64)
    if kind == "large":
        q = q * 40.0
    elif kind == "aligned":  # along one token's residual, scaled to a logit of tens
        t = int(torch.randint(TOKENS, (1,), generator=g))
        r = (k_hat.double() - k.double())[:, t]
        q = q * 0.1 + 30.0 * (r / r.norm(dim=-1, keepdim=True).clamp(min=1e-30))[:, None, None]
    return q.reshape(hkv * GROUPS, STEPS, HEAD_DIM)


def _layer(g: torch.Generator, tally: AttackTally) -> None:
    dtype, scheme = _pick(DTYPES, g), _pick(SCHEMES, g)
    k = _keys(_pick(("gaussian", "massive", "block edge", "tiny"), g), BATCH, dtype, g)
    v = torch.randn(BATCH, TOKENS, HEAD_DIM, generator=g).to(dtype)
    try:
        k_hat, v_hat = apply_scheme(scheme, k, role="key"), apply_scheme(scheme, v, role="value")
    except ValueError:  # the format cannot hold these keys (and says so): refused, never metered
        tally.rejected += BATCH * GROUPS * STEPS
        return
    q = _queries(_pick(("random", "large", "aligned"), g), k, k_hat, g).to(dtype)
    query = _pick(QUERIES, g) if bool(torch.rand(1, generator=g) < 0.5) else None
    q_read = None if query is None else query.read(q)
    obs = observe_stored(q, stored_keys(k, k_hat, v, v_hat, LAYOUT), LAYOUT, SCALE, fused=bool(torch.rand(1, generator=g) < 0.5),
                         q_read=q_read)
    k_rep = k.double().repeat_interleave(GROUPS, 0)  # (Hq, S, d): query head h reads kv head h // G
    count_meter(tally, obs.meter, obs.scores, q.double(), k_rep, SCALE)


def run(n: int, g: torch.Generator) -> AttackTally:
    """``n`` layers of :data:`BATCH` kv heads (see the module docstring)."""
    tally = AttackTally(NAME)
    with one_thread():
        for _ in range(n):
            _layer(g, tally)
    return tally

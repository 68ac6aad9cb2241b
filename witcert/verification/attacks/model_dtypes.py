"""Attack class: fp16, bf16 and fp32 models end to end through ``witcert.monitor`` (the ``"witcert"`` attention).

A tiny random Llama (``LlamaConfig``: hidden 128, 2 layers, 4 query heads over 2 kv heads, head
dim 32) is cast to each dtype and run with the ``"witcert"`` attention on a compressed cache:
the dithered INT8 cache under Tier B (non-adaptive: ``min(u + beta, Delta) + rho``; adaptive:
the deterministic branch ``Delta + rho``, registry "DB") or a Tier A scheme. Four fifths of
the models are *spiky*: a low-frequency RoPE channel of every kv head carries a massive key and
the queries concentrate on it, the case where ``Delta_t`` is nearly tight and the cast of a
dequantized key to the model's dtype decides soundness (issue 16: with bf16 keys an element's
error reaches 1.9x the ``s/2`` an fp32-only bound assumed; on the code before the fix this class
finds violations within a few dozen bf16 trials, mostly where attention splits its mass over a
few copies of one token).

Oracle, per cell (layer, query head, query): the TV between softmax over the exact keys (the
keys the model wrote into its cache, what an uncompressed model attends over) and softmax over
the keys the compressed attention actually read, both in fp64 with a causal mask built here,
from the query the attention received. The library's own ``true_tv`` is not used. The bound is
the cell's reported meter.
"""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass

import torch

from witcert.verification.attacks import AttackTally

NAME = "model dtypes (HF, fp32/fp16/bf16)"
SHARE = 0.0001  # one trial: 4 rows prefilled and probed on a tiny model (~0.3 s on one core)

TIER_A_SCHEMES = ("rtn-int4", "kivi-2bit", "fp8-e4m3", "kvquant-4bit")
VOCAB = 96
HEAD_DIM = 32
RECORDER = "witcert-attack-recorder"


@functools.lru_cache(maxsize=None)
def tiny_llama(dtype: torch.dtype):
    """A tiny random Llama in ``dtype``: hidden 128, 2 layers, 4 query heads over 2 kv heads, head dim 32."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(1234)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().to(dtype)


def spiky_llama(dtype: torch.dtype, channel: int, query_gain: float, key_gain: float):
    """A copy of :func:`tiny_llama` whose keys carry a massive ``channel`` and whose queries
    concentrate on it (every other query row scaled by 1/50): the model computes them itself."""
    model = copy.deepcopy(tiny_llama(dtype))
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.k_proj.weight.view(-1, HEAD_DIM, attn.k_proj.weight.shape[-1])[:, channel] *= key_gain
            rows = attn.q_proj.weight.view(-1, HEAD_DIM, attn.q_proj.weight.shape[-1])
            rows *= 0.02
            rows[:, channel] *= query_gain / 0.02
    return model


@dataclass(frozen=True)
class Call:
    """One measured attention call: its inputs, the keys attention read, and the reported meters."""

    layer: int
    query: torch.Tensor  # (B, Hq, Tq, d) post-RoPE, as attention received it
    key: torch.Tensor  # (B, Hkv, S, d) the exact keys the model wrote
    k_hat: torch.Tensor  # (B, Hkv, S, d) the keys the compressed attention read
    scale: float
    meter: torch.Tensor  # (B, Hq, Tq) reported


_RECORDING: list = []  # [(monitor, calls)] while a recorded run is active


def _recording_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from witcert.integrations.hf import attention

    monitor, calls = _RECORDING[-1]
    before = len(monitor.batches)
    out = attention.witcert_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                              dropout=dropout, **kwargs)
    if len(monitor.batches) > before:  # a measured (non-prefill) call: key is what attention read
        scale = module.scaling if scaling is None else scaling
        exact = attention._ACTIVE[-1].layer(module.layer_idx).store.exact()[0]
        calls.append(Call(module.layer_idx, query.detach().clone(), exact.clone(), key.detach().clone(),
                          float(scale), monitor.batches[-1].meter))
    return out


def recorded_run(model, monitor, ids: torch.Tensor, prefill: int, adaptive_probe: bool = False) -> list[Call]:
    """Prefill ``ids[:, :prefill]`` then feed the rest as one probe chunk under ``monitor`` (a
    :class:`witcert.integrations.hf.monitoring.Monitor` keeping the exact cache); returns the measured
    calls. The probe is declared non-adaptive unless ``adaptive_probe`` (Tier B's deterministic branch)."""
    import contextlib

    from transformers import AttentionInterface, DynamicCache
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(RECORDER, _recording_forward)
    AttentionMaskInterface.register(RECORDER, sdpa_mask)
    calls: list[Call] = []
    _RECORDING.append((monitor, calls))
    try:
        with torch.no_grad(), monitor:
            model.set_attn_implementation(RECORDER)  # the monitor restores the model's own on exit
            cache = DynamicCache(config=model.config)
            with monitor.non_adaptive():
                model(ids[:, :prefill], past_key_values=cache, use_cache=True)
            with contextlib.nullcontext() if adaptive_probe else monitor.non_adaptive():
                model(ids[:, prefill:], past_key_values=cache, use_cache=True)
    finally:
        _RECORDING.pop()
    return calls


def oracle_tv(call: Call, additive: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 TV (B, Hq, Tq) between attention over the exact keys and over the keys read, causal; ``additive``
    (B|1, Hq|1, Tq, S), a float mask the model added to its scores: entries at or below half its dtype's
    minimum hide a key, the others are added to both logits."""
    q = call.query.to(torch.float64)
    groups = q.shape[1] // call.key.shape[1]
    k = call.key.to(torch.float64).repeat_interleave(groups, dim=1)
    k_hat = call.k_hat.to(torch.float64).repeat_interleave(groups, dim=1)
    tq, s = q.shape[-2], k.shape[-2]
    visible = torch.arange(s)[None, :] <= torch.arange(s - tq, s)[:, None]  # (Tq, S)
    bias = torch.zeros(())
    if additive is not None:
        shown = additive > torch.finfo(additive.dtype).min / 2
        visible, bias = visible & shown, torch.where(shown, additive.to(torch.float64), 0.0)
    p = torch.softmax((call.scale * q @ k.transpose(-1, -2) + bias).masked_fill(~visible, -torch.inf), dim=-1)
    p_hat = torch.softmax((call.scale * q @ k_hat.transpose(-1, -2) + bias).masked_fill(~visible, -torch.inf), dim=-1)
    return 0.5 * (p - p_hat).abs().sum(-1)


def _pick(options, g):
    return options[int(torch.randint(len(options), (1,), generator=g))]


def _loguniform(low: float, high: float, g: torch.Generator) -> float:
    return math.exp(torch.empty(()).uniform_(math.log(low), math.log(high), generator=g).item())


def _inputs(g: torch.Generator, rows: int = 4) -> tuple[torch.Tensor, int]:
    """Token ids (rows, T) and the prefill length. Most trials are short (2-4 tokens) and most of
    their rows repeat one token: near-equal attention mass on a few tokens, where per-token errors
    beyond ``c_t`` show in the TV; the others run 8-40 random tokens."""
    if torch.rand((), generator=g) < 0.7:
        prefill, probe = int(torch.randint(1, 4, (), generator=g)), int(torch.randint(1, 3, (), generator=g))
    else:
        prefill, probe = int(torch.randint(8, 41, (), generator=g)), int(torch.randint(1, 5, (), generator=g))
    ids = torch.randint(0, VOCAB, (rows, prefill + probe), generator=g)
    repeated = torch.rand(rows, 1, generator=g) < 0.75
    return torch.where(repeated, ids[:, :1], ids), prefill


def _weighted(options: dict, g: torch.Generator):
    keys = list(options)
    return keys[int(torch.multinomial(torch.tensor(list(options.values())), 1, generator=g))]


def run(n: int, g: torch.Generator) -> AttackTally:
    from witcert.integrations.hf.monitoring import DITHERED, Monitor

    tally = AttackTally(NAME)
    for _ in range(n):
        dtype = _weighted({torch.float32: 0.2, torch.float16: 0.3, torch.bfloat16: 0.5}, g)
        if torch.rand((), generator=g) < 0.8:  # a low-frequency RoPE channel barely rotates across positions
            channel = _pick((13, 14, 15, 29, 30, 31), g)
            model = spiky_llama(dtype, channel, _loguniform(1, 100, g), _loguniform(1, 100, g))
        else:
            model = tiny_llama(dtype)
        ids, prefill = _inputs(g)
        cache = _weighted({"B": 0.4, "B-adaptive": 0.4, "A": 0.2}, g)
        if cache == "A":
            monitor = Monitor(model, _pick(TIER_A_SCHEMES, g), bands=8)
        else:  # the seed is drawn independently of the queries (a fixed one only to replay the fuzz)
            monitor = Monitor(model, DITHERED, tier="B", bands=8, seed=int(torch.randint(0, 2**62, (), generator=g)))
        for call in recorded_run(model, monitor, ids, prefill, adaptive_probe=cache == "B-adaptive"):
            tally.add(oracle_tv(call), call.meter)
    return tally

"""Real post-RoPE queries, keys and values of SmolLM2 per layer (teacher forcing), for sections 3-4.

A forward pre-hook on every attention module recomputes ``q, k, v`` from the hidden state with
the module's own projections and the model's ``apply_rotary_pos_emb`` (rotate_half): exactly the
tensors HF's eager attention forms. One forward pass per domain prompt; the last ``n_queries``
positions are the measured queries (causal mask), the whole prompt is the cache.
"""
from dataclasses import dataclass

import torch

DOMAINS = ("needle", "text", "code")


@dataclass(frozen=True)
class Capture:
    """One domain's tensors: ``q`` (L, Hq, Tq, d), ``k``/``v`` (L, Hkv, S, d) fp32, ``mask`` (Tq, S)."""

    domain: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor

    def __post_init__(self):
        if self.q.dim() != 4 or self.k.shape != self.v.shape or self.mask.shape != (self.q.shape[2], self.k.shape[2]):
            raise ValueError("inconsistent capture shapes")

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]


def prompt_ids(tokenizer, domain: str, n_tokens: int) -> torch.Tensor:
    """Token ids (1, ~n_tokens) of the domain's prompt: a passkey haystack, prose or stdlib code."""
    from witcert.observatory.workloads import needle_cases, text_cases

    if domain == "needle":
        text = needle_cases(tokenizer, n_tokens, depths=(0.5,), keys=(4,))[0].prompt
    elif domain in ("text", "code"):
        case = text_cases(tokenizer, domain, n_tokens, 16)[0]
        text = case.context + case.continuation
    else:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    return tokenizer(text, return_tensors="pt").input_ids[:, :n_tokens]


def capture(loaded, domain: str, n_tokens: int, n_queries: int) -> Capture:
    """Run the model once on the domain prompt and keep every layer's post-RoPE q, k, v."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = loaded.model
    ids = prompt_ids(loaded.tokenizer, domain, n_tokens)
    seen = []

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        d, cfg = module.head_dim, module.config
        q = module.q_proj(hidden).view(1, -1, cfg.num_attention_heads, d).transpose(1, 2)
        k = module.k_proj(hidden).view(1, -1, cfg.num_key_value_heads, d).transpose(1, 2)
        v = module.v_proj(hidden).view(1, -1, cfg.num_key_value_heads, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        seen.append((q[0, :, -n_queries:].detach(), k[0].detach(), v[0].detach()))

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    q, k, v = (torch.stack([t[i] for t in seen]).float() for i in range(3))
    s = ids.shape[1]
    positions = torch.arange(s - n_queries, s)
    mask = torch.arange(s).view(1, -1) <= positions.view(-1, 1)  # causal (Tq, S)
    return Capture(domain, q, k, v, mask)


def load():
    """The default model (eager attention, so the hook sees the plain Llama path)."""
    from witcert.integrations.hf.default_model import load_model

    return load_model(attn_implementation="eager")

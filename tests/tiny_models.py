"""Tiny random transformers decoders for the HF-integration tests (no download, built from a config).

``tiny(family)`` builds a 2-layer model of the named family with 4 query heads over 2 kv heads
(GQA), head dim 32 unless overridden, in eval mode. Families: Llama, Qwen2, Mistral (``rotate_half``
RoPE pairs) and Cohere, GLM, Helium (interleaved pairs).
"""
import functools

import torch

ROTATE_HALF = ("llama", "qwen2", "mistral")
INTERLEAVED = ("cohere", "glm", "helium")
VOCAB = 128


@functools.lru_cache(maxsize=None)
def _cached(family: str, items: tuple):
    import transformers

    configs = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig, "cohere": transformers.CohereConfig,
               "glm": transformers.GlmConfig, "helium": transformers.HeliumConfig}
    fields = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    fields.update(dict(items))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[family](**fields), attn_implementation="sdpa").eval()


def tiny(family: str = "llama", **overrides):
    """A tiny random decoder of ``family`` (cached per configuration; do not mutate it)."""
    return _cached(family, tuple(sorted(overrides.items())))


def prompts(rows: int = 2, length: int = 10, pad: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded token ids (rows, length) and their attention mask: row ``i > 0`` has ``pad`` pads."""
    ids = torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1:, :pad] = 0
    ids[1:, :pad] = 0
    return ids, mask

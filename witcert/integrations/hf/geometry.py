"""The attention geometry of a transformers model: layers, query and kv heads, head dim, RoPE pairs.

Everything comes from the model itself: the counts from its config (``num_hidden_layers``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``), the RoPE pair convention from
the ``rotate_half`` function of the attention module's own modeling file, probed on a vector:

- ``rotate_half`` convention (Llama, Qwen2, Mistral, Gemma, Phi3, ...): ``rotate_half(x) =
  cat(-x[d/2:], x[:d/2])``, pair ``j`` is ``(j, j + d/2)``;
- interleaved pairs (Cohere, Cohere2, GLM, GLM4, Helium, Ernie 4.5, ...): ``rotate_half(x) =
  stack(-x[1::2], x[0::2]).flatten()``, pair ``j`` is ``(2j, 2j + 1)``.

Bands (Theorem 2): the largest divisor of ``d/2`` not above 16, so any even head dim works
(64 -> 16, 80 -> 10, 112 -> 14, 128 -> 16).

Why the convention is not a soundness question here: the monitor forms every witness on the
keys attention reads (post-RoPE), and Cauchy-Schwarz per band holds for any partition of the
coordinates. The convention keeps bands made of whole RoPE pairs, so that a witness stays
position-invariant (Lemma 1, ``L1``) and the layout means what it says.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from witcert.tier_a.bands import ROPE_CONVENTIONS, BandLayout

MAX_BANDS = 16


@dataclass(frozen=True)
class AttentionGeometry:
    """Layer and head counts of a decoder and its RoPE pair convention."""

    layers: int
    query_heads: int
    kv_heads: int
    head_dim: int
    rope: str

    def __post_init__(self):
        for name in ("layers", "query_heads", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.query_heads % self.kv_heads:
            raise ValueError(f"query_heads={self.query_heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE pairs), got {self.head_dim}")
        if self.rope not in ROPE_CONVENTIONS:
            raise ValueError(f"rope must be one of {ROPE_CONVENTIONS}, got {self.rope!r}")

    def layout(self, bands: int | None = None) -> BandLayout:
        """The :class:`BandLayout` of a head (``bands=None``: :func:`auto_bands`)."""
        return BandLayout(self.head_dim, auto_bands(self.head_dim) if bands is None else bands, self.rope)


def auto_bands(head_dim: int) -> int:
    """The largest divisor of ``head_dim / 2`` not above 16 (every band holds whole RoPE pairs)."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
    pairs = head_dim // 2
    return max(b for b in range(1, min(MAX_BANDS, pairs) + 1) if pairs % b == 0)


def geometry_of(model, rope: str | None = None) -> AttentionGeometry:
    """The :class:`AttentionGeometry` of a transformers decoder (``rope=None``: probed, see the module doc)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"model must be a transformers PreTrainedModel (it has no .config), got {type(model).__name__}")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        raise ValueError(f"model config {type(config).__name__} has no num_attention_heads: not a decoder WitCert knows")
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return AttentionGeometry(layers=text.num_hidden_layers, query_heads=heads, kv_heads=kv_heads,
                             head_dim=head_dim, rope=rope if rope is not None else rope_convention(model))


def layout_for(model, bands: int | None = None, rope: str | None = None) -> BandLayout:
    """The :class:`BandLayout` of ``model``'s attention heads (config head dim, probed RoPE convention)."""
    return geometry_of(model, rope).layout(bands)


def attention_modules(model) -> list:
    """The model's attention modules (those with a ``layer_idx`` and a ``q_proj`` or ``qkv_proj``), in order."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "layer_idx", None), int) and (hasattr(m, "q_proj") or hasattr(m, "qkv_proj"))]


ROPE_CONFIG_FIELDS = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_dim", "rotary_pct",
                      "partial_rotary_factor")


def has_rope(model) -> bool:
    """Whether ``model`` rotates its keys: a RoPE field in its (text) config, or a module named ``*rotary*``."""
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if any(getattr(text, name, None) is not None for name in ROPE_CONFIG_FIELDS):
        return True
    return any("rotary" in name for name, _ in model.named_modules())


def rope_convention(model) -> str:
    """``"rotate_half"`` or ``"interleaved"``: what the attention module's ``rotate_half`` does to a probe."""
    if not has_rope(model):
        # Without RoPE there is no pair convention to probe; Tier A's band bound holds for any
        # grouping of channels into bands, so either value is sound (the monitor witnesses the keys
        # attention reads).
        raise ValueError(f"{type(model).__name__} has no rotary position embedding (RoPE): its config sets no "
                         f"rope parameters ({', '.join(ROPE_CONFIG_FIELDS[:3])}, ...) and it has no rotary module, "
                         "so there is no RoPE pair convention to probe; its keys are read as written and any "
                         "band grouping is sound: pass rope='rotate_half' to monitor it")
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention module with a layer_idx; pass rope= explicitly")
    rotate = getattr(sys.modules.get(type(modules[0]).__module__), "rotate_half", None)
    if not callable(rotate):
        raise ValueError(f"{type(modules[0]).__module__} defines no rotate_half: cannot tell its RoPE pair "
                         "convention; pass rope='rotate_half' or rope='interleaved' explicitly")
    probe = torch.arange(1.0, 9.0)
    got = rotate(probe)
    half = torch.cat([-probe[4:], probe[:4]])
    interleaved = torch.stack([-probe[1::2], probe[0::2]], dim=-1).flatten()
    if torch.equal(got, half):
        return "rotate_half"
    if torch.equal(got, interleaved):
        return "interleaved"
    raise ValueError(f"{type(modules[0]).__module__}.rotate_half is neither convention WitCert knows "
                     f"(probe {probe.tolist()} -> {got.tolist()}); pass rope= explicitly")

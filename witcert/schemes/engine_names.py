"""The engines' own names for KV formats (``--kv-cache-dtype`` spellings) and what WitCert says of each.

A leaf: :mod:`witcert.schemes.registry` asks it why a name is unknown, and
:mod:`witcert.schemes.engine_formats` registers the formats these names point to.
"""

# engine --kv-cache-dtype name -> (the WitCert scheme that reproduces it or None, engine, remark)
ENGINE_NAMES: dict[str, tuple[str | None, str, str]] = {
    "int8_per_token_head": ("int8-per-token-head", "vLLM", ""),
    "fp8_per_token_head": ("fp8-per-token-head", "vLLM", ""),
    "int4_per_token_head": ("int4-per-token-head", "vLLM", ""),
    "nvfp4": ("nvfp4", "vLLM", "per-tensor scale 1.0; a calibrated one: witcert.schemes.fp4_blocks.Nvfp4(k_scale=...)"),
    "fp4_e2m1": ("mxfp4", "SGLang", ""),
    "turboquant_4bit_nc": ("turboquant-4bit-nc", "vLLM", ""),
    "turboquant_k3v4_nc": ("turboquant-k3v4-nc", "vLLM", ""),
    "turboquant_3bit_nc": ("turboquant-3bit-nc", "vLLM", ""),
    "fp8": ("fp8-e4m3", "vLLM", "per-tensor scale 1.0, a raw E4M3 cast; a calibrated scale: fp8-e4m3-scaled"),
    "fp8_e4m3": ("fp8-e4m3", "vLLM", "per-tensor scale 1.0, a raw E4M3 cast"),
    "fp8_e5m2": ("fp8-e5m2", "vLLM", ""),
    "turboquant_k8v4": (None, "vLLM", "its FP8-key TurboQuant preset (raw E4M3 keys, 4-bit TurboQuant values) has no "
                                      "WitCert format, and is refused rather than metered as another"),
}


def engine_name_note(name) -> str | None:
    """What to say about an engine's ``--kv-cache-dtype`` spelling used as a scheme name (``None``: not one)."""
    if not isinstance(name, str) or name not in ENGINE_NAMES:
        return None
    scheme, engine, remark = ENGINE_NAMES[name]
    if scheme is None:
        return f"{engine}'s {name!r} is refused: {remark}"
    return f"{name!r} is {engine}'s name for WitCert's {scheme!r}" + (f" ({remark})" if remark else "")

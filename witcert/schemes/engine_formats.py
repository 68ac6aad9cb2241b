"""The KV formats serving engines ship, registered as schemes, and the engines' own names for them.

=========================  ==========================================  ===========================================
WitCert scheme             engine name                                 class
=========================  ==========================================  ===========================================
``int8-per-token-head``    vLLM ``--kv-cache-dtype int8_per_token_head``  :class:`~witcert.schemes.per_token_head.Int8PerTokenHead`
``fp8-per-token-head``     vLLM ``fp8_per_token_head``                 :class:`~witcert.schemes.per_token_head.Fp8PerTokenHead`
``int4-per-token-head``    vLLM ``int4_per_token_head``                :class:`~witcert.schemes.per_token_head.Int4PerTokenHead`
``nvfp4``                  vLLM ``nvfp4`` (uncalibrated scale 1.0)     :class:`~witcert.schemes.fp4_blocks.Nvfp4`
``mxfp4``                  SGLang ``--kv-cache-dtype fp4_e2m1``        :class:`~witcert.schemes.fp4_blocks.Mxfp4Block16`
``turboquant-4bit-nc``     vLLM ``turboquant_4bit_nc``                 :class:`~witcert.schemes.turboquant.TurboQuant`
``turboquant-k3v4-nc``     vLLM ``turboquant_k3v4_nc``                 ``TurboQuant(key_bits=3)``
``turboquant-3bit-nc``     vLLM ``turboquant_3bit_nc``                 ``TurboQuant(3, 3)``
=========================  ==========================================  ===========================================

Each is a :class:`~witcert.schemes.kv_format.KVFormat`: the registered scheme and the codec that stores the
engine's packed codes are one object (:func:`format_of` finds it). An engine name WitCert has no format for is
never metered as another: :func:`engine_name_note` says what it is and which name to use, or why it is refused.
"""
from witcert.schemes.fp4_blocks import Mxfp4Block16, Nvfp4
from witcert.schemes.kv_format import KVFormat
from witcert.schemes.per_token_head import Fp8PerTokenHead, Int4PerTokenHead, Int8PerTokenHead
from witcert.schemes.engine_names import ENGINE_NAMES, engine_name_note  # noqa: F401 (this module's API too)
from witcert.schemes.registry import _REGISTRY, register_scheme
from witcert.schemes.turboquant import TurboQuant

FORMATS: dict[str, KVFormat] = {
    "int8-per-token-head": Int8PerTokenHead(),
    "fp8-per-token-head": Fp8PerTokenHead(),
    "int4-per-token-head": Int4PerTokenHead(),
    "nvfp4": Nvfp4(),
    "mxfp4": Mxfp4Block16(),
    "turboquant-4bit-nc": TurboQuant(4, 4),
    "turboquant-k3v4-nc": TurboQuant(3, 4),
    "turboquant-3bit-nc": TurboQuant(3, 3),
}

for _name, _format in FORMATS.items():
    register_scheme(_name)(_format)



def format_of(scheme) -> KVFormat | None:
    """The :class:`KVFormat` a scheme name or object denotes when the registry still maps it to one, else ``None``."""
    if isinstance(scheme, KVFormat):
        return scheme
    if isinstance(scheme, str) and isinstance(_REGISTRY.get(scheme), KVFormat):
        return _REGISTRY[scheme]
    return None


def listing(name: str, head_dim: int = 64, bands: int = 16) -> str | None:
    """``witcert schemes``' line of an engine format (``None`` for any other scheme): what it is, and what a token
    of one kv head costs, keys and values, at ``head_dim`` channels and ``bands`` witness bands, beside bf16."""
    fmt = format_of(name)
    if fmt is None:
        return None
    cost = fmt.bytes_per_token(head_dim, bands)
    return (f"{fmt.summary} [{cost['codes']} B + witness {cost['witness']} B per token per kv head at d={head_dim}, "
            f"{bands} bands; bf16 {cost['bf16']} B]")

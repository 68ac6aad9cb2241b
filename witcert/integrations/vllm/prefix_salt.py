"""A request's scheme and gate are part of its cache blocks' identity, so prefix caching never mixes them.

vLLM's prefix caching shares a full block between requests whose tokens (and extra keys: LoRA, multimodal
inputs, the request's ``cache_salt``) hash alike. The plugin stores each request's keys as *its* scheme
reconstructs them, and the gate writes exact keys back into blocks it repairs; shared by token hash alone, a
``witcert_scheme: none`` request would attend an earlier ``rtn-int4`` request's keys (and be counted as the
uncompressed baseline), and a lossy request would get exact keys. So every request's ``cache_salt`` is
extended, in the engine process before its block hashes are computed, with ``witcert:<scheme>:<gate|raw>``:
requests share prefix blocks only with requests of the same scheme and gate setting (and, as before, the same
salt of their own). The meter itself never depended on it: it reads back what each block holds.
"""
import functools

from . import config

SEPARATOR = "|"


def salt_of(settings: config.RequestSettings) -> str:
    """The plugin's part of a request's cache salt."""
    return f"witcert:{settings.scheme}:{'gate' if settings.gate else 'raw'}"


def salted(own: str | None, settings: config.RequestSettings) -> str:
    """``own`` (the request's cache salt, if any) extended with :func:`salt_of`."""
    return salt_of(settings) if not own else f"{own}{SEPARATOR}{salt_of(settings)}"


def install(cfg: config.PluginConfig) -> None:
    """Extend every request's cache salt as it enters the engine core (``Request.from_engine_core_request``,
    where vLLM computes its block hashes). Idempotent."""
    from vllm.v1.request import Request

    original = Request.from_engine_core_request.__func__
    if getattr(original, "_witcert", False):
        return

    @functools.wraps(original)
    def from_engine_core_request(cls, request, block_hasher):
        params = getattr(request, "sampling_params", None)
        if params is not None:
            settings = config.request_settings(cfg, params.extra_args)
            request.cache_salt = salted(request.cache_salt, settings)
        return original(cls, request, block_hasher)

    from_engine_core_request._witcert = True
    Request.from_engine_core_request = classmethod(from_engine_core_request)

"""WitCert inside vLLM: a plugin that meters the engine's own KV cache (Tier A).

Enable with ``WITCERT_VLLM=1`` (entry point ``witcert`` in the ``vllm.general_plugins`` group).
Off (the default), :func:`register` returns at once: nothing is imported, patched or registered,
and vLLM runs unchanged. On, vLLM's CPU attention backend is replaced by a subclass
(:mod:`.backend`) that, without touching vLLM's kernels,

- on write, stores ``scheme(exact key)`` and ``scheme(exact value)`` through vLLM's own writer
  when a scheme is named (``WITCERT_VLLM_SCHEME``, or per request), reads each key back from the
  cache and stores the fp16 rounded-up band witness of ``exact post-RoPE key - stored key`` in a
  side tensor indexed like the cache blocks;
- on each decode step (and each query token of a speculative-decoding verification step), meters every
  (request, layer, query head): a proved upper bound on the TV between attention over the exact keys and
  attention over the stored keys, from a per-sequence metering state updated from the written slots only,
  in one pass per layer and step over the batch (:mod:`.decode_pass`); an operator may meter every k-th
  step or some layers and heads (:mod:`.sampling`);
- makes each request's scheme and gate part of its cache blocks' identity (:mod:`.prefix_salt`), so prefix
  caching never serves one scheme's keys to another;
- publishes Prometheus series on vLLM's ``/metrics`` (:mod:`.prometheus`), and JSON lines per
  cell with ``WITCERT_VLLM_JSONL``; ``WITCERT_VLLM_SHADOW=1`` keeps the exact keys and checks
  every cell against the true TV (test and audit mode);
- with ``WITCERT_VLLM_GATE=1``, repairs every decode cell whose meter exceeds ``tau``: its
  flagged blocks' exact keys and values, paged in from a content-checked host store, are written
  back into vLLM's cache (persistent) and the step's attention is recomputed.

Switches: :mod:`.config`. Only vLLM's CPU backend (``CPU_ATTN``) is supported; on other platforms
the plugin logs a warning and stays off.
"""
import logging

from . import config

logger = logging.getLogger("vllm.witcert")  # under vLLM's logger: its handler, level and format

_REGISTERED = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point (called by vLLM in every process, maybe twice)."""
    global _REGISTERED
    cfg = config.PluginConfig.from_env()
    if not cfg.enabled or _REGISTERED:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        logger.warning("WitCert: the vLLM plugin meters the CPU attention backend only; "
                       "platform %s is not supported, metering stays off", current_platform.device_name)
        return
    from prometheus_client import REGISTRY
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from . import prefix_salt, schemes
    from .prometheus import WitCertCollector
    from .runtime import ensure_metrics_dir, flush_when_idle, validate_request_args

    schemes.load(cfg)  # a scheme that cannot load stops the start-up here, naming the variable
    register_backend(AttentionBackendEnum.CPU_ATTN, "witcert.integrations.vllm.backend.WitCertCPUAttentionBackend")
    validate_request_args()
    prefix_salt.install(cfg)
    flush_when_idle()
    REGISTRY.register(WitCertCollector(ensure_metrics_dir()))
    _REGISTERED = True
    logger.info("WitCert: metering vLLM's KV cache (bands=%d, tau=%g, shadow=%s, scheme=%s, schemes=%s, gate=%s)",
                cfg.bands, cfg.tau, cfg.shadow, cfg.scheme, ",".join(cfg.schemes) or "-", cfg.gate)

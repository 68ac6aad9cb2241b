"""Environment switches of the vLLM plugin (read once per process, validated with clear errors).

``WITCERT_VLLM=1`` turns the plugin on; anything else (or unset) leaves vLLM untouched.
"""
import os
from dataclasses import dataclass

ENABLE = "WITCERT_VLLM"
BANDS = "WITCERT_VLLM_BANDS"
TAU = "WITCERT_VLLM_TAU"
JSONL = "WITCERT_VLLM_JSONL"
SHADOW = "WITCERT_VLLM_SHADOW"
METRICS_DIR = "WITCERT_VLLM_METRICS_DIR"
MAX_REQUESTS = "WITCERT_VLLM_MAX_REQUESTS"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class PluginConfig:
    """What the plugin does in this process.

    Parameters
    ----------
    enabled : bool
        ``WITCERT_VLLM``: meter the KV cache (off: the plugin registers nothing).
    bands : int
        ``WITCERT_VLLM_BANDS``: Tier A bands per head (must divide head_dim / 2). Default 16.
    tau : float
        ``WITCERT_VLLM_TAU``: threshold of the certified fraction (a cell is certified when its
        meter is <= tau). Default 0.2.
    jsonl : str or None
        ``WITCERT_VLLM_JSONL``: append one JSON line per metered cell to ``<path>.<pid>``.
    shadow : bool
        ``WITCERT_VLLM_SHADOW``: keep the exact post-RoPE keys beside the cache and check every
        metered cell against the true TV (a test and audit mode: +50% key memory, slower).
    metrics_dir : str or None
        ``WITCERT_VLLM_METRICS_DIR``: where engine processes publish their snapshot for the API
        server's ``/metrics`` (created when unset).
    max_requests : int
        ``WITCERT_VLLM_MAX_REQUESTS``: how many recent requests keep a per-request series.
    """

    enabled: bool = False
    bands: int = 16
    tau: float = 0.2
    jsonl: str | None = None
    shadow: bool = False
    metrics_dir: str | None = None
    max_requests: int = 64

    def __post_init__(self):
        if isinstance(self.bands, bool) or not isinstance(self.bands, int) or self.bands <= 0:
            raise ValueError(f"{BANDS} must be a positive integer, got {self.bands!r}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"{TAU} must be in (0, 1] (a certified threshold), got {self.tau!r}")
        if self.max_requests <= 0:
            raise ValueError(f"{MAX_REQUESTS} must be a positive integer, got {self.max_requests!r}")

    @classmethod
    def from_env(cls, env=None) -> "PluginConfig":
        """Read the switches from ``env`` (default ``os.environ``)."""
        env = os.environ if env is None else env
        return cls(
            enabled=_flag(env, ENABLE),
            bands=_int(env, BANDS, 16),
            tau=_float(env, TAU, 0.2),
            jsonl=env.get(JSONL) or None,
            shadow=_flag(env, SHADOW),
            metrics_dir=env.get(METRICS_DIR) or None,
            max_requests=_int(env, MAX_REQUESTS, 64),
        )


def _flag(env, name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be 1/0 (or true/false), got {env.get(name)!r}")


def _int(env, name: str, default: int) -> int:
    return _parsed(env, name, default, int, "an integer")


def _float(env, name: str, default: float) -> float:
    return _parsed(env, name, default, float, "a number")


def _parsed(env, name: str, default, kind, what: str):
    """``kind(env[name])``, ``default`` when unset or empty; a clear error naming the variable otherwise."""
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {raw!r}") from None

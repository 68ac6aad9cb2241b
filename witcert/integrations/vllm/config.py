"""Environment switches of the vLLM plugin (read once per process, validated with clear errors).

``WITCERT_VLLM=1`` turns the plugin on; anything else (or unset) leaves vLLM untouched.

Settings can also be chosen per request, in vLLM's ``SamplingParams.extra_args`` (over the
OpenAI-compatible API: ``extra_body={"vllm_xargs": {...}}``): ``witcert_scheme`` (one of the
schemes the operator loaded: ``WITCERT_VLLM_SCHEME`` or ``WITCERT_VLLM_SCHEMES``),
``witcert_gate`` (``true``/``false``; turning it on needs ``WITCERT_VLLM_GATE=1``) and the
sampled-metering switches of :mod:`.sampling` (``witcert_meter_every``, ``witcert_meter_heads``,
``witcert_meter_layers``, ``witcert_meter_seed``; engine defaults ``WITCERT_VLLM_METER_EVERY``,
``WITCERT_VLLM_METER_HEADS``, ``WITCERT_VLLM_METER_LAYERS``), and the request audit of :mod:`.audit`
(``witcert_audit_rate``, ``witcert_audit_tau``, ``witcert_audit_delta``, ``witcert_audit_seed``), and the spot
check of :mod:`.spot` (``witcert_certificate``, ``witcert_spot_keys``, ``witcert_spot_delta``). A request
never loads code: only the operator's names can be chosen.
"""
import os
from dataclasses import dataclass, field

from . import audit as request_audit
from . import sampling, spot

ENABLE = "WITCERT_VLLM"
BANDS = "WITCERT_VLLM_BANDS"
TAU = "WITCERT_VLLM_TAU"
JSONL = "WITCERT_VLLM_JSONL"
SHADOW = "WITCERT_VLLM_SHADOW"
METRICS_DIR = "WITCERT_VLLM_METRICS_DIR"
MAX_REQUESTS = "WITCERT_VLLM_MAX_REQUESTS"
SCHEME = "WITCERT_VLLM_SCHEME"
SCHEMES = "WITCERT_VLLM_SCHEMES"
GATE = "WITCERT_VLLM_GATE"
GATE_BLOCK = "WITCERT_VLLM_GATE_BLOCK"
COMPILE = "WITCERT_VLLM_COMPILE"
DEFER = "WITCERT_VLLM_DEFER"
METER_EVERY = "WITCERT_VLLM_METER_EVERY"
METER_HEADS = "WITCERT_VLLM_METER_HEADS"
METER_LAYERS = "WITCERT_VLLM_METER_LAYERS"

# per-request keys of SamplingParams.extra_args
XARG_SCHEME = "witcert_scheme"
XARG_GATE = "witcert_gate"

NONE = "none"  # no scheme: the cache holds what vLLM's writer stores from the exact keys

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
    scheme : str
        ``WITCERT_VLLM_SCHEME``: the scheme every request's keys and values are stored with
        unless the request names another (``witcert_scheme``). ``"none"`` (default) stores what
        vLLM's writer makes of the exact keys; otherwise any name ``witcert schemes`` lists (a
        registered scheme, ``module:function``, an installed ``witcert.schemes`` entry point) or
        ``dithered-int8`` (Tier B's cache, deterministic branch).
    schemes : tuple of str
        ``WITCERT_VLLM_SCHEMES``: comma-separated further schemes a request may choose.
    gate : bool
        ``WITCERT_VLLM_GATE``: keep a content-checked exact copy of every key and value on the
        host and repair, inside the engine, every decode cell whose meter exceeds ``tau``
        (requests may opt out with ``witcert_gate: false``).
    gate_block : int
        ``WITCERT_VLLM_GATE_BLOCK``: tokens per repair block (default 16).
    compile : bool
        ``WITCERT_VLLM_COMPILE``: run the decode pass as one ``torch.compile`` graph (default on; the eager
        pass, the same computation, where compilation is unavailable).
    defer : int
        ``WITCERT_VLLM_DEFER``: meter the decode rows of this many steps together (default 8; 1 meters every
        step as it runs). Only where nothing feeds back: a step with a gated request or a speculative
        verification is metered at once; queued rows are metered when the batch changes, when the engine
        goes idle, and before a snapshot. Each row is metered over the keys it attended (its own token as
        the cache held it then). Single-worker engines only (a tensor-parallel worker meters every step).
    meter_every, meter_heads, meter_layers
        ``WITCERT_VLLM_METER_EVERY`` / ``_HEADS`` / ``_LAYERS``: the engine's default sampled metering
        (:mod:`.sampling`; default every cell).
    """

    enabled: bool = False
    bands: int = 16
    tau: float = 0.2
    jsonl: str | None = None
    shadow: bool = False
    metrics_dir: str | None = None
    max_requests: int = 64
    scheme: str = NONE
    schemes: tuple = ()
    gate: bool = False
    gate_block: int = 16
    compile: bool = True
    defer: int = 8
    meter_every: int = 1
    meter_heads: float = 1.0
    meter_layers: str = ""

    def __post_init__(self):
        if isinstance(self.bands, bool) or not isinstance(self.bands, int) or self.bands <= 0:
            raise ValueError(f"{BANDS} must be a positive integer, got {self.bands!r}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"{TAU} must be in (0, 1] (a certified threshold), got {self.tau!r}")
        if self.max_requests <= 0:
            raise ValueError(f"{MAX_REQUESTS} must be a positive integer, got {self.max_requests!r}")
        if not isinstance(self.scheme, str) or not self.scheme.strip():
            raise ValueError(f"{SCHEME} must name a scheme (or 'none'), got {self.scheme!r}")
        if any(not isinstance(s, str) or not s.strip() for s in self.schemes):
            raise ValueError(f"{SCHEMES} must be a comma-separated list of scheme names, got {self.schemes!r}")
        if isinstance(self.gate_block, bool) or not isinstance(self.gate_block, int) or self.gate_block <= 0:
            raise ValueError(f"{GATE_BLOCK} must be a positive integer, got {self.gate_block!r}")
        if isinstance(self.defer, bool) or not isinstance(self.defer, int) or self.defer <= 0:
            raise ValueError(f"{DEFER} must be a positive integer (steps metered together), got {self.defer!r}")
        for variable, key, value in ((METER_EVERY, sampling.EVERY, self.meter_every),
                                     (METER_HEADS, sampling.HEADS, self.meter_heads),
                                     (METER_LAYERS, sampling.LAYERS, self.meter_layers)):
            try:
                sampling.metering_of(**{k.rsplit("_", 1)[-1]: (value if k == key else None) for k in sampling.KEYS})
            except ValueError as err:
                raise ValueError(str(err).replace(key, variable, 1)) from None

    @property
    def allowed_schemes(self) -> tuple:
        """Every scheme a request may choose: the default first, then ``schemes``, ``none`` always."""
        names = [self.scheme, *self.schemes, NONE]
        return tuple(dict.fromkeys(names))

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
            scheme=(env.get(SCHEME) or NONE).strip(),
            schemes=tuple(s.strip() for s in (env.get(SCHEMES) or "").split(",") if s.strip()),
            gate=_flag(env, GATE),
            gate_block=_int(env, GATE_BLOCK, 16),
            compile=_flag(env, COMPILE, default="1"),
            defer=_int(env, DEFER, 8),
            meter_every=_int(env, METER_EVERY, 1),
            meter_heads=_float(env, METER_HEADS, 1.0),
            meter_layers=(env.get(METER_LAYERS) or "").strip(),
        )


def _flag(env, name: str, default: str = "") -> bool:
    value = env.get(name, default).strip().lower()
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


@dataclass(frozen=True)
class RequestSettings:
    """What the plugin does for one request: its scheme, whether the gate repairs its cells, which cells are
    metered (:class:`.sampling.Metering`), and its request audit (:class:`witcert.Audit`, ``None``: none; with an
    audit and no sampling switch only the picked cells are metered), and its spot check (:class:`.spot.SpotRequest`,
    ``None``: the deterministic meter alone)."""

    scheme: str
    gate: bool
    metering: sampling.Metering = field(default_factory=sampling.Metering)
    audit: object = None
    spot: object = None

    @property
    def everything(self) -> bool:
        """Every cell of the request is metered (no sampling, no audit)."""
        return self.metering.everything and self.audit is None


def default_settings(cfg: PluginConfig) -> RequestSettings:
    """The settings of a request that names none (the engine's defaults)."""
    return request_settings(cfg, None)


def request_settings(cfg: PluginConfig, extra_args) -> RequestSettings:
    """A request's settings from its ``SamplingParams.extra_args`` (engine defaults where unset).

    Raises ``ValueError`` naming the key for a scheme the operator did not load, a non-boolean
    ``witcert_gate``, a gate asked for on an engine started without ``WITCERT_VLLM_GATE=1``, a bad
    sampling switch or audit setting, or sampling or the audit together with the gate (which needs every cell's
    meter, and would act on the audit's own outcomes).
    """
    extra = extra_args or {}
    if not isinstance(extra, dict):
        raise ValueError(f"extra_args must be a dict, got {type(extra).__name__}")
    scheme = extra.get(XARG_SCHEME, cfg.scheme)
    if not isinstance(scheme, str) or scheme not in cfg.allowed_schemes:
        raise ValueError(f"{XARG_SCHEME}={scheme!r} is not a scheme this engine loaded; choose one of "
                         f"{', '.join(cfg.allowed_schemes)} (the operator loads schemes with {SCHEME} and {SCHEMES})")
    gate = extra.get(XARG_GATE, cfg.gate)
    if isinstance(gate, str) and gate.strip().lower() in _TRUE + _FALSE:
        gate = gate.strip().lower() in _TRUE
    elif type(gate) is int and gate in (0, 1):  # JSON true may arrive as 1 (vllm_xargs holds str/int/float)
        gate = bool(gate)
    if not isinstance(gate, bool):
        raise ValueError(f"{XARG_GATE} must be true or false, got {gate!r}")
    if gate and not cfg.gate:
        raise ValueError(f"{XARG_GATE}=true needs an engine started with {GATE}=1 (it keeps the exact store "
                         "the gate repairs from)")
    metering = sampling.metering_of(extra.get(sampling.EVERY, cfg.meter_every), extra.get(sampling.HEADS, cfg.meter_heads),
                                    extra.get(sampling.LAYERS, cfg.meter_layers), extra.get(sampling.SEED))
    if gate and not metering.everything:
        raise ValueError(f"sampled metering ({', '.join(sampling.KEYS[:3])}) leaves cells unmetered, and the gate "
                         f"needs every cell's meter: turn one off ({XARG_GATE}=false, or meter every cell)")
    audit = request_audit.audit_of(extra)
    if gate and audit is not None:
        raise ValueError(f"{request_audit.RATE} meters only the audit's picked cells, and the gate needs every cell's "
                         f"meter (repairs driven by them would also change the population the audit states about): "
                         f"turn one off ({XARG_GATE}=false, or no audit)")
    checks = spot.spot_of(extra, cfg.gate, GATE)
    if checks is not None and audit is not None:
        raise ValueError(f"{spot.CERTIFICATE}='spot' with {request_audit.RATE}: the audit states about the meter, not "
                         "a probabilistic bound; turn one off")
    return RequestSettings(scheme=scheme, gate=gate, metering=metering, audit=audit, spot=checks)

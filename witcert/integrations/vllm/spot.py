"""A request's spot check in the engine: its switches in ``SamplingParams.extra_args`` (registry SCO, SCR).

``witcert_certificate``: ``"deterministic"`` (default: the meter alone) or ``"spot"``: every metered decode cell
whose meter exceeds ``tau`` is spot-checked (:mod:`.spot_check`: exact keys drawn from the gate's content-checked
exact store after the query is fixed, :func:`witcert.spot.check_cells` over the layer-step's cells), and the
cell's bound becomes ``min(meter, spot bound)``: a *probabilistic* bound, holding with probability at least
``1 - delta``, labelled so (``bound="probabilistic"``, its ``delta``) in the telemetry, the cell log and
Prometheus. With the gate on the request, the gate repairs only cells the check could not certify
(:mod:`.spot_gate`); the check spends ``1 - GATE_SHARE`` of ``delta`` and the re-checks after repair the rest.

``witcert_spot_keys`` (int >= 1, default 256): the most exact keys a check reads per cell (in rounds of 32, 128,
... stopping at a bound ``<= tau``); ``witcert_spot_delta`` (in (0, 1), default 1e-6): each cell's failure
probability. The exact store exists only on an engine started with ``WITCERT_VLLM_GATE=1``.
"""
from dataclasses import dataclass

CERTIFICATE, KEYS, DELTA = "witcert_certificate", "witcert_spot_keys", "witcert_spot_delta"
XARGS = (CERTIFICATE, KEYS, DELTA)
CERTIFICATES = ("deterministic", "spot")
DEFAULT_KEYS, DEFAULT_DELTA = 256, 1e-6


@dataclass(frozen=True)
class SpotRequest:
    """One request's spot check: ``keys`` the most exact keys per checked cell, ``delta`` each cell's failure
    probability (the check before repair and the gate's re-checks together)."""

    keys: int = DEFAULT_KEYS
    delta: float = DEFAULT_DELTA


def spot_of(extra: dict, store_kept: bool, gate_switch: str) -> SpotRequest | None:
    """The request's :class:`SpotRequest` from its ``extra_args`` (``None``: the deterministic certificate).

    ``store_kept``: the engine keeps the exact store (``gate_switch`` names the variable that turns it on).
    Raises ``ValueError`` naming the key for an unknown certificate, a key budget that is not a positive integer,
    a ``delta`` outside (0, 1), spot settings without ``witcert_certificate: "spot"``, or a spot check on an engine
    without the exact store."""
    certificate = extra.get(CERTIFICATE, "deterministic")
    if certificate not in CERTIFICATES:
        raise ValueError(f"{CERTIFICATE} must be one of {', '.join(CERTIFICATES)}, got {certificate!r}")
    if certificate == "deterministic":
        given = [k for k in (KEYS, DELTA) if extra.get(k) not in (None, "")]
        if given:
            raise ValueError(f"{', '.join(given)} set without {CERTIFICATE}='spot' (the deterministic meter reads no "
                             "exact keys)")
        return None
    if not store_kept:
        raise ValueError(f"{CERTIFICATE}='spot' needs an engine started with {gate_switch}=1 (it keeps the exact "
                         "store the check reads its keys from)")
    return SpotRequest(keys=_keys(extra.get(KEYS)), delta=_delta(extra.get(DELTA)))


def _keys(value) -> int:
    if value is None or value == "":
        return DEFAULT_KEYS
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{KEYS} must be a positive integer (exact keys per checked cell), got {value!r}")
    return value


def _delta(value) -> float:
    if value is None or value == "":
        return DEFAULT_DELTA
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"{DELTA} must be a probability in (0, 1) (each cell's failure probability), got {value!r}")
    return float(value)

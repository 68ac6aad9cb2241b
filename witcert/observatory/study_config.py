"""What one ``witcert study`` run does: :class:`StudyConfig` and the ``--quick`` shape.

Kept apart from :mod:`witcert.observatory.study` so that the command line reads the defaults
without importing torch or transformers (an argument error is reported before anything heavy loads).
"""
from __future__ import annotations

from dataclasses import dataclass

from witcert.core.thresholds import check_certified_tau

REPAIR_SCHEMES = ("fp8-e4m3", "rtn-int4", "kivi-2bit", "kvquant-4bit")
GATED_SCHEMES = ("kivi-2bit", "rtn-int4")
RISK_SCHEMES = ("kivi-2bit",)
SWEEP_SCHEMES = ("kivi-2bit",)


@dataclass(frozen=True)
class StudyConfig:
    """What one ``witcert study`` run does (defaults: the full study of ``make study``)."""

    cases: int = 32  # needle cases of the repair study (each configuration answers all of them)
    sweep_cases: int = 32  # the first cases of the same family, for the layer sweep
    context_tokens: int = 256
    new_tokens: int = 6  # greedy answer tokens (a space and the five digits)
    probe_tokens: int | None = 1  # last prompt tokens read over the compressed cache (None: the whole question)
    batch: int = 16  # cases per forward call
    schemes: tuple[str, ...] = REPAIR_SCHEMES  # each raw
    gated_schemes: tuple[str, ...] = GATED_SCHEMES  # each also behind the certified gate
    risk_schemes: tuple[str, ...] = RISK_SCHEMES  # each also behind the risk-ranked gate
    sweep_schemes: tuple[str, ...] = SWEEP_SCHEMES
    spot_gated_schemes: tuple[str, ...] = ()  # each also behind the spot-certified gate (witcert.spot.gate)
    spot_keys: int = 128  # exact keys per spot check of the spot-certified gate
    sweep_layers: tuple[int, ...] | None = None  # the single layers swept (None: every layer)
    tau_certified: float = 0.2
    tau_risk: float = 5.0
    bands: int | None = None
    seed: int = 0  # needle family (codes, key names, scattered depths)

    def __post_init__(self):
        for name in ("cases", "context_tokens", "new_tokens", "batch", "spot_keys"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.probe_tokens is not None and self.probe_tokens < 1:
            raise ValueError(f"probe_tokens must be >= 1 or None (the whole question), got {self.probe_tokens}")
        if not 0 <= self.sweep_cases <= self.cases:
            raise ValueError(f"sweep_cases must lie in [0, cases={self.cases}], got {self.sweep_cases}")
        if not self.schemes and not self.sweep_schemes:
            raise ValueError("give at least one scheme (schemes or sweep_schemes)")
        for name in ("gated_schemes", "risk_schemes", "sweep_schemes", "spot_gated_schemes"):
            extra = set(getattr(self, name)) - set(self.schemes)
            if extra:
                raise ValueError(f"{name}: {sorted(extra)} must also be among schemes (their raw row is the comparison)")
        check_certified_tau(self.tau_certified, "tau_certified")
        if not self.tau_risk >= 1.0:
            raise ValueError(f"tau_risk must be >= 1 (risk-ranked gate), got {self.tau_risk}")


QUICK = StudyConfig(cases=4, sweep_cases=4, batch=4, context_tokens=192, schemes=("kivi-2bit",),
                    gated_schemes=("kivi-2bit",), risk_schemes=("kivi-2bit",), sweep_schemes=("kivi-2bit",),
                    spot_gated_schemes=("kivi-2bit",),
                    sweep_layers=(0, -1))  # first and last layer

"""The certified threshold ``tau``: one valid range wherever a meter threshold is taken.

The meter is a TV bound clamped at 1, so a threshold at or above 1 certifies nothing (every cell
is "covered") and a threshold of 0 is met only by a lossless cache. ``witcert.monitor(tau=)``,
the observatory's and the study's configurations and the command line's ``--tau`` all check
through :func:`check_certified_tau`. The gate's risk-ranked regime (``witcert.Gate(tau >= 1)``)
gates on the raw risk score, not on the meter, and keeps its own range.
"""
import math

CERTIFIED_TAU_RANGE = "strictly between 0 and 1"


def check_certified_tau(tau, name: str = "tau") -> float:
    """``tau`` as a float; ``ValueError`` naming ``name`` unless it is a number in (0, 1).

    Parameters
    ----------
    tau : float
        The threshold a meter is compared with (``meter <= tau``: certified at ``tau``).
    name : str
        How the caller spells the argument (``"tau"``, ``"--tau"``, ``"tau_certified"``).
    """
    if isinstance(tau, bool) or not isinstance(tau, (int, float)):
        raise ValueError(f"{name} must be a number {CERTIFIED_TAU_RANGE}, got {tau!r}")
    if not (math.isfinite(tau) and 0.0 < tau < 1.0):
        raise ValueError(f"{name} must lie {CERTIFIED_TAU_RANGE} (the meter is a TV bound clamped at 1; "
                         f"the certified regime), got {tau!r}")
    return float(tau)

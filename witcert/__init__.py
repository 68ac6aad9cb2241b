"""WitCert: sound runtime risk observability for KV-cache compression.

For every (layer, head, decode step) WitCert reports a *meter*: a proved upper bound on the total
variation between attention over exact keys and attention over compressed keys. The few names a
user needs are here; everything else lives in the subpackage of its layer:

=====================  ==============================================================
``witcert.core``       the meter: TV bounds from per-token radii, rounding, input checks
``witcert.tier_a``     band-norm witness and its per-token bound (any quantizer)
``witcert.tier_b``     dithered INT8 cache and its probabilistic certificate
``witcert.schemes``    the scheme registry and the built-in quantizers
``witcert.gate``       gating and repair from a verified backing store
``witcert.audit``      the sampled request audit: a per-request statement from picked cells
``witcert.integrations``  transformers (and vLLM) integrations
``witcert.observatory``   the real-model observatory (``witcert observe``)
``witcert.verification``  sup-box adversary, ``witcert fuzz`` and its attack classes
``witcert.kernels``    Triton kernels;  ``witcert.spec``: executable spec and theorem registry
=====================  ==============================================================

``spec/registry.py`` names the theorem behind every bound.
"""
from witcert.audit.settings import Audit
from witcert.core.metering import meter, risk_score
from witcert.gate.policy import Gate
from witcert.integrations.hf.monitoring import Monitor, monitor
from witcert.integrations.hf.sampling import MeterSampling
from witcert.schemes.registry import get_scheme, list_schemes, register_scheme
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.observation import observe
from witcert.tier_a.score_rounding import score_rounding_bound
from witcert.tier_a.rotary import apply_rope
from witcert.tier_a.witness import logit_bound, witness_of
from witcert.tier_b.certificate import tier_b_logit_bound
from witcert.tier_b.quantizer import DitheredInt8

__version__ = "0.1.0"

__all__ = [
    "Audit",
    "BandLayout",
    "DitheredInt8",
    "Gate",
    "MeterSampling",
    "Monitor",
    "apply_rope",
    "get_scheme",
    "list_schemes",
    "logit_bound",
    "meter",
    "monitor",
    "observe",
    "register_scheme",
    "risk_score",
    "score_rounding_bound",
    "tier_b_logit_bound",
    "witness_of",
]

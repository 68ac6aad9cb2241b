"""WitCert: sound runtime risk observability for KV-cache compression.

Every public name below is a proved (or, for Tier B, probabilistic) upper bound or the
machinery that feeds one; ``spec/registry.py`` names the theorem behind each.
Names resolve lazily so that ``import witcert.spec`` stays free of torch.
"""
import sys
import types
from importlib import import_module

__version__ = "0.1.0"

# public name -> module that defines it (one concept per module)
_EXPORTS = {
    # meter core (Foundation): T1, P1, max-norm
    "meter": "witcert.meter",
    "risk_score": "witcert.meter",
    "eform_bound": "witcert.bounds",
    "two_sided_bound": "witcert.bounds",
    "retention_bound": "witcert.bounds",
    "maxnorm_bound": "witcert.bounds",
    "competitor_bound": "witcert.bounds",
    "sup_box_tv": "witcert.adversary",
    # Tier A: band-norm witness (Lemma 1, T2)
    "BandLayout": "witcert.bands",
    "witness_of": "witcert.witness",
    "logit_bound": "witcert.witness",
    "apply_rope": "witcert.rope",
    "register_scheme": "witcert.schemes",
    "schemes": "witcert.schemes",
    "get_scheme": "witcert.schemes",
    "value_residual_norms": "witcert.values",
    "output_bound": "witcert.values",
    "joint_pass": "witcert.values",
    "observe": "witcert.observe",
    # Tier B: dithered INT8 (L2, L3)
    "philox4x32_10": "witcert.philox",
    "StandaloneCounter": "witcert.counters",
    "PagedCounter": "witcert.counters",
    "DitheredInt8": "witcert.dithered_int8",
    "PackedStore": "witcert.packed_store",
    "tier_b_logit_bound": "witcert.tier_b",
    # gating and repair
    "Gate": "witcert.gate",
    "BackingStore": "witcert.backing_store",
    "Repairer": "witcert.repair",
    "LayerPager": "witcert.repair",
}

__all__ = sorted(_EXPORTS)


class _Package(types.ModuleType):
    """Resolve exported names before submodules: ``witcert.meter`` is the function even after
    the module ``witcert/meter.py`` that defines it has been imported (which sets a same-named
    attribute on the package)."""

    def __getattribute__(self, name):
        exports = super().__getattribute__("_EXPORTS")
        if name in exports:
            return getattr(import_module(exports[name]), name)
        return super().__getattribute__(name)

    def __getattr__(self, name):
        raise AttributeError(f"module 'witcert' has no attribute {name!r}")


sys.modules[__name__].__class__ = _Package

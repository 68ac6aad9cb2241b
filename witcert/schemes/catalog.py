"""Every scheme name WitCert accepts, grouped as ``witcert schemes`` lists them, and the unknown-name message.

Three kinds of name: tensor schemes in the registry (built-ins and loaded ``module:function``
specs), installed plugins (entry-point group ``witcert.schemes``, listed without importing
them), and caches that are not tensor functions: the dithered INT8 cache with its Tier B
certificate, and transformers' own ``QuantizedCache`` configurations. Importing this module
loads neither transformers nor any plugin.
"""
import importlib.metadata

from witcert.integrations.hf.quantized_cache import HF_CACHE_SCHEMES  # no transformers import
from witcert.schemes.registry import list_schemes

ENTRY_POINT_GROUP = "witcert.schemes"

DITHERED = "dithered-int8"  # the Tier B cache (witcert.DitheredInt8), not a registry scheme
CACHE_SCHEMES = {
    DITHERED: "the dithered INT8 cache (witcert.DitheredInt8) with its Tier B certificate "
              "(--tier B; the probabilistic branch for non-adaptive queries only); a fresh secret dither "
              "seed per request, so its rows are random between identical runs",
    **{name: f"transformers' own QuantizedCache, {spec.backend} {spec.nbits}-bit (axis 0, groups of "
             f"{spec.q_group_size}; the prompt quantized as it is written, later tokens exact until "
             f"{spec.residual_length} accumulate, then the whole cache re-quantized; maintained witnesses; "
             "extra 'quant')"
       for name, spec in HF_CACHE_SCHEMES.items()},
}


def entry_points() -> dict[str, str]:
    """The installed ``witcert.schemes`` entry points: name -> ``module:attribute`` (nothing imported)."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def plugin_names() -> list[str]:
    """Installed entry-point plugins not (yet) registered under their name, sorted."""
    registered = set(list_schemes())
    return sorted(name for name in entry_points() if name not in registered)


def unknown_scheme_message(name) -> str:
    """What to say about a scheme name nothing answers to: every name ``witcert schemes`` lists."""
    from witcert.schemes.engine_names import engine_name_note

    note = engine_name_note(name)  # an engine's own spelling: which scheme it is, or why it is refused
    message = (f"{note}; " if note else "") + f"unknown scheme {name!r}; registered schemes: {', '.join(list_schemes())}"
    plugins = sorted(entry_points())  # a loaded plugin is registered too: named in both lists
    if plugins:
        message += f"; installed plugins: {', '.join(plugins)}"
    return (message + f"; caches: {', '.join(CACHE_SCHEMES)}; or your own fn(x) -> x_hat "
            "(a callable, or module:function on the command line)")

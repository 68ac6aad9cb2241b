"""Third-party schemes: ``module:function`` specs and the ``witcert.schemes`` entry-point group.

A scheme outside this package is named in one of two ways (``witcert observe --scheme ...``):

* ``package.module:function`` -- the module is imported (the current directory is searched
  first, as ``python -m`` would) and ``function`` (a dotted attribute path is allowed) is registered
  under the spec itself, so reports and telemetry name exactly what ran;
* a name an installed distribution declares in the entry-point group ``witcert.schemes``::

      # the plugin's pyproject.toml
      [project.entry-points."witcert.schemes"]
      my-int4 = "my_package.schemes:int4"

  registered under the entry-point name when first asked for (listing never imports a plugin).

:func:`resolve_scheme` also *probes* every newly loaded scheme: it runs it through
:func:`witcert.schemes.registry.apply_scheme` on a small random cache tensor, for keys and for
values, so a scheme that returns the wrong shape, dtype, a tensor subclass or NaN is rejected
with that message before a model is loaded, not after. The probe is a smoke test of the
contract, not of soundness: soundness never depends on the scheme (Tier A's witness is computed
from whatever it returns).
"""
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Callable

import torch

from witcert.schemes.catalog import ENTRY_POINT_GROUP, entry_points, unknown_scheme_message
from witcert.schemes.registry import ROLES, apply_scheme, list_schemes, register_scheme

PROBE_SHAPE = (1, 2, 32, 128)  # (batch, kv heads, tokens, head_dim): 32 tokens, channel groups up to 128 divide


class SchemeLoadError(ValueError):
    """A scheme spec that names nothing loadable, or a loaded scheme that fails the probe."""


def is_spec(name: str) -> bool:
    """Whether ``name`` has the ``module:function`` form."""
    module, sep, attribute = name.partition(":")
    return bool(sep and module and attribute)


def resolve_scheme(name: str) -> str:
    """The registered name under which ``name`` runs, loading (and probing) a plugin if needed.

    ``name`` is a registered scheme, a ``module:function`` spec or an entry-point name, in that
    order. Raises :class:`SchemeLoadError` (a ``ValueError``) saying what was wrong and what is
    known otherwise.
    """
    if not isinstance(name, str) or not name.strip():
        raise SchemeLoadError(f"scheme must be a non-empty name, got {name!r}")
    if name in list_schemes():
        return name
    if is_spec(name):
        fn = _load_spec(name)
    else:
        plugins = entry_points()
        if name not in plugins:
            raise SchemeLoadError(unknown_scheme_message(name))
        fn = _load_entry_point(name)
    probe(name, fn)
    register_scheme(name, replace=True)(fn)
    return name


def probe(name: str, fn: Callable) -> None:
    """Run ``fn`` once per role on a random fp32 cache tensor of :data:`PROBE_SHAPE` (see module doc)."""
    x = torch.randn(PROBE_SHAPE, generator=torch.Generator().manual_seed(0))
    for role in ROLES:
        try:
            apply_scheme(fn, x, role=role)
        except Exception as err:  # any failure here would surface later, inside a model run
            raise SchemeLoadError(f"scheme {name!r} failed its check on a random {role} tensor of shape "
                                  f"{PROBE_SHAPE} (float32): {err}") from err


def _load_spec(spec: str) -> Callable:
    module_name, _, attribute = spec.partition(":")
    try:
        obj = _import_from_here(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):  # the module itself, not one it imports
            raise SchemeLoadError(f"scheme {spec!r}: no module named {module_name!r} (searched the current "
                                  "directory and the installed packages)") from None
        raise SchemeLoadError(f"scheme {spec!r}: importing {module_name!r} failed: {err}") from err
    except Exception as err:
        raise SchemeLoadError(f"scheme {spec!r}: importing {module_name!r} failed: "
                              f"{type(err).__name__}: {err}") from err
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise SchemeLoadError(f"scheme {spec!r}: {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SchemeLoadError(f"scheme {spec!r} is a {type(obj).__name__}, not a callable fn(x) -> x_hat")
    return obj


def _import_from_here(module_name: str):
    """Import ``module_name``, searching the current directory first as ``python -m`` would.

    An installed ``witcert`` command starts with its own bin directory on ``sys.path``, not the
    current one; the current directory is added for this import only.
    """
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        return importlib.import_module(module_name)
    finally:
        if added:
            sys.path.remove(here)


def _load_entry_point(name: str) -> Callable:
    ep = next(ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name)
    try:
        obj = ep.load()
    except Exception as err:
        raise SchemeLoadError(f"scheme {name!r} (entry point {ep.value!r} of group {ENTRY_POINT_GROUP!r}) "
                              f"failed to load: {type(err).__name__}: {err}") from err
    if not callable(obj):
        raise SchemeLoadError(f"scheme {name!r} (entry point {ep.value!r}) is a {type(obj).__name__}, "
                              "not a callable fn(x) -> x_hat")
    return obj

"""Compression schemes: the registry of cache-preserving quantizers and the built-in ones.
"""

from witcert.schemes import builtin  # noqa: F401  (the built-in schemes register themselves)
from witcert.schemes import engine_formats  # noqa: F401  (the engine KV formats register themselves)
